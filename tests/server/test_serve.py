"""serve(): the blocking entry point, shut down by SIGTERM / SIGINT in a real process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect

from omni_stream.errors import EngineDeadError
from omni_stream.models import Synthetic
from omni_stream.server import Server
from omni_stream.server.app import ServerFailedError

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


@contextlib.contextmanager
def omni_stream_serve(
    *args: str, env: dict[str, str | None] | None = None, listen_timeout: float = 120.0
) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str], str]]:
    """A real ``omni-stream serve --port 0 ARGS...`` in its own process: (the process, its output
    lines, its URL) once it listens; killed on the way out if the test did not stop it. ``env``:
    variables to set, or to unset (None)."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    for name, value in (env or {}).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, cwd=ROOT,
    )
    try:
        lines = _lines(proc)
        url = _wait_line(lines, r"listening on (http://127\.0\.0\.1:\d+)", timeout=listen_timeout).group(1)
        yield proc, lines, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


# -- dies loudly: a dead engine ends the process ----------------------------------------


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _DiesAtStep2(Synthetic):
    """Raises SystemExit in step 2: not a step failure, it kills the engine's producer."""

    name = "dies"

    def step(self, states: Sequence[Any]) -> list[Any]:
        if any(s.step + 1 == 2 for s in states):
            raise SystemExit("the model called exit() at step 2")
        return super().step(states)


def dying_model() -> Synthetic:
    """``--model tests.server.test_serve:dying_model``."""
    return _DiesAtStep2()


