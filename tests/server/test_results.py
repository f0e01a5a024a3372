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


@pytest.mark.asyncio
async def test_several_images_are_several_results_on_every_door() -> None:
    # Issue #20's num_images over the real server: the websocket sends one final frame per
    # image (index of images) after a grid preview; the Python client's results() gives them
    # in order; HTTP lists them as a JSON array and serves each at output?index=i; each
    # equals pipe(num_images_per_prompt=n)'s image.
    pytest.importorskip("diffusers")
    import httpx

    from omni_stream import client as omc
    from omni_stream.models.diffusers import Diffusers

    from ..models.test_diffusers import fixed_embeddings, sd_pipe

    pipe = sd_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    params = {"prompt": "a cat", "steps": 2, "seed": 3, "height": 16, "width": 24, "num_images": 3}
    emb = fixed_embeddings("a cat", "")
    with one_torch_thread():
        expected = pipe(
            prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
            num_inference_steps=2, height=16, width=24, generator=torch.Generator().manual_seed(3),
            num_images_per_prompt=3, output_type="pil",
        ).images
        async with running(model) as server:
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="three", params=params)
                msgs = await until_end(ws, "three", timeout=60)
            async with omc.connect(server.url) as client:
                finals = await client.generate(params).results()
            async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
                listing = await http.post("/v1/generations?wait=true", json={"params": params})
                status = (await http.get(f"/v1/generations/{listing.json()['id']}")).json()
                second = await http.get(listing.json()["images"][1]["url"])
                missing = await http.get(listing.json()["images"][1]["url"].replace("index=1", "index=3"))
                bad = await http.get(listing.json()["images"][1]["url"].replace("index=1", "index=x"))
    assert msgs[-1]["type"] == "done"
    previews = [m for m in msgs if m["type"] == "preview"]
    grid, *results = previews
    # 3 latents of 12x8 (drawn at latent size): a 2x2 grid.
    assert not grid["final"] and (grid["width"], grid["height"]) == (24, 16)
    assert "index" not in grid
    assert [(r["final"], r["index"], r["images"]) for r in results] == [(True, i, 3) for i in range(3)]
    for result, image in zip(results, expected, strict=True):
        got = Image.open(io.BytesIO(result["image"]))
        assert got.convert("RGB").tobytes() == image.tobytes()
    assert [(f.index, f.images) for f in finals] == [(0, 3), (1, 3), (2, 3)]
    assert [f.data for f in finals] == [r["image"] for r in results]
    assert listing.status_code == 200, listing.text
    body = listing.json()
    assert [(i["index"], i["width"], i["height"], i["format"]) for i in body["images"]] == [
        (i, 24, 16, "png") for i in range(3)
    ]
    assert status["images"] == 3 and status["seed"] == 3
    assert second.status_code == 200 and second.content == results[1]["image"]
    assert second.headers["x-omni-stream-images"] == "3"
    assert missing.status_code == 404 and missing.json()["field"] == "index"
    assert bad.status_code == 400 and bad.json()["field"] == "index"
