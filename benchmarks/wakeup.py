"""A Wakeup's wait and wake, alone: microseconds a cycle on each anyio backend, bounded and not.

One reader task waits (``await wakeup.wait(timeout)``) until a counter
reaches N; the main task bumps the counter, wakes it and yields, N times.
A cycle is one wake, one task switch each way, one wait: what a frame
costs the engine's reader on top of its own work. ``timeout=60`` is the
reader's case (every wait is bounded by the step timeout); ``None`` is an
unbounded wait.

``python -m benchmarks.wakeup [--backend asyncio uvloop trio] [--reps N] [--against TREE]``

``--against``: another checkout's Wakeup run interleaved with this one
(``other/this`` > 1 when this one is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from omni_stream._wakeup import Wakeup

from .handover import BACKENDS, load_other

__all__ = ["cycle_us", "main"]

N = 20_000


async def _yield() -> None:
    # The cheapest scheduling point of the backend: the reader runs in between.
    await anyio.lowlevel.cancel_shielded_checkpoint()


async def cycle_us(cls: Any, timeout: float | None, n: int = N) -> float:
    """Microseconds per wait-and-wake cycle of a fresh ``cls()`` Wakeup."""
    wakeup = cls()
    count = 0

    async def reader() -> None:
        while count < n:
            await wakeup.wait(timeout)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        t0 = time.perf_counter()
        for _ in range(n):
            count += 1
            wakeup.wake()
            await _yield()
        elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wakeup", description=__doc__.split("\n")[0])
    p.add_argument("--backend", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--against", metavar="TREE")
    args = p.parse_args(argv)
    classes: dict[str, Any] = {"this": Wakeup}
    if args.against:
        classes["other"] = load_other(args.against)._wakeup.Wakeup
    print(f"us per wait-and-wake cycle, median of {args.reps} runs of {N}")
    print(f"{'backend':<8} {'timeout':>8} " + " ".join(f"{k:>8}" for k in classes)
          + (f" {'other/this':>11}" if args.against else ""))
    for name in args.backend:
        backend, options = BACKENDS[name]
        for timeout in (None, 60.0):
            got: dict[str, list[float]] = {k: [] for k in classes}
            for rep in range(args.reps):
                order = list(classes) if rep % 2 == 0 else list(classes)[::-1]
                for k in order:
                    got[k].append(anyio.run(cycle_us, classes[k], timeout, backend=backend,
                                            backend_options=options))
            med = {k: statistics.median(v) for k, v in got.items()}
            line = f"{name:<8} {timeout!s:>8} " + " ".join(f"{med[k]:>8.2f}" for k in classes)
            if args.against:
                line += f" {med['other'] / med['this']:>11.3f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
