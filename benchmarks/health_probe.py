"""``/health`` sampled in a process of its own: how long a probe waits for the server's answer.

``python -m benchmarks.health_probe PORT INTERVAL`` (a :class:`~benchmarks.stress_common.JsonChild`):
says ``ready``; on ``{"cmd": "go"}`` starts a ``GET /health`` on a fresh
connection every INTERVAL seconds (each on its own schedule, so one slow
answer does not delay the next probe; each given up after
:data:`TIMEOUT_S`); on ``{"cmd": "stop"}`` answers ``{"event": "result",
"samples": [[t, seconds, status, connections, requests, active, queued, counted], ...]}``
(``t``: when it was sent, ``time.monotonic()``; status 0: no answer, a
refused or dropped connection or a timeout; ``counted``: every fifth
probe, the bytes the server counts against ``max_memory_bytes``, used plus
reserved, from ``/metrics``, else None) and exits. A process of its own
so that what the attacker or the honest client does on their event loops
does not show up as the server's slowness.

:class:`HealthProbe` is the parent's side.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from .stress_common import JsonChild, percentile

__all__ = ["HealthProbe", "summarize"]

#: Seconds a probe waits for an answer before it counts as none.
TIMEOUT_S = 10.0


async def _counted(port: int) -> int | None:
    """``omni_stream_memory_bytes`` + ``omni_stream_memory_reserved_bytes`` from ``/metrics``."""
    from .http_wire import fetch

    try:
        text = (await fetch(port, "GET", "/metrics", timeout=TIMEOUT_S)).body.decode()
    except Exception:  # noqa: BLE001 - not counted this time
        return None
    names = ("omni_stream_memory_bytes ", "omni_stream_memory_reserved_bytes ")
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(names)]
    return int(sum(values)) if len(values) == 2 else None


async def _probe(port: int, out: list[list[Any]], *, metrics: bool) -> None:
    from .http_wire import fetch

    t0 = time.monotonic()
    row: list[Any]
    try:
        answer = await fetch(port, "GET", "/health", timeout=TIMEOUT_S)
        h = answer.json()
        server, load = h.get("server") or {}, h.get("load") or {}
        row = [t0, time.monotonic() - t0, answer.status, server.get("connections"), server.get("requests"),
               load.get("active"), load.get("queued"), None]
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, Exception):  # noqa: BLE001
        row = [t0, time.monotonic() - t0, 0, None, None, None, None, None]
    if metrics:
        row[7] = await _counted(port)
    out.append(row)


async def _main(port: int, interval: float) -> None:
    def say(**msg: Any) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    say(event="ready")
    samples: list[list[Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    sampler: asyncio.Task[None] | None = None

    async def sample() -> None:
        t_next = time.monotonic()
        n = 0
        while True:
            n += 1
            task = asyncio.create_task(_probe(port, samples, metrics=n % 5 == 1))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            t_next += interval
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))

    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        cmd = json.loads(line) if line.strip() else {"cmd": "stop"}
        if cmd["cmd"] == "go" and sampler is None:
            sampler = asyncio.create_task(sample())
            say(event="going")
        elif cmd["cmd"] == "stop":
            if sampler is not None:
                sampler.cancel()
            if tasks:
                await asyncio.wait(set(tasks), timeout=TIMEOUT_S + 1)
            say(event="result", samples=sorted(samples))
            return


class HealthProbe:
    """The parent's side of the probe process."""

    def __init__(self, child: JsonChild) -> None:
        self.child = child

    @classmethod
    async def start(cls, port: int, interval: float = 0.2) -> HealthProbe:
        child = await JsonChild.start("benchmarks.health_probe", str(port), str(interval),
                                      what="the /health probe")
        await child.expect("ready", timeout=60)
        return cls(child)

    async def go(self) -> None:
        await self.child.send(cmd="go")
        await self.child.expect("going", timeout=30)

    async def stop(self) -> list[list[Any]]:
        await self.child.send(cmd="stop")
        result = await self.child.expect("result", timeout=TIMEOUT_S + 30)
        await self.child.close(10)
        return list(result["samples"])

    async def kill(self) -> None:
        await self.child.close(5, terminate=True)


def summarize(samples: list[list[Any]]) -> dict[str, Any]:
    """Answer times (max, p99, p50 in seconds), failures and the largest load seen."""
    times = [s[1] for s in samples]
    answered = [s for s in samples if s[2]]

    def most(i: int) -> int | None:
        values = [s[i] for s in answered if isinstance(s[i], int)]
        return max(values) if values else None

    return {
        "probes": len(samples), "max_s": max(times, default=float("nan")), "p99_s": percentile(times, 99),
        "p50_s": percentile(times, 50), "unanswered": len(samples) - len(answered),
        "not_200": sum(1 for s in answered if s[2] != 200),
        "max_connections": most(3), "max_requests": most(4), "max_active": most(5), "max_queued": most(6),
        "max_counted_mib": (most(7) or 0) / (1 << 20),
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.health_probe PORT INTERVAL")
    asyncio.run(_main(int(sys.argv[1]), float(sys.argv[2])))
