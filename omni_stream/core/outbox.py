"""One client's bounded send path: an ordered outbox where the latest update wins.

Every message for a client goes through its :class:`Outbox`, as the
message object (a ``protocol`` server message or a ``protocol.Preview``);
one writer task per connection drains it onto the socket (a websocket sends
each one's ``wire``, encoded once for every watcher; an event stream or an
OpenAI door reads its fields). Producers (the per-request consumers, the
connection's reader) never wait on a client: ``put`` is synchronous, so one
stalled client cannot delay another, nor a generation. Sizes are the
messages' wire lengths.

Two kinds of entry:

- must-deliver (``accepted``, final previews, ``done``, ``cancelled``,
  ``error``): kept in order, never dropped. At most ``max_pending`` may wait,
  holding at most ``max_pending_bytes`` (one message alone may be larger:
  a result is never refused to a client that has nothing else waiting); one
  more marks the outbox *overflowed*, and the writer's next ``get`` raises
  :class:`OutboxOverflowError` so the connection is closed (1008) instead of
  buffering without bound for a client that stopped reading.
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

Bytes: when a put would take the queued bytes over ``max_pending_bytes``,
unsent latest-wins previews (kind ``"preview"``) give way, oldest first, with
what they pinned; a new preview that still does not fit is dropped itself
(unless nothing else waits: one message alone may be larger than the bound).
Only previews are shed for bytes: a progress is tiny, and dropping one alone
could let its step's preview out without it. A :class:`MemoryBudget` shared by
every outbox and request record bounds the server's total the same way
(see its docstring).

So per request at most one pending preview, one progress pinned to it and one
latest progress wait, plus at most ``max_pending`` must-deliver entries in
all, each at most one encoded image. The socket's own write buffer is
bounded by websockets' ``write_limit``. An outbox that overflows, or is
:meth:`~Outbox.abort`-ed when its connection ends, frees what it queued at
once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import anyio

from .._wakeup import Wakeup
from ..errors import OutboxOverflowError
from ..params import positive_int
from ..protocol import Preview, ServerMessage
from .memory import MemoryBudget, MemoryReservation

# MemoryBudget and MemoryReservation (memory.py's) are re-exported: outboxes
# report to the budget, and callers long imported them from here.
#: What an outbox queues: a text message or a preview, each encoding its wire form once.
Outgoing = ServerMessage | Preview

__all__ = [
    "MemoryBudget",
    "MemoryReservation",
    "Outbox",
    "OutboxItem",
    "OutboxOverflowError",
    "OutboxStatistics",
    "Outgoing",
]

#: Must-deliver messages up to this size count against ``max_pending``
#: only, not against the byte bound (see ``put``): text messages are smaller.
_SMALL_MESSAGE_BYTES = 64 * 1024

#: The only latest-wins kind shed for bytes (see the module docstring).
_SHEDDABLE = "preview"
#: The most must-deliver messages one client message queues: an attach's
#: ``accepted``, final preview and terminal message (see :meth:`Outbox.has_room`).
_REPLY_RESERVE = 3


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One message to send: the message object, its ``kind`` (metrics) and whether it must go.

    The websocket writer sends ``message.wire``; the other doors read the
    message's fields (SSE, the OpenAI doors).
    """

    message: Outgoing
    must_deliver: bool

    @property
    def kind(self) -> str:
        return self.message.kind


class _Entry:
    __slots__ = ("item", "key", "pinned", "since", "size")

    def __init__(self, item: OutboxItem, key: Hashable | None, pinned: int | None) -> None:
        self.item = item
        self.key = key  # latest_key while replaceable, else None
        self.pinned = pinned  # seq of the entry pinned to this one
        self.size = _size(item.message)
        #: Since when a message with this latest_key has waited unsent (kept
        #: across replacements: a client that never reads never resets it).
        self.since = time.monotonic()


def _size(message: Outgoing) -> int:
    # Its wire form, encoded once and shared by every outbox it goes to.
    # Server text messages are ASCII JSON (protocol.dumps escapes the rest),
    # so characters are bytes; encoding each one just to count would cost.
    return len(message.wire)


@dataclass(frozen=True, slots=True)
class OutboxStatistics:
    """A snapshot of an outbox."""

    pending: int  #: entries waiting, of both kinds
    pending_must: int  #: must-deliver entries waiting
    pending_bytes: int  #: bytes of the entries waiting, of both kinds
    pending_must_bytes: int  #: bytes of the must-deliver entries waiting
    replaced: int  #: latest-wins entries removed unsent (replaced or shed), ever
    max_pending: int
    max_pending_bytes: int
    overflowed: bool
    closed: bool


