"""``omni-stream serve`` in a process of its own, as an operator runs it: the attack tools' server.

:class:`ServeProcess` runs ``python -m omni_stream serve --model MODEL --host
127.0.0.1 --port 0 --device DEVICE`` from the repository root (so a model
``benchmarks.image_model:ImageSynthetic`` imports), with the limits given as
their ``OMNI_STREAM_*`` environment variables (the process's own
environment's are removed first: the defaults are the defaults) and,
optionally, a lower ``RLIMIT_NOFILE``, set by the child's own first line of
Python (:func:`omni_stream_argv`), not by a ``preexec_fn``: Python code run
between fork and exec is unsafe in a parent with threads, and a test process
that has run Ray still has gRPC's (a child of one died of SIGABRT before exec).
It learns the port from the server's ``listening on`` log line, keeps
reading the log (a full pipe would block the server), counts its WARNING
and ERROR lines, and reads the process's RSS and peak RSS from ``/proc``;
:meth:`reset_peak` starts a new peak (``/proc/PID/clear_refs``).
:meth:`stop` sends SIGTERM and returns the exit status (0: a clean shutdown).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import sys
from collections.abc import Mapping
from typing import Any

from .stress_common import ROOT, proc_cpu_s, proc_status

__all__ = ["ServeProcess", "omni_stream_argv"]

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:(\d+))")

# Lowers the soft (and, when asked, the hard) descriptor limit, then runs
# ``python -m omni_stream.cli ARGS`` in this same process.
_LIMITED = (
    "import resource, runpy, sys\n"
    "soft, hard = int(sys.argv[1]), int(sys.argv[2])\n"
    "hard = hard if hard >= 0 else resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
    "sys.argv = ['omni-stream', *sys.argv[3:]]\n"
    "runpy.run_module('omni_stream.cli', run_name='__main__', alter_sys=True)\n"
)


def omni_stream_argv(*args: str, nofile: int | None = None, hard: bool = False) -> list[str]:
    """``python -m omni_stream.cli ARGS`` as a command line, ``RLIMIT_NOFILE`` lowered to ``nofile`` first.

    ``hard`` lowers the hard limit too. Without ``nofile`` it is the plain command.
    """
    if nofile is None:
        return [sys.executable, "-m", "omni_stream.cli", *args]
    return [sys.executable, "-c", _LIMITED, str(nofile), str(nofile if hard else -1), *args]


class ServeProcess:
    """See the module docstring. ``url`` is the websocket endpoint, ``http_url`` the HTTP root."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, log: collections.deque[str]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.port = port
        self.http_url = f"http://127.0.0.1:{port}"
        self.url = f"ws://127.0.0.1:{port}/ws"
        self.log = log
        self.warnings = 0
        self.errors: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        *,
        model: str = "synthetic",
        device: str = "cpu",
        env: Mapping[str, str] | None = None,
        nofile: int | None = None,
        timeout: float = 180.0,
    ) -> ServeProcess:
        """Start it and wait until it listens; raises RuntimeError with its log when it does not."""
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_")}
        child_env.update(env or {})
        paths = (str(ROOT), child_env.get("PYTHONPATH", ""))
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child_env.setdefault("PYTHONUNBUFFERED", "1")

        argv = omni_stream_argv(
            "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--device", device,
            nofile=nofile,
        )
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=ROOT, env=child_env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, limit=1 << 20,
        )
        log: collections.deque[str] = collections.deque(maxlen=200)
        assert proc.stderr is not None
        stderr = proc.stderr

        async def listening() -> int:
            while True:
                line = (await stderr.readline()).decode(errors="replace")
                if not line:
                    code = await proc.wait()
                    raise RuntimeError(f"omni-stream serve exited with status {code}: {''.join(log)}")
                log.append(line)
                found = _LISTENING.search(line)
                if found:
                    return int(found.group(2))

        try:
            port = await asyncio.wait_for(listening(), timeout)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        server = cls(proc, port, log)
        server._reader = asyncio.create_task(server._read_log())
        return server

    async def _read_log(self) -> None:
        assert self.proc.stderr is not None
        while line := (await self.proc.stderr.readline()).decode(errors="replace"):
            self.log.append(line)
            if ": warning:" in line[:40]:
                self.warnings += 1
            elif ": error:" in line[:40] or line.startswith("Traceback"):
                self.errors.append(line.strip()[:300])

    def stats(self) -> dict[str, float]:
        """RSS and peak RSS (MiB) since the last :meth:`reset_peak`, CPU seconds, descriptors; {} if gone."""
        try:
            st = proc_status(self.pid)
            user, system = proc_cpu_s(self.pid)
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except (OSError, KeyError, IndexError, ValueError):
            return {}
        return {"rss_mib": int(st["VmRSS"].split()[0]) / 1024,
                "peak_rss_mib": int(st["VmHWM"].split()[0]) / 1024,
                "cpu_s": user + system, "threads": int(st["Threads"]), "fds": fds}

    def reset_peak(self) -> bool:
        """Make the peak RSS (VmHWM) the current RSS; False where the kernel does not allow it."""
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (killed after ``timeout``); the exit status."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except TimeoutError:
                self._reader.cancel()
        return code

    def tail(self, n: int = 20) -> str:
        return "".join(list(self.log)[-n:])

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "port": self.port, "warnings": self.warnings, "errors": self.errors[:10]}
