"""The client's websocket on any anyio backend: websockets' Sans-I/O protocol over an anyio stream.

websockets' own client (``websockets.asyncio.client``) runs on asyncio only
(uvloop included). Under trio the :class:`~omni_stream.client.Client`
opens an :class:`AnyioSocket` instead: the same protocol code
(``websockets.client.ClientProtocol``: the handshake, framing, masking,
UTF-8 and size checks, the closing handshake) driven by anyio's TCP (and
TLS) streams, with the part of ``ClientConnection`` the client uses:
``send``, ``async for``, ``close``, ``close_code`` / ``close_reason``, and
the same exceptions (``InvalidStatus``, ``InvalidURI``, ``ConnectionClosed``).

Who reads: one task at a time, under ``_receiving`` (the client's reader,
or ``close`` finishing the closing handshake when nobody else reads).
Whoever reads also answers the server's pings and its close frame
(``data_to_send`` after every ``receive_data``). Who writes: one task at a
time, under ``_sending`` (a request's message, a pong, a ping, a close).
Keepalive (:meth:`keepalive`, a task of the client's): a ping every
``interval`` seconds; no pong within ``timeout`` fails the connection
(1011), waits ``close_timeout`` at most for the server's side of the
closing handshake, and drops the TCP connection, so every request on it
ends with ConnectionClosedError (1006) as with websockets' client.

Once a close frame has gone out (the client's, its answer to the
server's, or a failure's: 1009, 1007), the server has ``close_timeout`` to
end the TCP connection, whoever is reading, then the client drops it: a
server that never does cannot hold a reader.

Messages the server sends in fragments are joined here (websockets'
Sans-I/O layer hands over frames, not messages); ``max_size`` bounds the
joined message too (1009, as websockets' client).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import ssl
from collections import deque
from collections.abc import Iterable, Sequence

import anyio
import anyio.abc
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidMessage, PayloadTooBig
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

__all__ = ["AnyioSocket"]

logger = logging.getLogger("omni_stream.client")

#: Bytes asked of the stream per read.
_READ_SIZE = 65536


class AnyioSocket:
    """One websocket connection over an anyio byte stream (see the module docstring)."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        protocol: ClientProtocol,
        *,
        close_timeout: float | None,
        max_size: int | None,
    ) -> None:
        self._stream = stream
        self._protocol = protocol
        self._close_timeout = close_timeout
        self._max_size = max_size
        self._messages: deque[str | bytes] = deque()
        # A message the server is sending in fragments: its parts so far, and whether it is text.
        self._parts: list[bytes] = []
        self._parts_size = 0
        self._text = False
        self._sending = anyio.Lock()
        self._receiving = anyio.Lock()
        self._pongs: dict[bytes, anyio.Event] = {}
        #: The TCP connection has ended (read to its end, or dropped by us).
        self._ended = False
        # When a closing handshake began (``close_expected``): the server has until then to end
        # the TCP connection, or it is dropped (``close_timeout``), whoever reads.
        self._close_by: float | None = None

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        headers: Sequence[tuple[str, str]] = (),
        max_size: int | None = 1 << 20,
        open_timeout: float | None = 10.0,
        close_timeout: float | None = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> AnyioSocket:
        """Connect and complete the opening handshake.

        Raises InvalidURI (``url``), TimeoutError (``open_timeout``), OSError
        (the TCP connection), InvalidStatus (the server answered without
        switching protocols) or another InvalidHandshake, as websockets'
        ``connect`` does.
        """
        uri = parse_uri(url)
        with anyio.fail_after(open_timeout):
            if uri.secure:
                stream: anyio.abc.ByteStream = await anyio.connect_tcp(
                    uri.host,
                    uri.port,
                    tls=True,
                    ssl_context=ssl_context or ssl.create_default_context(),
                    tls_hostname=uri.host,
                )
            else:
                stream = await anyio.connect_tcp(uri.host, uri.port)
            try:
                protocol = ClientProtocol(uri, max_size=max_size)
                request = protocol.connect()
                for name, value in headers:
                    request.headers[name] = value
                protocol.send_request(request)
                socket = cls(stream, protocol, close_timeout=close_timeout, max_size=max_size)
                await socket._flush()
                await socket._handshake()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                raise
        return socket

    async def _handshake(self) -> None:
        protocol = self._protocol
        while True:
            data = await self._read()
            if data:
                protocol.receive_data(data)
            else:
                protocol.receive_eof()
            events = protocol.events_received()
            if events:
                break
            if not data:
                raise InvalidMessage("the server closed the connection during the opening handshake")
        if protocol.handshake_exc is not None:
            raise protocol.handshake_exc
        response, rest = events[0], events[1:]
        assert isinstance(response, Response), type(response)
        # Frames that came in the same read as the response.
        self._take(rest)

    # -- what the client calls ----------------------------------------------------------

    @property
    def close_code(self) -> int | None:
        """The close code the server sent (1006: none came); None while the connection is open."""
        return self._protocol.close_code

    @property
    def close_reason(self) -> str | None:
        return self._protocol.close_reason

    def __aiter__(self) -> AnyioSocket:
        return self

    async def __anext__(self) -> str | bytes:
        """The next message; raises ConnectionClosed once the connection has closed."""
        while not self._messages:
            if self._ended:
                raise self._closed()
            try:
                # The usual case, the one reader alone: no scheduler pass for the lock (trio's
                # anyio.Lock.acquire is two), the read itself waits.
                self._receiving.acquire_nowait()
            except anyio.WouldBlock:
                async with self._receiving:
                    if not self._messages and not self._ended:
                        await self._receive()
                continue
            try:
                await self._receive()
            finally:
                self._receiving.release()
        return self._messages.popleft()

    async def send(self, message: str | bytes) -> None:
        """Send one message; raises ConnectionClosed when the connection is closing or closed."""
        async with self._sending:
            protocol = self._protocol
            if protocol.state is not State.OPEN:
                raise self._closed()
            if isinstance(message, str):
                protocol.send_text(message.encode())
            else:
                protocol.send_binary(message)
            await self._flush_locked()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """The closing handshake (``close_timeout`` at most), then the TCP connection; idempotent."""
        protocol = self._protocol
        if protocol.state is State.OPEN:
            async with self._sending:
                if protocol.state is State.OPEN:
                    protocol.send_close(code, reason)
                    await self._flush_locked()
        await self._finish()

    async def keepalive(self, interval: float, timeout: float | None) -> None:
        """Ping every ``interval`` seconds; fail the connection when a pong is ``timeout`` late.

        A task of the client's for the connection's life: returns once the
        connection has ended.
        """
        while not self._ended:
            await anyio.sleep(interval)
            if self._ended or self._protocol.state is not State.OPEN:
                return
            data = os.urandom(4)
            pong = self._pongs[data] = anyio.Event()
            try:
                async with self._sending:
                    self._protocol.send_ping(data)
                    await self._flush_locked()
            except ConnectionClosed:
                return
            if timeout is None:
                continue
            with anyio.move_on_after(timeout):
                await pong.wait()
            self._pongs.pop(data, None)
            if not pong.is_set() and not self._ended:
                logger.info("no pong from the server within %.1f s: closing the connection", timeout)
                with anyio.move_on_after(self._close_timeout):
                    async with self._sending:
                        if self._protocol.state is State.OPEN:
                            self._protocol.fail(1011, "keepalive ping timeout")
                            await self._flush_locked()
                await self._abort()
                return

    # -- reading ----------------------------------------------------------------------

    async def _read(self) -> bytes:
        """Bytes from the network; b"" at its end (or a connection reset or closed under us, or
        the closing handshake's time up)."""
        try:
            if self._close_by is None:
                return bytes(await self._stream.receive(_READ_SIZE))
            with anyio.move_on_after(max(0.0, self._close_by - anyio.current_time())):
                return bytes(await self._stream.receive(_READ_SIZE))
            return b""
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return b""

    async def _receive(self) -> None:
        """Read once and take what came; answer what the protocol has to (pongs, the close frame)."""
        data = await self._read()
        protocol = self._protocol
        if data:
            protocol.receive_data(data)
        else:
            protocol.receive_eof()
        self._take(protocol.events_received())
        if self._close_by is None and protocol.close_expected():
            # A close frame went out (ours, or the answer to the server's, or a failure's).
            wait = math.inf if self._close_timeout is None else self._close_timeout
            self._close_by = anyio.current_time() + wait
        # Answer what the protocol has to (a pong, the close frame), taken under the lock so that
        # bytes go out in the order the protocol made them. No writer: no scheduler pass for it.
        with contextlib.suppress(ConnectionClosed):  # the server is gone: reading will say so
            try:
                self._sending.acquire_nowait()
            except anyio.WouldBlock:
                async with self._sending:
                    await self._flush_locked()
            else:
                try:
                    await self._flush_locked()
                finally:
                    self._sending.release()
        if not data:
            await self._abort()

    def _take(self, events: Iterable[object]) -> None:
        for event in events:
            if not isinstance(event, Frame):
                continue
            opcode = event.opcode
            if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
                self._parts, self._parts_size, self._text = [], 0, opcode is Opcode.TEXT
                self._part(event)
            elif opcode is Opcode.CONT:
                self._part(event)
            elif opcode is Opcode.PONG:
                pong = self._pongs.pop(bytes(event.data), None)
                if pong is not None:
                    pong.set()
            # PING and CLOSE: the protocol queued the answer (data_to_send).

    def _part(self, frame: Frame) -> None:
        self._parts.append(bytes(frame.data))
        self._parts_size += len(frame.data)
        if self._max_size is not None and self._parts_size > self._max_size:
            # As websockets' client: a message over max_size fails the connection (1009).
            self._parts = []
            exc = PayloadTooBig(self._parts_size, self._max_size)
            self._protocol.fail(1009, str(exc)[:120])
            return
        if not frame.fin:
            return
        data = b"".join(self._parts)
        self._parts, self._parts_size = [], 0
        if not self._text:
            self._messages.append(data)
            return
        try:
            self._messages.append(data.decode())
        except UnicodeDecodeError:
            self._protocol.fail(1007, "invalid UTF-8 in a text message")

    # -- writing and ending -------------------------------------------------------------

    async def _flush(self) -> None:
        async with self._sending:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        """Write what the protocol has to send (call holding ``_sending``)."""
        for chunk in self._protocol.data_to_send():
            try:
                if chunk:
                    await self._stream.send(chunk)
                else:
                    await self._stream.send_eof()  # the protocol's end of our side
            except (
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
                NotImplementedError,
            ) as exc:
                if isinstance(exc, NotImplementedError):
                    continue  # TLS has no half-close: the close that follows ends it
                await self._abort()
                raise self._closed() from exc

    async def _finish(self) -> None:
        """Read until the server ends the TCP connection (``close_timeout`` at most), then end it."""
        with anyio.move_on_after(self._close_timeout):
            while not self._ended:
                async with self._receiving:
                    if not self._ended:
                        await self._receive()
        await self._abort()

    async def _abort(self) -> None:
        """End the TCP connection now; the protocol counts as closed (1006 if no close frame came)."""
        if self._ended:
            return
        self._ended = True
        if self._protocol.state is not State.CLOSED:
            self._protocol.receive_eof()
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()
        for pong in self._pongs.values():
            pong.set()  # a waiting keepalive sees the end instead
        self._pongs.clear()

    def _closed(self) -> ConnectionClosed:
        protocol = self._protocol
        if protocol.state is State.CLOSED:
            return protocol.close_exc
        return ConnectionClosedError(protocol.close_rcvd, protocol.close_sent)