class Outbox:
    """Ordered, bounded, latest-wins queue for one client (see the module docstring).

    ``on_replaced(kind)`` is called for each entry removed unsent (replaced
    or shed; metrics); ``on_overflow()`` once, when it overflows. With a
    ``budget``, queued bytes count against the server's :class:`MemoryBudget`.
    """

    def __init__(
        self,
        *,
        max_pending: int,
        max_pending_bytes: int = 64 << 20,
        budget: MemoryBudget | None = None,
        on_replaced: Callable[[str], None] | None = None,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        """Raises ParamsError when ``max_pending`` or ``max_pending_bytes`` < 1."""
        positive_int(max_pending, "max_pending")
        positive_int(max_pending_bytes, "max_pending_bytes")
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._budget = budget
        self._on_replaced = on_replaced
        #: Called once when the outbox overflows, e.g. to interrupt a send
        #: that is blocked on the very client that stopped reading.
        self.on_overflow = on_overflow
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._by_key: dict[Hashable, int] = {}
        self._seq = 0
        self._pending_must = 0
        self._bytes = 0
        self._must_bytes = 0
        self._replaced = 0
        self._overflow: OutboxOverflowError | None = None
        self._closed = False
        # Wakes the writer (get) / a reader waiting for room (wait_for_room).
        self._wakeup = Wakeup()
        self._room = Wakeup()
        if budget is not None:
            budget._register(self)

    def put(
        self,
        message: Outgoing,
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
        if self._closed or self._overflow is not None:
            return
        size = _size(message)
        kind = message.kind
        must = latest_key is None
        since: float | None = None
        if must:
            if self._pending_must >= self._max_pending:
                self.overflow("max_pending", f"more than {self._max_pending} must-deliver messages waiting")
                return
            # Small messages (accepted, done, errors) are bounded by their
            # count above: one behind an oversize result (a big video) must
            # not close a client that reads, and lose the result with it.
            if (
                size > _SMALL_MESSAGE_BYTES
                and self._pending_must
                and self._must_bytes + size > self._max_pending_bytes
            ):
                self.overflow(
                    "max_pending_bytes",
                    f"more than {self._max_pending_bytes} bytes of must-deliver messages waiting",
                )
                return
        else:
            old = self._by_key.pop(latest_key, None)
            if old is not None:
                since = self._entries[old].since
                self._drop(old)
            if kind == _SHEDDABLE and self._budget is not None and self._budget.over(size):
                # The server is short of memory: previews are what gives way.
                self._count_dropped(kind)
                return
        if self._bytes + size > self._max_pending_bytes:
            self._shed_previews(self._bytes + size - self._max_pending_bytes)
            fits = not self._bytes or self._bytes + size <= self._max_pending_bytes
            if kind == _SHEDDABLE and not must and not fits:
                self._count_dropped(kind)  # it does not fit beside what must be delivered
                return
        pinned = self._by_key.pop(pin_key, None) if pin_key is not None else None
        if pinned is not None:
            self._entries[pinned].key = None  # no longer replaceable on its own
        entry = _Entry(OutboxItem(message, must), latest_key, pinned)
        if since is not None:
            entry.since = since
        seq = self._append(entry)
        if must:
            self._pending_must += 1
            self._must_bytes += size
        else:
            self._by_key[latest_key] = seq
        self._wake()
        if self._budget is not None:
            self._budget.add(size)  # last: it may shed this very outbox

    def held_since(self, latest_key: Hashable) -> float | None:
        """Since when (``time.monotonic()``) messages with ``latest_key`` have waited unsent.

        Newer ones replacing older ones keep the time of the first: a
        client that never reads never resets it. None when none waits.
        """
        seq = self._by_key.get(latest_key)
        return None if seq is None else self._entries[seq].since

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
            await self._wakeup.wait()

    def get_nowait(self) -> OutboxItem | None:
        """The next message, or None when empty; raises like :meth:`get`."""
        if self._overflow is not None:
            raise self._overflow
        if not self._entries:
            if self._closed:
                raise anyio.EndOfStream
            return None
        _, entry = self._entries.popitem(last=False)
        if entry.key is not None:
            del self._by_key[entry.key]
        self._forget(entry)
        if entry.item.must_deliver:
            self._pending_must -= 1
            self._must_bytes -= entry.size
            self._room.wake()
        return entry.item

    def has_room(self) -> bool:
        """Whether the reply to one more client message fits without overflowing (as far as known).

        True when nothing must-deliver waits, or there is room for
        ``_REPLY_RESERVE`` more must-deliver messages and under half
        ``max_pending_bytes`` of them wait; also once closed or overflowed
        (puts are ignored then).
        """
        if self._closed or self._overflow is not None or not self._pending_must:
            return True
        return (
            self._pending_must + _REPLY_RESERVE <= self._max_pending
            and self._must_bytes <= self._max_pending_bytes // 2
        )

    async def wait_for_room(self) -> None:
        """Wait until a must-deliver entry is taken, or the outbox closes or overflows."""
        if self._closed or self._overflow is not None:
            return
        await self._room.wait()

    def shed_previews(self) -> None:
        """Drop every unsent latest-wins preview (with what it pinned); the budget's first resort."""
        self._shed_previews(None)

    def overflow(self, limit: str, message: str) -> None:
        """Mark the outbox overflowed over ``limit`` and free everything queued.

        The writer's next ``get`` raises OutboxOverflowError(message, limit=limit);
        ``on_overflow`` is called. Ignored once overflowed.
        """
        if self._overflow is not None:
            return
        self._overflow = OutboxOverflowError(message, limit=limit)
        self._clear()
        self._wake()
        if self.on_overflow is not None:
            self.on_overflow()

    def close(self) -> None:
        """Accept no more messages; ``get`` drains what is queued, then raises EndOfStream."""
        self._closed = True
        self._wake()

    def abort(self) -> None:
        """Close and free everything queued at once: the connection is gone.

        Also drops ``on_overflow`` (typically a bound method of the
        connection, which holds this outbox: a reference cycle that only the
        cyclic GC would otherwise free, queued messages and all).
        """
        self._closed = True
        self._clear()
        self.on_overflow = None
        if self._budget is not None:
            self._budget._unregister(self)
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def overflowed(self) -> bool:
        return self._overflow is not None

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> OutboxStatistics:
        return OutboxStatistics(
            pending=len(self._entries),
            pending_must=self._pending_must,
            pending_bytes=self._bytes,
            pending_must_bytes=self._must_bytes,
            replaced=self._replaced,
            max_pending=self._max_pending,
            max_pending_bytes=self._max_pending_bytes,
            overflowed=self.overflowed,
            closed=self._closed,
        )

    def _append(self, entry: _Entry) -> int:
        self._seq += 1
        self._entries[self._seq] = entry
        self._bytes += entry.size
        return self._seq

    def _forget(self, entry: _Entry) -> None:
        # Every entry leaves through here (sent, replaced, shed or cleared).
        self._bytes -= entry.size
        if self._budget is not None:
            self._budget.release(entry.size)

    def _drop(self, seq: int | None) -> None:
        # Only latest-wins entries are ever dropped; a pinned progress goes
        # with the preview it was pinned to (if it is still unsent).
        while seq is not None:
            entry = self._entries.pop(seq, None)
            if entry is None:
                return
            self._forget(entry)
            self._count_dropped(entry.item.kind)
            seq = entry.pinned

    def _shed_previews(self, needed: int | None) -> None:
        # Oldest first; ``needed`` None sheds them all. Only entries still
        # keyed (not pinned to a later one) are dropped, with their pins.
        freed = 0
        for seq, entry in list(self._entries.items()):
            if needed is not None and freed >= needed:
                return
            if entry.key is None or entry.item.kind != _SHEDDABLE or seq not in self._entries:
                continue
            before = self._bytes
            del self._by_key[entry.key]
            self._drop(seq)
            freed += before - self._bytes

    def _count_dropped(self, kind: str) -> None:
        self._replaced += 1
        if self._on_replaced is not None:
            self._on_replaced(kind)

    def _clear(self) -> None:
        for entry in self._entries.values():
            self._forget(entry)
        self._entries.clear()
        self._by_key.clear()
        self._pending_must = 0
        self._must_bytes = 0
        self._room.wake()

    def _wake(self) -> None:
        self._wakeup.wake()
        if self._closed or self._overflow is not None:
            self._room.wake()

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"Outbox(pending={s.pending}, must={s.pending_must}/{s.max_pending}, "
            f"bytes={s.pending_bytes}, replaced={s.replaced})"
        )
