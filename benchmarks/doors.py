"""The attacks of issue #19 against a real ``omni-stream serve``: memory, the honest client, ``/health``.

``python -m benchmarks.doors [--attacks 1,2,...|names] [--seconds S] [--device D] [--json PATH] [--list]``

Each attack (``door_attacks.py``; ``--list`` names them) runs against a
fresh ``omni-stream serve`` process (``serve_process.py``) with the default
limits, except where the issue's finding says otherwise (1b: 256 MiB of
``max_memory_bytes``; 4 and 4b: ``RLIMIT_NOFILE`` 256, 4b 64 MiB), the
model the finding used (Mixture, the default, for 1 and 1b; an image
model, ``image_model.py``, for 6 and 7; Synthetic, whose steps cost what
``work`` says, for the attacks on the wire). Around each:

- an honest websocket client in a process of its own
  (``stress_common.HonestProcess``: 20-step requests one after another,
  reading everything) measures its step gaps quiet (before the attack)
  and during it, and how long each request waited for its first step;
- ``/health`` is fetched every 0.2 s on a fresh connection by a process of
  its own (``health_probe.py``): its answer time (max) and the load it
  reports (connections, requests running);
- the server's RSS: idle (after the quiet requests), its peak during the
  attack (VmHWM, reset as the attack starts, and a sample every 20 ms),
  and what it still holds once every request ended and the clients left.

The measures (issue #19), each a violation when missed: peak RSS over the
idle server within ``max_memory_bytes`` + 10%; the honest client's step
p99 during the attack within 3x its quiet p99; ``/health`` answered within
0.5 s, every time; the attack's own outcome as the server must answer it
(``problems``: e.g. a 2xx to a cross-site POST, a stalled body never
answered); no ERROR in the server's log and a clean exit on SIGTERM. Exit
status 1 when any is violated; every violation is named.

The attackers run in this process (raw sockets, a few KiB each); each
measuring process runs beside it, so the two cores are shared four ways:
treat timings as indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .door_attacks import RUNS, SETUPS, Outcome, Target
from .health_probe import HealthProbe, summarize
from .serve_process import ServeProcess
from .stress_common import HonestProcess, percentile

__all__ = ["ATTACKS", "AttackSpec", "main", "run_attack", "run_doors"]

MIB = 1 << 20
#: The measures (see the module docstring).
MEMORY_SLACK = 1.10
HONEST_RATIO = 3.0
HEALTH_MAX_S = 0.5
#: The server's defaults the attacks need to know (docs/protocol.md, Limits).
DEFAULT_LIMITS: dict[str, Any] = {
    "max_memory_bytes": 1 << 30, "send_timeout_s": 30.0, "body_timeout_s": 30.0,
    "max_connections": 64, "max_connections_per_principal": 32, "max_requests_per_principal": 16,
}
_ENV_NAMES = {
    "max_memory_bytes": "OMNI_STREAM_MAX_MEMORY_BYTES", "send_timeout_s": "OMNI_STREAM_SEND_TIMEOUT",
    "body_timeout_s": "OMNI_STREAM_BODY_TIMEOUT",
}
SYNTHETIC_HONEST = {"shape": [3, 16, 16], "work": 1}


@dataclass(frozen=True)
class AttackSpec:
    """One attack: its id and name, the issue's finding, and the server it runs against."""

    id: str
    name: str
    finding: str
    model: str = "synthetic"
    limits: dict[str, Any] = field(default_factory=dict)
    nofile: int | None = None
    honest: dict[str, Any] = field(default_factory=lambda: dict(SYNTHETIC_HONEST))


