"""One client's bounded send path: an ordered outbox where the latest update wins.

Every message for a client goes through its :class:`Outbox`; one writer task
per connection drains it onto the socket. Producers (the per-request
consumers, the connection's reader) never wait on a client: ``put`` is
synchronous, so one stalled client cannot delay another, nor a generation.

Two kinds of entry:

- must-deliver (``accepted``, final previews, ``done``, ``cancelled``,
  ``error``): kept in order, never dropped. At most ``max_pending`` may wait;
  one more marks the outbox *overflowed*, and the writer's next ``get``
  raises :class:`OutboxOverflowError` so the connection is closed (1008)
  instead of buffering without bound for a client that stopped reading.
- latest-wins (intermediate ``progress`` and previews), put with a
  ``latest_key`` such as ``(request_id, "preview")``: a newer entry with the
  same key removes the unsent older one and goes to the back of the queue.
  Moving to the back (rather than taking the old slot) is what keeps a step's
  ``progress`` ahead of its preview: both are always enqueued in that order.

So at most ``max_pending`` + (2 x requests watched) entries wait, each at
most one encoded image. The socket's own write buffer is bounded by
websockets' ``write_limit``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import anyio

__all__ = ["Outbox", "OutboxItem", "OutboxStatistics", "OutboxOverflowError"]


class OutboxOverflowError(Exception):
    """Too many must-deliver messages are waiting: the client is not reading."""


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One message to send: ``data`` (text or binary) and its ``kind`` for metrics."""

    data: str | bytes
    kind: str
    must_deliver: bool


@dataclass(frozen=True, slots=True)
class OutboxStatistics:
    """A snapshot of an outbox."""

    pending: int  #: entries waiting, of both kinds
    pending_must: int  #: must-deliver entries waiting
    replaced: int  #: latest-wins entries removed unsent by a newer one, ever
    max_pending: int
    overflowed: bool
    closed: bool


class Outbox:
    """Ordered, bounded, latest-wins queue for one client (see the module docstring).

    ``on_replaced(kind)`` is called for each entry replaced unsent (metrics).
    """

    def __init__(
        self, *, max_pending: int, on_replaced: Callable[[str], None] | None = None
    ) -> None:
        """Raises ValueError when ``max_pending`` < 1."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._max_pending = max_pending
        self._on_replaced = on_replaced
        self._entries: OrderedDict[int, tuple[OutboxItem, Hashable | None]] = OrderedDict()
        self._by_key: dict[Hashable, int] = {}
        self._seq = 0
        self._pending_must = 0
        self._replaced = 0
        self._overflowed = False
        self._closed = False
        self._wakeup: anyio.Event | None = None

    def put(self, data: str | bytes, kind: str, *, latest_key: Hashable | None = None) -> None:
        """Queue one message without waiting.

        With ``latest_key`` the message may be replaced by a newer one with
        the same key before it is sent; without, it is must-deliver. Puts to
        a closed or overflowed outbox are ignored (the connection is going
        away). Never raises for a full outbox: it marks itself overflowed.
        """
        if self._closed or self._overflowed:
            return
        if latest_key is None:
            if self._pending_must >= self._max_pending:
                self._overflowed = True
                self._wake()
                return
            self._pending_must += 1
            self._append(OutboxItem(data, kind, True), None)
        else:
            old = self._by_key.pop(latest_key, None)
            if old is not None:
                replaced, _ = self._entries.pop(old)
                self._replaced += 1
                if self._on_replaced is not None:
                    self._on_replaced(replaced.kind)
            self._by_key[latest_key] = self._append(OutboxItem(data, kind, False), latest_key)
        self._wake()

    def discard(self, latest_key: Hashable) -> None:
        """Drop the unsent latest-wins entry with ``latest_key``, if any."""
        seq = self._by_key.pop(latest_key, None)
        if seq is not None:
            del self._entries[seq]

    async def get(self) -> OutboxItem:
        """Wait for the next message, oldest first.

        Raises OutboxOverflowError once the outbox overflowed (before any
        further message: the client is disconnected promptly), and
        anyio.EndOfStream when it is closed and empty.
        """
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            self._wakeup = anyio.Event()
            await self._wakeup.wait()

    def get_nowait(self) -> OutboxItem | None:
        """The next message, or None when empty (for tests and draining); raises like ``get``."""
        if self._overflowed:
            raise OutboxOverflowError(f"more than {self._max_pending} must-deliver messages waiting")
        if not self._entries:
            if self._closed:
                raise anyio.EndOfStream
            return None
        _, (item, key) = self._entries.popitem(last=False)
        if key is not None:
            del self._by_key[key]
        else:
            self._pending_must -= 1
        return item

    def close(self) -> None:
        """Accept no more messages; ``get`` drains what is queued, then raises EndOfStream."""
        self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def overflowed(self) -> bool:
        return self._overflowed

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> OutboxStatistics:
        return OutboxStatistics(
            pending=len(self._entries),
            pending_must=self._pending_must,
            replaced=self._replaced,
            max_pending=self._max_pending,
            overflowed=self._overflowed,
            closed=self._closed,
        )

    def _append(self, item: OutboxItem, key: Hashable | None) -> int:
        self._seq += 1
        self._entries[self._seq] = (item, key)
        return self._seq

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def __repr__(self) -> str:
        s = self.statistics()
        return f"Outbox(pending={s.pending}, must={s.pending_must}/{s.max_pending}, replaced={s.replaced})"
