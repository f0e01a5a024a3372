"""Ray Serve overhead: per-frame cost through a replica, and what a replica holds for a stalled reader.

``python -m benchmarks.ray_overhead [--steps N] [--reps R] [--stall S] [--json PATH]``

Starts a local Ray instance (``num_cpus=2``, Serve without its HTTP proxy)
and one replica of the synthetic model on the CPU device, in this machine.

1. Per frame: one request of ``N`` steps (``work=0``: the steps cost
   almost nothing, so what is measured is the hand-over) read to its end
   with ``policy="all"``, in process (``Engine``) and through the replica
   (``RemoteEngine``, window 2 and 8), for 64 px and 256 px frames
   (``[3, 64, 64]`` float32: 48 KiB, carried inline by Ray; ``[3, 256,
   256]``: 768 KiB, through the object store). Median of ``R`` runs.
2. A stalled reader: a request of 100,000 steps with ``policy="latest"``,
   read once, then not read for ``S`` seconds while the replica's report
   is sampled: frames in transit (sent, unacknowledged), frames the
   engine coalesced, steps computed, and the replica process's RSS. The
   frames held must stay within the window however long the stall.

Prints one table per part; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

SIZES = (64, 256)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _drain(stream: Any) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


async def _per_frame_local(params: dict[str, Any], reps: int) -> float:
    import omni_stream as om

    times = []
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        await engine.generate({**params, "steps": 3})  # warm up
        for _ in range(reps):
            t0 = time.perf_counter()
            n = await _drain(engine.stream(params, policy="all"))
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


async def _per_frame_remote(name: str, params: dict[str, Any], reps: int, window: int) -> float:
    from omni_stream.integrations.ray_serve import RemoteEngine

    times = []
    async with RemoteEngine(name, window=window) as engine:
        await engine.generate({**params, "steps": 3})
        for _ in range(reps):
            t0 = time.perf_counter()
            n = await _drain(engine.stream(params, policy="all"))
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


async def _stalled_reader(name: str, stall_s: float) -> dict[str, Any]:
    from omni_stream.integrations.ray_serve import RemoteEngine

    shape = [3, 256, 256]
    frame_bytes = 3 * 256 * 256 * 4
    samples: list[dict[str, Any]] = []
    async with RemoteEngine(name) as engine:
        stream = engine.stream({"shape": shape, "work": 0, "steps": 100_000}, policy="latest")
        await stream.__anext__()
        replica = stream.replica
        await engine.refresh()
        pid = next(v.report.pid for v in engine.replicas() if v.replica == replica)
        start_stats = next(v.report.health.statistics for v in engine.replicas() if v.replica == replica)
        rss0 = _rss_mib(pid)
        t0 = time.monotonic()
        while time.monotonic() - t0 < stall_s:
            await asyncio.sleep(0.5)
            await engine.refresh()
            view = next(v for v in engine.replicas() if v.replica == replica)
            s = view.report.health.statistics
            samples.append({
                "t_s": round(time.monotonic() - t0, 1),
                "in_transit": view.report.in_transit,
                "steps": s.steps - start_stats.steps,
                "coalesced": s.frames_dropped - start_stats.frames_dropped,
                "rss_mib": _rss_mib(pid),
            })
        await stream.aclose()
    held = max(x["in_transit"] for x in samples)
    steps = samples[-1]["steps"]
    rss = [x["rss_mib"] for x in samples if x["rss_mib"] is not None]
    return {
        "stall_s": stall_s,
        "frame_bytes": frame_bytes,
        "max_in_transit_frames": held,
        "max_in_transit_mib": held * frame_bytes / 2**20,
        "steps_computed": steps,
        "unbounded_would_hold_mib": steps * frame_bytes / 2**20,
        "frames_coalesced": samples[-1]["coalesced"],
        "replica_rss_mib_start": rss0,
        "replica_rss_mib_max": max(rss) if rss else None,
        "samples": samples,
    }


def run(steps: int, reps: int, stall_s: float) -> dict[str, Any]:
    import ray
    from ray import serve

    from omni_stream.integrations.ray_serve import deploy

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    name = "bench"
    deploy("synthetic", name=name, replicas=1, num_cpus=0, engine_kwargs={"device": "cpu"})
    out: dict[str, Any] = {"steps": steps, "reps": reps, "per_frame": []}
    try:
        for size in SIZES:
            params = {"shape": [3, size, size], "work": 0, "steps": steps}
            local = asyncio.run(_per_frame_local(params, reps))
            row: dict[str, Any] = {"size": size, "local_ms": local * 1e3}
            for window in (2, 8):
                remote = asyncio.run(_per_frame_remote(name, params, reps, window))
                row[f"remote_w{window}_ms"] = remote * 1e3
                row[f"overhead_w{window}_ms"] = (remote - local) * 1e3
            out["per_frame"].append(row)
        out["stalled_reader"] = asyncio.run(_stalled_reader(name, stall_s))
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"\nper frame, {out['steps']} steps, work=0, policy all, median of {out['reps']}:")
    print(f"{'frame':>10} {'in process':>11} {'replica w2':>11} {'+overhead':>10} {'replica w8':>11} {'+overhead':>10}")
    for r in out["per_frame"]:
        print(
            f"{r['size']:>4} px    {r['local_ms']:>8.3f} ms {r['remote_w2_ms']:>8.3f} ms {r['overhead_w2_ms']:>7.3f} ms"
            f" {r['remote_w8_ms']:>8.3f} ms {r['overhead_w8_ms']:>7.3f} ms"
        )
    s = out["stalled_reader"]
    print(f"\nstalled reader, {s['stall_s']:.0f} s, 256 px frames ({s['frame_bytes'] // 1024} KiB), window 2:")
    print(f"{'t':>6} {'in transit':>11} {'steps':>8} {'coalesced':>10} {'replica RSS':>12}")
    for x in s["samples"]:
        rss = "-" if x["rss_mib"] is None else f"{x['rss_mib']:.0f} MiB"
        print(f"{x['t_s']:>5.1f}s {x['in_transit']:>11} {x['steps']:>8} {x['coalesced']:>10} {rss:>12}")
    print(
        f"held at most {s['max_in_transit_frames']} frames ({s['max_in_transit_mib']:.1f} MiB); "
        f"an unbounded queue would hold {s['steps_computed']} frames ({s['unbounded_would_hold_mib']:.0f} MiB)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ray_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per request (default 200)")
    ap.add_argument("--reps", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    ap.add_argument("--stall", type=float, default=6.0, help="seconds the stalled reader does not read (default 6)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        print('needs Ray Serve: pip install "omni-stream[ray]"', file=sys.stderr)
        return 2
    logging.getLogger("ray").setLevel(logging.WARNING)
    out = run(args.steps, args.reps, args.stall)
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
