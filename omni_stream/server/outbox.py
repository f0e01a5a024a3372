"""One client's bounded send path: an ordered outbox where the latest update wins.

Every message for a client goes through its :class:`Outbox`; one writer task
per connection drains it onto the socket. Producers (the per-request
consumers, the connection's reader) never wait on a client: ``put`` is
synchronous, so one stalled client cannot delay another, nor a generation.

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

import contextlib
import heapq
import itertools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import anyio

from .._wakeup import Wakeup
from ..errors import OutboxOverflowError
from ..params import positive_int

__all__ = [
    "MemoryBudget",
    "MemoryReservation",
    "Outbox",
    "OutboxItem",
    "OutboxOverflowError",
    "OutboxStatistics",
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
    """One message to send: ``data`` (text or binary) and its ``kind`` for metrics."""

    data: str | bytes
    kind: str
    must_deliver: bool


class _Entry:
    __slots__ = ("item", "key", "pinned", "since", "size")

    def __init__(self, item: OutboxItem, key: Hashable | None, pinned: int | None) -> None:
        self.item = item
        self.key = key  # latest_key while replaceable, else None
        self.pinned = pinned  # seq of the entry pinned to this one
        self.size = _size(item.data)
        #: Since when a message with this latest_key has waited unsent (kept
        #: across replacements: a client that never reads never resets it).
        self.since = time.monotonic()


def _size(data: str | bytes) -> int:
    # Server text messages are ASCII JSON (protocol.dumps escapes the rest),
    # so characters are bytes; encoding each one just to count would cost.
    return len(data)


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


class _Retained(Protocol):
    def evict_oldest_retained(self) -> bool: ...


class MemoryBudget:
    """Bytes the server holds, against ``limit`` (``max_memory_bytes``).

    Counted in ``used``: what waits in every :class:`Outbox` given this
    budget, plus what request records keep for ``attach`` replays (their
    latest progress, preview and terminal message). Counted in
    ``reserved``: what running requests are expected to hold outside the
    outboxes (their state in the engine, frames on their way to the
    consumer, preview and result rendering), as :class:`MemoryReservation`
    objects made at admission (``admission.reserve_memory``, which refuses a
    request that does not fit with ``busy``).

    A reservation has two parts: ``own`` bytes, and ``shared`` bytes that
    count only towards its batch ``group``: the engine steps one batch at a
    time, so of the groups only the largest counts, and within a group only
    its ``batch_size`` largest ``shared`` values (what one model call
    handles at most), summed and passed through the group's ``batch_cost``
    (bytes held for a batch of that many shared bytes; default: as many).

    While ``used + reserved`` is over the limit, new latest-wins previews are
    refused; when an addition takes it over, it sheds until under,
    deterministically: first every queued latest-wins preview; then, one at
    a time, the larger side gives way: held for requests (retained results
    plus reservations: the result that ended first is forgotten,
    :meth:`set_retained`) or queued (the connection holding the most queued
    bytes is closed, 1008: its outbox overflows). When that side is larger
    but only running requests hold it, shedding stops there. Must-deliver
    messages of a connection that stays open are never dropped. A message
    fanned out to several clients counts once per outbox.
    """

    def __init__(self, limit: int) -> None:
        """Raises ParamsError when ``limit`` < 1."""
        positive_int(limit, "limit")
        self.limit = limit
        self.used = 0
        # Weak: a budget outlives connections, and must not keep one alive.
        self._outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()
        self._retained: weakref.ref[_Retained] | None = None
        self._shedding = False
        # Reservations, by token (the budget holds no reference to them, so
        # one dropped without release() is released by its __del__).
        self._own: dict[int, int] = {}
        self._groups: dict[Hashable, dict[int, int]] = {}
        self._batch_size: dict[Hashable, int] = {}
        self._batch_cost: dict[Hashable, Callable[[int], int]] = {}
        self._own_total = 0
        self._reserved = 0
        self._tokens = itertools.count()

    def set_retained(self, source: _Retained) -> None:
        """Where ended retained results are evicted from (the request registry; held weakly)."""
        self._retained = weakref.ref(source)

    @property
    def reserved(self) -> int:
        """Bytes reserved by running requests (see the class docstring)."""
        return self._reserved

    @property
    def total(self) -> int:
        """``used + reserved``: what the limit bounds."""
        return self.used + self._reserved

    @property
    def reservations(self) -> int:
        """How many reservations are held."""
        return len(self._own)

    def over(self, extra: int = 0) -> bool:
        """Whether holding ``extra`` more bytes would be over the limit."""
        return self.used + self._reserved + extra > self.limit

    def add(self, n: int) -> None:
        """Count ``n`` bytes more; shed (see the class docstring) if that goes over."""
        self.used += n
        if self.used + self._reserved > self.limit:
            self._shed()

    def release(self, n: int) -> None:
        """Count ``n`` bytes fewer."""
        self.used -= n

    # -- reservations --------------------------------------------------------------

    def reserved_with(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
    ) -> int:
        """What ``reserved`` would be with one more reservation like this (``group`` None: alone)."""
        token = next(self._tokens)
        self._put(token, own, shared, group, batch_size, batch_cost)
        try:
            return self._reserved
        finally:
            self._drop_token(token, group)

    def fits(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
    ) -> bool:
        """Whether such a reservation keeps ``used + reserved`` within the limit."""
        reserved = self.reserved_with(
            own, shared, group=group, batch_size=batch_size, batch_cost=batch_cost
        )
        return self.used + reserved <= self.limit

    def reserve(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
        own_per_byte: float = 0.0,
        shared_per_byte: float = 0.0,
        frame_bytes: int = 0,
    ) -> MemoryReservation:
        """Count a running request's expected bytes until the reservation is released.

        Never refuses (``admission.reserve_memory`` checks :meth:`fits`
        first). ``group`` None: a group of its own. ``own_per_byte``,
        ``shared_per_byte`` and ``frame_bytes``: how
        :meth:`MemoryReservation.observe_frame` grows it when frames turn out
        larger than ``frame_bytes``.
        """
        token = next(self._tokens)
        if group is None:
            group = ("alone", token)
        self._put(token, own, shared, group, batch_size, batch_cost)
        return MemoryReservation(
            self, token, group, own, shared,
            own_per_byte=own_per_byte, shared_per_byte=shared_per_byte, frame_bytes=frame_bytes,
        )

    def _put(
        self,
        token: int,
        own: int,
        shared: int,
        group: Hashable | None,
        batch_size: int,
        batch_cost: Callable[[int], int] | None = None,
    ) -> None:
        if group is None:
            group = ("alone", token)
        self._own[token] = own
        self._own_total += own
        self._groups.setdefault(group, {})[token] = shared
        self._batch_size[group] = max(1, batch_size)
        if batch_cost is not None:
            self._batch_cost[group] = batch_cost
        self._recount()

    def _drop_token(self, token: int, group: Hashable | None) -> None:
        if group is None:
            group = ("alone", token)
        own = self._own.pop(token, None)
        if own is None:
            return
        self._own_total -= own
        members = self._groups.get(group)
        if members is not None:
            members.pop(token, None)
            if not members:
                del self._groups[group]
                self._batch_size.pop(group, None)
                self._batch_cost.pop(group, None)
        self._recount()

    def _recount(self) -> None:
        # The largest batch the engine could step: of each group its
        # batch_size largest shared parts; of the groups the largest.
        batch = 0
        for group, members in self._groups.items():
            size = self._batch_size.get(group, 1)
            values = members.values()
            part = sum(values) if len(members) <= size else sum(heapq.nlargest(size, values))
            cost = self._batch_cost.get(group)
            batch = max(batch, cost(part) if cost is not None else part)
        self._reserved = self._own_total + batch

    # -- shedding --------------------------------------------------------------

    def _register(self, outbox: Outbox) -> None:
        self._outboxes.add(outbox)

    def _unregister(self, outbox: Outbox) -> None:
        self._outboxes.discard(outbox)

    def _shed(self) -> None:
        if self._shedding:  # overflowing an outbox releases bytes, re-entering here
            return
        self._shedding = True
        try:
            for box in list(self._outboxes):
                box.shed_previews()
            while self.used + self._reserved > self.limit:
                queued = {box: box.pending_bytes for box in list(self._outboxes) if box.pending_bytes}
                queued_total = sum(queued.values())
                if self.used - queued_total + self._reserved >= queued_total:
                    if not self._evict_retained():
                        # Held by running requests: not the connections'
                        # doing. Previews stay refused until they end.
                        return
                else:
                    max(queued, key=queued.__getitem__).overflow(
                        "max_memory_bytes",
                        f"the server holds more than max_memory_bytes={self.limit} bytes",
                    )
        finally:
            self._shedding = False

    def _evict_retained(self) -> bool:
        source = self._retained() if self._retained is not None else None
        return source is not None and source.evict_oldest_retained()

    def __repr__(self) -> str:
        return (
            f"MemoryBudget(used={self.used}, reserved={self._reserved}, limit={self.limit}, "
            f"outboxes={len(self._outboxes)}, reservations={len(self._own)})"
        )


class MemoryReservation:
    """What one running request is expected to hold, counted in a :class:`MemoryBudget`.

    Made by :meth:`MemoryBudget.reserve`; ``release()`` (idempotent) gives
    the bytes back, and so does dropping the last reference to it
    unreleased. :meth:`observe_frame` grows it when the request's frames
    turn out larger than estimated at admission (never shrinks it).
    """

    __slots__ = (
        "_budget",
        "_group",
        "_own_base",
        "_own_per_byte",
        "_released",
        "_shared_per_byte",
        "_token",
        "frame_bytes",
        "own",
        "shared",
    )

    def __init__(
        self,
        budget: MemoryBudget,
        token: int,
        group: Hashable,
        own: int,
        shared: int,
        *,
        own_per_byte: float,
        shared_per_byte: float,
        frame_bytes: int,
    ) -> None:
        self._budget = budget
        self._token = token
        self._group = group
        self.own = own
        self.shared = shared
        self.frame_bytes = frame_bytes
        # What own is beyond its per-frame part (a fixed base per request).
        self._own_base = max(0, own - int(own_per_byte * frame_bytes))
        self._own_per_byte = own_per_byte
        self._shared_per_byte = shared_per_byte
        self._released = False

    @property
    def nbytes(self) -> int:
        """What the request reserves when it is alone in its batch."""
        cost = self._budget._batch_cost.get(self._group)
        return self.own + (cost(self.shared) if cost is not None else self.shared)

    @property
    def released(self) -> bool:
        return self._released

    def observe_frame(self, nbytes: int) -> None:
        """A frame of ``nbytes`` reached the server: grow the reservation if it is over the estimate.

        Growing may take the budget over its limit (the frame is already
        there): then queued previews give way, then retained results, as
        for an addition.
        """
        if self._released or nbytes <= self.frame_bytes:
            return
        self.frame_bytes = nbytes
        own = max(self.own, self._own_base + int(self._own_per_byte * nbytes))
        shared = max(self.shared, int(self._shared_per_byte * nbytes))
        if (own, shared) == (self.own, self.shared):
            return
        budget = self._budget
        size = budget._batch_size.get(self._group, 1)
        cost = budget._batch_cost.get(self._group)
        budget._drop_token(self._token, self._group)
        self.own, self.shared = own, shared
        budget._put(self._token, own, shared, self._group, size, cost)
        if budget.used + budget._reserved > budget.limit:
            budget._shed()

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        if self._released:
            return
        self._released = True
        self._budget._drop_token(self._token, self._group)

    def __del__(self) -> None:
        # Dropped unreleased (a caller that raised between reserving and
        # starting the request): give the bytes back. Nothing to do when the
        # interpreter is shutting down.
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"MemoryReservation(own={self.own}, shared={self.shared}, {state})"


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
        if self._closed or self._overflow is not None:
            return
        size = _size(data)
        must = latest_key is None
        since: float | None = None
        if must:
            if self._pending_must >= self._max_pending:
                self.overflow(
                    "max_pending", f"more than {self._max_pending} must-deliver messages waiting"
                )
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
        entry = _Entry(OutboxItem(data, kind, must), latest_key, pinned)
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
