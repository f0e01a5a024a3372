"""uvicorn's HTTP/1.1 protocol with deadlines and wire bounds, and a bound on every send.

uvicorn bounds neither how long a request's headers or body may take nor
what its body costs on the wire, and an ASGI response's sends wait for a
client that stops reading for as long as the socket stays open. Each of
these let one client hold a descriptor, a buffer or the event loop as long
as it liked (issue #19, findings 2-4). :class:`DeadlineH11Protocol` (made
for a server's limits by :func:`h11_protocol`) drops a connection:

- whose request headers are not complete within :data:`HEADER_TIMEOUT_S`
  (the first request on a connection, and each next one on a kept-alive
  connection): slowloris;
- whose request body is not complete within ``body_timeout_s`` of its
  headers (a POST that sends 10 bytes of a declared megabyte), with 408
  when no answer has started;
- whose body is over ``max_message_bytes``, or whose chunked framing on
  the wire outweighs its data (more than :data:`FRAMING_ALLOWANCE` bytes
  plus 1/8 of the data), with 413, checked every :data:`_SLICE_BYTES` of
  wire as it is parsed: a body in chunks of one byte is six times its size
  on the wire and costs the pure-Python parser one event per byte; decoded
  bytes alone let a ~1 MiB body in 1-byte chunks take 13 s of the event
  loop.

:class:`BoundedSend` bounds each send of a response by ``send_timeout_s``;
a client that does not take a send in time is cut off (the transport
aborted: what was buffered for it is freed at once, not when TCP gives up).

uvicorn has no public hook for these: this module is where omni_stream
relies on its internals (the protocol's ``cycle``, the ``receive`` callable
being a method of the object that holds the transport), checked by
tests/server/test_http11.py against the installed uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "FRAMING_ALLOWANCE",
    "HEADER_TIMEOUT_S",
    "LINGER_IDLE_S",
    "LINGER_MAX",
    "BoundedSend",
    "DeadlineH11Protocol",
    "LingerSlots",
    "abort_receive",
    "abort_transport",
    "h11_protocol",
    "transport_of",
]

logger = logging.getLogger("omni_stream.server")

#: Seconds a client has to send a request's headers (the websocket
#: handshake included); as python-websockets' open_timeout.
HEADER_TIMEOUT_S: Final = 10.0
#: Bytes of chunked framing a body may carry beyond its data, plus 1/8 of
#: its size: a body in chunks of 100 bytes or more (7 bytes of framing
#: each) always fits, and so does any body of a few KiB however chunked;
#: one of a megabyte in chunks of a few bytes does not. With 1-byte chunks
#: (5 bytes of framing each) it trips after about 1.2 KiB of wire, some 200
#: parser events at ~7 us each: under 2 ms of the event loop (16 KiB let it
#: take 38 ms).
FRAMING_ALLOWANCE: Final = 1 << 10
#: Seconds a refused connection is read and dropped before it is closed (see _linger), at
#: most. httpd and nginx give a lingering close 30 s (MAX_SECS_TO_LINGER; lingering_time);
#: here what it may send is bounded in bytes too (LINGER_BYTES), and 10 s carries the rest
#: of a body of max_message_bytes (1 MiB by default) at 1 Mbit/s.
LINGER_S: Final = 10.0
#: The silence that ends a lingering close sooner: the longest pause a client still
#: sending its body may make between two writes. httpd's lingering close waits 2 s for
#: each read (SECONDS_TO_LINGER, ap_lingering_close), nginx 5 s (lingering_timeout). A
#: client needs about that: a lost segment stalls its sender for a retransmission timeout
#: (1 s at first, RFC 6298; 200 ms at least on Linux, doubling each time it is lost
#: again), and a client process starved of the CPU waits hundreds of milliseconds for it.
#: 0.1 s reset a client that paused 0.5 s under its answer (tests/server/test_http11.py).
LINGER_IDLE_S: Final = 2.0
#: Refused connections of one server lingering at once, at most; past it a refused
#: connection is closed at once (its client may then read a reset rather than its
#: answer). Each holds a descriptor for up to LINGER_S: without a cap, a flood of
#: clients refused while they send would hold as many as it opens (300 stalled POSTs
#: once used up a server's 256); with it, lingering costs this many beyond
#: max_connections (64 by default), at most.
LINGER_MAX: Final = 32
#: A refused connection lingers only if it had sent this much of its body, or
#: declared a body of at most this much (see _linger).
LINGER_MIN_BYTES: Final = 16 << 10
#: How long a small declared body lingers, at most (a client sending a few KiB
#: slowly, a phone, a proxy, is answered only once it has written all): only
#: for the bytes it declared, and with the same LINGER_IDLE_S between writes.
LINGER_SMALL_S: Final = 3.0
#: A chunked body (and a request's head) is parsed this much at a time, its
#: framing checked in between: a slice of one-byte chunks is about 170
#: parser events (about 1 ms). A body with a Content-Length has no framing
#: to outweigh it and is parsed as it comes.
_SLICE_BYTES: Final = 1 << 10
#: Bytes a refused connection may still send, beyond ``max_message_bytes``,
#: read and dropped before it is closed without waiting for it: a client
#: refused for a body it is sending (413 for its declared size, 429 for one
#: connection too many) reads the answer once its send is done, and a close
#: before then would reset the connection under it; an abusive client may
#: send for as long as it likes, and reading all of it would cost the loop
#: what the refusal saved.
LINGER_BYTES: Final = 256 << 10


class LingerSlots:
    """The refused connections of one server lingering now: at most ``limit`` (:data:`LINGER_MAX`).

    Touched on the server's event loop only: no lock.
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int = LINGER_MAX) -> None:
        self.limit = limit
        self.held = 0

    def take(self) -> bool:
        """One more lingering connection, if there is room; False (nothing taken) when not."""
        if self.held >= self.limit:
            return False
        self.held += 1
        return True

    def give(self) -> None:
        """A lingering connection is closed."""
        self.held -= 1


