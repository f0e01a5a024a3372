"""A request's result over the websocket: full size, in the request's output format."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image
from websockets.asyncio.client import connect

from omni_stream.models import Synthetic

from ..conftest import one_torch_thread
from .conftest import Slow, check_stream, recv, running, send, until_end


@pytest.mark.asyncio
async def test_synthetic_latent_frames_preview_with_the_default_decoder() -> None:
    # [4, 64, 64] frames once met the "rgb" default and every preview failed.
    async with running(Slow(0.05)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="lat", params={"steps": 3, "work": 0})
        msgs = await until_end(ws, "lat")
    check_stream(msgs, "lat", 3)
    previews = [m for m in msgs if m["type"] == "preview"]
    assert [(p["step"], p["width"], p["height"]) for p in previews] == [(1, 64, 64), (2, 64, 64), (3, 64, 64)]
    assert [p["format"] for p in previews] == ["jpeg", "jpeg", "png"]
    assert msgs[0]["preview"]["decoder"] == "auto"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("output", "fmt", "pillow"),
    [({"format": "jpeg", "quality": 95}, "jpeg", "JPEG"), ({"format": "webp"}, "webp", "WEBP"), (None, "png", "PNG")],
)
async def test_the_result_comes_in_the_requested_format_at_full_size(output, fmt, pillow) -> None:
    params = {"steps": 2, "work": 0, "shape": [3, 600, 40]}
    message = {"type": "generate", "id": "big", "params": params, "preview": {"max_size": 64}}
    if output is not None:
        message["output"] = output
    async with running(Slow(0.05)) as server, connect(server.url) as ws:
        await send(ws, **message)
        msgs = await until_end(ws, "big")
    check_stream(msgs, "big", 2)
    assert msgs[0]["output"]["format"] == fmt
    first, final = [m for m in msgs if m["type"] == "preview"]
    assert (first["width"], first["height"]) == (4, 64)  # previews obey max_size
    assert (final["format"], final["width"], final["height"]) == (fmt, 40, 600)
    image = Image.open(io.BytesIO(final["image"]))
    assert (image.format, image.size) == (pillow, (40, 600))


@pytest.mark.asyncio
async def test_bad_output_settings_are_rejected_naming_the_field() -> None:
    async with running(Synthetic()) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="x", params={}, output={"format": "bmp"})
        reply = await recv(ws)
    assert (reply["type"], reply["code"], reply["field"], reply["id"]) == (
        "error", "invalid_field", "output.format", "x"
    )


@pytest.mark.asyncio
async def test_output_latent_sends_the_final_latent_drawn_by_the_preview_decoder() -> None:
    async with running(Synthetic()) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="l", params={"steps": 2, "work": 0, "output": "latent"})
        msgs = await until_end(ws, "l")
    check_stream(msgs, "l", 2)
    final = msgs[-2]
    assert (final["format"], final["width"], final["height"]) == ("png", 64, 64)


@pytest.mark.asyncio
async def test_a_diffusers_result_is_the_pipelines_image_with_its_params() -> None:
    pytest.importorskip("diffusers")
    with one_torch_thread():  # as the producer runs: the result equals pipe()'s bit for bit
        await _diffusers_result()


async def _diffusers_result() -> None:
    from omni_stream.models.diffusers import Diffusers

    from ..models.test_diffusers import fixed_embeddings, sd_pipe

    pipe = sd_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    params = {"prompt": "a cat", "steps": 2, "seed": 3, "height": 32, "width": 24}
    async with running(model) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="cat", params=params, preview={"max_size": 8})
        msgs = await until_end(ws, "cat", timeout=60)
    check_stream(msgs, "cat", 2)
    final = msgs[-2]
    assert (final["format"], final["width"], final["height"]) == ("png", 24, 32)
    image = Image.open(io.BytesIO(final["image"]))
    emb = fixed_embeddings("a cat", "")
    expected = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        num_inference_steps=2, height=32, width=24, generator=torch.Generator().manual_seed(3),
        output_type="pil",
    ).images[0]
    assert image.convert("RGB").tobytes() == expected.tobytes()
    saved = json.loads(image.text["omni_stream"])
    assert (saved["prompt"], saved["steps"], saved["seed"], saved["model"]) == ("a cat", 2, 3, "diffusers")
    assert image.text["parameters"].startswith("a cat\n")


@pytest.mark.asyncio
async def test_a_diffusers_server_lists_samplers_and_loras_and_runs_what_a_request_names(tmp_path) -> None:
    # Issue #20 over the real server: /models lists the samplers (the sampler param's choices)
    # and the loaded LoRAs; a request names both; a LoRA the server did not load is a 422
    # naming the entry; a drawn seed comes back and reproduces the picture.
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    import httpx

    from omni_stream.models.diffusers import Diffusers

    from ..models.test_diffusers import fixed_embeddings, sd_pipe
    from ..models.test_diffusers_loras import make_lora

    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)
    model.load_loras({"ink": make_lora(tmp_path / "ink", 7)})
    params = {"prompt": "a cat", "steps": 2, "height": 16, "width": 16, "sampler": "euler_a",
              "loras": [{"name": "ink", "scale": 0.5}]}
    with one_torch_thread():
        async with running(model) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
            card = (await http.get("/models")).json()
            assert card["loras"] == ["ink"]
            (sampler,) = [p for p in card["params"] if p["name"] == "sampler"]
            assert {"default", "euler_a", "dpmpp_2m_karras"} <= set(sampler["choices"])
            refused = await http.post("/v1/generations", json={"params": {**params, "loras": [{"name": "oil"}]}})
            assert refused.status_code == 422
            assert (refused.json()["error"], refused.json()["field"]) == ("bad_params", "loras[0].name")
            first = await http.post("/v1/generations?wait=true", json={"params": params})
            assert first.status_code == 200, first.text
            made = json.loads(Image.open(io.BytesIO(first.content)).text["omni_stream"])
            assert made["sampler"] == "euler_a" and isinstance(made["seed"], int)
            again = await http.post("/v1/generations?wait=true", json={"params": {**params, "seed": made["seed"]}})
            assert again.content == first.content
            plain = await http.post("/v1/generations?wait=true", json={"params": {**params, "seed": made["seed"],
                                                                                 "loras": []}})
            assert plain.content != first.content  # the LoRA was applied
