"""Memory attacks against a server with small bounds: peak RSS against the configured bound.

``python -m benchmarks.exhaust [--max-memory-mib M] [--max-pending-mib P] [--rounds R] [--seconds S]
[--attacks abdec] [--together]``

Starts ``omni_stream.server.Server`` (Synthetic, CPU) on 127.0.0.1 port 0
with ``max_memory_bytes`` = M MiB (default 64) and ``max_pending_bytes`` =
P MiB (default 8), measures this process's RSS once it has served a
request (the baseline), then runs these attacks while sampling VmRSS every
20 ms:

(a) clients that never read send ~1 MiB messages (just under
    ``max_message_bytes``; each is rejected), R rounds of connect, send
    until the server stops reading, close;
(b) clients that never read ask for raw full-size previews of the largest
    frame the synthetic model allows (``shape: [3, 1024, 1024]``: 4 Mi
    values at most, so not 2048 px; ``preview: {"format": "raw",
    "max_size": 2048}``), several requests each;
(d) clients that never read ask, again and again for S seconds (a new
    request every 0.25 s each), for the largest square RGB frame this
    server admits (``admission.estimate_memory`` at the request cap), raw
    previews, 200 steps: what the server admits runs, the rest is refused;
(e) the same with frames of a quarter of those bytes, so several run at
    once (and batch together);
(c) the admission flood: 16 never-reading connections x 16 long requests,
    kept open for S seconds.

An honest client (one 20-step request after another, reading everything)
measures its per-step latency (p50 / p99) quiet, before the attacks, and
during each attack (a request is counted in the attack it started in),
how long each of its requests waited for its first step (p50 / max:
under the flood that is time in the server's gate), and its step latency
without the attack's first second (its connections and first burst of
messages: during (c), 16 handshakes and 256 generates handled within
~0.2 s are most of the slowest gaps), reported beside the whole one.

By default each attack runs against a fresh server in a process of its
own, with its own idle baseline (``--attacks`` picks and orders them);
``--together`` runs them one after another against one server: then what
glibc keeps of one attack's freed memory (it is not given back, and a
different thread's arena cannot reuse it) is charged to the next ones too.

Exit status 1 when a peak RSS over its baseline > M MiB x 1.1 (the
issue's measure: the configured bound + 10%, the idle server's RSS
excluded), when a server ends unhealthy, or when the flood was not
refused with ``busy`` / ``too_many_requests`` at all. The attackers run in
the server's process too (raw sockets, a few KiB each: the RSS measured is
the server's, with them). The honest client (its warm-up requests, and its
step latency during the attacks) runs in a process of its own
(``stress_common.HonestProcess``): reading and parsing its replies shares
neither the server's event loop nor its RSS.
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

from .stress_common import HonestProcess, RawClient, health, percentile, rss_mib

__all__ = ["main", "run_exhaust"]

MIB = 1 << 20
#: An attack's onset (its connections and first burst of messages), left
#: out of the "settled" latency figure (reported beside the whole one).
ONSET_S = 1.0


class Sampler:
    def __init__(self) -> None:
        self.peak: dict[str, float] = collections.defaultdict(float)
        self.phase = "idle"
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            r = rss_mib()
            self.peak[self.phase] = max(self.peak[self.phase], r)
            await asyncio.sleep(0.02)

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


def _largest_admitted_side(server: Any, *, fraction: float = 1.0) -> int:
    """The side of the largest ``[3, s, s]`` frame estimated within ``fraction`` of the request cap."""
    from omni_stream.core import admission

    on_host = admission.state_on_host(server.engine)
    batch = int(server.engine.max_batch_size)
    cap = int(server.limits.max_memory_bytes * admission.MAX_REQUEST_MEMORY_SHARE * fraction)

    def alone(side: int) -> int:
        est = admission.estimate_memory(server.model, {"shape": [3, side, side]}, on_host=on_host,
                                        batch_size=batch)
        return est.alone

    lo, hi = 1, 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if alone(mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


async def _attack_admitted(server: Any, side: int, clients: int, seconds: float, tag: str) -> dict[str, int]:
    conns = [await RawClient.connect(server.host, server.port, server.url) for _ in range(clients)]
    sent = 0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for i, c in enumerate(conns):
            if await c.send_text(json.dumps({
                "type": "generate", "id": f"{tag}-{i}-{sent}",
                "params": {"shape": [3, side, side], "work": 0, "steps": 200, "seed": sent},
                "preview": {"format": "raw", "max_size": 2048},
            }), timeout=1.0):
                sent += 1
        await asyncio.sleep(0.25)
    for c in conns:
        c.close()
    return {"side": side, "clients": clients, "requests_sent": sent}


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


ATTACKS = ("a", "b", "d", "e", "c")
_PHASES = {"a": "a_big_messages", "b": "b_raw_previews", "d": "d_largest_admitted", "e": "e_quarter_size",
           "c": "c_flood"}


async def _exhaust(
    max_memory_mib: int, max_pending_mib: int, rounds: int, seconds: float, attacks: Sequence[str] = ATTACKS
) -> dict[str, Any]:
    from omni_stream.models import Synthetic
    from omni_stream.server import Server

    out: dict[str, Any] = {"max_memory_mib": max_memory_mib, "max_pending_mib": max_pending_mib}
    sampler = Sampler()
    async with Server(Synthetic(), host="127.0.0.1", port=0, device="cpu",
                      max_memory_bytes=max_memory_mib * MIB, max_pending_bytes=max_pending_mib * MIB,
                      send_timeout_s=5.0, shutdown_timeout_s=1.0, close_timeout_s=1.0) as server:
        honest = await HonestProcess.start(server.url, steps=20, params={"shape": [3, 16, 16], "work": 1})
        await honest.quiet(5)  # warm-up and quiet baseline
        out["baseline_mib"] = rss_mib()
        sampler.start()
        t0 = time.perf_counter()
        began: dict[str, float] = {}
        # The honest client runs through every attack, its step gaps tagged by attack.
        await honest.load(_PHASES[attacks[0]])
        for attack in attacks:
            sampler.phase = _PHASES[attack]
            await honest.phase(_PHASES[attack])
            began[_PHASES[attack]] = time.monotonic()  # one clock for every process on the host
            before = await _rejections(server.http_url)
            if attack == "a":
                out["a"] = await _attack_big_messages(server, rounds, 4)
            elif attack == "b":
                out["b"] = await _attack_raw_previews(server, 4, 2, 8.0)
            elif attack == "d":
                out["d"] = await _attack_admitted(server, _largest_admitted_side(server), 4, seconds, "big")
            elif attack == "e":
                side = _largest_admitted_side(server, fraction=0.25)
                out["e"] = await _attack_admitted(server, side, 8, seconds, "mid")
            else:
                conns, n = await _attack_flood(server, 16, 16)
                await asyncio.sleep(seconds)
                _, h_during = await health(server.http_url)
                await honest.phase("after")
                for c in conns:
                    c.close()
                out["c"] = {"connections": n, "load_during": h_during.get("load")}
            out[attack].update(_refused(before, await _rejections(server.http_url)))
            await honest.phase("after")
            await asyncio.sleep(1.0)
        sampler.stop()
        measured = await honest.stop()
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        status, h = await health(server.http_url)
        out["health"] = (status, h.get("status"))
        out["metrics"] = await asyncio.to_thread(_metrics, server.http_url)
    out["peak_mib"] = {k: v for k, v in sampler.peak.items() if k != "idle"}
    gaps = measured["gaps"]
    out["honest"] = {
        phase: {"p50_ms": percentile(g, 50) * 1e3, "p99_ms": percentile(g, 99) * 1e3, "steps": len(g)}
        for phase, g in gaps.items() if phase != "after" and g
    }
    # The same without the gaps that ended in an attack's first second (its
    # connections and first messages: a burst of handshakes and admissions).
    out["honest_settled"] = {}
    for phase, g in gaps.items():
        if phase in began:
            late = [x for x, t in zip(g, measured["stamps"][phase], strict=True) if t - began[phase] >= ONSET_S]
            if late:
                out["honest_settled"][phase] = {
                    "p50_ms": percentile(late, 50) * 1e3, "p99_ms": percentile(late, 99) * 1e3, "steps": len(late),
                }
    out["honest_wait"] = {
        phase: {"p50_ms": percentile(w, 50) * 1e3, "max_ms": max(w) * 1e3, "requests": len(w)}
        for phase, w in measured.get("waits", {}).items() if phase != "after" and w
    }
    out["honest_busy"], out["honest_errors"] = measured["busy"], measured["errors"][:3]
    return out


async def _rejections(http_url: str) -> dict[str, float]:
    metrics = await asyncio.to_thread(_metrics, http_url)
    return {k: float(v) for k, v in metrics.items() if k.startswith("omni_stream_rejections_total")}


def _refused(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    out = {}
    for key, value in after.items():
        code = key.split('code="')[-1].split('"')[0]
        n = int(value - before.get(key, 0.0))
        if n:
            out[f"refused_{code}"] = n
    return out


def _metrics(http_url: str) -> dict[str, str]:
    import urllib.request

    with urllib.request.urlopen(http_url + "/metrics", timeout=20) as reply:
        text = reply.read().decode()
    keep = ("omni_stream_slow_client_disconnects_total", "omni_stream_messages_dropped_total",
            "omni_stream_rejections_total", "omni_stream_memory_bytes")
    return {line.split(" ")[0]: line.split(" ")[-1] for line in text.splitlines()
            if line.startswith(keep)}


def _one(args: tuple[int, int, int, float, tuple[str, ...]]) -> dict[str, Any]:
    logging.getLogger("omni_stream").setLevel(logging.ERROR)
    return asyncio.run(_exhaust(*args))


def run_exhaust(
    *,
    max_memory_mib: int = 64,
    max_pending_mib: int = 8,
    rounds: int = 5,
    seconds: float = 8.0,
    attacks: Sequence[str] = ATTACKS,
    together: bool = False,
) -> list[dict[str, Any]]:
    """One result per server run: each attack in a fresh process (its own idle baseline), or all in one."""
    args = (max_memory_mib, max_pending_mib, rounds, seconds)
    if together:
        return [asyncio.run(_exhaust(*args, tuple(attacks)))]
    import multiprocessing

    # A process per attack: memory the allocator keeps after one attack
    # (freed, not given back) is not charged to the next.
    ctx = multiprocessing.get_context("spawn")
    out = []
    for attack in attacks:
        with ctx.Pool(1) as pool:
            out.append(pool.apply(_one, ((*args, (attack,)),)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exhaust", description=__doc__.split("\n")[0])
    ap.add_argument("--max-memory-mib", type=int, default=64,
                    help="the server's max_memory_bytes in MiB (64)")
    ap.add_argument("--max-pending-mib", type=int, default=8,
                    help="the server's max_pending_bytes in MiB (8)")
    ap.add_argument("--rounds", type=int, default=5, help="connect/flood/close rounds of attack (a) (5)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long attacks (d) and (e) last (8)")
    ap.add_argument("--attacks", default="".join(ATTACKS),
                    help=f"which attacks, in this order (default {''.join(ATTACKS)})")
    ap.add_argument("--together", action="store_true",
                    help="run the attacks one after another against one server (one baseline) instead of "
                         "each against a fresh server process")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    attacks = [a for a in args.attacks if a in ATTACKS]
    runs = run_exhaust(max_memory_mib=args.max_memory_mib, max_pending_mib=args.max_pending_mib,
                       rounds=args.rounds, seconds=args.seconds, attacks=attacks, together=args.together)
    m = args.max_memory_mib
    allowed = m * 1.1
    how = "all in one server" if args.together else "each against a fresh server process"
    print(f"exhaust: max_memory_bytes {m} MiB, max_pending_bytes {args.max_pending_mib} MiB, attacks {how}; "
          f"allowed peak RSS over the idle baseline {allowed:.1f} MiB (the bound + 10%)")
    bad = []
    refused_flood = False
    for s in runs:
        base = s["baseline_mib"]
        for phase, v in s["peak_mib"].items():
            print(f"  peak RSS {phase}: {v:.1f} MiB, +{v - base:.1f} over the baseline {base:.1f} MiB")
            if v - base > allowed:
                bad.append(f"{phase}: peak RSS +{v - base:.1f} MiB > {allowed:.1f} MiB")
        for k in ATTACKS:
            if k in s:
                print(f"  ({k}) {s[k]}")
        h = s["honest"]
        quiet = h.get("quiet")
        for phase, g in h.items():
            ratio = ""
            if quiet and phase != "quiet":
                ratio = f", {g['p99_ms'] / quiet['p99_ms']:.1f}x the quiet p99"
            print(f"  honest step latency ({phase}): p50 {g['p50_ms']:.1f} ms p99 {g['p99_ms']:.1f} ms "
                  f"({g['steps']} steps{ratio})")
        for phase, g in s.get("honest_settled", {}).items():
            ratio = f", {g['p99_ms'] / quiet['p99_ms']:.1f}x the quiet p99" if quiet else ""
            print(f"  honest step latency ({phase}, after its first {ONSET_S:g} s): p50 {g['p50_ms']:.1f} ms "
                  f"p99 {g['p99_ms']:.1f} ms ({g['steps']} steps{ratio})")
        for phase, w in s.get("honest_wait", {}).items():
            print(f"  honest wait for a first step ({phase}): p50 {w['p50_ms']:.1f} ms, "
                  f"max {w['max_ms']:.1f} ms ({w['requests']} requests)")
        if s["honest_busy"] or s["honest_errors"]:
            print(f"  honest client: {s['honest_busy']} busy, errors {s['honest_errors']}")
        if "c" in s:
            refused_flood = any("busy" in k or "too_many_requests" in k for k in s["c"])
        if s["health"][0] != 200:
            bad.append(f"/health {s['health']} after {', '.join(s['peak_mib'])}")
    if args.verbose:
        for s in runs:
            for k, v in s["metrics"].items():
                print(f"  {k} {v}")
    ends = ", ".join(f"{s['health'][0]} {s['health'][1]}" for s in runs)
    print(f"  health at the end: {ends}; {sum(s['wall_s'] for s in runs):.1f} s of attacks")
    if "c" in attacks and not refused_flood:
        bad.append("the flood was never refused (no busy / too_many_requests rejections)")
    print("  violations: " + ("; ".join(bad) if bad else "none"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
