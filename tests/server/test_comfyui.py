"""The ComfyUI API door (issue #37), driven by real ComfyUI clients against a real server.

``comfy-api-simplified`` (the client library bots and scripts use, unmodified)
and a raw websocket client speaking ComfyUI's protocol, against one real
uvicorn server of two tiny diffusers models: ``sd`` (text-to-image, with a
LoRA ``ink``) and ``img`` (image-to-image). Each image the door gives is
compared with the same request made on our own HTTP door, so the mapping of
a workflow onto our params is checked by what comes out. The red-team tests
of the other doors (tokens, per-principal bounds, body bounds, Origin and
Host, on the handshake too) run against these routes on a second server.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from PIL import Image

from ..comfyui.workflows import advanced, img2img, txt2img, with_lora
from .conftest import running

pytest.importorskip("diffusers")
pytest.importorskip("peft")
simplified = pytest.importorskip("comfy_api_simplified")

from websockets.sync.client import connect  # noqa: E402

from omni_stream.comfyui import ACCEPTED  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402

from ..models import test_diffusers as sd  # noqa: E402
from ..models import test_diffusers_callback as cb  # noqa: E402
from ..models.test_diffusers_loras import make_lora  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@contextmanager
def serving(models: Any, **options: Any) -> Iterator[Any]:
    """A real server (``running``) on its own loop in a thread, for the sync clients."""
    ready, stop = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with running(models, **options) as server:
            box["server"] = server
            ready.set()
            await anyio.to_thread.run_sync(stop.wait)

    def target() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:  # noqa: BLE001 - told to the test below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=target, name="comfyui test server", daemon=True)
    thread.start()
    assert ready.wait(120), "the server did not start"
    if "error" in box:
        raise box["error"]
    try:
        yield box["server"]
    finally:
        stop.set()
        thread.join(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("comfy")
    text = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    text.load_loras({"ink": make_lora(root / "ink", 7)})
    edit = Diffusers(cb.img2img_pipe(cb.make_text_encoder(root)), mode="callback")
    with serving({"sd": text, "img": edit}) as started:
        yield started


def http(server: Any, **options: Any) -> httpx.Client:
    return httpx.Client(base_url=server.http_url, timeout=60, **options)


def ws_url(server: Any, client_id: str, query: str = "") -> str:
    return f"{server.url}?clientId={client_id}{query}"


#: What txt2img() asks for, in our params (its seed, steps, cfg and sampler are ComfyUI's).
PARAMS: dict[str, Any] = dict(
    prompt="a cat",
    negative_prompt="blur",
    seed=5,
    steps=3,
    guidance_scale=7.0,
    sampler="euler",
    width=16,
    height=16,
)


def ours(server: Any, model: str, params: dict[str, Any]) -> bytes:
    """The same request on our own door: ``/v1/generations?wait=true``'s PNG."""
    with http(server) as client:
        reply = client.post(
            "/v1/generations?wait=true", json={"model": model, "params": params, "output": {"format": "png"}}
        )
    assert reply.status_code == 200, reply.text
    return pixels(reply.content)


def pixels(data: bytes) -> bytes:
    return Image.open(io.BytesIO(data)).convert("RGB").tobytes()


def listen(ws: Any, prompt_id: str) -> list[Any]:
    """A ComfyUI socket's frames until its prompt is over (``executing`` with node null)."""
    frames = []
    while True:
        frame = ws.recv(timeout=60)
        frames.append(frame if isinstance(frame, bytes) else json.loads(frame))
        if isinstance(frame, str):
            msg = frames[-1]
            if (
                msg["type"] == "executing"
                and msg["data"]["node"] is None
                and msg["data"]["prompt_id"] == prompt_id
            ):
                return frames


def post(server: Any, workflow: dict[str, Any], **body: Any) -> httpx.Response:
    with http(server) as client:
        return client.post("/prompt", json={"prompt": workflow, **body})


