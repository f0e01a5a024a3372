"""The server under trio: ``Server`` on anyio's trio backend, and ``omni-stream serve --loop trio``.

hypercorn serves the same ASGI app there (server/hypercorn_trio.py). The
clients are real ones on their own asyncio loop in a worker thread (our
Python client, websockets' sync client, urllib), so what is tested is the
server's side of the wire under trio, not a trio client.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from typing import Any

import anyio
import pytest

from omni_stream import client as om_client
from omni_stream.config import run
from omni_stream.errors import ParamsError, UnsupportedBackendError
from omni_stream.models import Synthetic
from omni_stream.server import Server

from .test_serve import _wait_line, omni_stream_serve

pytest.importorskip("hypercorn")
pytest.importorskip("trio")

PARAMS = {"shape": [3, 16, 16], "work": 0, "steps": 4}


def _http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as reply:
        return json.loads(reply.read())


def _client_session(url: str) -> dict[str, Any]:
    """On its own asyncio loop (this is a worker thread): our client generates over the websocket."""

    async def main() -> dict[str, Any]:
        async with om_client.connect(url) as conn:
            frames = [frame async for frame in conn.generate(PARAMS)]
        return {"steps": [f.step for f in frames], "final": frames[-1].final}

    return asyncio.run(main())


def test_server_runs_under_trio_every_door() -> None:
    async def main() -> None:
        async with Server(Synthetic(), port=0, device="cpu") as server:
            # The websocket, with our own client (asyncio, in a thread).
            got = await anyio.to_thread.run_sync(_client_session, server.url)
            assert got["steps"][-1] == PARAMS["steps"] and got["final"], got
            # The HTTP API: a request waited on, its status, /health.
            health = await anyio.to_thread.run_sync(_http_json, server.http_url + "/health")
            assert health["ok"] is True
            def waited() -> tuple[str, bytes, str]:
                req = urllib.request.Request(
                    server.http_url + "/v1/generations?wait=true", data=json.dumps({"params": PARAMS}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=30) as reply:
                    name = reply.headers["Content-Disposition"].split('filename="')[1].split(".")[0]
                    return reply.headers["Content-Type"], reply.read(), name

            kind, body, rid = await anyio.to_thread.run_sync(waited)
            assert kind == "image/png" and body.startswith(b"\x89PNG"), kind
            status = await anyio.to_thread.run_sync(_http_json, server.http_url + f"/v1/generations/{rid}")
            assert status["status"] == "done", status
            # Event streams too: every step, then done.
            def sse() -> list[str]:
                req = urllib.request.Request(
                    server.http_url + "/v1/generations?stream=true",
                    data=json.dumps({"params": PARAMS}).encode(),
                    headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
                )
                with urllib.request.urlopen(req, timeout=30) as reply:
                    body = reply.read().decode()
                return [line.split(":", 1)[1].strip() for line in body.splitlines() if line.startswith("event:")]

            events = await anyio.to_thread.run_sync(sse)
            assert events[-1] == "done", events
            assert server.engine.statistics().completed >= 3

    anyio.run(main, backend="trio")


def test_trio_server_shuts_down_gracefully_mid_render() -> None:
    """A graceful shutdown under trio lets a running request finish (shutdown_timeout_s)."""

    async def main() -> None:
        async with Server(Synthetic(), port=0, device="cpu", shutdown_timeout_s=30) as server:
            created = await anyio.to_thread.run_sync(
                _http_json, server.http_url + "/v1/generations",
                {"params": {"shape": [3, 8, 8], "work": 0, "steps": 40, "hang_at": 2, "hang_s": 0.3}},
            )
            await server.shutdown()
            assert created["id"]
            stats = server.engine.statistics()
            assert stats.completed == 1, stats

    anyio.run(main, backend="trio")


def test_a_quiet_listener_outlives_the_body_deadline_under_trio() -> None:
    """A websocket client that only listens, longer than body_timeout_s, is not cut off.

    (hypercorn's read_timeout would do it: it bounds every read, a listener's too.)
    """

    def listen(url: str) -> list[str]:
        from websockets.sync.client import connect

        kinds: list[str] = []
        with connect(url, open_timeout=20) as ws:
            ws.send(json.dumps({"type": "generate", "id": "slow", "params": {
                "shape": [3, 8, 8], "work": 0, "steps": 3, "hang_at": 2, "hang_s": 2.5}}))
            while not kinds or kinds[-1] not in ("done", "error", "cancelled"):
                data = ws.recv(timeout=30)
                if isinstance(data, str):
                    kinds.append(json.loads(data)["type"])
        return kinds

    async def main() -> list[str]:
        async with Server(Synthetic(), port=0, device="cpu", body_timeout_s=1.0) as server:
            return await anyio.to_thread.run_sync(listen, server.url)

    kinds = anyio.run(main, backend="trio")
    assert kinds[0] == "accepted" and kinds[-1] == "done", kinds


def test_serve_loop_trio_in_a_real_process() -> None:
    with omni_stream_serve("--model", "synthetic", "--device", "cpu", "--loop", "trio") as (proc, lines, url):
        assert _http_json(url + "/health")["ok"] is True
        from websockets.sync.client import connect

        with connect(url.replace("http", "ws") + "/ws", open_timeout=20) as ws:
            ws.send(json.dumps({"type": "generate", "id": "t1", "params": PARAMS}))
            kinds = []
            while not kinds or kinds[-1] not in ("done", "error", "cancelled"):
                data = ws.recv(timeout=30)
                if isinstance(data, str):
                    kinds.append(json.loads(data)["type"])
        assert kinds[0] == "accepted" and kinds[-1] == "done", kinds
        proc.send_signal(signal.SIGTERM)
        _wait_line(lines, "SIGTERM: shutting down")
        assert proc.wait(timeout=60) == 0


def test_loop_names_are_checked() -> None:
    async def main() -> None:
        pass

    with pytest.raises(ParamsError, match="loop must be one of asyncio, uvloop, trio"):
        run(main, loop="curio")


def test_under_trio_without_hypercorn_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A missing module: importing it raises ImportError, as when it was never installed.
    monkeypatch.setitem(sys.modules, "hypercorn", None)

    async def main() -> None:
        async with Server(Synthetic(), port=0, device="cpu"):
            pass

    with pytest.raises(UnsupportedBackendError, match=r"omni-stream\[trio\]"):
        anyio.run(main, backend="trio")
