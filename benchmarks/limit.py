"""Figure 1, the limit: the engine against the same model's steps in a bare loop.

The bare loop calls ``model.step`` back to back with no streaming at all,
which no engine can beat. It runs two ways, side by side with the engine:

* ``bare_main``: in the main thread, as a user's plain script runs it;
* ``bare_worker``: in a worker thread, the floor for any engine that keeps
  its event loop free, with the better of two torch thread settings
  (torch's default, and ``torch.set_num_threads(1)`` in that thread).

The engine runs the same requests with ``max_batch_size`` equal to their
count, so it advances them in the same batched calls the bare loop makes.
A fifth variant, ``engine_1t``, is the engine with one line added to its
producer thread (``torch.set_num_threads(1)`` before the model loads,
emulated through :class:`~benchmarks.harness.ProducerThreads`): the change
``threads.py`` argues for.

Values: ``engine / bare_main`` (what a user switching from a script sees)
and ``engine / bare_worker`` (the engine's own overhead over the floor).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

import omni_stream as om

from .harness import (
    Context,
    Figure,
    ProducerThreads,
    Target,
    interleave,
    median,
    run_in_thread,
    stream_all,
)

__all__ = ["bare_steps", "engine_steps", "run"]

#: Our own bound for the engine's overhead over the worker-thread floor: the
#: copy into a pool buffer, the hand-over to the loop and the clone cost a
#: few tens of microseconds a step, a few percent of a 1 ms step.
OVERHEAD_TARGET = Target("<=", 1.10)


def bare_steps(
    model: om.StepModel, params: Sequence[Mapping[str, Any]], *, cpu_s: list[float] | None = None
) -> float:
    """Start every request and step them all together to the end; returns seconds.

    ``model.load`` runs before the clock starts (the engine loads its model
    before the first request too). The process CPU seconds of the timed part
    are appended to ``cpu_s`` when given.
    """
    device = torch.device("cpu")
    model.load(device)
    checked = [model.validate(p) for p in params]
    total = model.total_steps(checked[0])
    c0, t0 = time.process_time(), time.perf_counter()
    states = [model.start(p, device) for p in checked]
    for _ in range(total):
        model.step(states)
    wall = time.perf_counter() - t0
    if cpu_s is not None:
        cpu_s.append(time.process_time() - c0)
    return wall


async def engine_steps(
    model: om.StepModel,
    params: Sequence[Mapping[str, Any]],
    *,
    cpu_s: list[float] | None = None,
    **options: Any,
) -> float:
    """The same requests through a fresh Engine, every frame read; returns seconds.

    A one-step request runs first, untimed, so the model is loaded and the
    producer thread is up before the clock starts. The process CPU seconds
    of the timed part are appended to ``cpu_s`` when given.
    """
    options.setdefault("max_batch_size", max(1, len(params)))
    async with om.Engine(model, device="cpu", **options) as engine:
        await engine.generate(dict(params[0], steps=1))
        c0 = time.process_time()
        wall = await stream_all(engine, params)
        if cpu_s is not None:
            cpu_s.append(time.process_time() - c0)
        return wall


def _variants(
    params: list[dict[str, Any]], cpu: dict[str, list[float]]
) -> dict[str, Callable[[], Awaitable[float]]]:
    """The five ways of running ``params``, each returning seconds.

    Each also appends the process CPU seconds of its timed part to
    ``cpu[name]`` (every thread: the producer's compute and the loop's work).
    """
    for name in ("bare_main", "bare_worker", "bare_worker_1t", "engine", "engine_1t"):
        cpu[name] = []

    async def bare_main() -> float:
        return bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_main"])

    async def bare_worker() -> float:
        return run_in_thread(lambda: bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_worker"]))

    async def bare_worker_1t() -> float:
        return run_in_thread(
            lambda: bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_worker_1t"]), threads=1
        )

    async def engine() -> float:
        return await engine_steps(om.models.Synthetic(), params, cpu_s=cpu["engine"])

    async def engine_1t() -> float:
        model = ProducerThreads(om.models.Synthetic(), 1)
        try:
            return await engine_steps(model, params, cpu_s=cpu["engine_1t"])
        finally:
            model.restore()

    return {
        "bare_main": bare_main,
        "bare_worker": bare_worker,
        "bare_worker_1t": bare_worker_1t,
        "engine": engine,
        "engine_1t": engine_1t,
    }


async def run(ctx: Context) -> list[Figure]:
    steps_1ms, steps_10ms, steps_batch = (30, 8, 8) if ctx.quick else (200, 40, 40)
    configs = [
        ("1ms", 0.001, 1, steps_1ms),
        ("10ms", 0.010, 1, steps_10ms),
        ("16x1ms", 0.001, 16, steps_batch),
    ]
    figures: list[Figure] = []
    for label, step_s, n, steps in configs:
        work = ctx.work_for(step_s)
        params = [{"steps": steps, "work": work, "seed": i} for i in range(n)]
        ctx.log(f"limit {label}: {n} request(s) x {steps} steps, work={work}")
        cpu: dict[str, list[float]] = {}
        samples = await interleave(_variants(params, cpu), ctx.reps, ctx=ctx)
        med = {k: median(v) for k, v in samples.items()}
        floor_name = min(("bare_worker", "bare_worker_1t"), key=lambda k: med[k])
        floor = med[floor_name]
        per_step = {f"{k}_per_step_ms": v / steps * 1e3 for k, v in med.items()}
        cpu_ms = {k: median(v) / (steps * n) * 1e3 for k, v in cpu.items()}
        cpu_extra_ms = cpu_ms["engine_1t"] - cpu_ms["bare_worker_1t"]
        details = {
            "requests": n,
            "steps": steps,
            "work": work,
            "floor": floor_name,
            "samples_s": samples,
            **per_step,
            # Whole-process CPU per frame: the engine's minus the floor's is
            # what its machinery costs a frame (engine setup included).
            "cpu_ms_per_frame": cpu_ms,
            "engine_1t_vs_main": med["engine_1t"] / med["bare_main"],
            "engine_1t_vs_worker": med["engine_1t"] / floor,
        }
        baseline = {k: med[k] for k in ("bare_main", "bare_worker", "bare_worker_1t")}
        engine_raw = {k: med[k] for k in ("engine", "engine_1t")}
        figures.append(
            Figure(
                name=f"limit.{label}.vs_main",
                value=med["engine"] / med["bare_main"],
                target=None,
                baseline=baseline,
                engine=engine_raw,
                limits=(
                    "where torch runs: the engine steps in a worker thread, whose OpenMP team "
                    "contends with the main thread's (see threads); the worker floor below"
                ),
                details=details,
            )
        )
        figures.append(
            Figure(
                name=f"limit.{label}.vs_worker",
                value=med["engine"] / floor,
                target=OVERHEAD_TARGET,
                baseline=baseline,
                engine=engine_raw,
                limits=(
                    f"floor = {floor_name}; the engine's producer uses torch's default threads "
                    f"(with one: {med['engine_1t'] / floor:.2f}x); its machinery costs "
                    f"{cpu_extra_ms:.2f} ms of CPU a frame (engine_1t against bare_worker_1t: "
                    "copies, hand-over to the loop, delivery, the reader's wake-up)"
                ),
                details=details,
            )
        )
        figures.append(
            Figure(
                name=f"limit.{label}.producer_1t_gain",
                value=med["engine"] / med["engine_1t"],
                target=None,
                baseline={"engine": med["engine"]},
                engine={"engine_1t": med["engine_1t"]},
                limits=(
                    "> 1 means torch.set_num_threads(1) on the producer thread makes the engine "
                    "faster here; depends on how busy the other core is"
                ),
                details=details,
            )
        )
    return figures