def test_txt2img_runs_for_comfy_api_simplified_and_history_and_view_give_the_image(server: Any) -> None:
    api = simplified.ComfyApiWrapper(server.http_url)
    prompt_id, previews = asyncio.run(api.queue_prompt_and_wait(simplified.ComfyWorkflowWrapper(txt2img())))
    # Whatever previews it caught (it connects after posting) are ComfyUI's frames, 8 bytes cut:
    # JPEGs, the last one the result itself.
    assert all(p[:2] == b"\xff\xd8" for p in previews[:-1])
    history = api.get_history(prompt_id)[prompt_id]
    assert history["status"]["status_str"] == "success" and history["status"]["completed"]
    [saved] = history["outputs"]["9"]["images"]
    assert saved["type"] == "output" and saved["filename"].startswith("ComfyUI_") and saved["subfolder"] == ""
    png = api.get_image(saved["filename"], saved["subfolder"], saved["type"])
    expected = ours(server, "sd", PARAMS)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and pixels(png) == expected
    if previews:  # it caught the end: the last binary frame is the result
        assert pixels(previews[-1]) == expected
    assert history["prompt"][1] == prompt_id and history["prompt"][4] == ["9"]
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}


@contextmanager
def unhurried(server: Any, model: str, seconds: float = 0.05) -> Iterator[None]:
    """``model``'s steps take ``seconds`` at least meanwhile: the server takes the newest frame
    only (policy latest), and a tiny model's step is quicker than a loaded CI box's loop turn."""
    served = server.service.rules.models[model]
    step = served.step

    def slower(states: Any) -> Any:
        time.sleep(seconds)
        return step(states)

    served.step = slower
    try:
        yield
    finally:
        del served.step


def test_a_raw_websocket_hears_comfyuis_messages_and_a_preview_every_step(server: Any) -> None:
    with connect(ws_url(server, "raw-1"), open_timeout=20) as ws, unhurried(server, "sd"):
        hello = json.loads(ws.recv(timeout=20))
        reply = post(server, txt2img(steps=4, seed=9), client_id="raw-1")
        assert reply.status_code == 200, reply.text
        prompt_id = reply.json()["prompt_id"]
        frames = listen(ws, prompt_id)
    assert hello == {
        "type": "status",
        "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "raw-1"},
    }
    kinds = ["preview" if isinstance(f, bytes) else f["type"] for f in frames]
    start = kinds.index("execution_start")
    assert kinds[start : start + 3] == ["execution_start", "execution_cached", "executing"]
    assert frames[start + 2]["data"]["node"] == "3"
    assert sorted(frames[start + 1]["data"]["nodes"]) == ["4", "5", "6", "7"]
    # Every step: its progress, then its preview (ComfyUI's binary frame: 1 = PREVIEW_IMAGE, then
    # 1 = JPEG; the last step's is the result itself, 2 = PNG).
    steps = [
        (f["data"]["value"], f["data"]["max"])
        for f in frames
        if isinstance(f, dict) and f["type"] == "progress"
    ]
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    progress = [i for i, kind in enumerate(kinds) if kind == "progress"]
    previews = [frames[i + 1] for i in progress]
    assert all(isinstance(p, bytes) for p in previews), kinds
    assert [struct.unpack(">II", p[:8]) for p in previews] == [(1, 1)] * 3 + [(1, 2)]
    assert [Image.open(io.BytesIO(p[8:])).format for p in previews] == ["JPEG"] * 3 + ["PNG"]
    assert kinds[progress[-1] + 2 :] == [
        "executing",
        "executing",
        "executed",
        "execution_success",
        "status",
        "executing",
    ]
    executed = next(f for f in frames if isinstance(f, dict) and f["type"] == "executed")
    assert executed["data"]["node"] == "9" and executed["data"]["prompt_id"] == prompt_id
    [image] = executed["data"]["output"]["images"]
    assert image["type"] == "output" and prompt_id in image["filename"]
    assert frames[-2] == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}}
    with http(server) as client:
        assert (
            client.get("/view", params={"filename": image["filename"], "type": "output"}).status_code == 200
        )


def test_an_img2img_workflow_runs_on_an_uploaded_image(server: Any, tmp_path: Path) -> None:
    api = simplified.ComfyApiWrapper(server.http_url)
    cb.picture(seed=4).save(tmp_path / "in.png")
    uploaded = api.upload_image(tmp_path / "in.png", subfolder="tests")
    assert uploaded == {"name": "in.png", "subfolder": "tests", "type": "input"}
    again = api.upload_image(tmp_path / "in.png", subfolder="tests")  # a name taken is renamed
    assert again["name"] == "in (1).png"
    workflow = img2img("tests/in.png", denoise=0.5, steps=2, seed=3, prompt="a red cat", negative="dog")
    images = api.queue_and_wait_images(simplified.ComfyWorkflowWrapper(workflow), "Save Image")
    data = base64.b64encode((tmp_path / "in.png").read_bytes()).decode()
    # denoise 0.5 of 2 steps: ComfyUI runs 2 steps of a 4-step schedule, diffusers' strength 0.5 of 4.
    expected = ours(
        server,
        "img",
        {
            "prompt": "a red cat",
            "negative_prompt": "dog",
            "seed": 3,
            "steps": 4,
            "strength": 0.5,
            "guidance_scale": 7.0,
            "sampler": "euler",
            "image": "data:image/png;base64," + data,
        },
    )
    assert pixels(list(images.values())[-1]) == expected
    with http(server) as client:
        view = client.get("/view", params={"filename": "in.png", "subfolder": "tests", "type": "input"})
    assert view.content == (tmp_path / "in.png").read_bytes()