IMAGE_MODEL = "benchmarks.image_model:ImageSynthetic"
ATTACKS: dict[str, AttackSpec] = {a.id: a for a in (
    AttackSpec("1", "size", "size 1600 (RSS +4,467 MiB peak, +1,361 held), 1024 (honest gap 9.9 s)",
               model="mixture", honest={"size": 256}),
    AttackSpec("1b", "size_small_bound", "256 MiB bound, sizes 512/508/504/500: +1,225 peak, +782 held",
               model="mixture", limits={"max_memory_bytes": 256 * MIB}, honest={"size": 256}),
    AttackSpec("2", "tiny_chunks", "~1 MiB body in 1-byte chunks: 13 s to answer, honest gap 4.2 s, "
               "/health 9.5 s"),
    AttackSpec("3", "unread_output", "200 never-reading GETs of a 3 MiB result: +569-601 MiB held"),
    AttackSpec("4", "slow_bodies", "300 POSTs with 10 body bytes: descriptors (256) used up, /health "
               "unreachable", nofile=256),
    AttackSpec("4b", "partial_bodies", "200 POSTs with 1,000,000 of 1,048,000 bytes: +200 MiB against 64 MiB",
               nofile=256, limits={"max_memory_bytes": 64 * MIB}),
    AttackSpec("5", "http_flood", "one HTTP client filled 132 places in 0.65 s; honest first step "
               "5.5-7.75 s"),
    AttackSpec("6", "image_decode", "4096x4096 PNG data URLs at 2.5/s decoded on the loop: honest p99 "
               "268-856 ms (quiet 23-27)", model=IMAGE_MODEL),
    AttackSpec("6b", "image_decode_allowed", "(new) 2048x2048 PNGs at 2.5/s, decoded in a worker thread",
               model=IMAGE_MODEL),
    AttackSpec("7", "image_memory", "a 1024x1024 input reserved 0.25 MiB and cost +379 MiB (2048: +623)",
               model=IMAGE_MODEL),
    AttackSpec("8", "cross_site", "a cross-site POST got 202; Host not checked"),
    AttackSpec("9", "priority_flood", "priority-10 flood from 4 connections: honest priority-0 first step "
               "9.2-12.4 s (0.35 s at equal priority)"),
    AttackSpec("10", "sse_connections", "POSTs with Accept: text/event-stream were not counted against "
               "max_connections"),
)}
_BY_NAME = {a.name: a.id for a in ATTACKS.values()}


def _env(limits: dict[str, Any]) -> dict[str, str]:
    return {_ENV_NAMES[k]: str(int(v) if k == "max_memory_bytes" else v) for k, v in limits.items()}


async def _settle(server: ServeProcess, timeout: float) -> bool:
    """Wait until the server runs no request and holds no client; whether it did within ``timeout``."""
    from .http_wire import fetch

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = (await fetch(server.port, "GET", "/health", timeout=10)).json()
        except (OSError, TimeoutError, ValueError, Exception):  # noqa: BLE001
            h = {}
        srv = h.get("server") or {}
        if srv.get("requests") == 0 and srv.get("connections") == 0:
            return True
        await asyncio.sleep(0.2)
    return False


