"""Shared helpers of the stress tools (chaos, fuzz, soak, exhaust).

Process readings from ``/proc`` (this process or another), a violation
log, percentiles, a server in a process of its own
(:class:`ServerProcess`, ``benchmarks/_server_proc.py``), an honest
websocket client that measures the time between its ``progress``
messages (in this process, :class:`HonestClient`, or in one of its own,
:class:`HonestProcess`), and a raw client that never reads. Nothing here
talks to anything but servers this process started.

``python -m benchmarks.stress_common honest CONFIG_JSON`` is the honest
client's process: JSON commands on stdin, JSON replies on stdout (see
:class:`HonestProcess`). Its times are ``time.monotonic()``
(CLOCK_MONOTONIC, the same clock in every process on the machine), so
the parent can line its step gaps up with what other processes did.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ChildError",
    "HonestClient",
    "HonestProcess",
    "JsonChild",
    "RawClient",
    "ServerProcess",
    "Violations",
    "fd_count",
    "health",
    "percentile",
    "proc_cpu_s",
    "proc_status",
    "rss_mib",
    "slope_per_min",
    "thread_count",
]


#: The repository root: children run ``python -m benchmarks...`` from here.
ROOT = Path(__file__).resolve().parent.parent


def proc_status(pid: int | str = "self") -> dict[str, str]:
    """``/proc/PID/status`` as a dict (Linux); this process by default."""
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def proc_cpu_s(pid: int | str = "self") -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads, from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick  # utime, stime: fields 14 and 15


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
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den


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
    ``stamps`` holds, for each gap, when it ended (``time.monotonic()``).
    ``waits`` holds, by phase, the seconds from each ``generate`` to its
    first ``progress`` (accepted, waiting in the server's gate, the first
    step): what a queue costs, which step gaps do not show.
    """

    def __init__(self, url: str, *, steps: int = 20, params: dict[str, Any] | None = None) -> None:
        self.url = url
        self.steps = steps
        self.params = params or {"shape": [3, 16, 16], "work": 0}
        self.gaps: dict[str, list[float]] = {}
        self.stamps: dict[str, list[float]] = {}
        self.waits: dict[str, list[float]] = {}
        self.phase = "quiet"
        self.errors: list[str] = []
        self.busy = 0
        self.done = 0
        self._n = 0  # request ids stay unique over several runs
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, *, requests: int | None = None) -> None:
        from websockets.asyncio.client import connect

        n = 0
        async with connect(self.url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
            while not self._stop.is_set() and (requests is None or n < requests):
                n += 1
                self._n += 1
                rid = f"honest-{os.getpid()}-{self._n}"
                params = {**self.params, "steps": self.steps, "seed": self._n}
                sent = time.monotonic()
                await ws.send(json.dumps({
                    "type": "generate", "id": rid, "params": params,
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
                        now = time.monotonic()
                        if last is not None:
                            self.gaps.setdefault(phase, []).append(now - last)
                            self.stamps.setdefault(phase, []).append(now)
                        else:
                            self.waits.setdefault(phase, []).append(now - sent)
                        last = now
                    elif kind == "done":
                        self.done += 1
                        break
                    elif kind == "error" and msg.get("code") == "busy":
                        self.busy += 1
                        await asyncio.sleep(min(float(msg.get("retry_after_s", 1)), 1.0))
                        break
                    elif kind in ("error", "cancelled"):
                        why = msg.get("code") or msg.get("reason")
                        self.errors.append(f"{kind}: {why}: {msg.get('message', '')}")
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


# -- processes of their own ------------------------------------------------------------


class ChildError(RuntimeError):
    """A child process did not answer as it should (it exited, or it was silent too long)."""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class JsonChild:
    """``python -m MODULE ARGS`` from the repository root, speaking JSON lines.

    Commands go to its stdin, one JSON object a line; it answers on its
    stdout the same way (its stderr is this process's). ``recv`` raises
    :class:`ChildError` when the child exits or says nothing for ``timeout``
    seconds.
    """

    def __init__(self, proc: asyncio.subprocess.Process, what: str) -> None:
        self.proc = proc
        self.what = what

    @classmethod
    async def start(cls, module: str, *args: str, what: str | None = None,
                    pipe_stderr: bool = False) -> JsonChild:
        """``pipe_stderr``: its stderr is a pipe (``proc.stderr``) for the caller to read."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args, cwd=ROOT, env=_child_env(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 30,
            stderr=asyncio.subprocess.PIPE if pipe_stderr else None,
        )
        return cls(proc, what or module)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()

    async def recv(self, timeout: float | None = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raise ChildError(f"{self.what} (pid {self.pid}) said nothing for {timeout} s") from None
        if not line:
            code = await self.proc.wait()
            raise ChildError(f"{self.what} (pid {self.pid}) exited with status {code} before answering")
        out: dict[str, Any] = json.loads(line)
        return out

    async def expect(self, event: str, timeout: float | None = 60.0) -> dict[str, Any]:
        msg = await self.recv(timeout)
        if msg.get("event") != event:
            raise ChildError(f"{self.what} (pid {self.pid}) answered {msg!r}, expected {event!r}")
        return msg

    async def close(self, timeout: float = 30.0, *, terminate: bool = False) -> int:
        """Close its stdin (or SIGTERM it) and wait for it to exit; killed after ``timeout``. Its status."""
        if self.proc.returncode is None:
            if terminate:
                self.proc.send_signal(signal.SIGTERM)
            elif self.proc.stdin is not None and not self.proc.stdin.is_closing():
                self.proc.stdin.close()
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            return -9


class ServerProcess:
    """``omni_stream.server.Server`` (Synthetic, CPU) in a process of its own: ``benchmarks/_server_proc.py``.

    The way users run it: its own interpreter and event loop (uvloop, as
    ``omni-stream serve``), so clients measured against it do not share its
    loop or its CPU time. ``limits`` are Server keyword arguments
    (``shutdown_timeout_s``, ``max_memory_bytes``, ...). ``stats()`` reads
    its RSS, peak RSS (VmHWM) and CPU seconds from ``/proc``; ``stop()``
    sends SIGTERM (a graceful shutdown) and returns its exit status. Its
    log goes on to this process's stderr; ``log_errors`` counts its ERROR
    lines and tracebacks (an exception the server did not handle: uvicorn's
    ``Exception in ASGI application``, a task's).
    """

    def __init__(self, child: JsonChild, info: dict[str, Any]) -> None:
        self.child = child
        self.url: str = info["url"]
        self.http_url: str = info["http_url"]
        self.pid: int = info["pid"]
        self.log_errors: list[str] = []
        self._log: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, limits: dict[str, Any] | None = None, *, verbose: bool = False,
                    profile: str | None = None) -> ServerProcess:
        args = ["--limits", json.dumps(limits or {})] + (["--verbose"] if verbose else [])
        args += ["--profile", profile] if profile else []
        child = await JsonChild.start("benchmarks._server_proc", *args, what="the server process",
                                      pipe_stderr=True)
        server: ServerProcess | None = None
        errors: list[str] = []

        async def forward() -> None:
            assert child.proc.stderr is not None
            while line := await child.proc.stderr.readline():
                text = line.decode(errors="replace")
                sys.stderr.write(text)
                if " ERROR " in text[:60] or text.startswith("Traceback"):
                    errors.append(text.strip()[:300])

        log = asyncio.create_task(forward())
        try:
            info = await child.expect("listening", timeout=120)
        except BaseException:
            await child.close(5, terminate=True)
            log.cancel()
            raise
        server = cls(child, info)
        server.log_errors, server._log = errors, log
        return server

    def stats(self) -> dict[str, float]:
        """RSS and peak RSS (MiB), user and system CPU seconds so far; empty once it exited."""
        try:
            st = proc_status(self.pid)
            user, system = proc_cpu_s(self.pid)
        except (OSError, KeyError, IndexError, ValueError):
            return {}
        return {"rss_mib": int(st["VmRSS"].split()[0]) / 1024,
                "peak_rss_mib": int(st["VmHWM"].split()[0]) / 1024,
                "user_s": user, "sys_s": system, "cpu_s": user + system, "threads": int(st["Threads"])}

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (killed after ``timeout``); the exit status (0: a clean shutdown)."""
        code = await self.child.close(timeout, terminate=True)
        if self._log is not None:
            try:
                await asyncio.wait_for(self._log, 5)
            except TimeoutError:
                self._log.cancel()
        return code


class HonestProcess:
    """An :class:`HonestClient` in a process of its own (``python -m benchmarks.stress_common honest``).

    ``await quiet(n)`` runs ``n`` requests and returns when they are done;
    ``await load(phase)`` starts it running requests one after another
    (gaps tagged ``phase``) until ``await stop()``, which returns what it
    measured: ``gaps``, ``stamps`` (their ends, ``time.monotonic()``) and
    ``waits`` (to a request's first step) by phase, ``busy``, ``done``,
    ``errors``. Its own CPU work (parsing replies)
    runs on its own loop, not the server's nor an attacker's.
    """

    def __init__(self, child: JsonChild) -> None:
        self.child = child

    @classmethod
    async def start(cls, url: str, *, steps: int = 20, params: dict[str, Any] | None = None) -> HonestProcess:
        config = json.dumps({"url": url, "steps": steps, "params": params})
        child = await JsonChild.start("benchmarks.stress_common", "honest", config, what="the honest client")
        await child.expect("ready", timeout=60)
        return cls(child)

    async def quiet(self, requests: int, phase: str = "quiet", timeout: float = 300.0) -> None:
        await self.child.send(cmd="run", phase=phase, requests=requests)
        await self.child.expect("ran", timeout=timeout)

    async def load(self, phase: str) -> None:
        await self.child.send(cmd="load", phase=phase)
        await self.child.expect("loading", timeout=60)

    async def phase(self, phase: str) -> None:
        """While loading: tag the requests started from now on ``phase``."""
        await self.child.send(cmd="phase", phase=phase)
        await self.child.expect("phased", timeout=60)

    async def stop(self, timeout: float = 150.0) -> dict[str, Any]:
        await self.child.send(cmd="stop")
        result = await self.child.expect("result", timeout=timeout)
        await self.child.close(10)
        return result

    async def kill(self) -> None:
        await self.child.close(5, terminate=True)


async def _honest_main(config: dict[str, Any]) -> None:
    """The honest client's process: commands on stdin, replies on stdout."""
    client = HonestClient(config["url"], steps=config.get("steps", 20), params=config.get("params"))
    task: asyncio.Task[None] | None = None

    def say(**msg: Any) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    async def guarded(requests: int | None) -> None:
        try:
            await client.run(requests=requests)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            client.errors.append(f"{type(exc).__name__}: {exc}")

    say(event="ready", pid=os.getpid())
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            if task is not None:
                client.stop()
                await task
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            client.phase = cmd["phase"]
            await guarded(cmd["requests"])
            say(event="ran")
        elif cmd["cmd"] == "load":
            client.phase = cmd["phase"]
            client._stop.clear()
            task = asyncio.create_task(guarded(None))
            say(event="loading")
        elif cmd["cmd"] == "phase":
            # While loading: the requests started from now on are tagged ``phase``.
            client.phase = cmd["phase"]
            say(event="phased")
        elif cmd["cmd"] == "stop":
            client.stop()
            if task is not None:
                await task
            say(event="result", gaps=client.gaps, stamps=client.stamps, waits=client.waits, busy=client.busy, done=client.done,
                errors=client.errors)
            return


if __name__ == "__main__":
    if sys.argv[1:2] == ["honest"] and len(sys.argv) == 3:
        asyncio.run(_honest_main(json.loads(sys.argv[2])))
    else:
        sys.exit("usage: python -m benchmarks.stress_common honest CONFIG_JSON")
