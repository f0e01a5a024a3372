"""PinnedBufferPool: fixed-size host buffers reused by shape and dtype, leased for copies, lent to readers.

A buffer is leased for one frame: the copier leases it on the producer
thread, the device copies into it, and once the copy's event completed the
copier either gives it back (:meth:`release`, after cloning a small frame)
or **lends** it (:meth:`lend`): the reader's frame *is* the buffer, and the
buffer returns to the pool by itself when the last reference to that frame
(and to every view of it) is gone. A large frame is then copied once, by the
device, instead of a second time on the host: that second copy, into a fresh
allocation that faults in every page, ran at 5% of the link's speed.

What is never done: a lease whose copy is still in flight is not released
(that raises) nor lent, because a late copy would overwrite whoever had the
buffer next; this holds even when the lease's own request was cancelled or
timed out: the copier still waits for the event first. A lent buffer is not
reused while any tensor refers to its memory.

Bounds: at most ``max_buffers`` buffers exist (leased, lent or free); when
every one is leased or lent, :meth:`acquire` waits (backpressure on the
producer from copies in flight). Lending is capped so that it never starves
copies: at most ``max_lent`` buffers are lent at a time in all, and at most
``max_lent_per_owner`` to one owner (a request); past either, :meth:`lend`
says no and the caller copies the frame instead. So a reader that keeps its
frames gets copies once it holds its share, and other requests still get
buffers.

Pinned allocation is slow (``cudaHostAlloc`` takes milliseconds and
serialises with the device), so buffers are kept and reused; when the pool
is full and a new shape is asked for, a free buffer of another shape is
freed to make room. Each buffer keeps the event of its last copy, which the
device records again for the next one (an event a frame costs a driver call
to create and one to destroy).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PoolClosedError
from ..params import positive_int
from .base import CopyEvent

__all__ = ["BufferLease", "PinnedBufferPool", "PoolStatistics", "PoolClosedError"]

_Key = tuple[tuple[int, ...], torch.dtype]
# A free buffer and the event of its last copy (None before its first).
_Slot = tuple[torch.Tensor, "CopyEvent | None"]
# How long a waiting acquire sleeps before it looks again for buffers given
# back: a frame collected on the waiting thread itself cannot wake it.
_RECHECK_S = 0.05


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """``buffers_in_use``: leased (a copy issued or about to be); ``buffers_lent``: frames readers hold."""

    buffers_total: int
    buffers_in_use: int
    buffers_in_flight: int
    max_buffers: int
    buffers_lent: int = 0


class BufferLease:
    """One leased buffer; ``event`` is the event of the copy into it (or of its last one)."""

    __slots__ = ("buffer", "key", "event", "_released")

    def __init__(self, buffer: torch.Tensor, key: _Key, event: CopyEvent | None = None) -> None:
        self.buffer = buffer
        self.key = key
        self.event = event
        self._released = False

    @property
    def in_flight(self) -> bool:
        return self.event is not None and not self.event.query()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class PinnedBufferPool:
    """Thread-safe pool of host buffers; see the module docstring."""

    def __init__(
        self,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        *,
        max_buffers: int = 64,
        max_lent: int | None = None,
        max_lent_per_owner: int = 4,
    ) -> None:
        """``max_lent`` defaults to half of ``max_buffers``; 0 lends nothing."""
        positive_int(max_buffers, "max_buffers")
        if max_lent is None:
            max_lent = max_buffers // 2
        if not isinstance(max_lent, int) or not 0 <= max_lent < max_buffers:
            raise ValueError(
                f"max_lent must be an int from 0 to max_buffers - 1 ({max_buffers - 1}), got {max_lent!r}"
            )
        positive_int(max_lent_per_owner, "max_lent_per_owner")
        self._allocate = allocate
        self._max = max_buffers
        self._max_lent = max_lent
        self._max_lent_per_owner = max_lent_per_owner
        self._free: dict[_Key, list[_Slot]] = defaultdict(list)
        self._leases: dict[int, BufferLease] = {}
        self._total = 0
        self._lent = 0
        self._lent_by: dict[Hashable, int] = {}
        # Lent buffers given back, from whichever thread dropped the last frame: taken into
        # the free lists under the lock by the next pool call (see _given_back).
        self._back: deque[tuple[torch.Tensor, CopyEvent | None, _Key, Hashable]] = deque()
        # Re-entrant: a frame collected while this thread holds the lock (a garbage collection
        # inside a pool call) gives its buffer back on this thread.
        self._cond = threading.Condition(threading.RLock())
        self._closed = False

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> BufferLease:
        """Lease a buffer of ``shape`` and ``dtype``; waits while all are leased or lent.

        Raises PoolClosedError if the pool is closed while waiting.
        """
        key = (tuple(shape), dtype)
        slot: _Slot | None  # None: allocate a new one, outside the lock
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("buffer pool closed")
                if self._back:
                    self._take_back()
                free = self._free.get(key)
                if free:
                    slot = free.pop()
                    break
                if self._total < self._max:
                    slot = None
                    self._total += 1
                    break
                if self._evict_one():
                    continue
                self._cond.wait(_RECHECK_S)
        if slot is None:
            try:
                buffer = self._allocate(key[0], dtype)
            except BaseException:
                with self._cond:
                    self._total -= 1
                    self._cond.notify_all()
                raise
            lease = BufferLease(buffer, key)
        else:
            lease = BufferLease(slot[0], key, slot[1])
        with self._cond:
            self._leases[id(lease)] = lease
        return lease

    def _evict_one(self) -> bool:
        # Caller holds the lock. Free one idle buffer of any shape so a new
        # shape can be allocated without exceeding the cap.
        for slots in self._free.values():
            if slots:
                slots.pop()
                self._total -= 1
                return True
        return False

    def release(self, lease: BufferLease) -> None:
        """Return ``lease``'s buffer to the pool.

        Raises RuntimeError if its copy is still in flight, or if it was
        already released (or lent).
        """
        if lease.in_flight:
            raise RuntimeError("released a host buffer whose copy is still in flight")
        with self._cond:
            if lease._released:
                raise RuntimeError("host buffer lease released twice")
            lease._released = True
            del self._leases[id(lease)]
            self._free[lease.key].append((lease.buffer, lease.event))
            lease.buffer = None  # type: ignore[assignment]
            self._cond.notify()

    def lend(self, lease: BufferLease, owner: Hashable) -> torch.Tensor | None:
        """``lease``'s buffer as a tensor of its own, or None when lending is capped now.

        The tensor (the buffer's shape and dtype, no copy) may be kept, viewed,
        written and shared freely: the buffer comes back to the pool only once
        the last reference to its memory is gone. The lease is used up either
        way but for None, when it stays the caller's (to copy out and release).
        Raises RuntimeError if its copy is still in flight or it was released.
        """
        if lease.in_flight:
            raise RuntimeError("lent a host buffer whose copy is still in flight")
        buffer, event, key = lease.buffer, lease.event, lease.key
        if buffer is None:
            raise RuntimeError("lent a host buffer lease already released")
        with self._cond:
            if self._back:
                self._take_back()
            if self._lent >= self._max_lent or self._lent_by.get(owner, 0) >= self._max_lent_per_owner:
                return None
        # The reader's tensor is made through numpy so that its memory's lifetime can be
        # watched: torch.from_numpy keeps ``raw`` alive exactly as long as some tensor uses
        # the memory, views and all, and a weak reference to ``raw`` says when that ends.
        # (A tensor's storage takes no weak references in every torch we support.)
        raw = buffer.reshape(-1).view(torch.uint8).numpy()
        frame = torch.from_numpy(raw).view(buffer.dtype).view(buffer.shape)
        with self._cond:
            if lease._released:
                raise RuntimeError("lent a host buffer lease already released")
            lease._released = True
            del self._leases[id(lease)]
            self._lent += 1
            self._lent_by[owner] = self._lent_by.get(owner, 0) + 1
        lease.buffer = None  # type: ignore[assignment]
        _watch(raw, self, (buffer, event, key, owner))
        return frame

    def _given_back(self, item: tuple[torch.Tensor, CopyEvent | None, _Key, Hashable]) -> None:
        # Any thread, when the last reference to a lent buffer went: possibly inside a pool
        # call on this very thread (a collection), which then takes it back itself.
        self._back.append(item)
        if self._cond._is_owned():  # type: ignore[attr-defined]  # Condition's own check
            return
        with self._cond:
            self._take_back()
            self._cond.notify_all()

    def _take_back(self) -> None:
        # Caller holds the lock.
        back = self._back
        while back:
            buffer, event, key, owner = back.popleft()
            self._lent -= 1
            left = self._lent_by[owner] - 1
            if left:
                self._lent_by[owner] = left
            else:
                del self._lent_by[owner]
            if self._closed:
                self._total -= 1
            else:
                self._free[key].append((buffer, event))

    def forget(self, lease: BufferLease) -> None:
        """Drop ``lease`` without reusing its buffer (its copy may never complete).

        The buffer stays referenced by the lease (so a late copy writes into
        memory that is still allocated) and leaves the pool for good; the
        pool may allocate a replacement.
        """
        with self._cond:
            if lease._released:
                return
            lease._released = True
            self._leases.pop(id(lease), None)
            self._total -= 1
            self._cond.notify()

    def statistics(self) -> PoolStatistics:
        with self._cond:
            if self._back:
                self._take_back()
            leases = list(self._leases.values())
            total, lent = self._total, self._lent
        return PoolStatistics(
            buffers_total=total,
            buffers_in_use=len(leases),
            buffers_in_flight=sum(1 for lease in leases if lease.in_flight),
            max_buffers=self._max,
            buffers_lent=lent,
        )

    def close(self) -> None:
        """Wake any waiter with PoolClosedError; leases may still be released, lent buffers come back."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# One weak reference per lent buffer, kept here until it fires: a weakref whose
# referent dies calls back only while the weakref object itself is alive.
_watching: dict[int, weakref.ref[Any]] = {}


_Lent = tuple[torch.Tensor, "CopyEvent | None", _Key, Hashable]


def _watch(raw: Any, pool: PinnedBufferPool, item: _Lent) -> None:
    def gone(ref: weakref.ref[Any]) -> None:
        _watching.pop(id(ref), None)
        pool._given_back(item)

    ref = weakref.ref(raw, gone)
    _watching[id(ref)] = ref
