"""Figure 7, memory: RSS after 1,000 requests against after 100, and a reader that never reads.

One engine serves 1,000 short Synthetic requests, 16 at a time, in the mix a
server sees: most read to the end, every tenth is abandoned by its reader
after two frames (the request is cancelled), every tenth uses the "latest"
policy. Resident memory is read (after ``gc.collect()``) once 100 have
finished and again after 1,000. Anything kept per request (an entry in a
table, a late frame of a cancelled request, a buffer lease) grows the
second reading; the ratio should stay within noise (target <= 1.05).

The reader that never reads: one "all" request of 1,000 steps whose frames
nobody takes. The producer must stop advancing it once ``queue_size``
frames wait (its bounded buffer); the figure is the frames it holds over
that bound (target <= 1.0), from ``engine.statistics()``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import omni_stream as om

from .harness import Context, Figure, Target, rss_bytes

__all__ = ["run"]

RSS_TARGET = Target("<=", 1.05)
HELD_TARGET = Target("<=", 1.0)
CONCURRENCY = 16
QUEUE_SIZE = 8


async def _one(engine: om.Engine, i: int) -> None:
    params = {"steps": 6, "work": 0, "seed": i}
    if i % 10 == 3:
        # Abandoned by its reader: leaving `async with` cancels the request.
        async with engine.stream(params) as stream:
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    break
        return
    policy = "latest" if i % 10 == 7 else "all"
    async with engine.stream(params, policy=policy) as stream:
        async for _ in stream:
            pass


async def _serve(engine: om.Engine, start: int, stop: int) -> None:
    for wave in range(start, stop, CONCURRENCY):
        async with asyncio.TaskGroup() as tg:
            for i in range(wave, min(stop, wave + CONCURRENCY)):
                tg.create_task(_one(engine, i))


def _rss_settled() -> int:
    gc.collect()
    return rss_bytes()


async def _never_read(engine: om.Engine) -> dict[str, Any]:
    before = engine.statistics()
    stream = engine.stream({"steps": 1000, "work": 0}, policy="all")
    # Wait until the producer has stopped advancing it (steps stable for a while).
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + 5.0
    while time.monotonic() < deadline:
        steps = engine.statistics().steps
        if steps != last:
            last, stable_since = steps, time.monotonic()
        elif time.monotonic() - stable_since > 0.3:
            break
        await asyncio.sleep(0.02)
    during = engine.statistics()
    await stream.aclose()
    await asyncio.sleep(0.05)
    after = engine.statistics()
    return {
        "steps_computed": during.steps - before.steps,
        "frames_held": during.frames_delivered - before.frames_delivered,
        "buffers_total": during.buffers_total,
        "buffers_in_use": during.buffers_in_use,
        "buffers_in_flight": during.buffers_in_flight,
        "active_after_close": after.active,
        "buffers_in_use_after_close": after.buffers_in_use,
        "cancelled_after_close": after.cancelled - before.cancelled,
    }


async def run(ctx: Context) -> list[Figure]:
    first, total = (20, 100) if ctx.quick else (100, 1000)
    ctx.log(f"memory: {total} requests, {CONCURRENCY} at a time; RSS after {first} and after {total}")
    async with om.Engine(om.models.Synthetic(), device="cpu", queue_size=QUEUE_SIZE) as engine:
        t0 = time.perf_counter()
        await _serve(engine, 0, first)
        rss_first = _rss_settled()
        await _serve(engine, first, total)
        rss_total = _rss_settled()
        elapsed = time.perf_counter() - t0
        stats = engine.statistics().to_dict()
        held = await _never_read(engine)
    ctx.log(f"RSS {rss_first / 2**20:.1f} MiB after {first}, {rss_total / 2**20:.1f} MiB after {total}; never-read: {held}")
    return [
        Figure(
            name=f"memory.rss_{total}_vs_{first}",
            value=rss_total / rss_first,
            target=RSS_TARGET,
            baseline={f"rss_after_{first}_mib": rss_first / 2**20},
            engine={f"rss_after_{total}_mib": rss_total / 2**20, "run_s": elapsed},
            limits="allocator noise (torch's CPU allocator and Python's arenas keep freed memory)",
            details={"statistics": stats, "requests": total, "concurrency": CONCURRENCY},
        ),
        Figure(
            name="memory.never_read_held_vs_bound",
            value=held["frames_held"] / QUEUE_SIZE,
            target=HELD_TARGET,
            baseline={"queue_size": float(QUEUE_SIZE)},
            engine={k: float(v) for k, v in held.items()},
            limits="the engine's bound: a request pauses once queue_size frames wait for its reader",
            details=held,
        ),
    ]
