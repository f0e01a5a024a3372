"""Figure 5, loop health: event-loop lag while 64 requests stream.

A ticker task sleeps ``INTERVAL`` over and over and records how late it
wakes: the time a ready callback (a websocket write, a health check) waits
for the loop. Side by side, the same ticker runs on the idle loop, whose
lag is the timer's own granularity (uvloop's timers tick in whole
milliseconds). The loaded run streams 64 Synthetic requests (~1 ms steps,
the engine's default options), every frame read by its own task.

Value: the loaded run's p99 lag in milliseconds (target <= 5 ms); the idle
p99 is the baseline beside it, and p50 and the maximum are reported too.
A diagnostic variant runs the producer with one torch thread (the change
``threads.py`` argues for), which leaves the second core to the loop.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import omni_stream as om

from .harness import (
    Context,
    Figure,
    Target,
    interleave,
    median,
    percentile,
    stream_all,
)

__all__ = ["run", "ticker"]

TARGET = Target("<=", 5.0)
INTERVAL = 0.002
REQUESTS = 64


async def ticker(stop: asyncio.Event, interval: float = INTERVAL) -> list[float]:
    """Sleep ``interval`` until ``stop`` is set; returns each wake-up's lateness in seconds."""
    lags: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(max(0.0, time.perf_counter() - t0 - interval))
    return lags


@dataclass(frozen=True, slots=True)
class LagSample:
    """One run of the ticker: how late each tick woke (seconds), and how long the run took."""

    elapsed_s: float
    lags: list[float]
    statistics: dict[str, Any]


async def _measure(load: bool, params: list[dict[str, object]], idle_s: float) -> LagSample:
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tick = tg.create_task(ticker(stop))
        if load:
            model = om.models.Synthetic()
            async with om.Engine(model, device="cpu") as engine:
                await engine.generate(dict(params[0], steps=1))
                elapsed = await stream_all(engine, params)
                stats = engine.statistics().to_dict()
        else:
            await asyncio.sleep(idle_s)
            elapsed, stats = idle_s, {}
        stop.set()
    return LagSample(elapsed, tick.result(), stats)


async def run(ctx: Context) -> list[Figure]:
    steps = 5 if ctx.quick else 30
    work = ctx.work_for(0.001)
    params: list[dict[str, object]] = [{"steps": steps, "work": work, "seed": i} for i in range(REQUESTS)]
    idle_s = 0.3 if ctx.quick else 1.0
    ctx.log(f"loop_lag: {REQUESTS} requests x {steps} steps, work={work}; ticker every {INTERVAL * 1e3:g} ms")

    async def idle() -> LagSample:
        return await _measure(False, params, idle_s)

    async def loaded() -> LagSample:
        return await _measure(True, params, idle_s)

    samples = await interleave({"idle": idle, "loaded": loaded}, ctx.reps)

    def stat(kind: str, q: float) -> float:
        return median([percentile(s.lags, q) * 1e3 for s in samples[kind]])

    def worst(kind: str) -> float:
        return max(max(s.lags, default=0.0) for s in samples[kind]) * 1e3

    loaded_p99, idle_p99 = stat("loaded", 99), stat("idle", 99)
    ctx.log(
        f"lag ms: idle p50 {stat('idle', 50):.2f} p99 {idle_p99:.2f} max {worst('idle'):.2f}; "
        f"loaded p50 {stat('loaded', 50):.2f} p99 {loaded_p99:.2f} max {worst('loaded'):.2f}"
    )
    return [
        Figure(
            name="loop_lag.p99_ms",
            value=loaded_p99,
            unit="ms",
            target=TARGET,
            baseline={"idle_p50_ms": stat("idle", 50), "idle_p99_ms": idle_p99, "idle_max_ms": worst("idle")},
            engine={
                "loaded_p50_ms": stat("loaded", 50),
                "loaded_p99_ms": loaded_p99,
                "loaded_max_ms": worst("loaded"),
                "stream_s": median([s.elapsed_s for s in samples["loaded"]]),
            },
            limits=(
                "the GIL: the loop waits for the producer thread to let go of it (up to the 5 ms "
                "switch interval), plus the loop's own per-frame work and the machine's other load "
                "(the idle loop's own p99 beside it)"
            ),
            details={
                "requests": REQUESTS,
                "steps": steps,
                "work": work,
                "interval_s": INTERVAL,
                "ticks": {k: [len(s.lags) for s in v] for k, v in samples.items()},
                "loaded_p99_per_rep_ms": [percentile(s.lags, 99) * 1e3 for s in samples["loaded"]],
                "statistics": samples["loaded"][-1].statistics,
                "switch_interval_s": sys.getswitchinterval(),
            },
        )
    ]
