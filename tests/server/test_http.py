"""The HTTP side of the port: HEAD, other methods, bytes that are not HTTP; the server's log lines."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect

from omni_stream.errors import ParamsError
from omni_stream.models import Synthetic
from omni_stream.server import Server
from omni_stream.server import app as server_app
from omni_stream.server import service as server_service

from .conftest import SMALL, Slow, running, send, until, until_end


async def raw_http(server: Server, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh TCP connection; everything the server answers before closing."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(data)
        await writer.drain()
        with anyio.fail_after(timeout):
            return await reader.read()
    finally:
        writer.close()


def parse(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def request(method: str, path: str, *extra: str) -> bytes:
    # Connection: close, so that reading to the end does not wait out keep-alive.
    return "\r\n".join(
        [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *extra, "", ""]
    ).encode()


@pytest.mark.asyncio
async def test_head_answers_the_get_headers_without_a_body() -> None:
    async with running() as server:
        for path in ("/", "/models", "/nope", "/health", "/metrics"):
            get_status, get_headers, get_body = parse(await raw_http(server, request("GET", path)))
            status, headers, body = parse(await raw_http(server, request("HEAD", path)))
            assert body == b"", f"HEAD {path} sent a body"
            assert status == get_status
            assert headers["content-type"] == get_headers["content-type"]
            assert int(get_headers["content-length"]) == len(get_body) > 0
            if path in ("/", "/models", "/nope"):  # the same bytes every time
                assert headers["content-length"] == get_headers["content-length"]
            else:
                assert int(headers["content-length"]) > 0


@pytest.mark.asyncio
async def test_other_methods_get_405_with_allow() -> None:
    async with running() as server:
        for method, path, allow in [
            ("POST", "/health", "GET, HEAD"),
            ("PUT", "/", "GET, HEAD"),
            ("DELETE", "/models", "GET, HEAD"),
            ("POST", "/ws", "GET, HEAD"),
            ("DELETE", "/v1/generations", "GET, POST, HEAD"),
            ("PUT", "/v1/generations/x", "GET, DELETE, HEAD"),
        ]:
            status, headers, body = parse(await raw_http(server, request(method, path, "Content-Length: 0")))
            assert (status, headers["allow"]) == (405, allow), (method, path)
            if method == "HEAD":
                assert body == b""
            else:
                assert b'"error":"method_not_allowed"' in body and method.encode() in body
        # An unknown path is unknown whatever the method.
        status, _, _ = parse(await raw_http(server, request("POST", "/nope", "Content-Length: 0")))
        assert status == 404


@pytest.mark.asyncio
async def test_what_is_not_a_websocket_gets_an_http_answer() -> None:
    # docs/http.md: a request the server can parse gets an HTTP answer, one it
    # cannot a plain 400; /ws without an upgrade is told to upgrade.
    async with running() as server:
        with_body = request("POST", "/health", "Content-Length: 3") + b"abc"
        status, headers, _ = parse(await raw_http(server, with_body))
        assert (status, headers["allow"]) == (405, "GET, HEAD")
        status, _, _ = parse(await raw_http(server, b"hello there\r\n\r\n"))
        assert status == 400
        status, headers, body = parse(await raw_http(server, request("GET", "/ws")))
        assert (status, headers["upgrade"]) == (426, "websocket") and b"upgrade_required" in body
        # The server is none the worse.
        status, _, _ = parse(await raw_http(server, request("GET", "/health")))
        assert status == 200


@pytest.mark.asyncio
async def test_slow_request_headers_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn alone would keep a connection that never finishes its headers forever.
    from omni_stream.server import http11

    monkeypatch.setattr(http11, "HEADER_TIMEOUT_S", 0.5)
    async with running() as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            await writer.drain()
            with anyio.fail_after(10):
                assert await reader.read() == b""  # dropped
        finally:
            writer.close()
        # An idle connection too, and a kept-alive one after its first answer.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            with anyio.fail_after(10):
                data = await reader.read()
            assert data.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
        status, _, _ = parse(await raw_http(server, request("GET", "/health")))
        assert status == 200


# -- log lines ---------------------------------------------------------------------------


def _done_records(caplog: pytest.LogCaptureFixture) -> dict[str, logging.LogRecord]:
    return {
        r.request_id: r  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "omni_stream.server" and r.getMessage().startswith("request done ")
    }


@pytest.mark.asyncio
async def test_each_request_logs_one_line_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omni_stream.server")
    async with running(Slow(0.02)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="ok-1", params={**SMALL, "steps": 3})
        await until_end(ws, "ok-1")
        await send(ws, type="generate", id="gone-1", params={**SMALL, "steps": 500})
        await until(ws, lambda m: m.get("type") == "progress" and m["id"] == "gone-1")
        await send(ws, type="cancel", id="gone-1")
        await until_end(ws, "gone-1")
        await send(ws, type="generate", id="bad-1", params={**SMALL, "steps": 4, "fail_at": 2})
        await until_end(ws, "bad-1")
        with anyio.fail_after(10):
            while len(_done_records(caplog)) < 3:
                await anyio.sleep(0.01)
    records = _done_records(caplog)
    assert sorted(records) == ["bad-1", "gone-1", "ok-1"], "one line per request"
    ok = records["ok-1"]
    assert ok.levelno == logging.INFO
    assert re.fullmatch(
        r"request done id=ok-1 conn=\S+ principal=connection:\S+ model=slow outcome=done steps=3 total=3 "
        r"frames=3 frames_dropped=0 previews=3 elapsed_s=\d+\.\d+ detach=False",
        ok.getMessage(),
    ), ok.getMessage()
    fields: dict[str, Any] = {k: getattr(ok, k) for k in (
        "request_id", "model", "outcome", "code", "reason", "steps", "total_steps", "frames",
        "frames_dropped", "previews", "detach")}
    assert fields == {"request_id": "ok-1", "model": "slow", "outcome": "done", "code": None,
                      "reason": None, "steps": 3, "total_steps": 3, "frames": 3,
                      "frames_dropped": 0, "previews": 3, "detach": False}
    assert ok.connection and ok.elapsed_s > 0  # type: ignore[attr-defined]
    gone = records["gone-1"]
    assert (gone.outcome, gone.reason) == ("cancelled", "client")  # type: ignore[attr-defined]
    assert "outcome=cancelled reason=client" in gone.getMessage()
    bad = records["bad-1"]
    assert (bad.outcome, bad.code) == ("error", "step_failed")  # type: ignore[attr-defined]
    assert "outcome=error code=step_failed steps=1 total=4" in bad.getMessage()


@pytest.mark.asyncio
async def test_the_log_line_counts_frames_a_busy_server_let_the_engine_replace(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_stream.core import records

    caplog.set_level(logging.INFO, logger="omni_stream.server")
    real = records.RequestRecord.publish_progress

    def slow_publish(self: Any, message: Any) -> None:
        time.sleep(0.02)  # the server falls behind a fast engine: latest-wins replaces frames
        real(self, message)

    monkeypatch.setattr(records.RequestRecord, "publish_progress", slow_publish)
    async with running() as server, connect(server.url) as ws:
        await send(ws, type="generate", id="fast", params={**SMALL, "steps": 200}, preview={"every": 50})
        await until_end(ws, "fast")
        with anyio.fail_after(10):
            while "fast" not in _done_records(caplog):
                await anyio.sleep(0.01)
    line = _done_records(caplog)["fast"]
    taken, dropped = line.frames, line.frames_dropped  # type: ignore[attr-defined]
    assert taken + dropped == 200 and dropped > 0 and taken >= 1
    assert f"frames={taken} frames_dropped={dropped}" in line.getMessage()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("host", "token", "warns"),
    [("0.0.0.0", None, True), ("0.0.0.0", "secret", False), ("127.0.0.1", None, False)],
)
async def test_a_non_loopback_address_without_a_token_warns(
    caplog: pytest.LogCaptureFixture, host: str, token: str | None, warns: bool
) -> None:
    caplog.set_level(logging.INFO, logger="omni_stream.server")
    async with Server(Synthetic(), host=host, port=0, token=token, device="cpu", shutdown_timeout_s=0.5):
        pass
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "without a token" in r.getMessage()]
    assert len(warnings) == int(warns)
    if warns:
        assert "0.0.0.0" in warnings[0].getMessage() and "--token" in warnings[0].getMessage()


# -- out of file descriptors --------------------------------------------------------------


def test_emfile_from_the_loop_warns_once_a_minute(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING)
    handler = server_app._loop_exception_handler(server_service.FdWarning())
    loop = asyncio.new_event_loop()
    try:
        emfile = {"message": "socket.accept() out of system resource",
                  "exception": OSError(errno.EMFILE, "Too many open files")}
        for _ in range(100):  # asyncio reports it up to 100 times a tick
            handler(loop, emfile)
        handler(loop, {**emfile, "exception": OSError(errno.ENFILE, "Too many open files in system")})
        fd_lines = [r for r in caplog.records if "out of file descriptors" in r.getMessage()]
        assert len(fd_lines) == 1 and fd_lines[0].levelno == logging.WARNING
        assert "Too many open files" in fd_lines[0].getMessage()
        # A minute later it is said again.
        now = server_service.time.monotonic()
        monkeypatch.setattr(server_service.time, "monotonic", lambda: now + 61)
        handler(loop, emfile)
        assert len([r for r in caplog.records if "out of file descriptors" in r.getMessage()]) == 2
        monkeypatch.undo()
        # Anything else is the loop's default handler's (an ERROR from asyncio).
        handler(loop, {"message": "something else", "exception": ValueError("x")})
        assert any(r.name == "asyncio" and r.levelno == logging.ERROR for r in caplog.records)
    finally:
        loop.close()


def test_stay_dead_must_be_a_bool() -> None:
    with pytest.raises(ParamsError) as info:
        Server(Synthetic(), port=0, stay_dead="yes")  # type: ignore[arg-type]
    assert info.value.field == "stay_dead"
