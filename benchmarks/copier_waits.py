"""How the copier waits for copies: host calls on copy events a frame, off the producer thread.

``python -m benchmarks.copier_waits [--rows ...] [--steps N]`` (``benchmarks.ab_copier --waits`` runs it
before and after issue #33).

Counts, on the simulated GPU, the ``query()`` and ``synchronize()`` calls
made on copy events by threads other than the producer (each one is the GIL
taken by a thread beside the producer's, while it may be launching the
next step) and the loop's wake-ups for frames, per frame of one request of
each step shape (``benchmarks/step_shapes.py``). Polling with a back-off
queries a dozen times a frame; waiting in ``synchronize`` wakes once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any

import omni_stream as om
from omni_stream.device import SimDevice, simcuda

from .step_shapes import ROWS, ShapeStep

__all__ = ["count_waits"]


def count_waits(row_name: str, steps: int) -> dict[str, float]:
    row = next(r for r in ROWS if r.name == row_name)
    calls = {"query": 0, "synchronize": 0}
    query, synchronize = simcuda.Event.query, simcuda.Event.synchronize

    def counted(name: str, fn: Any) -> Any:
        def call(self: simcuda.Event) -> Any:
            if threading.current_thread().name != "omni-stream-producer":
                calls[name] += 1
            return fn(self)
        return call

    simcuda.Event.query = counted("query", query)  # type: ignore[method-assign]
    simcuda.Event.synchronize = counted("synchronize", synchronize)  # type: ignore[method-assign]
    try:
        async def run() -> int:
            async with om.Engine(ShapeStep(row, "sim"), device=SimDevice(compute_s=row.device_s)) as eng:
                await eng.generate({"steps": 2})
                for k in calls:
                    calls[k] = 0
                woken = eng._copier.wakeups
                async for _ in eng.stream({"steps": steps}):
                    pass
                return int(eng._copier.wakeups - woken)

        wakeups = asyncio.run(run())
    finally:
        simcuda.Event.query, simcuda.Event.synchronize = query, synchronize  # type: ignore[method-assign]
    return {"query": calls["query"] / steps, "synchronize": calls["synchronize"] / steps,
            "loop_wakeups": wakeups / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["compute_1ms", "launch_8ms", "video_6ms"])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    for name in args.rows:
        w = count_waits(name, args.steps)
        print(f"{name:14s} per frame: event.query {w['query']:.1f}, event.synchronize {w['synchronize']:.1f}, "
              f"loop wake-ups {w['loop_wakeups']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