def test_a_lora_workflow_runs_with_the_lora_at_strength_model(server: Any) -> None:
    with connect(ws_url(server, "lora"), open_timeout=20) as ws:
        ws.recv(timeout=20)
        reply = post(server, with_lora(txt2img(seed=11), "ink.safetensors", 0.5), client_id="lora")
        assert reply.status_code == 200, reply.text
        frames = listen(ws, reply.json()["prompt_id"])
    result = pixels([f for f in frames if isinstance(f, bytes)][-1][8:])
    params = {**PARAMS, "seed": 11}
    assert result == ours(server, "sd", {**params, "loras": [{"name": "ink", "scale": 0.5}]})
    assert result != ours(server, "sd", params)


def test_interrupt_cancels_the_callers_running_prompt(server: Any) -> None:
    api = simplified.ComfyApiWrapper(server.http_url)
    with connect(ws_url(server, "stop"), open_timeout=20) as ws:
        ws.recv(timeout=20)
        prompt_id = post(server, txt2img(steps=900), client_id="stop").json()["prompt_id"]
        while not (isinstance(frame := ws.recv(timeout=30), str) and json.loads(frame)["type"] == "progress"):
            pass
        assert api.get_queue()["queue_running"][0][1] == prompt_id
        api.interrupt()
        frames = listen(ws, prompt_id)
    kinds = [f["type"] for f in frames if isinstance(f, dict)]
    assert "execution_interrupted" in kinds and "execution_success" not in kinds
    interrupted = next(f for f in frames if isinstance(f, dict) and f["type"] == "execution_interrupted")
    assert interrupted["data"]["node_id"] == "3" and interrupted["data"]["node_type"] == "KSampler"
    history = api.get_history(prompt_id)[prompt_id]
    assert history["status"]["status_str"] == "error" and history["outputs"] == {}


def test_a_workflow_with_another_node_is_refused_naming_it_and_the_nodes_we_run(server: Any) -> None:
    workflow = txt2img()
    workflow["8"] = {
        "class_type": "VAEDecodeTiled",
        "inputs": {"samples": ["3", 0], "vae": ["4", 2], "tile_size": 512},
    }
    reply = post(server, workflow)
    body = reply.json()
    assert reply.status_code == 400 and body["error"]["type"] == "invalid_prompt"
    assert "VAEDecodeTiled" in body["error"]["message"] and "KSamplerAdvanced" in body["error"]["message"]
    assert body["node_errors"]["8"]["class_type"] == "VAEDecodeTiled"
    with pytest.raises(simplified.ComfyApiError, match="400"):
        simplified.ComfyApiWrapper(server.http_url).queue_prompt(workflow)
    # A param the model refuses names the node input it came from.
    refused = post(server, txt2img(width=17)).json()
    assert list(refused["node_errors"]) == ["5"]
    assert refused["node_errors"]["5"]["errors"][0]["extra_info"] == {"input_name": "width"}
    # Nothing of it ran.
    assert not [r for r in server.service.registry if not r.ended]


def test_object_info_lists_exactly_the_nodes_we_run_with_our_lists(server: Any) -> None:
    api = simplified.ComfyApiWrapper(server.http_url)
    info = api.get_object_info()
    assert set(info) == set(ACCEPTED)
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == ["sd", "img"]
    assert info["LoraLoader"]["input"]["required"]["lora_name"][0] == ["ink"]
    samplers = info["KSampler"]["input"]["required"]["sampler_name"][0]
    assert "euler" in samplers and "euler_ancestral" in samplers and "dpmpp_2m" in samplers
    assert info["KSampler"]["output"] == ["LATENT"] and info["SaveImage"]["output_node"] is True
    assert list(api.get_object_info("KSampler")) == ["KSampler"]
    assert api.get_object_info("UpscaleModelLoader") == {}
    stats = api.get_system_stats()
    assert stats["devices"][0]["type"] == "cpu" and stats["system"]["comfyui_version"].startswith(
        "omni_stream"
    )