class _RssSampler:
    """The server's RSS every 20 ms (beside VmHWM: the sample says when)."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self.peak = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.server.stats().get("rss_mib", 0.0))
            await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _gaps(measured: dict[str, Any], phase: str) -> list[float]:
    return list(measured.get("gaps", {}).get(phase, []))


async def run_attack(spec: AttackSpec, *, seconds: float, device: str = "cpu", quiet_requests: int = 10,
                     verbose: bool = False) -> dict[str, Any]:
    """One attack against a fresh server: its outcome and every measure (see the module docstring)."""
    limits = {**DEFAULT_LIMITS, **spec.limits}
    server = await ServeProcess.start(model=spec.model, device=device, env=_env(spec.limits),
                                      nofile=spec.nofile)
    honest: HonestProcess | None = None
    probe: HealthProbe | None = None
    result: dict[str, Any] = {"id": spec.id, "name": spec.name, "model": spec.model, "finding": spec.finding,
                              "limits": spec.limits, "nofile": spec.nofile, "seconds": seconds}
    try:
        honest, probe = await asyncio.gather(
            HonestProcess.start(server.url, steps=20, params=spec.honest), HealthProbe.start(server.port)
        )
        target = Target(server.port, seconds, limits)
        if spec.id in SETUPS:
            target.setup = await SETUPS[spec.id](target)
        cpu_q, t_q = server.stats().get("cpu_s", math.nan), time.monotonic()
        await honest.quiet(quiet_requests)
        quiet_share = (server.stats().get("cpu_s", math.nan) - cpu_q) / max(time.monotonic() - t_q, 1e-3)
        await _settle(server, 30)
        await asyncio.sleep(0.5)
        idle = server.stats()["rss_mib"]
        server.reset_peak()
        sampler = _RssSampler(server)
        sampler.start()
        await probe.go()
        await honest.load("attack")
        cpu0, own0, t0 = server.stats().get("cpu_s", math.nan), time.process_time(), time.monotonic()
        try:
            outcome = await RUNS[spec.id](target)
        except Exception as exc:  # noqa: BLE001 - the attack tool's own failure: reported as such
            outcome = Outcome(problems=[f"the attack itself failed: {type(exc).__name__}: {exc}"])
        attack_s = time.monotonic() - t0
        cpu = {"server_s": server.stats().get("cpu_s", math.nan) - cpu0,
               "attacker_s": time.process_time() - own0,
               "server_quiet_share": quiet_share}
        await honest.phase("after")
        samples = await probe.stop()
        probe = None
        sampler.stop()
        peak = max(sampler.peak, server.stats().get("peak_rss_mib", 0.0))
        measured = await honest.stop()
        honest = None
        settled = await _settle(server, 60)
        await asyncio.sleep(1.0)
        after = server.stats()
        result.update(
            outcome=outcome.to_dict(), attack_s=round(attack_s, 1), idle_mib=idle, peak_mib=peak,
            held_mib=after.get("rss_mib", math.nan), settled=settled, health=summarize(samples),
            bound_mib=limits["max_memory_bytes"] / MIB, fds_after=after.get("fds"),
            cpu={k: round(v, 2) for k, v in cpu.items()},
        )
        quiet, during = _gaps(measured, "quiet"), _gaps(measured, "attack")
        waits = measured.get("waits", {})
        result["honest"] = {
            "quiet_p50_ms": percentile(quiet, 50) * 1e3, "quiet_p99_ms": percentile(quiet, 99) * 1e3,
            "quiet_steps": len(quiet), "p50_ms": percentile(during, 50) * 1e3,
            "p99_ms": percentile(during, 99) * 1e3, "max_ms": max(during, default=math.nan) * 1e3,
            "steps": len(during), "busy": measured.get("busy", 0), "errors": measured.get("errors", [])[:3],
            "quiet_wait_max_ms": max(waits.get("quiet", []), default=math.nan) * 1e3,
            "wait_p50_ms": percentile(waits.get("attack", []), 50) * 1e3,
            "wait_max_ms": max(waits.get("attack", []), default=math.nan) * 1e3,
            "requests": len(waits.get("attack", [])),
        }
    finally:
        for child in (honest, probe):
            if child is not None:
                await child.kill()
        result["exit_status"] = await server.stop()
        result["server_log"] = server.describe()
        if verbose:
            print(server.tail(40), file=sys.stderr)
    result["violations"] = violations(result)
    return result


def violations(r: dict[str, Any]) -> list[str]:
    """The measures an attack's result misses, each named (empty: all held)."""
    out: list[str] = []
    tag = f"({r['id']}) {r['name']}"
    if "outcome" not in r:
        return [f"{tag}: did not run"]
    over = r["peak_mib"] - r["idle_mib"]
    allowed = r["bound_mib"] * MEMORY_SLACK
    if over > allowed:
        out.append(f"{tag}: peak RSS +{over:.0f} MiB over idle > max_memory_bytes + 10% ({allowed:.0f} MiB)")
    held = r["held_mib"] - r["idle_mib"]
    if held > allowed:
        out.append(f"{tag}: +{held:.0f} MiB still held once idle > {allowed:.0f} MiB")
    h = r["honest"]
    if h["steps"] == 0:
        out.append(f"{tag}: the honest client got no step during the attack "
                   f"({h['busy']} busy, errors {h['errors']})")
    elif h["p99_ms"] > HONEST_RATIO * h["quiet_p99_ms"]:
        out.append(f"{tag}: honest step p99 {h['p99_ms']:.1f} ms > {HONEST_RATIO:g}x quiet "
                   f"{h['quiet_p99_ms']:.1f} ms ({h['p99_ms'] / h['quiet_p99_ms']:.1f}x)")
    if h["errors"]:
        out.append(f"{tag}: honest client errors {h['errors']}")
    hs = r["health"]
    if hs["max_s"] > HEALTH_MAX_S:
        out.append(f"{tag}: /health took up to {hs['max_s']:.2f} s (> {HEALTH_MAX_S} s)")
    if hs["unanswered"] or hs["not_200"]:
        out.append(f"{tag}: /health unanswered {hs['unanswered']}, not 200 {hs['not_200']} of {hs['probes']}")
    out += [f"{tag}: {p}" for p in r["outcome"]["problems"][:10]]
    if not r["settled"]:
        out.append(f"{tag}: the server still ran requests or held clients 60 s after the attack")
    if r["exit_status"] != 0:
        out.append(f"{tag}: the server exited with status {r['exit_status']} on SIGTERM")
    if r["server_log"]["errors"]:
        out.append(f"{tag}: the server logged errors: {r['server_log']['errors'][:3]}")
    return out


def run_doors(ids: Sequence[str], *, seconds: float = 10.0, device: str = "cpu", quiet_requests: int = 10,
              verbose: bool = False) -> list[dict[str, Any]]:
    """Each attack in ``ids`` against a fresh server, one after another; their results."""
    _raise_nofile()
    out = []
    for attack_id in ids:
        out.append(asyncio.run(run_attack(ATTACKS[attack_id], seconds=seconds, device=device,
                                          quiet_requests=quiet_requests, verbose=verbose)))
    return out


