"""Batching across requests on a native diffusers loop: N concurrent requests, batched or not.

The random SD pipeline of ``diffusers_stream`` (its sizes; ``--quick``:
toy sizes), 10 Euler steps with guidance at 64 px, one torch thread on the
producer. For N = 4 and 16 requests with their own seeds:

``one_at_a_time``
    the N requests through the engine one after another (a serial queue).
``unbatched``
    the N at once with ``batch=False``: one request per UNet call, their
    steps interleaved (the engine's round robin), which is what every
    request waited for before batching was on by default.
``batched``
    the N at once with the default (up to ``DEFAULT_MAX_BATCH`` requests a
    call): their steps share UNet calls.

Figures: ``one_at_a_time / batched`` (throughput: above 1 is faster), the
mean latency of ``batched`` against ``unbatched``, and the largest
difference between a batched request's result and its solo run (a batched
call can round differently from a one-request call).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import torch

import omni_stream as om

from .diffusers_stream import QUICK_SIZES, SIZES, THREADS, _embeddings, _quiet_diffusers, build_pipe
from .harness import Context, Figure, interleave, median, reset_main_thread

__all__ = ["run"]

COUNTS = (4, 16)


async def _run(model: Any, requests: list[dict[str, Any]], *, together: bool) -> tuple[float, float, list[Any]]:
    """Wall seconds for all, the mean seconds from the start to each request's result (a queued
    request's wait included: all N arrive at once), and each final frame."""
    finals: list[Any] = [None] * len(requests)
    latencies = [0.0] * len(requests)
    reset_main_thread()
    async with om.Engine(model, device="cpu", torch_threads=THREADS) as engine:
        await engine.generate(dict(requests[0], steps=1, output="latent"))  # untimed warm-up
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            finals[i] = await engine.generate(dict(requests[i], output="latent"))
            latencies[i] = time.perf_counter() - t0

        if together:
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
        else:
            for i in range(len(requests)):
                await one(i)
        wall = time.perf_counter() - t0
    return wall, sum(latencies) / len(latencies), [f.data for f in finals]


async def run(ctx: Context) -> list[Figure]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("diffusers_batching needs diffusers (pip install diffusers)") from exc
    _quiet_diffusers()
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings
    from omni_stream.models.diffusers.native import DEFAULT_MAX_BATCH

    sizes = QUICK_SIZES if ctx.quick else SIZES
    pipe = build_pipe(sizes)
    emb, neg = _embeddings(sizes)
    embeddings = PromptEmbeddings(prompt_embeds=emb, negative_prompt_embeds=neg)
    batched = Diffusers(pipe, encode_prompt=lambda p, n: embeddings)
    unbatched = Diffusers(pipe, encode_prompt=lambda p, n: embeddings, batch=False)
    ctx.log(f"diffusers_batching: SD pipeline UNet {sizes.unet}, {sizes.px} px, {sizes.steps} steps, "
            f"max_batch_size {batched.max_batch_size} (default) against 1, {THREADS} torch thread")
    figures: list[Figure] = []
    for count in COUNTS:
        requests = [{"prompt": "bench", "steps": sizes.steps, "seed": i, "height": sizes.px, "width": sizes.px}
                    for i in range(count)]
        latency: dict[str, list[float]] = {"batched": [], "unbatched": [], "one_at_a_time": []}
        results: dict[str, list[Any]] = {}

        def variant(model: Any, key: str, together: bool) -> Any:
            async def sample() -> float:
                wall, mean, finals = await _run(model, requests, together=together)
                latency[key].append(mean)
                results[key] = finals
                return wall

            return sample

        samples = await interleave(
            {
                "one_at_a_time": variant(unbatched, "one_at_a_time", False),
                "unbatched": variant(unbatched, "unbatched", True),
                "batched": variant(batched, "batched", True),
            },
            ctx.reps,
            ctx=ctx,
        )
        med = {k: median(v) for k, v in samples.items()}
        solo = results["one_at_a_time"]
        diff = max(float((a - b).abs().max()) for a, b in zip(results["batched"], solo, strict=True))
        exact = all(torch.equal(a, b) for a, b in zip(results["unbatched"], solo, strict=True))
        mean_lat = {k: median(v) for k, v in latency.items()}
        details = {"samples_s": samples, "mean_latency_s": latency, "max_abs_diff_batched_vs_solo": diff,
                   "unbatched_equals_solo": exact, "max_batch_size": DEFAULT_MAX_BATCH}
        figures += [
            Figure(
                name=f"diffusers_batching.throughput_{count}",
                value=med["one_at_a_time"] / med["batched"],
                target=None,
                baseline={"one_at_a_time": med["one_at_a_time"]},
                engine={"batched": med["batched"], "unbatched": med["unbatched"]},
                limits=(
                    f"{count} requests at once, batched up to {DEFAULT_MAX_BATCH} a UNet call, against one "
                    f"after another; unbatched but concurrent: {med['one_at_a_time'] / med['unbatched']:.3f}x; "
                    f"one CPU thread; results within "
                    f"{diff:.2g} of the solo runs (unbatched: {'bit for bit' if exact else 'NOT equal'})"
                ),
                details=details,
            ),
            Figure(
                name=f"diffusers_batching.mean_latency_{count}",
                value=mean_lat["batched"] / mean_lat["unbatched"],
                target=None,
                baseline={"unbatched_mean_s": mean_lat["unbatched"]},
                engine={"batched_mean_s": mean_lat["batched"], "one_at_a_time_mean_s": mean_lat["one_at_a_time"]},
                limits=(
                    f"mean seconds from arrival to result of {count} requests arriving at once, batched "
                    f"against unbatched; one after another (a queue): "
                    f"{mean_lat['one_at_a_time'] / mean_lat['unbatched']:.3f}x"
                ),
                details=details,
            ),
        ]
    return figures
