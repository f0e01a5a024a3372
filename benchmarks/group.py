"""EngineGroup throughput: two ``sim`` devices against one, side by side.

``python -m benchmarks.group [--rounds R] [--requests N] [--steps S] [--compute-ms C] [--batch B]
[--json PATH]``

``N`` requests of ``S`` steps each (``Synthetic``, ``work=0``, ``[3, 64,
64]`` frames), started at once and read to their end with
``policy="all"``, through one ``Engine`` on a ``SimDevice(compute_s=C)``
and through ``EngineGroup`` of two such devices. The simulated kernel time
is the device's (a worker thread sleeping on a device clock), not the CPU's,
so two simulated devices do not compete for the cores, and the group
should do nearly twice the frames per second of one engine: the target is
>= 1.9x. ``max_batch_size`` is ``B`` (default 1: each step is one
request's, so a frame costs ``C`` of device time; with batching the device
time is per batch and one engine would batch all ``N`` requests into one
step, which measures the batcher rather than the group).

The two variants run alternately, ``R`` rounds, reversing the order every
other round (the machine's other load shifts both alike). A row per round
(one engine fps, group fps, ratio) and the median; pass/fail is the median
ratio against the target. Exit status 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["TARGET", "main", "run"]

#: Two simulated devices against one: throughput at least this many times one's.
TARGET = 1.9
SHAPE = [3, 64, 64]


async def _load(engine: Any, requests: int, steps: int) -> tuple[int, float]:
    """Start ``requests`` streams at once, read each to its end; frames and wall seconds."""

    async def one(seed: int) -> int:
        n = 0
        params = {"steps": steps, "work": 0, "shape": SHAPE, "seed": seed}
        async for _ in engine.stream(params, policy="all"):
            n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(requests)))
    return sum(counts), time.perf_counter() - t0


async def _sample(kind: str, requests: int, steps: int, compute_s: float, batch: int) -> float:
    import omni_stream as om
    from omni_stream.device import SimDevice

    if kind == "engine":
        engine: Any = om.Engine(
            om.models.Synthetic(), device=SimDevice(compute_s=compute_s), max_batch_size=batch
        )
    else:
        engine = om.EngineGroup(
            om.models.Synthetic,
            devices=[SimDevice(compute_s=compute_s), SimDevice(compute_s=compute_s)],
            max_batch_size=batch,
        )
    async with engine:
        await engine.generate({"steps": 2, "work": 0, "shape": SHAPE})  # warm up
        frames, wall = await _load(engine, requests, steps)
    if frames != requests * steps:
        raise RuntimeError(f"{kind}: {frames} frames read, expected {requests * steps}")
    return frames / wall


def run(rounds: int, requests: int, steps: int, compute_s: float, batch: int) -> dict[str, Any]:
    rows = []
    for r in range(rounds):
        order = ("engine", "group") if r % 2 == 0 else ("group", "engine")
        fps: dict[str, float] = {}
        for kind in order:
            fps[kind] = asyncio.run(_sample(kind, requests, steps, compute_s, batch))
        ratio = fps["group"] / fps["engine"]
        rows.append({"engine_fps": fps["engine"], "group_fps": fps["group"], "ratio": ratio})
    ratio = statistics.median(r["ratio"] for r in rows)
    return {
        "requests": requests,
        "steps": steps,
        "compute_s": compute_s,
        "max_batch_size": batch,
        "ideal_engine_fps": batch / compute_s if compute_s else None,
        "rounds": rows,
        "engine_fps": statistics.median(r["engine_fps"] for r in rows),
        "group_fps": statistics.median(r["group_fps"] for r in rows),
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio >= TARGET,
    }


def _print(out: dict[str, Any]) -> None:
    print(
        f"\nEngineGroup(sim, sim) against Engine(sim): {out['requests']} requests x {out['steps']} steps, "
        f"compute_s={out['compute_s']:g}, max_batch_size={out['max_batch_size']}, policy all"
    )
    print(f"{'round':>6} {'one engine':>12} {'group':>12} {'ratio':>7}")
    for i, r in enumerate(out["rounds"], 1):
        print(f"{i:>6} {r['engine_fps']:>8.1f} fps {r['group_fps']:>8.1f} fps {r['ratio']:>6.2f}x")
    verdict = "pass" if out["passed"] else "FAIL"
    print(
        f"{'median':>6} {out['engine_fps']:>8.1f} fps {out['group_fps']:>8.1f} fps {out['ratio']:>6.2f}x"
        f"   target >= {out['target']}x: {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.group", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds, median reported (default 5)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    ap.add_argument("--steps", type=int, default=20, help="steps per request (default 20)")
    ap.add_argument("--compute-ms", type=float, default=10.0, help="sim time per step, ms (default 10)")
    ap.add_argument("--batch", type=int, default=1, help="max_batch_size of each engine (default 1)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.steps < 1 or args.batch < 1 or args.compute_ms < 0:
        ap.error("--rounds, --requests, --steps and --batch must be >= 1, --compute-ms >= 0")
    out = run(args.rounds, args.requests, args.steps, args.compute_ms / 1e3, args.batch)
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