class DeadlineH11Protocol(H11Protocol):
    """:class:`H11Protocol` with the deadlines and wire bounds of the module docstring.

    The class attributes are the defaults; :func:`h11_protocol` makes a
    subclass with a server's limits.
    """

    #: The body's decoded bound (max_message_bytes) and its deadline (body_timeout_s).
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    #: Shared by every connection of a server (h11_protocol makes one per server).
    linger_slots: LingerSlots = LingerSlots()

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_cycle: Any = None
    _body_wire = 0
    _body_decoded = 0
    _chunked = False
    _lingering = False
    _linger_left = -1
    _linger_idle: asyncio.TimerHandle | None = None
    _linger_slot = False  # holds one of linger_slots
    _linger_exact = False  # lingering for the rest of a small declared body only
    _declared: int | None = None  # the request's Content-Length, None when chunked or absent

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        if self._linger_idle is not None:
            self._linger_idle.cancel()
        if self._linger_slot:
            self._linger_slot = False
            self.linger_slots.give()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            # Refused: what the client still sends is read and dropped (see
            # _linger), up to the byte budget, while it keeps coming.
            self._linger_left -= len(data)
            # Over the budget; or, for a small declared body, all of it in (its
            # answer was sent before, so this close resets nothing).
            if self._linger_left < 0 or (self._linger_exact and self._linger_left == 0):
                self.transport.close()
            else:
                self._arm_linger_idle()
            return
        cycle = self.cycle
        if cycle is not None and cycle is self._body_cycle and cycle.more_body and not self._chunked:
            self._body_wire += len(data)  # (no framing to count: a Content-Length body)
            super().data_received(data)
            return
        # Parsed a slice at a time, a body's framing counted between slices,
        # so a body of tiny chunks is refused after a bounded amount of
        # parsing, not after all of what one read brought (up to 256 KiB).
        for start in range(0, len(data), _SLICE_BYTES):
            piece = data[start : start + _SLICE_BYTES] if len(data) > _SLICE_BYTES else data
            cycle = self.cycle
            counting = cycle is not None and cycle is self._body_cycle
            counting = counting and cycle.more_body and not cycle.response_complete
            before = len(cycle.body) if counting and cycle is not None else 0
            super().data_received(piece)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return
            if not counting or cycle is not self.cycle:
                continue
            assert cycle is not None
            # The app cannot run during this call: what the body grew by is what the parser decoded.
            self._body_wire += len(piece)
            self._body_decoded += max(0, len(cycle.body) - before)
            problem = self._body_problem()
            if problem is not None:
                self._refuse(413, "limit_exceeded", problem)
                return

    def _body_problem(self) -> str | None:
        framing = self._body_wire - self._body_decoded
        if self._body_decoded > self.max_body_bytes:
            limit = self.max_body_bytes
            return f"the body is over {limit} bytes (max_message_bytes, OMNI_STREAM_MAX_MESSAGE_BYTES)"
        if framing > FRAMING_ALLOWANCE + self._body_decoded // 8:
            return (
                f"the body's chunked framing ({framing} bytes for {self._body_decoded} of data) outweighs "
                "what it carries: send it with a Content-Length or in chunks of 100 bytes or more"
            )
        return None

    def handle_events(self) -> None:
        super().handle_events()
        # A request whose headers arrived (an HTTP cycle, or an upgrade to a
        # websocket: this object is no longer the transport's protocol).
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.transport.get_protocol() is not self:
            self._disarm_header_timer()
        if cycle is not None and cycle is not self._body_cycle and self.transport.get_protocol() is self:
            # A new request: its body's clock and count start now (headers are in).
            self._body_cycle = cycle
            # Its answer's close goes through _close_after_answer.
            # (A stand-in with the transport's every other member: uvicorn types it as the transport.)
            cycle.transport = _AnswerTransport(  # type: ignore[assignment]
                self.transport, lambda: self._close_after_answer(cycle)
            )
            self._body_wire = self._body_decoded = 0
            self._chunked = any(
                name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in self.headers
            )
            lengths = [value for name, value in self.headers if name == b"content-length"]
            self._declared = int(lengths[0]) if len(lengths) == 1 and lengths[0].isdigit() else None
            self._disarm_body_timer()
            if cycle.more_body:
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
        if cycle is not None and not cycle.more_body:
            self._disarm_body_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this connection

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being answered (its headers did arrive)
        if not self.transport.is_closing():
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return
        self._refuse(
            408,
            "body_timeout",
            f"the request's body did not arrive within {self.body_timeout_s:g} s of its headers "
            "(body_timeout_s, OMNI_STREAM_BODY_TIMEOUT)",
            stalled=True,  # nothing to linger for
        )

    def _refuse(
        self, status: int, code: str, message: str, *, sending: bool = True, stalled: bool = False
    ) -> None:
        """Answer ``status`` if no answer has started, then drop the connection; the app sees a disconnect."""
        cycle = self.cycle
        self._disarm_body_timer()
        if cycle is not None:
            if not cycle.response_started:
                body = f'{{"error":"{code}","message":{_json_str(message)}}}'.encode()
                reason = {408: b"Request Timeout", 413: b"Content Too Large"}.get(status, b"Error")
                head = (
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\ncache-control: no-store\r\n\r\n" % (status, reason, len(body))
                )
                self.transport.write(head + body)
                cycle.response_started = cycle.response_complete = True
            # The app's next receive() reads http.disconnect; its sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        logger.info("dropping an HTTP connection: %s", message)
        self._linger(sending=sending, stalled=stalled)

    def _linger(self, *, sending: bool = False, stalled: bool = False) -> None:
        # A lingering close (as the websocket's, ws_protocol.py): a client
        # still sending its body would have its data answered with a reset
        # if we closed at once, which can discard our answer before it reads
        # it. So, for one that is sending (``sending``: refused mid-body for
        # what it sends) or has been (LINGER_MIN_BYTES of its body in): the
        # answer, FIN, then read and drop while data keeps coming (a
        # pause of LINGER_IDLE_S ends it), up to max_message_bytes +
        # LINGER_BYTES, and LINGER_S at most. A small declared body still
        # coming (a refusal at its head of a slow client's few KiB) lingers
        # too, for LINGER_SMALL_S at most: it would otherwise never read its
        # answer. One that stalled, or declared much and sent little, is
        # closed at once, and so is one refused while LINGER_MAX others
        # linger: lingering connections must not pile up and hold
        # descriptors (300 stalled POSTs once used up a server's 256).
        if self._lingering:
            return
        small = self._declared is not None and self._declared <= LINGER_MIN_BYTES
        if stalled or (not sending and not small and self._body_wire < LINGER_MIN_BYTES):
            self.transport.close()
            return
        if not self.linger_slots.take():
            logger.debug(
                "closing a refused HTTP connection at once: %d others linger", self.linger_slots.held
            )
            self.transport.close()
            return
        self._linger_slot = True
        slow_small = small and not sending
        self._lingering = True
        if slow_small:
            # Only what it declared, and only for a few seconds: a trickle of
            # a few bytes must not hold a descriptor past the answer for long.
            assert self._declared is not None
            self._linger_left = max(0, self._declared - self._body_wire)
            self._linger_exact = True
        else:
            self._linger_left = self.max_body_bytes + LINGER_BYTES
        self.flow.resume_reading()
        transport = self.transport
        if transport.can_write_eof() and not transport.is_closing():
            transport.write_eof()
            self.loop.call_later(LINGER_SMALL_S if slow_small else LINGER_S, transport.close)
            self._arm_linger_idle()
        else:
            transport.close()

    def _arm_linger_idle(self) -> None:
        if self._linger_idle is not None:
            self._linger_idle.cancel()
        self._linger_idle = self.loop.call_later(LINGER_IDLE_S, self.transport.close)

    def _close_after_answer(self, cycle: Any) -> None:
        """uvicorn closes a connection after its answer (``Connection: close``): if that request's
        body is still arriving (the app answered before reading it: a refusal), linger instead."""
        if cycle is self.cycle and cycle.more_body and not self.transport.is_closing():
            self._linger()
        else:
            self.transport.close()

    def eof_received(self) -> None:
        if self._lingering:
            self.transport.close()
            return
        super().eof_received()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers bytes that are not HTTP itself and closes; an app
        # still running for that request (answering before it read the body)
        # must not send after it: it is told its client is gone, as _refuse
        # does, instead of h11 raising in it ("Exception in ASGI application").
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.response_started = cycle.response_complete = True
            cycle.disconnected = True
            cycle.message_event.set()
        super().send_400_response(msg)


