"""Figure 4, batching: 16 concurrent compatible requests against the same 16 one at a time.

Baseline ``one_at_a_time``: the 16 requests through the engine one after
another, each alone (what a serial queue such as ComfyUI's does). Then the
16 submitted at once, with ``max_batch_size`` 1, 2, 4, 8 and 16: the curve
``one_at_a_time / concurrent`` shows what batching across requests buys,
and ``max_batch_size=1`` separates it from merely running concurrently.

Two models: the default, ``Mixture`` at size 64 (its step is dominated by
per-call overhead and small reductions, which batching amortises), and
``Synthetic`` with ~1 ms steps (a matmul whose cost grows with the batch).
One model instance serves every engine of a figure, so its image bank is
rendered once, outside the clock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import omni_stream as om

from .harness import (
    Context,
    Figure,
    Target,
    interleave,
    median,
    run_in_thread,
    stream_all,
)
from .limit import bare_steps

__all__ = ["run"]

TARGET_MIXTURE_16 = Target(">=", 4.0)
REQUESTS = 16
BATCH_SIZES = (1, 2, 4, 8, 16)


async def _one_at_a_time(model: om.StepModel, params: Sequence[Mapping[str, Any]]) -> float:
    async with om.Engine(model, device="cpu") as engine:
        await engine.generate(dict(params[0], steps=1))
        t0 = time.perf_counter()
        for p in params:
            await stream_all(engine, [p])
        return time.perf_counter() - t0


async def _concurrent(model: om.StepModel, params: Sequence[Mapping[str, Any]], batch: int) -> float:
    async with om.Engine(model, device="cpu", max_batch_size=batch) as engine:
        await engine.generate(dict(params[0], steps=1))
        return await stream_all(engine, params)


async def _curve(
    ctx: Context, label: str, model: om.StepModel, params: list[dict[str, Any]], reps: int
) -> list[Figure]:
    async def seq() -> float:
        return await _one_at_a_time(model, params)

    def conc(b: int):
        async def sample() -> float:
            return await _concurrent(model, params, b)

        return sample

    async def bare_seq() -> float:
        return run_in_thread(lambda: sum(bare_steps(model, [p]) for p in params))

    async def bare_batch() -> float:
        return run_in_thread(lambda: bare_steps(model, params))

    sizes = (1, 16) if ctx.quick else BATCH_SIZES
    variants = {
        "one_at_a_time": seq,
        **{f"batch_{b}": conc(b) for b in sizes},
        "bare_one_at_a_time": bare_seq,
        "bare_batch_16": bare_batch,
    }
    samples = await interleave(variants, reps, ctx=ctx)
    med = {k: median(v) for k, v in samples.items()}
    curve = {b: med["one_at_a_time"] / med[f"batch_{b}"] for b in sizes}
    ctx.log(f"batching {label}: " + ", ".join(f"{b}: {v:.2f}x" for b, v in curve.items()))
    # The model's own ceiling: the same steps with no engine, in a worker
    # thread (where the engine runs them), alone vs all 16 in one call.
    ceiling = med["bare_one_at_a_time"] / med["bare_batch_16"]
    details = {
        "requests": REQUESTS,
        "params": params[0],
        "curve": curve,
        "model_ceiling_16": ceiling,
        "samples_s": samples,
    }
    figures = []
    for b in sizes:
        target = TARGET_MIXTURE_16 if (label == "mixture" and b == 16) else None
        figures.append(
            Figure(
                name=f"batching.{label}.b{b}",
                value=curve[b],
                target=target,
                baseline={
                    "one_at_a_time": med["one_at_a_time"],
                    "bare_one_at_a_time": med["bare_one_at_a_time"],
                },
                engine={f"batch_{b}": med[f"batch_{b}"], "bare_batch_16": med["bare_batch_16"]},
                limits=(
                    f"the model's own batching: its bare steps gain {ceiling:.2f}x from 16 in one "
                    "call; max_batch_size=1 is concurrency alone"
                ),
                details=details,
            )
        )
    return figures


async def run(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    mixture_steps = 3 if ctx.quick else 30
    mixture = om.models.Mixture()
    params = [
        {"size": 64, "steps": mixture_steps, "seed": i, "prompt": ""} for i in range(REQUESTS)
    ]
    ctx.log(f"batching mixture: {REQUESTS} requests x {mixture_steps} steps at size 64")
    figures += await _curve(ctx, "mixture", mixture, params, ctx.reps)

    synth_steps = 5 if ctx.quick else 20
    work = ctx.work_for(0.001)
    params = [{"steps": synth_steps, "work": work, "seed": i} for i in range(REQUESTS)]
    ctx.log(f"batching synthetic: {REQUESTS} requests x {synth_steps} steps, work={work}")
    figures += await _curve(ctx, "synthetic", om.models.Synthetic(), params, ctx.reps)
    return figures
