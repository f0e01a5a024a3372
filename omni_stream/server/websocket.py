"""The websocket door: one client's outbox, a reader and a writer, and how it is closed.

The reader hands each message to the core (``Service.receive``: parsed,
its input images decoded off the loop, acted on by the rules; handling a
message never waits on another client), then gives the writer a turn, and
reads the next message only once its principal is within its rate
(``Rules.pace``: max_messages_per_s per principal, shared by all its
connections) and the outbox has room for its reply (backpressure: a client
bursting messages it does read the replies of is slowed down, never
closed). The writer drains the :class:`Outbox` onto the socket; it is the
only task that ever waits on this client, bounded by ``send_timeout_s``, and
an overflowing outbox interrupts it. A client that stops reading is closed
with 1008; the close itself is bounded too (see :meth:`ClientConnection._close`).
When the connection ends, its outbox is aborted: whatever was still queued
is freed at once, not when the cyclic GC next runs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import protocol
from ..core.limits import ServerLimits
from ..core.outbox import OutboxOverflowError, Outgoing
from ..core.principal import Principal
from ..core.rates import COST_BYTES, message_cost
from ..core.rules import Client, Rules
from .http11 import abort_transport, transport_of

if TYPE_CHECKING:
    from .service import Service

# COST_BYTES, message_cost (core/rates.py) and transport_of, abort_transport
# (http11.py) are re-exported: they were defined here before.
__all__ = ["COST_BYTES", "ClientConnection", "abort_transport", "message_cost", "transport_of"]

#: How long the writer may be stuck in one send to a paused socket before the
#: reader stops waiting for room (the client is then taken as not reading).
_STALL_GRACE_S = 2.0

logger = logging.getLogger("omni_stream.server")


class _Closed(Exception):
    """The socket is closed (by the client, the network, or us)."""


class ClientConnection:
    """One open (accepted) websocket (see the module docstring), a client of the core while it is open.

    ``principal``: who it is (its token's, else its own connection).
    Registers itself with ``rules`` (the caller checked
    ``rules.connection_refusal`` first); the caller disconnects it.
    """

    def __init__(self, ws: WebSocket, *, rules: Rules, service: Service, principal: Principal) -> None:
        self.ws = ws
        self.remote = _remote(ws)
        self.client: Client = rules.connect(principal, "websocket")
        self.outbox = rules.open_outbox(self.client, on_overflow=self._overflowed)
        #: The client's id: the owner of the requests it starts.
        self.id = self.client.id
        self._rules = rules
        self._service = service
        self._limits = rules.limits
        self._metrics = rules.metrics
        # Set by close_soon: the writer closes the socket with it once drained.
        self._close_with: tuple[int, str] | None = None
        # The writer's current send: an overflowing outbox cancels it, since a
        # writer blocked on a client that stopped reading would never notice.
        self._send_scope: anyio.CancelScope | None = None
        #: When the send in progress began (loop clock), None between sends.
        self._send_started: float | None = None
        #: The close code and reason, once known (for the log).
        self._closed_with: tuple[int, str] | None = None

    async def run(self) -> None:
        """Read and write until the websocket closes; never raises for this client's faults.

        A bug here is logged and the client closed with 1011, so one
        connection cannot take the server down.
        """
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write)
                await self._read()
                tg.cancel_scope.cancel()
        except Exception:
            logger.exception("connection %s from %s failed", self.id, self.remote)
            await self._close(protocol.CLOSE_INTERNAL_ERROR, "internal error")
        finally:
            # Nothing queued can be sent any more: free it now. This also
            # breaks the outbox -> on_overflow -> self cycle.
            self.outbox.abort()
            self._send_scope = None

    def close_soon(self, code: int, reason: str) -> None:
        """Send what is queued, then close with ``code`` and ``reason``; accept no more."""
        self._close_with = (code, reason)
        self.outbox.close()

    def close_text(self) -> str:
        if self._closed_with is None:
            return "no close frame"
        code, reason = self._closed_with
        return f"{code} {reason}".strip()

    async def _read(self) -> None:
        while True:
            try:
                message = await self.ws.receive()
            except (RuntimeError, OSError):  # receive after the disconnect
                return
            if message["type"] == "websocket.disconnect":
                if self._closed_with is None:
                    self._closed_with = (int(message.get("code") or 1005), str(message.get("reason") or ""))
                return
            data: str | bytes | None = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            await self._handle(data)
            # max_messages_per_s per principal: past it, the next message is read later.
            delay = self._rules.pace(self.client, len(data))
            if delay > 0.0:
                await anyio.sleep(delay)

    async def _handle(self, data: str | bytes) -> None:
        """One message the client sent: to the core (a protocol other than ours overrides it)."""
        await self._service.receive(self.client, data)
        # The server may hand over messages it already received without
        # yielding: without this turn, a burst of messages in one TCP
        # write queued every reply before the writer sent the first.
        await anyio.lowlevel.checkpoint()
        await self._wait_for_room()

    async def _wait_for_room(self) -> None:
        # Backpressure: read the next message only once its reply fits; the
        # client's further messages wait in the server's receive queue (the
        # ASGI server stops reading the socket while one is unread), then in
        # TCP. A send waits while the transport's buffer is full, also for a
        # client that reads (a large preview), so a waiting writer alone does
        # not mean "not reading": only one stuck in the same send for a grace
        # period does. Then this stops waiting, the client's next reply
        # overflows the outbox and it is closed (1008) at once, rather than
        # after send_timeout_s.
        grace = min(_STALL_GRACE_S, self._limits.send_timeout_s)
        while not self.outbox.has_room():
            started = self._send_started
            if started is not None and anyio.current_time() - started >= grace:
                return
            with anyio.move_on_after(grace / 4):
                await self.outbox.wait_for_room()

    def _greeting(self) -> list[str | bytes]:
        """Frames sent first, before any message (none in our protocol)."""
        return []

    def _frames(self, message: Outgoing) -> list[str | bytes]:
        """The frames that carry ``message``: its wire form, encoded once for every watcher (a
        protocol other than ours, ComfyUI's, overrides it)."""
        return [message.wire]

    async def _write(self) -> None:
        sent = self._metrics.messages_sent
        try:
            if await self._send_frames(self._greeting()) == "closed":
                return
            while True:
                try:
                    item = await self.outbox.get()
                except anyio.EndOfStream:
                    if self._close_with is not None:
                        await self._close(*self._close_with)
                    return
                except OutboxOverflowError as exc:
                    await self._close_slow(self._overflow_reason(exc))
                    return
                outcome = await self._send_frames(self._frames(item.message))
                if outcome == "closed":
                    return
                if outcome == "sent":
                    sent.labels(item.kind).inc()
                # "cut": the outbox overflowed mid-send; get() raises OutboxOverflowError next.
        except _Closed:
            return
        finally:
            # A reader waiting for room must not wait on a writer that is gone.
            self.outbox.close()

    async def _send_frames(self, frames: list[str | bytes]) -> Literal["sent", "cut", "closed"]:
        """Send one message's frames within one ``send_timeout_s``: ``sent``; ``cut`` when an
        overflowing outbox cancelled the send (_overflowed); ``closed`` when the client was closed
        for not reading within the bound."""
        if not frames:
            return "sent"
        timeout = self._limits.send_timeout_s
        # One scope for both ways a send ends early: its deadline (the client stopped
        # reading) and an overflowing outbox, which cancels it. One scope, not two, a message.
        with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
            self._send_scope = scope
            self._send_started = anyio.current_time()
            try:
                for frame in frames:
                    await self._send(frame)
            finally:
                self._send_scope = None
                self._send_started = None
        if not scope.cancelled_caught:
            return "sent"
        if self.outbox.overflowed:
            return "cut"
        await self._close_slow(f"client not reading: a send was blocked for {timeout:g} s")
        return "closed"

    def _overflow_reason(self, exc: OutboxOverflowError) -> str:
        # Short enough for a close frame (123 bytes): the limit, its value, its variable.
        limit = exc.limit
        where = f"{limit}={getattr(self._limits, limit, '?')} ({ServerLimits.env_name(limit)})"
        if limit == "max_memory_bytes":
            return f"client not reading: server over {where}"
        return f"client not reading: over {where}"

    def _overflowed(self) -> None:
        if self._send_scope is not None:
            self._send_scope.cancel()

    async def _close_slow(self, reason: str) -> None:
        logger.warning("closing connection %s from %s: %s", self.id, self.remote, reason)
        self._metrics.slow_client_disconnects.inc()
        self.outbox.close()
        # A close reason must fit a control frame (123 bytes).
        await self._close(protocol.CLOSE_POLICY_VIOLATION, reason[:120])

    async def _send(self, data: str | bytes) -> None:
        message: dict[str, Any] = {"type": "websocket.send"}
        message["text" if isinstance(data, str) else "bytes"] = data
        try:
            await self.ws.send(message)
        except (WebSocketDisconnect, OSError, RuntimeError) as exc:
            # RuntimeError: Starlette's "send after close" (the reader saw the
            # disconnect first); OSError: the ASGI server's ClientDisconnected.
            raise _Closed from exc

    async def _close(self, code: int, reason: str) -> None:
        # A close waits, like any send, for room in the transport's buffer:
        # for a client that stopped reading, that is forever. Bound it, then
        # drop the TCP connection.
        if self._closed_with is None:
            self._closed_with = (code, reason)
        closed = False
        with anyio.move_on_after(self._limits.close_timeout_s):
            with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
                await self.ws.send({"type": "websocket.close", "code": code, "reason": reason})
            closed = True
        if not closed:
            abort_transport(self.ws)

    def __repr__(self) -> str:
        return f"ClientConnection({self.id!r}, {self.remote}, {self.outbox!r})"


def _remote(ws: WebSocket) -> str:
    client = ws.client
    return f"{client.host}:{client.port}" if client is not None else "unknown"
