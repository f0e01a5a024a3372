"""Shared helpers of the stress tools (chaos, fuzz, soak, exhaust).

Process readings from ``/proc/self``, a violation log, percentiles, a
server on 127.0.0.1 port 0, an honest websocket client that measures the
time between its ``progress`` messages, and a raw client that never reads.
Nothing here talks to anything but servers this process started.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "HonestClient",
    "RawClient",
    "Violations",
    "fd_count",
    "health",
    "percentile",
    "proc_status",
    "rss_mib",
    "slope_per_min",
    "thread_count",
]


def proc_status() -> dict[str, str]:
    """``/proc/self/status`` as a dict (Linux)."""
    out: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def rss_mib() -> float:
    """VmRSS of this process in MiB."""
    return int(proc_status()["VmRSS"].split()[0]) / 1024


def thread_count() -> int:
    return int(proc_status()["Threads"])


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``ts`` (seconds), per minute."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den


@dataclass
class Violations:
    """Everything a run found wrong; a run passes when it stays empty."""

    items: list[str] = field(default_factory=list)
    limit: int = 20  # printed in full; the rest only counted

    def add(self, what: str) -> None:
        self.items.append(what)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def report(self) -> str:
        if not self.items:
            return "violations: none"
        lines = [f"violations: {len(self.items)}"]
        lines += [f"  - {v}" for v in self.items[: self.limit]]
        if len(self.items) > self.limit:
            lines.append(f"  ... and {len(self.items) - self.limit} more")
        return "\n".join(lines)


async def health(http_url: str) -> tuple[int, dict[str, Any]]:
    """``GET /health``: (status, JSON), from a thread."""

    def get() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(http_url + "/health", timeout=20) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    return await asyncio.to_thread(get)


class HonestClient:
    """A well-behaved client: one request at a time, reads everything, times each step.

    ``gaps`` holds the seconds between consecutive ``progress`` messages (the
    per-step latency a user sees); ``phase`` tags which part of a run they
    belong to, so one client can measure a quiet baseline and a loaded run.
    """

    def __init__(self, url: str, *, steps: int = 20, params: dict[str, Any] | None = None) -> None:
        self.url = url
        self.steps = steps
        self.params = params or {"shape": [3, 16, 16], "work": 0}
        self.gaps: dict[str, list[float]] = {}
        self.phase = "quiet"
        self.errors: list[str] = []
        self.busy = 0
        self.done = 0
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, *, requests: int | None = None) -> None:
        from websockets.asyncio.client import connect

        n = 0
        async with connect(self.url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
            while not self._stop.is_set() and (requests is None or n < requests):
                n += 1
                rid = f"honest-{os.getpid()}-{n}"
                await ws.send(json.dumps({
                    "type": "generate", "id": rid, "params": {**self.params, "steps": self.steps, "seed": n},
                    "preview": {"format": "raw", "max_size": 16},
                }))
                last = None
                phase = self.phase
                while True:
                    data = await asyncio.wait_for(ws.recv(), 120)
                    if isinstance(data, bytes):
                        continue
                    msg = json.loads(data)
                    if msg.get("id") != rid:
                        continue
                    kind = msg["type"]
                    if kind == "progress":
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.setdefault(phase, []).append(now - last)
                        last = now
                    elif kind == "done":
                        self.done += 1
                        break
                    elif kind == "error" and msg.get("code") == "busy":
                        self.busy += 1
                        await asyncio.sleep(min(float(msg.get("retry_after_s", 1)), 1.0))
                        break
                    elif kind in ("error", "cancelled"):
                        self.errors.append(f"{kind}: {msg.get('code') or msg.get('reason')}: {msg.get('message', '')}")
                        break

    def summary(self, phase: str) -> str:
        g = self.gaps.get(phase, [])
        return (f"{phase}: {len(g)} steps, p50 {percentile(g, 50) * 1e3:.1f} ms, "
                f"p99 {percentile(g, 99) * 1e3:.1f} ms")

    def p(self, phase: str, q: float) -> float:
        return percentile(self.gaps.get(phase, []), q)


class RawClient:
    """A websocket client that never reads after the handshake, with a tiny receive buffer."""

    def __init__(self, proto: Any, writer: asyncio.StreamWriter) -> None:
        self._proto = proto
        self._writer = writer

    @classmethod
    async def connect(cls, host: str, port: int, url: str) -> RawClient:
        from websockets.client import ClientProtocol
        from websockets.http11 import Response
        from websockets.uri import parse_uri

        proto = ClientProtocol(parse_uri(url), max_size=None)
        proto.send_request(proto.connect())
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        writer.write(b"".join(proto.data_to_send()))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        proto.receive_data(head)
        (response,) = proto.events_received()
        if not isinstance(response, Response) or response.status_code != 101:
            writer.transport.abort()
            raise ConnectionError(f"handshake refused: {getattr(response, 'status_code', response)}")
        return cls(proto, writer)

    async def send_text(self, text: str, *, timeout: float = 5.0) -> bool:
        """Send one message; False when the server stopped reading us or closed."""
        if self._writer.is_closing():
            return False
        self._proto.send_text(text.encode())
        self._writer.write(b"".join(self._proto.data_to_send()))
        try:
            await asyncio.wait_for(self._writer.drain(), timeout)
        except (TimeoutError, ConnectionError, OSError):
            return False
        return True

    def close(self) -> None:
        self._writer.transport.abort()
