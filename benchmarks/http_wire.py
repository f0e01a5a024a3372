"""A raw HTTP/1.1 client for the attack and fuzz tools: any bytes out, h11 to read the answer.

The attacks of ``benchmarks/doors.py`` and the HTTP half of
``benchmarks/fuzz.py`` send what no proper client would (bodies in one-byte
chunks, bodies that stop half way, foreign ``Host`` and ``Origin``
headers, sockets that never read), so requests are built here as bytes
(:func:`request_bytes`) and answers parsed with h11 (the parser uvicorn
itself uses), which checks the server's side of the protocol: a malformed
answer raises :class:`h11.RemoteProtocolError`.

Sockets are opened to 127.0.0.1 only; ``source`` binds another loopback
address as the client's (127.0.0.2, ...: the server keys an HTTP
caller on its address, so each source is a client of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11

__all__ = [
    "Answer",
    "HttpConn",
    "chunked_body",
    "fetch",
    "Silent",
    "open_socket",
    "request_bytes",
]

HOST = "127.0.0.1"


@dataclass
class Answer:
    """One HTTP answer: status, headers (lowercased names; the last of a repeated one), body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: Seconds from the request's first byte sent to the answer's head read.
    head_s: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def closes(self) -> bool:
        return "close" in self.headers.get("connection", "").lower()


def request_bytes(
    method: str,
    target: str,
    *,
    host: str,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes | None = None,
    length: int | None = None,
    chunked: bool = False,
) -> bytes:
    """A request's head (and ``body``, when given and not chunked) as bytes.

    ``length``: the Content-Length to declare (default: ``len(body)``; a
    declared length larger than what is sent is a stalled body);
    ``chunked``: declare ``Transfer-Encoding: chunked`` (the caller sends
    the framed body, :func:`chunked_body`). ``host`` is sent as is (an
    empty string: no ``Host`` header).
    """
    lines = [f"{method} {target} HTTP/1.1"]
    if host:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif body is not None or length is not None:
        lines.append(f"Content-Length: {len(body or b'') if length is None else length}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + (body or b"") if not chunked else head


def chunked_body(body: bytes, chunk: int) -> bytes:
    """``body`` framed as chunks of ``chunk`` bytes, with the last-chunk marker."""
    pieces = (body[i:i + chunk] for i in range(0, len(body), chunk))
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def open_socket(
    port: int, *, source: str | None = None, timeout: float = 10.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to 127.0.0.1:``port`` (from ``source``, a loopback address).

    Nagle's algorithm off: a request written in two pieces (a head, then a chunked body) would
    otherwise wait for the server's delayed ACK of the first, 40 ms, on every call.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source is not None:
            sock.bind((source, 0))
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (HOST, port)), timeout)
        return await asyncio.open_connection(sock=sock, limit=1 << 20)
    except BaseException:
        sock.close()
        raise


