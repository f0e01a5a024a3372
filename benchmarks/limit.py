"""Figure 1, the limit: the engine against the same model's steps in a bare loop.

The bare loop calls ``model.step`` back to back with no streaming at all,
which no engine can beat. It runs two ways, side by side with the engine:

* ``bare_main``: in the main thread, as a user's plain script runs it;
* ``bare_worker``: in a worker thread, the floor for any engine that keeps
  its event loop free, with the better of two torch thread settings
  (torch's default, and ``torch.set_num_threads(1)`` in that thread).

The engine runs the same requests with ``max_batch_size`` equal to their
count, so it advances them in the same batched calls the bare loop makes,
twice: with its defaults (one producer torch thread) and with
``torch_threads`` = the CPU count, the arrangement for compute-bound CPU
serving (``Engine.start`` releases the loop thread's idle OpenMP team, so
the producer's is the only one; ``threads.py`` shows why that matters).

Values: ``engine / floor`` (the engine's own overhead over the worker
floor; the issue's targets: <= 1.03 at 10 ms, <= 1.10 at 1 ms),
``engine / bare_main`` (what a user switching from a script sees with the
defaults) and ``engine_all_cores / bare_main`` (the same with every core;
target <= 1.10 at 10 ms).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

import omni_stream as om
from omni_stream.device.openmp import release_idle_team

from .harness import (
    Context,
    Figure,
    Target,
    interleave,
    median,
    reset_main_thread,
    run_in_thread,
    stream_all,
)

__all__ = ["bare_steps", "engine_steps", "run"]

#: The issue's bound for the engine's overhead over the worker-thread floor at
#: 1 ms steps (and ours for 16 batched): the frame's copy, the hand-over to
#: the loop and the reader's wake-up cost about a tenth of a millisecond.
OVERHEAD_TARGET = Target("<=", 1.10)
#: The worker-thread arrangements the floor is the best of.
BARE_WORKERS = ("bare_worker", "bare_worker_1t", "bare_worker_released")
#: The issue's bound for the engine against a user's plain loop in the main
#: thread, 10 ms steps, with the arrangement that avoids the OpenMP trap.
MAIN_TARGET = Target("<=", 1.10)


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
    """The ways of running ``params``, each returning seconds.

    Each also appends the process CPU seconds of its timed part to
    ``cpu[name]`` (every thread: the producer's compute and the loop's work).
    """
    cores = os.cpu_count() or 1
    for name in (*BARE_WORKERS, "bare_main", "engine", "engine_all_cores"):
        cpu[name] = []

    # Every variant starts from the same process state (reset_main_thread says
    # what an engine variant would otherwise leave behind for the next one).
    async def bare_main() -> float:
        reset_main_thread()
        return bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_main"])

    async def bare_worker() -> float:
        reset_main_thread()
        return run_in_thread(lambda: bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_worker"]))

    async def bare_worker_1t() -> float:
        reset_main_thread()
        return run_in_thread(
            lambda: bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_worker_1t"]), threads=1
        )

    async def bare_worker_released() -> float:
        # What Engine.start does for its producer: the main thread's idle
        # team released first, so the worker's team is the only one.
        reset_main_thread()
        release_idle_team()
        return run_in_thread(
            lambda: bare_steps(om.models.Synthetic(), params, cpu_s=cpu["bare_worker_released"])
        )

    async def engine() -> float:
        reset_main_thread()
        return await engine_steps(om.models.Synthetic(), params, cpu_s=cpu["engine"])

    async def engine_all_cores() -> float:
        # The arrangement for compute-bound CPU serving: a producer team as
        # large as the machine (the engine releases the loop thread's idle
        # team at start, so it is the only one).
        reset_main_thread()
        return await engine_steps(
            om.models.Synthetic(), params, cpu_s=cpu["engine_all_cores"], torch_threads=cores
        )

    return {
        "bare_main": bare_main,
        "bare_worker": bare_worker,
        "bare_worker_1t": bare_worker_1t,
        "bare_worker_released": bare_worker_released,
        "engine": engine,
        "engine_all_cores": engine_all_cores,
    }


async def run(ctx: Context) -> list[Figure]:
    steps_1ms, steps_10ms, steps_batch = (30, 8, 8) if ctx.quick else (200, 40, 40)
    # (label, step seconds, requests, steps, target for engine / worker floor,
    #  target for engine with all cores / the main thread's plain loop)
    configs = [
        ("1ms", 0.001, 1, steps_1ms, OVERHEAD_TARGET, None),
        ("10ms", 0.010, 1, steps_10ms, Target("<=", 1.03), MAIN_TARGET),
        ("16x1ms", 0.001, 16, steps_batch, OVERHEAD_TARGET, None),
    ]
    figures: list[Figure] = []
    for label, step_s, n, steps, worker_target, main_target in configs:
        work = ctx.work_for(step_s)
        params = [{"steps": steps, "work": work, "seed": i} for i in range(n)]
        ctx.log(f"limit {label}: {n} request(s) x {steps} steps, work={work}")
        cpu: dict[str, list[float]] = {}
        samples = await interleave(_variants(params, cpu), ctx.reps, ctx=ctx)
        med = {k: median(v) for k, v in samples.items()}
        floor_name = min(BARE_WORKERS, key=lambda k: med[k])
        floor = med[floor_name]
        best_name = min(("engine", "engine_all_cores"), key=lambda k: med[k])
        best = med[best_name]
        per_step = {f"{k}_per_step_ms": v / steps * 1e3 for k, v in med.items()}
        cpu_ms = {k: median(v) / (steps * n) * 1e3 for k, v in cpu.items()}
        cpu_extra_ms = cpu_ms["engine"] - cpu_ms["bare_worker_1t"]
        details = {
            "requests": n,
            "steps": steps,
            "work": work,
            "floor": floor_name,
            "best_engine": best_name,
            "samples_s": samples,
            **per_step,
            # Whole-process CPU per frame: the engine's minus the floor's is
            # what its machinery costs a frame (engine setup included).
            "cpu_ms_per_frame": cpu_ms,
        }
        baseline = {k: med[k] for k in ("bare_main", *BARE_WORKERS)}
        engine_raw = {k: med[k] for k in ("engine", "engine_all_cores")}
        settings = {"engine": "torch_threads=1 (the default on 1-2 cores)", "engine_all_cores": f"torch_threads={os.cpu_count()}"}
        best_setting = settings[best_name]
        rows = [
            (
                "vs_worker",
                best / floor,
                worker_target,
                f"the engine at its best setting ({best_setting}) against the best worker "
                f"arrangement ({floor_name}); what is left is the per-frame work on the loop "
                "(hand-over, delivery, the reader's wake-up), which holds the GIL the producer's "
                "next torch call needs",
            ),
            (
                "default_vs_worker_1t",
                med["engine"] / med["bare_worker_1t"],
                None,
                "same thread setting on both sides (one torch thread): the machinery alone, "
                f"{cpu_extra_ms:.2f} ms more CPU a frame",
            ),
            (
                "vs_main",
                best / med["bare_main"],
                main_target,
                f"the engine at its best setting ({best_setting}) against the user's plain "
                f"loop in the main thread (torch's default threads); the default engine: "
                f"{med['engine'] / med['bare_main']:.2f}x. With every core the producer's team is the "
                "only one (Engine.start released the loop thread's), so it steps as fast as the "
                "main thread; the default keeps two cores for the loop and previews (one thread on "
                "2 cores: previews, the loop and the sockets need them; naive, loop_lag)",
            ),
        ]
        figures.extend(
            Figure(
                name=f"limit.{label}.{suffix}",
                value=value,
                target=target,
                baseline=baseline,
                engine=engine_raw,
                limits=limits,
                details=details,
            )
            for suffix, value, target, limits in rows
        )
    return figures
