"""serve(): the blocking entry point, shut down by SIGTERM / SIGINT in a real process."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from omni_stream.server import serve
serve("synthetic", port=0, device="cpu", shutdown_timeout_s=5)
print("serve returned", flush=True)
"""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_line(lines: queue.Queue[str], pattern: str, timeout: float = 60.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_runs_until_a_signal_then_shuts_down(signum: int) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env,
    )
    try:
        lines = _lines(proc)
        url = _wait_line(lines, r"listening on (http://127\.0\.0\.1:\d+)").group(1)
        with urllib.request.urlopen(url + "/health", timeout=20) as reply:
            assert reply.status == 200 and json.loads(reply.read())["ok"] is True
        proc.send_signal(signum)
        _wait_line(lines, signal.Signals(signum).name + ": shutting down")
        _wait_line(lines, "serve returned")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
