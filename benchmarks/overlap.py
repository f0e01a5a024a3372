"""Figure 3, overlap on an accelerator: per-step time against max(compute, copy).

On a GPU the copy of step n to the host runs on a side stream while step
n+1 computes, so a step should cost max(C, D), not C + D. The simulated
device (:class:`omni_stream.device.SimDevice`) has real compute and copy
"streams" (threads that sleep ``compute_s`` and ``copy_s``), so the
engine's pipelining is measured without a GPU; the model does no CPU work
(``work=0``).

The per-step time is measured in steady state: the interval between frame
arrivals after the first few, so the pipeline's fill (C + D once) does not
count. Side by side, a bare pipelined loop drives the same simulated device
with two host buffers and nothing else: its per-step time is the floor the
device itself allows (sleep granularity, thread wake-ups), and
``engine / bare`` is what the engine adds on top. Diagnostic variants run
the engine with other ``max_run_ahead`` values.
"""

from __future__ import annotations

import time
from collections import deque

import torch

import omni_stream as om
from omni_stream.device import SimDevice

from .harness import Context, Figure, Target, interleave, median, run_in_thread

__all__ = ["bare_pipeline", "engine_pipeline", "run"]

TARGET = Target("<=", 1.05)
COMPUTE_S = 0.010
COPY_S = 0.008
#: Frames before steady state: the fill of the pipeline and the first wake-ups.
WARMUP_FRAMES = 5


def _steady_per_step(stamps: list[float]) -> float:
    tail = stamps[WARMUP_FRAMES:]
    return (tail[-1] - tail[0]) / (len(tail) - 1)


def bare_pipeline(steps: int, *, depth: int = 2) -> float:
    """Drive a SimDevice directly with ``depth`` host buffers; returns the steady per-step seconds."""
    device = SimDevice(compute_s=COMPUTE_S, copy_s=COPY_S)
    device.prepare_thread()
    model = om.models.Synthetic()
    cpu = torch.device("cpu")
    model.load(cpu)
    state = model.start(model.validate({"steps": steps, "work": 0}), cpu)
    shape = tuple(model.validate({})["shape"])
    buffers = [device.host_buffer(shape, torch.float32) for _ in range(depth)]
    pending: deque[om.device.CopyEvent] = deque()
    stamps: list[float] = []
    try:
        for i in range(steps):
            out = model.step([state])[0]
            device.after_step()
            if len(pending) == depth:
                # The oldest copy used the buffer this one is about to reuse.
                pending.popleft().synchronize()
                stamps.append(time.perf_counter())
            pending.append(device.copy_to_host(out, buffers[i % depth]))
        while pending:
            pending.popleft().synchronize()
            stamps.append(time.perf_counter())
    finally:
        device.close()
    return _steady_per_step(stamps)


async def engine_pipeline(steps: int, **options: object) -> float:
    """One request through an Engine on a SimDevice; returns the steady per-step seconds."""
    device = SimDevice(compute_s=COMPUTE_S, copy_s=COPY_S)
    stamps: list[float] = []
    async with om.Engine(om.models.Synthetic(), device=device, **options) as engine:  # type: ignore[arg-type]
        async for _ in engine.stream({"steps": steps, "work": 0}):
            stamps.append(time.perf_counter())
    return _steady_per_step(stamps)


async def run(ctx: Context) -> list[Figure]:
    steps = 25 if ctx.quick else 100
    ideal = max(COMPUTE_S, COPY_S)
    ctx.log(f"overlap: SimDevice C={COMPUTE_S * 1e3:g} ms, D={COPY_S * 1e3:g} ms, {steps} steps")

    async def bare() -> float:
        return run_in_thread(lambda: bare_pipeline(steps))

    def engine_with(run_ahead: int | None):
        async def sample() -> float:
            opts = {} if run_ahead is None else {"max_run_ahead": run_ahead}
            return await engine_pipeline(steps, **opts)

        return sample

    variants = {"bare": bare, "engine": engine_with(None)}
    if not ctx.quick:
        variants.update({f"engine_run_ahead_{n}": engine_with(n) for n in (1, 2, 4)})
    samples = await interleave(variants, ctx.reps, ctx=ctx)
    med = {k: median(v) for k, v in samples.items()}
    engine_ms = {k: v * 1e3 for k, v in med.items() if k.startswith("engine")}
    return [
        Figure(
            name="overlap.sim",
            value=med["engine"] / ideal,
            target=TARGET,
            baseline={"max_C_D_ms": ideal * 1e3, "bare_pipeline_ms": med["bare"] * 1e3},
            engine=engine_ms,
            unit="x",
            limits=(
                f"the simulated streams' own sleeps and wake-ups: a bare pipelined loop takes "
                f"{med['bare'] / ideal:.3f}x max(C, D); the engine {med['engine'] / med['bare']:.3f}x that"
            ),
            details={
                "steps": steps,
                "compute_s": COMPUTE_S,
                "copy_s": COPY_S,
                "engine_vs_bare": med["engine"] / med["bare"],
                "samples_s": samples,
            },
        )
    ]