def _serve_cli(*extra: str) -> tuple[subprocess.Popen[str], queue.Queue[str], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream.cli", "serve", "--model", "tests.server.test_serve:dying_model",
         "--port", "0", "--device", "cpu", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    lines = _lines(proc)
    url = _wait_line(lines, r"listening on (http://127\.0\.0\.1:\d+)").group(1)
    return proc, lines, url


def _generate_until_end(url: str) -> list[dict[str, Any]]:
    from websockets.sync.client import connect

    got = []
    with connect(url.replace("http", "ws") + "/ws", open_timeout=20) as ws:
        ws.send(json.dumps({"type": "generate", "id": "doomed",
                            "params": {"shape": [3, 8, 8], "work": 0, "steps": 5}}))
        while not got or got[-1].get("type") not in ("done", "cancelled", "error"):
            data = ws.recv(timeout=20)
            if isinstance(data, str):
                got.append(json.loads(data))
    return got


def _health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_dead_engine_answers_the_clients_then_exits_with_status_3() -> None:
    proc, lines, url = _serve_cli()
    try:
        messages = _generate_until_end(url)
        last = messages[-1]
        assert (last["type"], last["code"], last["id"]) == ("error", "engine_error", "doomed")
        assert "SystemExit" in last["message"]
        # A supervisor sees the process go, with a status saying why.
        assert proc.wait(timeout=15) == 3
        output = []
        while not lines.empty():
            output.append(lines.get())
        text = "".join(output)
        # One ERROR line from the server says why it exits, with the cause.
        shutdown_lines = [line for line in text.splitlines() if "shutting down so that a supervisor" in line]
        assert len(shutdown_lines) == 1 and "error" in shutdown_lines[0]
        assert "SystemExit" in shutdown_lines[0]
        # The request's own line, at INFO.
        assert re.search(r"request done id=doomed conn=\S+ principal=\S+ model=dies outcome=error code=engine_error", text)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stay_dead_keeps_the_dead_server_up_for_debugging() -> None:
    proc, lines, url = _serve_cli("--stay-dead")
    try:
        assert _generate_until_end(url)[-1]["code"] == "engine_error"
        deadline = time.monotonic() + 20
        while (health := _health(url))[1]["status"] != "dead" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health[0] == 503 and health[1]["status"] == "dead"
        time.sleep(1.0)  # well past the server's looks at the engine (every 0.2 s)
        assert proc.poll() is None, "--stay-dead exited"
        status, body = _health(url)
        assert (status, body["status"]) == (503, "dead")
        _wait_line(lines, "staying up as asked")
        proc.send_signal(signal.SIGTERM)
        # Stopped by hand, it still says how it ended.
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- out of file descriptors ----------------------------------------------------------------

EMFILE_SCRIPT = """
import logging, os, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
import omni_stream.server.app as app
app._FD_WATCH_S = 0.2  # count descriptors often: the test waits on it

class Squeeze(logging.Filter):
    # Once listening, leave the server a handful of descriptors.
    def filter(self, record):
        if "listening on" in record.getMessage():
            used = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        return True

logging.getLogger("omni_stream.server").addFilter(Squeeze())
app.serve("synthetic", port=0, device="cpu", shutdown_timeout_s=1, close_timeout_s=0.5)
print("serve returned", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_running_out_of_file_descriptors_is_logged_once_a_minute() -> None:
    import socket

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", EMFILE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env,
    )
    clients = []
    try:
        lines = _lines(proc)
        port = int(_wait_line(lines, r"listening on http://127\.0\.0\.1:(\d+)").group(1))
        for _ in range(16):  # more connections than descriptors left
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        _wait_line(lines, r"WARNING omni_stream\.server out of file descriptors .*ulimit -n", timeout=30)
        time.sleep(1.0)  # many more failed accepts and counts: still one line a minute
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert not any("out of file descriptors" in line for line in rest), "".join(rest)
    finally:
        for sock in clients:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- dies loudly, in process: Server.fatal ------------------------------------------------



@pytest.mark.asyncio
async def test_a_dead_engine_ends_serve_forever_after_answering_the_client() -> None:
    from websockets.asyncio.client import connect

    server = Server(dying_model(), port=0, device="cpu", shutdown_timeout_s=5, close_timeout_s=1)
    got = []
    with anyio.fail_after(30):
        async with server:
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve_forever)
                async with connect(server.url) as ws:
                    await ws.send(json.dumps({"type": "generate", "id": "d",
                                              "params": {"shape": [3, 8, 8], "work": 0, "steps": 5}}))
                    async for data in ws:
                        if isinstance(data, str):
                            got.append(json.loads(data))
                # serve_forever returned by itself: the task group can end.
            assert ws.close_code == 1001
    assert (got[-1]["type"], got[-1]["code"]) == ("error", "engine_error")
    assert isinstance(server.fatal, EngineDeadError) and "SystemExit" in str(server.fatal)


@pytest.mark.asyncio
@pytest.mark.parametrize("stay_dead", [False, True])
async def test_a_failed_server_task_shuts_the_server_down_unless_stay_dead(
    caplog: pytest.LogCaptureFixture, stay_dead: bool
) -> None:
    caplog.set_level(logging.INFO, logger="omni_stream.server")
    server = Server(Synthetic(), port=0, device="cpu", shutdown_timeout_s=0.5, close_timeout_s=0.5,
                    stay_dead=stay_dead)

    async def broken() -> None:
        raise KeyError("the books are wrong")

    server.service._sweep_retained = broken  # type: ignore[method-assign]
    with anyio.fail_after(20):
        async with server:
            if stay_dead:
                while server.fatal is None:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.3)
                assert not server.closing
                status, body = await anyio.to_thread.run_sync(_health, server.http_url)
                assert (status, body["status"]) == (503, "dead")
                assert "retention sweep" in body["reason"]
                # Kept up, it takes no new work.
                async with connect(server.url) as ws:
                    await ws.send(json.dumps({"type": "generate", "id": "late", "params": {}}))
                    reply = json.loads(await ws.recv())
                assert (reply["code"], reply["id"]) == ("engine_unavailable", "late")
                server.request_shutdown()
            await server.serve_forever()
    assert isinstance(server.fatal, ServerFailedError)
    assert isinstance(server.fatal.__cause__, KeyError)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "omni_stream.server"]
    assert len(errors) == 1 and "retention sweep task failed" in errors[0].getMessage()
    assert ("staying up" in errors[0].getMessage()) == stay_dead


@pytest.mark.parametrize(
    ("error", "status"),
    [(EngineDeadError("the engine died: x"), 3), (ServerFailedError("the server's y task failed"), 4)],
)
def test_the_cli_exit_status_says_why_serve_ended(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, status: int
) -> None:
    import omni_stream.server
    from omni_stream import cli

    calls = []

    def serve(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise error

    monkeypatch.setattr(omni_stream.server, "serve", serve)
    assert cli.main(["serve", "--model", "synthetic", "--stay-dead"]) == status
    assert calls[0]["stay_dead"] is True
    assert f"(status {status})" in capsys.readouterr().err