class _AnswerTransport:
    """The transport as one request cycle sees it: its ``close`` asks the protocol first."""

    __slots__ = ("_close", "_transport")

    def __init__(self, transport: Any, close: Any) -> None:
        self._transport = transport
        self._close = close

    def close(self) -> None:
        self._close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _json_str(text: str) -> str:
    import json

    return json.dumps(text)


def h11_protocol(
    *, max_body_bytes: int, body_timeout_s: float, max_lingering: int = LINGER_MAX
) -> type[DeadlineH11Protocol]:
    """:class:`DeadlineH11Protocol` with these bounds (a class: uvicorn instantiates it per
    connection), its connections lingering ``max_lingering`` at a time at most."""
    return type(
        "DeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {
            "max_body_bytes": max_body_bytes,
            "body_timeout_s": body_timeout_s,
            "linger_slots": LingerSlots(max_lingering),
        },
    )


def transport_of(conn: Any) -> Any:
    """The asyncio transport under a Starlette ``WebSocket``/``Request``, or under an ASGI
    ``receive`` callable, where the ASGI server lets us see it; else None.

    ASGI hides it. Under uvicorn ``receive`` is a method of the connection's
    protocol object (websocket) or request cycle (HTTP), which holds it.
    """
    receive = getattr(conn, "_receive", conn)
    holder = getattr(receive, "__self__", None)
    return getattr(holder, "transport", None)


