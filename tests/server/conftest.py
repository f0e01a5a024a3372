"""Helpers for the server tests: a running server on 127.0.0.1:0, message readers, raw clients."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from websockets.client import ClientProtocol
from websockets.http11 import Response
from websockets.uri import parse_uri

from omni_stream.protocol import REQUEST_ENDING_CODES, unpack_preview
from omni_stream.server import Server

# Shared with the client tests; imported from here by the server tests.
from ..conftest import Slow, running  # noqa: F401

#: Small, fast request params: 16x16 RGB frames, no matmul load.
SMALL: dict[str, Any] = {"shape": [3, 16, 16], "work": 0}


async def recv(ws: Any, timeout: float = 20.0) -> dict[str, Any]:
    """The next message as a dict; a binary preview becomes ``{"type": "preview", header..., "image"}``."""
    with anyio.fail_after(timeout):
        data = await ws.recv()
    if isinstance(data, bytes):
        header, image = unpack_preview(data)
        return {"type": "preview", **header.to_dict(), "image": bytes(image), "raw": data}
    return json.loads(data)


def is_end(msg: dict[str, Any], rid: str) -> bool:
    if msg.get("id") != rid:
        return False
    if msg["type"] in ("done", "cancelled"):
        return True
    return msg["type"] == "error" and msg["code"] in REQUEST_ENDING_CODES


async def until_end(ws: Any, rid: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Messages for request ``rid`` up to and including its terminal one."""
    out = []
    with anyio.fail_after(timeout):
        while True:
            msg = await recv(ws)
            if msg.get("id") == rid:
                out.append(msg)
            if is_end(msg, rid):
                return out


async def until(ws: Any, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        while True:
            msg = await recv(ws)
            if pred(msg):
                return msg


async def send(ws: Any, **message: Any) -> None:
    await ws.send(json.dumps(message))


async def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; a generous bound only against hanging."""
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.02)


def check_stream(msgs: list[dict[str, Any]], rid: str, total: int, *, end: str = "done") -> None:
    """docs/protocol.md's ordering guarantees for one request's messages on one connection."""
    assert msgs[0]["type"] == "accepted" and msgs[0]["id"] == rid and msgs[0]["total"] == total
    assert msgs[-1]["type"] == end
    if len(msgs) > 2 and msgs[1]["type"] == "queued":  # it waited for a place: where, once
        assert msgs[1]["id"] == rid and msgs[1]["position"] >= 0
        msgs = [msgs[0], *msgs[2:]]
    assert [m["type"] for m in msgs].count("accepted") == 1
    last_step = last_progress = 0
    for m in msgs[1:-1]:
        assert m["type"] in ("progress", "preview"), m
        assert m["step"] >= last_step, "steps went backwards"
        last_step = m["step"]
        assert m["total"] == total
        if m["type"] == "progress":
            last_progress = m["step"]
        else:
            assert m["step"] == last_progress, f"preview {m['step']} not right after its progress"
    if end == "done":
        final = [m for m in msgs if m["type"] == "preview" and m["final"]]
        assert len(final) == 1 and final[0]["step"] == total
        assert msgs[-2] is final[0], "the final preview must come right before done"


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def http_get(server: Server, path: str, headers: dict[str, str] | None = None) -> HttpReply:
    def get() -> HttpReply:
        request = urllib.request.Request(server.http_url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=20) as reply:
                return HttpReply(reply.status, _titled(reply.headers), reply.read())
        except urllib.error.HTTPError as err:
            return HttpReply(err.code, _titled(err.headers), err.read())

    return await anyio.to_thread.run_sync(get)


def _titled(headers: Any) -> dict[str, str]:
    # HTTP header names are case-insensitive; uvicorn sends them lowercase.
    return {"-".join(w.capitalize() for w in k.split("-")): v for k, v in headers.items()}


class RawClient:
    """A websocket client that never reads after the handshake, with a tiny receive buffer.

    It still sends; the server's frames pile up in the kernel and then in the
    server's own buffers, the way a stalled browser tab or a dead network path
    behaves.
    """

    def __init__(self, proto: ClientProtocol, writer: asyncio.StreamWriter) -> None:
        self._proto = proto
        self._writer = writer

    @classmethod
    async def connect(cls, server: Server) -> RawClient:
        proto = ClientProtocol(parse_uri(server.url))
        proto.send_request(proto.connect())
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
        # limit: the stream stops reading the socket after ~2 KiB buffered.
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        writer.write(b"".join(proto.data_to_send()))
        await writer.drain()
        with anyio.fail_after(20):
            head = await reader.readuntil(b"\r\n\r\n")
        proto.receive_data(head)
        (response,) = proto.events_received()
        assert isinstance(response, Response) and response.status_code == 101, response
        return cls(proto, writer)

    async def send_text(self, text: str) -> None:
        self._proto.send_text(text.encode())
        self._writer.write(b"".join(self._proto.data_to_send()))
        await self._writer.drain()

    def close(self) -> None:
        self._writer.transport.abort()