def _raise_nofile() -> None:
    """The attacker holds hundreds of sockets: its own descriptor limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def format_result(r: dict[str, Any]) -> str:
    parts = [f"{k}={v // MIB} MiB" if k == "max_memory_bytes" else f"{k}={v}" for k, v in r["limits"].items()]
    parts += [f"RLIMIT_NOFILE={r['nofile']}"] if r["nofile"] else []
    setting = ", ".join(parts)
    lines = [f"({r['id']}) {r['name']} [{r['model']}; {setting or 'default limits'}]",
             f"  before: {r['finding']}"]
    if "outcome" not in r:
        return "\n".join(lines + ["  did not run"])
    o, h, hs = r["outcome"], r["honest"], r["health"]
    lines.append(f"  answers: {', '.join(f'{k} x{v}' for k, v in o['answers'].items()) or 'none'}")
    if o["figures"]:
        lines.append(f"  figures: {json.dumps(o['figures'], separators=(', ', ': '))}")
    lines.append(f"  memory: idle {r['idle_mib']:.1f} MiB; peak +{r['peak_mib'] - r['idle_mib']:.1f} MiB, "
                 f"held after +{r['held_mib'] - r['idle_mib']:.1f} MiB (bound {r['bound_mib']:.0f} MiB "
                 f"+ 10% = {r['bound_mib'] * MEMORY_SLACK:.0f}); the server counted at most "
                 f"{hs['max_counted_mib']:.1f} MiB (used + reserved, /metrics every second)")
    ratio = h["p99_ms"] / h["quiet_p99_ms"] if h["quiet_p99_ms"] else math.nan
    lines.append(f"  honest: quiet p50 {h['quiet_p50_ms']:.1f} / p99 {h['quiet_p99_ms']:.1f} ms "
                 f"({h['quiet_steps']} steps); during p50 {h['p50_ms']:.1f} / p99 {h['p99_ms']:.1f} / "
                 f"max {h['max_ms']:.1f} ms ({h['steps']} steps, {ratio:.1f}x); first step waited "
                 f"p50 {h['wait_p50_ms']:.0f} / max {h['wait_max_ms']:.0f} ms (quiet max "
                 f"{h['quiet_wait_max_ms']:.0f}; {h['requests']} requests, {h['busy']} busy)")
    lines.append(f"  /health: max {hs['max_s'] * 1e3:.0f} ms, p99 {hs['p99_s'] * 1e3:.0f} ms "
                 f"({hs['probes']} probes, {hs['unanswered']} unanswered); most seen: connections "
                 f"{hs['max_connections']}, requests {hs['max_requests']}, queued {hs['max_queued']}")
    cpu = r["cpu"]
    share = f" ({cpu['server_s'] / r['attack_s']:.0%} of a core" if r["attack_s"] >= 0.1 else " ("
    share += f"; {cpu['server_quiet_share']:.0%} serving the honest client alone, quiet)"
    lines.append(f"  {r['attack_s']} s of attack; CPU during it: server {cpu['server_s']:.1f} s{share}, "
                 f"attacker {cpu['attacker_s']:.1f} s; "
                 f"server exit {r['exit_status']}, "
                 f"{r['server_log']['warnings']} warnings, {len(r['server_log']['errors'])} errors logged")
    v = r["violations"]
    lines.append("  violations: " + ("none" if not v else f"{len(v)}"))
    lines += [f"    - {x}" for x in v]
    return "\n".join(lines)


def _resolve(spec: str) -> list[str]:
    ids = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        attack_id = item if item in ATTACKS else _BY_NAME.get(item)
        if attack_id is None:
            raise SystemExit(f"unknown attack {item!r}; known: "
                             + ", ".join(f"{a.id} ({a.name})" for a in ATTACKS.values()))
        ids.append(attack_id)
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.doors", description=__doc__.split("\n")[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help="attack ids or names, comma-separated, in this order (default: all; --list)")
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="how long each attack lasts (default 10; 3, 4, 4b hold their sockets past the "
                         "server's send or body timeout, 35 s)")
    ap.add_argument("--device", default="cpu", help="the server's --device (default cpu)")
    ap.add_argument("--quiet-requests", type=int, default=10, help="honest requests before each attack (10)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the attacks and exit")
    ap.add_argument("--verbose", action="store_true", help="print the tail of each server's log")
    args = ap.parse_args(argv)
    if args.list:
        for a in ATTACKS.values():
            print(f"{a.id:>3}  {a.name:22} {RUNS[a.id].__doc__.splitlines()[0]}")
        return 0
    logging.getLogger("omni_stream").setLevel(logging.ERROR)
    ids = _resolve(args.attacks)
    t0 = time.monotonic()
    results = []
    _raise_nofile()
    for attack_id in ids:
        r = asyncio.run(run_attack(ATTACKS[attack_id], seconds=args.seconds, device=args.device,
                                   quiet_requests=args.quiet_requests, verbose=args.verbose))
        print(format_result(r), flush=True)
        results.append(r)
    bad = [v for r in results for v in r["violations"]]
    print(f"doors: {len(results)} attacks in {time.monotonic() - t0:.0f} s; violations: "
          + ("none" if not bad else f"{len(bad)} (above)"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