class Silent:
    """A client that never reads: a raw socket whose answers stay in the kernel's buffer.

    What the server sends fills the socket's receive buffer (``rcvbuf``:
    small, set before connecting) and then the server's send buffer, as
    with a client that stopped reading; :meth:`status` peeks at the answer
    without taking it, :meth:`state` is the kernel's TCP state. A write
    the server refuses (it reset the connection) leaves the socket, and
    what it received, as it was.
    """

    #: TCP states (linux/tcp_states.h): established, closed (reset), close-wait (the server's FIN).
    ESTABLISHED, CLOSED, CLOSE_WAIT = 1, 7, 8

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def connect(cls, port: int, *, rcvbuf: int | None = None, source: str | None = None,
                      timeout: float = 10.0) -> Silent:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            if source is not None:
                sock.bind((source, 0))
            sock.setblocking(False)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (HOST, port)), timeout)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, data: bytes, timeout: float = 10.0) -> bool:
        """Write ``data``; False when the server does not take it within ``timeout`` or refused it."""
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(self.sock, data), timeout)
        except (OSError, TimeoutError):
            return False
        return True

    def status(self) -> int | None:
        """The status of the answer waiting unread, without reading it; None if none came."""
        try:
            head = self.sock.recv(32, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return None
        parts = head.split(b" ", 2)
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
            return int(parts[1])
        return None

    def state(self) -> int | None:
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        except OSError:
            return None
        return int(struct.unpack("B", info[:1])[0])

    def abort(self) -> None:
        """Close with a reset (what it received is dropped at once, on both sides)."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


class HttpConn:
    """One keep-alive connection: :meth:`send` any bytes, :meth:`answer` reads one answer with h11.

    After an answer with ``Connection: close`` (or a server that closed)
    the next :meth:`send` reconnects. Raises h11.RemoteProtocolError for a
    malformed answer, TimeoutError, ConnectionError.
    """

    def __init__(self, port: int, *, source: str | None = None) -> None:
        self.port = port
        self.source = source
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._h11: h11.Connection | None = None
        self.reconnects = 0

    @property
    def host(self) -> str:
        return f"{HOST}:{self.port}"

    async def _ensure(self) -> None:
        if self.writer is None or self.writer.is_closing() or self._h11 is None:
            self.close()
            self.reader, self.writer = await open_socket(self.port, source=self.source)
            self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
            self.reconnects += 1

    async def send(self, data: bytes, *, method: str = "GET", drain_timeout: float = 30.0) -> None:
        """Write one request's bytes (more may follow with :meth:`write`); ``method`` frames the answer."""
        await self._ensure()
        assert self._h11 is not None and self.writer is not None
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
        # h11 only needs the method (a HEAD answer has no body) and that our side is done.
        self._h11.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        self._h11.send(h11.EndOfMessage())
        await self.write(data, drain_timeout=drain_timeout)

    async def write(self, data: bytes, *, drain_timeout: float = 30.0) -> bool:
        """More bytes of the request; False when the server no longer takes them (it answered, closed)."""
        if self.writer is None or self.writer.is_closing():
            return False
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), drain_timeout)
        except (ConnectionError, OSError, TimeoutError):
            return False
        return True

    async def head(self, timeout: float = 30.0) -> h11.Response:
        """The answer's status line and headers."""
        while True:
            event = self._next_event()
            if event is h11.NEED_DATA:
                await self._feed(timeout)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return event
            raise h11.RemoteProtocolError(f"expected an answer's head, got {event!r}")

    async def body_parts(self, timeout: float = 30.0) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (after :meth:`head`)."""
        while True:
            event = self._next_event()
            if event is h11.NEED_DATA:
                await self._feed(timeout)
                continue
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._after_answer()
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection in the middle of an answer")

    async def answer(self, timeout: float = 30.0, *, max_body: int = 1 << 26) -> Answer:
        """One whole answer (its body up to ``max_body`` bytes)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        head = await self.head(timeout)
        t_head = loop.time() - t0
        body = bytearray()
        async for part in self.body_parts(timeout):
            body += part
            if len(body) > max_body:
                raise ValueError(f"an answer's body over {max_body} bytes")
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
        return Answer(head.status_code, headers, bytes(body), t_head)

    def _next_event(self) -> Any:
        assert self._h11 is not None
        return self._h11.next_event()

    async def _feed(self, timeout: float) -> None:
        assert self.reader is not None and self._h11 is not None
        data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
        self._h11.receive_data(data)  # b"": the server closed

    def _after_answer(self) -> None:
        assert self._h11 is not None
        if self._h11.their_state is not h11.DONE or self._h11.our_state is not h11.DONE:
            self.close()  # the server will close it (Connection: close): a fresh one next time

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None
        self._h11 = None


async def fetch(
    port: int,
    method: str,
    target: str,
    *,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    body: bytes | None = None,
    host: str | None = None,
    source: str | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One request on a fresh connection, its whole answer; then the connection is closed."""
    conn = HttpConn(port, source=source)
    items = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    try:
        await conn.send(
            request_bytes(method, target, host=conn.host if host is None else host, headers=items,
                          body=body),
            method=method,
        )
        return await conn.answer(timeout)
    finally:
        conn.close()