# -- the other doors' red-team tests, on these doors ---------------------------------------------

TOKENS = {"a": "aaa", "b": "bbb"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server with two tenants, one request each at a time, one in the engine, 32 KiB bodies."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("".join(f"{name}={secret}\n" for name, secret in TOKENS.items()))
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    with serving(
        {"sd": model},
        tokens_file=str(tokens),
        max_requests_per_principal=1,
        max_active=1,
        max_message_bytes=32 << 10,
    ) as started:
        yield started


def as_tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


def handshake(server: Any, path: str, **headers: str) -> int:
    """A websocket handshake's HTTP status, with ``headers`` (Host, Origin) as given."""
    import socket

    fields = {
        "Host": f"127.0.0.1:{server.port}",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
        **headers,
    }
    request = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    with socket.create_connection((server.host, server.port), timeout=20) as sock:
        sock.sendall(request.encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_token_host_and_origin_guard_every_comfyui_route_and_the_handshake(guarded: Any) -> None:
    evil = {"Origin": "http://evil.example"}
    with http(guarded) as client:
        for method, path in [
            ("GET", "/object_info"),
            ("GET", "/history"),
            ("POST", "/prompt"),
            ("POST", "/interrupt"),
            ("GET", "/view"),
            ("POST", "/upload/image"),
        ]:
            reply = client.request(method, path)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["type"] == "unauthorized" and reply.json()["node_errors"] == {}
            rebound = client.request(method, path, headers={**as_tenant("a"), "Host": "evil.example"})
            assert rebound.status_code == 421, path
        for path in ("/prompt", "/interrupt", "/upload/image", "/queue"):
            reply = client.post(path, headers={**as_tenant("a"), **evil}, json={"prompt": txt2img()})
            assert (
                reply.status_code == 403 and "OMNI_STREAM_ALLOW_ORIGINS" in reply.json()["error"]["message"]
            )
        assert client.get("/object_info", headers=as_tenant("a")).status_code == 200
    # comfy-api-simplified sends only basic auth: the password is read as the token.
    assert simplified.ComfyApiWrapper(guarded.http_url, user="me", password=TOKENS["a"]).get_object_info()
    with pytest.raises(simplified.ComfyApiError):
        simplified.ComfyApiWrapper(guarded.http_url, user="me", password="wrong").get_object_info()
    assert len(guarded.service.registry) == 0
    ws = "/ws?clientId=x"
    assert handshake(guarded, ws) == 401
    assert handshake(guarded, ws + "&token=aaa", Host="evil.example") == 421
    assert handshake(guarded, ws + "&token=aaa", **evil) == 403
    assert handshake(guarded, ws + "&token=aaa") == 101


def test_bodies_over_the_bound_are_refused_before_they_are_read(guarded: Any) -> None:
    big = txt2img(prompt="x" * (40 << 10))
    with http(guarded, headers=as_tenant("a")) as client:
        # The wire's own bound (http11.py) refuses it before any route reads it.
        reply = client.post("/prompt", json={"prompt": big})
        assert reply.status_code == 413 and "OMNI_STREAM_MAX_MESSAGE_BYTES" in reply.text
        upload = client.post("/upload/image", files={"image": ("big.png", b"\x89PNG" + b"0" * (40 << 10))})
        assert upload.status_code == 413
        bad = client.post("/upload/image", files={"image": ("not.png", b"GIF89a" + b"0" * 64)})
        assert bad.status_code == 400 and "PNG" in bad.json()["error"]["message"]
    assert len(guarded.service.registry) == 0


def test_a_tenant_sees_hears_and_stops_only_its_own_prompts(guarded: Any) -> None:
    door = guarded.app.door
    a, b = http(guarded, headers=as_tenant("a")), http(guarded, headers=as_tenant("b"))
    with (
        a,
        b,
        connect(ws_url(guarded, "x", "&token=aaa")) as ws_a,
        connect(ws_url(guarded, "x", "&token=bbb")) as ws_b,
    ):
        ws_a.recv(timeout=20), ws_b.recv(timeout=20)
        done = a.post("/prompt", json={"prompt": txt2img(), "client_id": "x"}).json()["prompt_id"]
        frames = listen(ws_a, done)
        [image] = next(f for f in frames if isinstance(f, dict) and f["type"] == "executed")["data"][
            "output"
        ]["images"]
        assert a.get("/view", params=image).status_code == 200
        assert b.get("/view", params=image).status_code == 404
        assert b.get(f"/history/{done}").json() == {} and b.get("/history").json() == {}
        assert list(a.get("/history").json()) == [done] and a.get("/history?max_items=0").json() == {}
        running = a.post("/prompt", json={"prompt": txt2img(steps=900), "client_id": "x"}).json()["prompt_id"]
        # One request at a time per principal (max_requests_per_principal), in ComfyUI's shape.
        second = a.post("/prompt", json={"prompt": txt2img()})
        assert second.status_code == 429 and second.json()["error"]["type"] == "too_many_requests"
        record = guarded.service.registry.get(running)
        watching = [c.owner for c in door.websockets.values() if c.id in record.watchers]
        assert watching == ["token:a"]  # b's socket of the same clientId hears nothing of it
        # b's prompt waits for the one place in the engine (max_active=1): its queue shows it alone.
        waiting = b.post("/prompt", json={"prompt": txt2img()}).json()["prompt_id"]
        assert [item[1] for item in a.get("/queue").json()["queue_running"]] == [running]
        assert b.get("/queue").json()["queue_running"] == []
        assert [item[1] for item in b.get("/queue").json()["queue_pending"]] == [waiting]
        assert b.post("/interrupt", json={"prompt_id": running}).status_code == 200
        assert b.post("/queue", json={"delete": [running]}).status_code == 200
        assert not record.ended
        assert b.post("/queue", json={"delete": [waiting]}).status_code == 200
        assert guarded.service.registry.get(waiting).outcome == "cancelled"
        assert a.post("/interrupt").status_code == 200
        assert listen(ws_a, running)[-3]["type"] == "execution_interrupted"


def test_ksampler_advanced_over_all_steps_makes_the_ksamplers_image(server: Any) -> None:
    with connect(ws_url(server, "adv"), open_timeout=20) as ws:
        ws.recv(timeout=20)
        results = []
        for workflow in (txt2img(seed=21), advanced(txt2img(seed=21))):
            reply = post(server, workflow, client_id="adv")
            assert reply.status_code == 200, reply.text
            results.append([f for f in listen(ws, reply.json()["prompt_id"]) if isinstance(f, bytes)][-1])
    assert results[0][8:] == results[1][8:]
    refused = post(server, advanced(txt2img(), end_at_step=1)).json()
    assert refused["node_errors"]["3"]["errors"][0]["extra_info"] == {"input_name": "end_at_step"}


def test_comfy_api_simplified_and_a_raw_socket_against_a_real_omni_stream_serve(tmp_path: Path) -> None:
    """The command users run, in its own process, a saved pipeline: ComfyUI's client queues the
    default workflow and gets the image our own door makes; a raw socket hears every step."""
    import signal
    from types import SimpleNamespace

    from .test_serve import omni_stream_serve

    pipe = sd.text_sd_pipe(tmp_path)
    pipe.save_pretrained(tmp_path / "sd")
    with omni_stream_serve("--model", f"sd=diffusers:{tmp_path / 'sd'}", "--device", "cpu") as (proc, _, url):
        served = SimpleNamespace(http_url=url, url=url.replace("http://", "ws://") + "/ws")
        api = simplified.ComfyApiWrapper(url)
        prompt_id, _ = asyncio.run(api.queue_prompt_and_wait(simplified.ComfyWorkflowWrapper(txt2img())))
        [saved] = api.get_history(prompt_id)[prompt_id]["outputs"]["9"]["images"]
        png = api.get_image(saved["filename"], saved["subfolder"], saved["type"])
        with connect(ws_url(served, "raw-real"), open_timeout=20) as ws:
            ws.recv(timeout=20)  # status
            reply = post(served, txt2img(steps=4, seed=9), client_id="raw-real")
            frames = listen(ws, reply.json()["prompt_id"])
        expected = ours(served, "sd", PARAMS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert pixels(png) == expected
    steps = [f["data"]["value"] for f in frames if isinstance(f, dict) and f["type"] == "progress"]
    assert steps[-1] == 4 and steps == sorted(steps)  # (latest-wins: a busy reader may miss one)
    assert any(isinstance(f, bytes) and struct.unpack(">II", f[:8]) == (1, 2) for f in frames)  # the PNG
