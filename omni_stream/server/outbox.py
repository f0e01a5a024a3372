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

Pinning keeps a step's ``progress`` ahead of its preview even as entries are
replaced. A preview is put with ``pin_key=(request_id, "progress")``: the
progress still waiting for that step is pinned to it, so a newer progress can
no longer replace it (that would let the preview out before any progress of
its step); when the preview itself is replaced, its pinned progress goes with
it. Without pinning, ``[progress 3, preview 3]`` plus ``progress 4`` became
``[preview 3, progress 4]``: a preview of a step the client never saw.

So per request at most one pending preview, one progress pinned to it and one
latest progress wait, plus at most ``max_pending`` must-deliver entries in
all, each at most one encoded image. The socket's own write buffer is
bounded by websockets' ``write_limit``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import anyio

__all__ = ["Outbox", "OutboxItem", "OutboxOverflowError", "OutboxStatistics"]


class OutboxOverflowError(Exception):
    """Too many must-deliver messages are waiting: the client is not reading."""


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One message to send: ``data`` (text or binary) and its ``kind`` for metrics."""

    data: str | bytes
    kind: str
    must_deliver: bool


class _Entry:
    __slots__ = ("item", "key", "pinned")

    def __init__(self, item: OutboxItem, key: Hashable | None, pinned: int | None) -> None:
        self.item = item
        self.key = key  # latest_key while replaceable, else None
        self.pinned = pinned  # seq of the entry pinned to this one


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

    ``on_replaced(kind)`` is called for each entry replaced unsent (metrics);
    ``on_overflow()`` once, when it overflows.
    """

    def __init__(
        self,
        *,
        max_pending: int,
        on_replaced: Callable[[str], None] | None = None,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        """Raises ValueError when ``max_pending`` < 1."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._max_pending = max_pending
        self._on_replaced = on_replaced
        #: Called once when the outbox overflows, e.g. to interrupt a send
        #: that is blocked on the very client that stopped reading.
        self.on_overflow = on_overflow
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._by_key: dict[Hashable, int] = {}
        self._seq = 0
        self._pending_must = 0
        self._replaced = 0
        self._overflowed = False
        self._closed = False
        self._wakeup: anyio.Event | None = None

    def put(
        self,
        data: str | bytes,
        kind: str,
        *,
        latest_key: Hashable | None = None,
        pin_key: Hashable | None = None,
    ) -> None:
        """Queue one message without waiting.

        With ``latest_key`` the message may be replaced by a newer one with
        the same key before it is sent; without, it is must-deliver.
        ``pin_key`` pins the pending latest-wins entry with that key (if
        any) to this message (see the module docstring). Puts to a closed
        or overflowed outbox are ignored (the connection is going away).
        Never raises for a full outbox: it marks itself overflowed.
        """
        if self._closed or self._overflowed:
            return
        if latest_key is None and self._pending_must >= self._max_pending:
            self._overflowed = True
            self._wake()
            if self.on_overflow is not None:
                self.on_overflow()
            return
        pinned = self._by_key.pop(pin_key, None) if pin_key is not None else None
        if pinned is not None:
            self._entries[pinned].key = None  # no longer replaceable on its own
        if latest_key is None:
            self._pending_must += 1
            self._append(_Entry(OutboxItem(data, kind, True), None, pinned))
        else:
            old = self._by_key.pop(latest_key, None)
            if old is not None:
                self._drop(old)
            self._by_key[latest_key] = self._append(
                _Entry(OutboxItem(data, kind, False), latest_key, pinned)
            )
        self._wake()

    def discard(self, latest_key: Hashable) -> None:
        """Drop the unsent latest-wins entry with ``latest_key`` (and what it pinned), if any."""
        seq = self._by_key.pop(latest_key, None)
        if seq is not None:
            self._drop(seq)

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
        """The next message, or None when empty; raises like :meth:`get`."""
        if self._overflowed:
            raise OutboxOverflowError(f"more than {self._max_pending} must-deliver messages waiting")
        if not self._entries:
            if self._closed:
                raise anyio.EndOfStream
            return None
        _, entry = self._entries.popitem(last=False)
        if entry.key is not None:
            del self._by_key[entry.key]
        if entry.item.must_deliver:
            self._pending_must -= 1
        return entry.item

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

    def _append(self, entry: _Entry) -> int:
        self._seq += 1
        self._entries[self._seq] = entry
        return self._seq

    def _drop(self, seq: int | None) -> None:
        # Only latest-wins entries are ever dropped; a pinned progress goes
        # with the preview it was pinned to (if it is still unsent).
        while seq is not None:
            entry = self._entries.pop(seq, None)
            if entry is None:
                return
            self._replaced += 1
            if self._on_replaced is not None:
                self._on_replaced(entry.item.kind)
            seq = entry.pinned

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def __repr__(self) -> str:
        s = self.statistics()
        return f"Outbox(pending={s.pending}, must={s.pending_must}/{s.max_pending}, replaced={s.replaced})"
