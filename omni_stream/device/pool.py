"""PinnedBufferPool: fixed-size host buffers reused by shape and dtype.

A buffer is leased for one frame: the copier leases it on the producer
thread, the device copies into it, and the lease is released only after
the copy's event has completed and the frame's bytes were handed over
(cloned into the caller's own tensor). Release of a lease whose copy is
still in flight raises, because handing such a buffer to another request
would let the late copy overwrite that request's frame. This holds even
when the lease's own request was cancelled or timed out: the copier still
waits for the event before it releases.

Pinned allocation is slow (``cudaHostAlloc`` takes milliseconds and
serialises with the device), so buffers are kept and reused; the pool is
capped at ``max_buffers``, and when it is full a free buffer of another
shape is freed to make room. When every buffer is leased, ``acquire``
waits: that is backpressure on the producer from copies in flight.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import PoolClosedError
from ..params import positive_int
from .base import CopyEvent

__all__ = ["BufferLease", "PinnedBufferPool", "PoolStatistics", "PoolClosedError"]

_Key = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    buffers_total: int
    buffers_in_use: int
    buffers_in_flight: int
    max_buffers: int


class BufferLease:
    """One leased buffer; ``event`` is set once a copy into it was issued."""

    __slots__ = ("buffer", "key", "event", "_released")

    def __init__(self, buffer: torch.Tensor, key: _Key) -> None:
        self.buffer = buffer
        self.key = key
        self.event: CopyEvent | None = None
        self._released = False

    @property
    def in_flight(self) -> bool:
        return self.event is not None and not self.event.query()


class PinnedBufferPool:
    """Thread-safe pool of host buffers; see the module docstring."""

    def __init__(
        self,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        *,
        max_buffers: int = 64,
    ) -> None:
        positive_int(max_buffers, "max_buffers")
        self._allocate = allocate
        self._max = max_buffers
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._leases: dict[int, BufferLease] = {}
        self._total = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> BufferLease:
        """Lease a buffer of ``shape`` and ``dtype``; waits while all are leased.

        Raises PoolClosedError if the pool is closed while waiting.
        """
        key = (tuple(shape), dtype)
        buf: torch.Tensor | None  # None: allocate a new one, outside the lock
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("buffer pool closed")
                free = self._free.get(key)
                if free:
                    buf = free.pop()
                    break
                if self._total < self._max:
                    buf = None
                    self._total += 1
                    break
                if self._evict_one():
                    continue
                self._cond.wait()
            lease_buf = buf
        if lease_buf is None:
            try:
                lease_buf = self._allocate(key[0], dtype)
            except BaseException:
                with self._cond:
                    self._total -= 1
                    self._cond.notify_all()
                raise
        lease = BufferLease(lease_buf, key)
        with self._cond:
            self._leases[id(lease)] = lease
        return lease

    def _evict_one(self) -> bool:
        # Caller holds the lock. Free one idle buffer of any shape so a new
        # shape can be allocated without exceeding the cap.
        for bufs in self._free.values():
            if bufs:
                bufs.pop()
                self._total -= 1
                return True
        return False

    def release(self, lease: BufferLease) -> None:
        """Return ``lease``'s buffer to the pool.

        Raises RuntimeError if its copy is still in flight, or if it was
        already released.
        """
        if lease.in_flight:
            raise RuntimeError("released a host buffer whose copy is still in flight")
        with self._cond:
            if lease._released:
                raise RuntimeError("host buffer lease released twice")
            lease._released = True
            del self._leases[id(lease)]
            self._free[lease.key].append(lease.buffer)
            lease.buffer = None  # type: ignore[assignment]
            self._cond.notify()

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
            leases = list(self._leases.values())
            total = self._total
        return PoolStatistics(
            buffers_total=total,
            buffers_in_use=len(leases),
            buffers_in_flight=sum(1 for lease in leases if lease.in_flight),
            max_buffers=self._max,
        )

    def close(self) -> None:
        """Wake any waiter with PoolClosedError; leases may still be released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
