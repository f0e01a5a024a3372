"""The OpenAI door against our own ``/v1/generations``, the same request through one server.

A server on 127.0.0.1 serving the random SD pipeline of ``diffusers_stream``
(its sizes; ``--quick``: toy sizes), one request at a time, the same seed:

``ours``
    ``POST /v1/generations?wait=true``, no previews (as the OpenAI call): the
    PNG itself.
``openai``
    ``POST /v1/images/generations`` (``b64_json``): the same PNG, base64 in
    OpenAI's ``ImagesResponse``.
``openai_stream``
    the same with ``stream: true, partial_images: 3``: three partial images
    (previews at full size) and the completed one, as SSE.

Figures: ``openai / ours`` (target <= 1.05: the translation and base64 cost
nothing a caller sees) and ``openai_stream / openai`` (what the partial
images cost), with whether the images are byte for byte the same.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from .diffusers_stream import QUICK_SIZES, SIZES, _embeddings, _quiet_diffusers, build_pipe
from .harness import Context, Figure, Target, interleave, median, reset_main_thread

__all__ = ["run"]


async def run(ctx: Context) -> list[Figure]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("openai_door needs diffusers (pip install diffusers)") from exc
    _quiet_diffusers()
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings
    from omni_stream.server import Server

    sizes = QUICK_SIZES if ctx.quick else SIZES
    emb, neg = _embeddings(sizes)
    embeddings = PromptEmbeddings(prompt_embeds=emb, negative_prompt_embeds=neg)
    model = Diffusers(build_pipe(sizes), encode_prompt=lambda p, n: embeddings)
    params = {"prompt": "bench", "steps": sizes.steps, "seed": 1, "height": sizes.px, "width": sizes.px}
    openai_body = {"prompt": "bench", "size": f"{sizes.px}x{sizes.px}", "steps": sizes.steps, "seed": 1}
    ctx.log(f"openai_door: SD pipeline UNet {sizes.unet}, {sizes.px} px, {sizes.steps} steps")
    got: dict[str, bytes] = {}
    reset_main_thread()
    async with Server(model, host="127.0.0.1", port=0, device="cpu") as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=120) as http:

            async def ours() -> float:
                t0 = time.perf_counter()
                # No previews, as the OpenAI call asks for none: the same work on both sides
                # (with its default previews ours also renders one per step for GET .../preview).
                reply = await http.post(
                    "/v1/generations?wait=true", json={"params": params, "preview": {"every": 1 << 30}}
                )
                wall = time.perf_counter() - t0
                reply.raise_for_status()
                got["ours"] = reply.content
                return wall

            async def openai() -> float:
                t0 = time.perf_counter()
                reply = await http.post("/v1/images/generations", json=openai_body)
                wall = time.perf_counter() - t0
                reply.raise_for_status()
                got["openai"] = base64.b64decode(reply.json()["data"][0]["b64_json"])
                return wall

            async def openai_stream() -> float:
                t0 = time.perf_counter()
                events: list[Any] = []
                body = {**openai_body, "stream": True, "partial_images": 3}
                async with http.stream("POST", "/v1/images/generations", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("event: "):
                            events.append(line[7:])
                wall = time.perf_counter() - t0
                got["stream_events"] = ",".join(events).encode()
                return wall

            await ours()  # untimed warm-up
            samples = await interleave(
                {"ours": ours, "openai": openai, "openai_stream": openai_stream}, ctx.reps, ctx=ctx
            )
    med = {k: median(v) for k, v in samples.items()}
    same = got["ours"] == got["openai"]
    events = got["stream_events"].decode().split(",")
    return [
        Figure(
            name="openai_door.images_vs_generations",
            value=med["openai"] / med["ours"],
            target=Target("<=", 1.05),
            baseline={"ours_s": med["ours"]},
            engine={"openai_s": med["openai"]},
            limits=(
                f"one {sizes.px} px image through POST /v1/images/generations (b64_json) against "
                f"POST /v1/generations?wait=true, one at a time; the same PNG: {'yes' if same else 'NO'}"
            ),
            details={"samples_s": samples, "same_bytes": same},
        ),
        Figure(
            name="openai_door.stream_vs_plain",
            value=med["openai_stream"] / med["openai"],
            target=None,
            baseline={"openai_s": med["openai"]},
            engine={"openai_stream_s": med["openai_stream"]},
            limits=(
                "stream=true with partial_images=3 against the plain call; events: "
                + ", ".join(f"{events.count(e)} {e}" for e in dict.fromkeys(events))
            ),
            details={"samples_s": samples, "events": events},
        ),
    ]
