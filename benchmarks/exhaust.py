"""Memory attacks against a server with small bounds: peak RSS against the configured bound.

``python -m benchmarks.exhaust [--max-memory-mib M] [--max-pending-mib P] [--rounds R]``

Starts ``omni_stream.server.Server`` (Synthetic, CPU) on 127.0.0.1 port 0
with ``max_memory_bytes`` = M MiB (default 64) and ``max_pending_bytes`` =
P MiB (default 8), measures this process's RSS once it has served a
request (the baseline), then runs three attacks while sampling VmRSS every
50 ms:

(a) clients that never read send ~1 MiB messages (just under
    ``max_message_bytes``; each is rejected), R rounds of connect, send
    until the server stops reading, close;
(b) clients that never read ask for raw full-size previews of the largest
    frame the synthetic model allows (``shape: [3, 1024, 1024]``: 4 Mi
    values at most, so not 2048 px; ``preview: {"format": "raw",
    "max_size": 2048}``), several requests each;
(c) the admission flood: 16 never-reading connections x 16 long requests,
    while an honest client measures its per-step latency (p50 / p99), quiet
    before and during.

Exit status 1 when peak RSS > (baseline + M MiB) x 1.1, when the server
ends unhealthy, or when the flood was not refused with ``busy`` /
``too_many_requests`` at all. The attackers run in this process too (raw
sockets, a few KiB each).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from .stress_common import HonestClient, RawClient, health, rss_mib

__all__ = ["main", "run_exhaust"]

MIB = 1 << 20


class Sampler:
    def __init__(self) -> None:
        self.peak: dict[str, float] = collections.defaultdict(float)
        self.phase = "idle"
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            r = rss_mib()
            self.peak[self.phase] = max(self.peak[self.phase], r)
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()


async def _attack_big_messages(server: Any, rounds: int, clients: int) -> dict[str, int]:
    filler = "a" * (MIB - 200)
    msg = json.dumps({"type": "generate", "params": {}, "x": filler})
    sent = refused = 0
    for _ in range(rounds):
        conns = []
        for _ in range(clients):
            try:
                conns.append(await RawClient.connect(server.host, server.port, server.url))
            except (ConnectionError, OSError, TimeoutError):
                refused += 1
        for c in conns:
            for _ in range(64):
                if not await c.send_text(msg, timeout=1.0):
                    break
                sent += 1
        for c in conns:
            c.close()
        await asyncio.sleep(0.1)
    return {"messages_sent": sent, "handshakes_refused": refused}


async def _attack_raw_previews(server: Any, clients: int, per_client: int, seconds: float) -> dict[str, int]:
    conns = []
    for i in range(clients):
        c = await RawClient.connect(server.host, server.port, server.url)
        conns.append(c)
        for j in range(per_client):
            await c.send_text(json.dumps({
                "type": "generate", "id": f"raw-{i}-{j}",
                "params": {"shape": [3, 1024, 1024], "work": 0, "steps": 30, "seed": j},
                "preview": {"format": "raw", "max_size": 2048},
            }), timeout=2.0)
    await asyncio.sleep(seconds)
    for c in conns:
        c.close()
    return {"clients": clients, "requests": clients * per_client}


async def _attack_flood(server: Any, conns_n: int, per_conn: int) -> tuple[list[RawClient], int]:
    conns = []
    for i in range(conns_n):
        try:
            c = await RawClient.connect(server.host, server.port, server.url)
        except (ConnectionError, OSError, TimeoutError):
            continue
        conns.append(c)
        for j in range(per_conn):
            await c.send_text(json.dumps({
                "type": "generate", "id": f"flood-{i}-{j}",
                "params": {"shape": [3, 16, 16], "work": 1, "steps": 400, "seed": j},
                "preview": {"format": "jpeg", "max_size": 16},
            }), timeout=2.0)
    return conns, len(conns)


async def _exhaust(max_memory_mib: int, max_pending_mib: int, rounds: int) -> dict[str, Any]:
    from omni_stream.models import Synthetic
    from omni_stream.server import Server

    out: dict[str, Any] = {"max_memory_mib": max_memory_mib, "max_pending_mib": max_pending_mib}
    sampler = Sampler()
    async with Server(Synthetic(), host="127.0.0.1", port=0, device="cpu",
                      max_memory_bytes=max_memory_mib * MIB, max_pending_bytes=max_pending_mib * MIB,
                      send_timeout_s=5.0, shutdown_timeout_s=1.0, close_timeout_s=1.0) as server:
        honest = HonestClient(server.url, steps=20, params={"shape": [3, 16, 16], "work": 1})
        await honest.run(requests=5)  # warm-up and quiet baseline
        out["baseline_mib"] = rss_mib()
        sampler.start()
        t0 = time.perf_counter()
        sampler.phase = "a_big_messages"
        out["a"] = await _attack_big_messages(server, rounds, 4)
        sampler.phase = "b_raw_previews"
        out["b"] = await _attack_raw_previews(server, 4, 2, 8.0)
        await asyncio.sleep(1.0)
        sampler.phase = "c_flood"
        honest.phase = "flood"
        htask = asyncio.create_task(honest.run())
        conns, n = await _attack_flood(server, 16, 16)
        await asyncio.sleep(8.0)
        _, h_during = await health(server.http_url)
        honest.stop()
        await asyncio.wait_for(htask, 120)
        for c in conns:
            c.close()
        sampler.stop()
        out["c"] = {"connections": n, "load_during": h_during.get("load"), "honest_busy": honest.busy,
                    "honest_errors": honest.errors[:3]}
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        await asyncio.sleep(1.0)
        status, h = await health(server.http_url)
        out["health"] = (status, h.get("status"))
        metrics = await asyncio.to_thread(_metrics, server.http_url)
        out["metrics"] = metrics
    out["peak_mib"] = dict(sampler.peak)
    out["honest"] = {"quiet_p50_ms": honest.p("quiet", 50) * 1e3, "quiet_p99_ms": honest.p("quiet", 99) * 1e3,
                     "flood_p50_ms": honest.p("flood", 50) * 1e3, "flood_p99_ms": honest.p("flood", 99) * 1e3,
                     "flood_steps": len(honest.gaps.get("flood", []))}
    return out


def _metrics(http_url: str) -> dict[str, str]:
    import urllib.request

    with urllib.request.urlopen(http_url + "/metrics", timeout=20) as reply:
        text = reply.read().decode()
    keep = ("omni_stream_slow_client_disconnects_total", "omni_stream_messages_dropped_total",
            "omni_stream_rejections_total", "omni_stream_memory_bytes")
    return {line.split(" ")[0]: line.split(" ")[-1] for line in text.splitlines()
            if line.startswith(keep)}


def run_exhaust(*, max_memory_mib: int = 64, max_pending_mib: int = 8, rounds: int = 5) -> dict[str, Any]:
    return asyncio.run(_exhaust(max_memory_mib, max_pending_mib, rounds))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exhaust", description=__doc__.split("\n")[0])
    ap.add_argument("--max-memory-mib", type=int, default=64, help="the server's max_memory_bytes in MiB (64)")
    ap.add_argument("--max-pending-mib", type=int, default=8, help="the server's max_pending_bytes in MiB (8)")
    ap.add_argument("--rounds", type=int, default=5, help="connect/flood/close rounds of attack (a) (5)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    s = run_exhaust(max_memory_mib=args.max_memory_mib, max_pending_mib=args.max_pending_mib, rounds=args.rounds)
    bound = (s["baseline_mib"] + s["max_memory_mib"]) * 1.1
    peak = max(s["peak_mib"].values())
    print(f"exhaust: max_memory_bytes {s['max_memory_mib']} MiB, max_pending_bytes {s['max_pending_mib']} MiB, "
          f"baseline RSS {s['baseline_mib']:.1f} MiB, allowed peak {bound:.1f} MiB; {s['wall_s']} s")
    for phase, v in s["peak_mib"].items():
        print(f"  peak RSS {phase}: {v:.1f} MiB")
    print(f"  (a) {s['a']}")
    print(f"  (b) {s['b']}")
    print(f"  (c) {s['c']}")
    h = s["honest"]
    print(f"  honest step latency: quiet p50 {h['quiet_p50_ms']:.1f} ms p99 {h['quiet_p99_ms']:.1f} ms; "
          f"during the flood p50 {h['flood_p50_ms']:.1f} ms p99 {h['flood_p99_ms']:.1f} ms ({h['flood_steps']} steps)")
    for k, v in s["metrics"].items():
        print(f"  {k} {v}")
    print(f"  health at the end: {s['health'][0]} {s['health'][1]}")
    bad = []
    if peak > bound:
        bad.append(f"peak RSS {peak:.1f} MiB > {bound:.1f} MiB")
    if s["health"][0] != 200:
        bad.append(f"/health {s['health']}")
    if not any("busy" in k or "too_many_requests" in k for k in s["metrics"]):
        bad.append("the flood was never refused (no busy / too_many_requests rejections)")
    print("  violations: " + ("; ".join(bad) if bad else "none"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
