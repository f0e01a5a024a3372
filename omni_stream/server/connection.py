"""One websocket client: its outbox, a reader and a writer, and how it is closed.

The reader hands each message to the server's ``dispatch`` (synchronous:
handling a message never waits, so the reader only ever waits on the
socket). The writer drains the :class:`Outbox` onto the socket; it is the
only task that ever waits on this client, bounded by ``send_timeout_s``, and
an overflowing outbox interrupts it. A client that stops reading is closed
with 1008; the close itself is bounded too (see :meth:`ClientConnection._close`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import anyio
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from . import protocol
from .limits import ServerLimits
from .metrics import ServerMetrics
from .outbox import Outbox, OutboxOverflowError

__all__ = ["ClientConnection"]

logger = logging.getLogger("omni_stream.server")


class ClientConnection:
    """One open websocket (see the module docstring); ``id`` is its owner identity."""

    def __init__(
        self,
        ws: ServerConnection,
        *,
        limits: ServerLimits,
        metrics: ServerMetrics,
        dispatch: Callable[[ClientConnection, str | bytes], None],
    ) -> None:
        self.id = uuid.uuid4().hex
        self.ws = ws
        self.remote = _remote(ws)
        self.outbox = Outbox(
            max_pending=limits.max_pending,
            on_replaced=lambda kind: metrics.messages_dropped.labels(kind).inc(),
            on_overflow=self._overflowed,
        )
        self._limits = limits
        self._metrics = metrics
        self._dispatch = dispatch
        # Set by close_soon: the writer closes the socket with it once drained.
        self._close_with: tuple[int, str] | None = None
        # The writer's current send: an overflowing outbox cancels it, since a
        # writer blocked on a client that stopped reading would never notice.
        self._send_scope: anyio.CancelScope | None = None

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
            self.outbox.close()

    def close_soon(self, code: int, reason: str) -> None:
        """Send what is queued, then close with ``code`` and ``reason``; accept no more."""
        self._close_with = (code, reason)
        self.outbox.close()

    def close_text(self) -> str:
        code = self.ws.close_code
        return "no close frame" if code is None else f"{code} {self.ws.close_reason or ''}".strip()

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                self._dispatch(self, data)
        except ConnectionClosed:
            pass

    async def _write(self) -> None:
        sent = self._metrics.messages_sent
        timeout = self._limits.send_timeout_s
        try:
            while True:
                try:
                    item = await self.outbox.get()
                except anyio.EndOfStream:
                    if self._close_with is not None:
                        await self._close(*self._close_with)
                    return
                except OutboxOverflowError as exc:
                    await self._close_slow(f"client not reading: {exc}")
                    return
                # One scope for both ways a send ends early: its deadline (the
                # client stopped reading) and an overflowing outbox, which
                # cancels it (_overflowed). One scope, not two, a message.
                with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                    self._send_scope = scope
                    try:
                        await self.ws.send(item.data)
                    finally:
                        self._send_scope = None
                if scope.cancelled_caught:
                    if self.outbox.overflowed:
                        continue  # get() raises OutboxOverflowError next
                    await self._close_slow(f"client not reading: a send was blocked for {timeout:g} s")
                    return
                sent.labels(item.kind).inc()
        except ConnectionClosed:
            return

    def _overflowed(self) -> None:
        if self._send_scope is not None:
            self._send_scope.cancel()

    async def _close_slow(self, reason: str) -> None:
        logger.warning("closing connection %s from %s: %s", self.id, self.remote, reason)
        self._metrics.slow_client_disconnects.inc()
        self.outbox.close()
        # A close reason must fit a control frame (123 bytes).
        await self._close(protocol.CLOSE_POLICY_VIOLATION, reason[:120])

    async def _close(self, code: int, reason: str) -> None:
        # websockets' close() first waits, without a bound, to flush the
        # close frame: for a client that stopped reading, that is forever.
        # Bound it, then drop the TCP connection.
        with anyio.move_on_after(self._limits.close_timeout_s):
            await self.ws.close(code, reason)
        if self.ws.state is not State.CLOSED:
            self.ws.transport.abort()

    def __repr__(self) -> str:
        return f"ClientConnection({self.id!r}, {self.remote}, {self.outbox!r})"


def _remote(ws: ServerConnection) -> str:
    addr = ws.remote_address
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
