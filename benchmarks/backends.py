"""The engine's per-frame cost on each anyio backend: asyncio, asyncio with uvloop, trio.

``python -m benchmarks.backends [--steps N] [--reps R] [--json PATH]``

Synthetic steps with ``work=0`` (a 4x8x8 frame, no matmul), so the time a
frame takes is the engine's own: the producer's step and copy, the
thread-to-loop hand-over, delivery and the reader's wake-up. One request
and 16 at once, ``policy="all"``, on the CPU device. Reported per frame:
wall microseconds (median of ``reps`` runs, the backends sampled round
robin, alternating direction, so drift hits each alike) and process CPU
microseconds (every thread: the producer's and the loop's).

Not a figure of ``python -m benchmarks`` (whose harness drives asyncio
loops only): run it from a checkout to compare two versions of the code
side by side (``cd OTHER_CHECKOUT && python -m benchmarks.backends``); a
backend the code cannot run on is reported as failed, not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

import omni_stream as om

__all__ = ["BACKENDS", "main", "measure"]

#: name -> (anyio backend, backend_options)
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


async def _stream(requests: int, steps: int) -> tuple[float, float]:
    """Seconds and process CPU seconds from the first submit to the last frame."""
    model = om.models.Synthetic()
    params = [{"shape": [4, 8, 8], "work": 0, "steps": steps, "seed": i} for i in range(requests)]
    async with om.Engine(model, device="cpu", max_batch_size=requests) as engine:
        await engine.generate({**params[0], "steps": 3})  # warm: first-call costs out of the clock

        async def read(stream: om.FrameStream) -> None:
            async for _ in stream:
                pass

        c0, t0 = time.process_time(), time.perf_counter()
        streams = [engine.stream(p) for p in params]
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(read, s)
        return time.perf_counter() - t0, time.process_time() - c0


def measure(
    names: Sequence[str], *, requests: int, steps: int, reps: int
) -> dict[str, dict[str, Any]]:
    """Per backend: wall and CPU microseconds per frame (medians), or why it failed."""
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    frames = requests * steps
    for rep in range(reps):
        order = list(names) if rep % 2 == 0 else list(reversed(names))
        for name in order:
            if name in failed:
                continue
            backend, options = BACKENDS[name]
            try:
                w, c = anyio.run(_stream, requests, steps, backend=backend, backend_options=options)
            except Exception as exc:  # noqa: BLE001 - reported: this code does not run there
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            wall[name].append(w / frames * 1e6)
            cpu[name].append(c / frames * 1e6)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name in failed:
            out[name] = {"failed": failed[name]}
        else:
            out[name] = {
                "wall_us_per_frame": statistics.median(wall[name]),
                "cpu_us_per_frame": statistics.median(cpu[name]),
                "samples_wall_us": wall[name],
            }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.backends", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400, help="steps per request (default 400)")
    p.add_argument("--reps", type=int, default=7, help="runs per backend and size (default 7)")
    p.add_argument("--only", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    print(f"omni_stream from {om.__file__}")
    print(f"{'backend':<8} {'requests':>8} {'wall us/frame':>14} {'cpu us/frame':>13}")
    for requests in (1, 16):
        got = measure(args.only, requests=requests, steps=args.steps, reps=args.reps)
        results[f"{requests}x{args.steps}"] = got
        for name, r in got.items():
            if "failed" in r:
                print(f"{name:<8} {requests:>8}  failed: {r['failed']}")
            else:
                wall, cpu = r["wall_us_per_frame"], r["cpu_us_per_frame"]
                print(f"{name:<8} {requests:>8} {wall:>14.1f} {cpu:>13.1f}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
