"""Soak: a server under steady mixed load, its RSS, fds and threads sampled every second.

``python -m benchmarks.soak [--seconds S] [--clients C] [--max-rss-slope MB_PER_MIN]``

Starts ``omni_stream.server.Server`` (Synthetic, CPU) on 127.0.0.1 port 0
in this process and runs ``C`` clients against it for ``S`` seconds, each
in a loop: a small request read to the end (jpeg / raw previews), now and
then one cancelled mid-way, one whose connection is dropped mid-way
(reconnect), one detached and re-attached. Every second it samples this
process's VmRSS (``/proc/self/status``), open fds (``/proc/self/fd``) and
threads. Reports least-squares slopes (MB/min, fds/min, threads/min) over
the samples after the first quarter (warm-up), and the maxima. Exit status
1 when the RSS slope exceeds ``--max-rss-slope`` (default 5 MB/min) or the
server ends unhealthy. The clients run in the same process: their memory
counts too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from .stress_common import fd_count, health, rss_mib, slope_per_min, thread_count

__all__ = ["main", "run_soak"]


async def _client(url: str, n: int, stop: asyncio.Event, counts: collections.Counter[str]) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    rng = random.Random(n)
    i = 0
    while not stop.is_set():
        try:
            async with connect(url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
                while not stop.is_set():
                    i += 1
                    rid = f"soak-{n}-{i}"
                    action = rng.choices(("read", "cancel", "drop", "detach"), (80, 8, 6, 6))[0]
                    await ws.send(json.dumps({
                        "type": "generate", "id": rid, "detach": action == "detach",
                        "params": {"shape": [3, 64, 64], "work": 1, "steps": rng.randint(5, 20), "seed": i},
                        "preview": {"format": rng.choice(("jpeg", "raw")), "max_size": 64},
                    }))
                    steps = 0
                    while True:
                        data = await asyncio.wait_for(ws.recv(), 60)
                        if isinstance(data, bytes):
                            continue
                        msg = json.loads(data)
                        kind = msg["type"]
                        if kind == "progress":
                            steps += 1
                            if action == "cancel" and steps == 2:
                                await ws.send(json.dumps({"type": "cancel", "id": rid}))
                            if action in ("drop", "detach") and steps == 2:
                                break
                        elif kind in ("done", "cancelled") or (kind == "error" and msg.get("id") == rid):
                            counts[kind if kind != "error" else msg["code"]] += 1
                            if kind == "error" and msg["code"] == "busy":
                                await asyncio.sleep(1)
                            break
                    if action in ("drop", "detach") and steps == 2:
                        counts[action] += 1
                        break  # leave the connection (the request is cancelled, or runs on detached)
            if action == "detach":
                async with connect(url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
                    await ws.send(json.dumps({"type": "attach", "id": rid}))
                    while True:
                        data = await asyncio.wait_for(ws.recv(), 60)
                        if isinstance(data, bytes):
                            continue
                        msg = json.loads(data)
                        if msg["type"] in ("done", "cancelled", "error"):
                            counts[f"attach_{msg['type']}"] += 1
                            break
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            counts[f"client_{type(exc).__name__}"] += 1
            await asyncio.sleep(0.5)


async def _soak(seconds: float, clients: int, retention_s: float) -> dict[str, Any]:
    from omni_stream.models import Synthetic
    from omni_stream.server import Server

    samples: list[tuple[float, float, int, int]] = []
    counts: collections.Counter[str] = collections.Counter()
    async with Server(Synthetic(), host="127.0.0.1", port=0, device="cpu", retention_s=retention_s,
                      shutdown_timeout_s=1.0, close_timeout_s=1.0) as server:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_client(server.url, i, stop, counts)) for i in range(clients)]
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < seconds:
            samples.append((t, rss_mib(), fd_count(), thread_count()))
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            task.cancel()
        status, h = await health(server.http_url)
    warm = samples[len(samples) // 4:]
    ts = [s[0] for s in warm]
    return {
        "seconds": seconds, "clients": clients, "samples": len(samples),
        "rss_start_mib": samples[0][1] if samples else 0.0, "rss_max_mib": max(s[1] for s in samples),
        "rss_end_mib": samples[-1][1],
        "rss_slope_mib_per_min": slope_per_min(ts, [s[1] for s in warm]),
        "fds_max": max(s[2] for s in samples), "fds_slope_per_min": slope_per_min(ts, [s[2] for s in warm]),
        "threads_max": max(s[3] for s in samples), "threads_slope_per_min": slope_per_min(ts, [s[3] for s in warm]),
        "outcomes": dict(sorted(counts.items())), "health": (status, h.get("status")),
        "completed": h.get("completed"),
    }


def run_soak(*, seconds: float = 60.0, clients: int = 4, retention_s: float = 5.0) -> dict[str, Any]:
    return asyncio.run(_soak(seconds, clients, retention_s))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    ap.add_argument("--clients", type=int, default=4, help="client loops (default 4)")
    ap.add_argument("--max-rss-slope", type=float, default=5.0, help="MB/min of RSS growth allowed (default 5)")
    ap.add_argument("--retention-s", type=float, default=5.0, help="the server's retention_s (default 5)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    s = run_soak(seconds=args.seconds, clients=args.clients, retention_s=args.retention_s)
    print(f"soak: {s['clients']} clients for {s['seconds']:g} s, {s['samples']} samples, "
          f"{s['completed']} requests completed by the engine")
    print(f"  RSS: start {s['rss_start_mib']:.1f} MiB, max {s['rss_max_mib']:.1f} MiB, end {s['rss_end_mib']:.1f} MiB, "
          f"slope {s['rss_slope_mib_per_min']:+.2f} MiB/min (after warm-up)")
    print(f"  fds: max {s['fds_max']}, slope {s['fds_slope_per_min']:+.2f}/min; threads: max {s['threads_max']}, "
          f"slope {s['threads_slope_per_min']:+.2f}/min")
    print(f"  outcomes: {', '.join(f'{k}={v}' for k, v in s['outcomes'].items())}")
    print(f"  health at the end: {s['health'][0]} {s['health'][1]}")
    bad = []
    if s["rss_slope_mib_per_min"] > args.max_rss_slope:
        bad.append(f"RSS grows {s['rss_slope_mib_per_min']:.2f} MiB/min > {args.max_rss_slope}")
    if s["health"][0] != 200:
        bad.append(f"/health {s['health']}")
    print("  violations: " + ("; ".join(bad) if bad else "none"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