def abort_transport(conn: Any) -> bool:
    """Drop the TCP connection under ``conn`` (see :func:`transport_of`) at once, discarding
    what is buffered. Returns whether it could.

    ASGI has no abort: a client that stopped reading would otherwise keep its
    socket and the buffered bytes until the server's own close timer (10 s
    in uvicorn) or TCP's, which may be never.
    """
    abort = getattr(transport_of(conn), "abort", None)
    if abort is None:
        return False
    abort()
    return True


def abort_receive(receive: Receive) -> bool:
    """:func:`abort_transport` for an HTTP exchange, telling uvicorn its client is gone (no error log)."""
    holder = getattr(receive, "__self__", None)
    if holder is not None and hasattr(holder, "disconnected"):
        holder.disconnected = True
    return abort_transport(receive)


class _SendTimedOut(Exception):
    """A send to an HTTP client did not complete within send_timeout_s."""


class BoundedSend:
    """ASGI middleware: each ``send`` of an HTTP response completes within ``timeout_s``, or the
    client is cut off (see the module docstring). The app's own code unwinds through the send
    that timed out; the exchange ends quietly."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timeout = self.timeout_s

        async def bounded(message: Message) -> None:
            with anyio.move_on_after(timeout) as waited:
                await send(message)
            if waited.cancelled_caught:
                raise _SendTimedOut

        try:
            await self.app(scope, receive, bounded)
        except BaseException as exc:
            if not _timed_out(exc):
                raise
            logger.warning(
                "cutting off an HTTP client: a send was blocked for %g s (send_timeout_s)", timeout
            )
            abort_receive(receive)


def _timed_out(exc: BaseException) -> bool:
    # Raised through a task group (an event stream's), it arrives in an exception group.
    if isinstance(exc, _SendTimedOut):
        return True
    inner: Any = getattr(exc, "exceptions", None)
    return bool(inner) and all(_timed_out(e) for e in inner)
