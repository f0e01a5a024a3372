"""Device-to-host copies: issued on the producer thread, awaited off the loop.

``submit`` (producer thread) casts on the device if asked, leases a pool
buffer and issues the copy on the device's copy stream; it returns a
ticket that keeps the source tensor referenced, because a tensor freed while
the copy stream still reads it is recycled by the caching allocator and
the copy would read the next step's data.

``run`` (an event-loop task) takes tickets in the order they were issued,
waits for their events and hands the owned frames on. Events are waited on
through ``anyio.to_thread`` with a one-token limiter of our own: waiting
never blocks the loop and never takes tokens from anyio's shared limiter.
When every event in a batch has already completed and the bytes are few
(always on the CPU device), the batch is finished inline instead: a thread
hop costs a few hundred microseconds, more than such a copy.

Per ticket, in this order: wait for the copy; clone the host buffer into a
tensor the caller owns (unless the request already ended); release the
lease; drop the source. The lease goes back only after its event has
completed, even for a cancelled or timed-out request, so a buffer with a
copy in flight is never handed to anyone else.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ..device import Device, PinnedBufferPool
from ..device.pool import BufferLease
from .request import Request

__all__ = ["CopyTicket", "Copier"]

# Above this many bytes per batch, cloning on the loop would stall it.
_INLINE_MAX_BYTES = 1 << 20


@dataclass(slots=True, eq=False)
class CopyTicket:
    """One step's frame on its way to the host, or an error in its place."""

    request: Request
    step: int
    queued_s: float = 0.0
    compute_s: float = 0.0
    batch_size: int = 1
    src: torch.Tensor | None = None
    lease: BufferLease | None = None
    issued_at: float = 0.0
    copy_s: float = 0.0
    data: torch.Tensor | None = None
    #: The step failed: deliver this error after the frames before it.
    error: BaseException | None = None


class Copier:
    """See the module docstring."""

    def __init__(
        self,
        device: Device,
        pool: PinnedBufferPool,
        *,
        frame_dtype: torch.dtype | None = None,
    ) -> None:
        self._device = device
        self._pool = pool
        self._frame_dtype = frame_dtype
        self._inbox: deque[CopyTicket] = deque()
        self._wakeup = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- producer thread ---------------------------------------------------

    def submit(
        self,
        request: Request,
        step: int,
        out: torch.Tensor,
        *,
        queued_s: float,
        compute_s: float,
        batch_size: int,
    ) -> CopyTicket:
        """Issue the copy of one step's output; returns at once on async devices."""
        src = out.detach()
        if self._frame_dtype is not None and src.dtype != self._frame_dtype:
            # Cast on the device, before the copy: a dtype-changing .to("cpu")
            # silently goes through pageable memory.
            src = src.to(self._frame_dtype)
        lease = self._pool.acquire(tuple(src.shape), src.dtype)
        issued_at = time.monotonic()
        try:
            lease.event = self._device.copy_to_host(src, lease.buffer)
        except BaseException:
            self._pool.release(lease)
            raise
        return CopyTicket(
            request=request,
            step=step,
            queued_s=queued_s,
            compute_s=compute_s,
            batch_size=batch_size,
            src=src,
            lease=lease,
            issued_at=issued_at,
        )

    def post(self, tickets: list[CopyTicket]) -> None:
        """Hand tickets to the loop in issue order (thread-safe, never blocks)."""
        assert self._loop is not None, "Copier.post before run()"
        self._loop.call_soon_threadsafe(self._receive, tickets)

    # -- event loop ----------------------------------------------------------

    def _receive(self, tickets: list[CopyTicket]) -> None:
        self._inbox.extend(tickets)
        self._wakeup.set()

    def pending(self) -> int:
        return len(self._inbox)

    async def run(self, deliver: Callable[[list[CopyTicket]], Any]) -> None:
        """Forever: wait for tickets, finish their copies, ``deliver`` them in order."""
        self._loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            while self._inbox:
                batch = list(self._inbox)
                self._inbox.clear()
                if self._ready_inline(batch):
                    self._complete(batch)
                else:
                    # abandon_on_cancel: at shutdown a wedged device must not
                    # hold the loop; the worker still releases every lease.
                    await anyio.to_thread.run_sync(
                        self._complete, batch, limiter=self._limiter, abandon_on_cancel=True
                    )
                deliver(batch)

    @staticmethod
    def _ready_inline(batch: list[CopyTicket]) -> bool:
        nbytes = 0
        for t in batch:
            lease = t.lease
            if lease is None:
                continue
            if lease.event is not None and not lease.event.query():
                return False
            nbytes += lease.buffer.numel() * lease.buffer.element_size()
        return nbytes <= _INLINE_MAX_BYTES

    def _complete(self, batch: list[CopyTicket]) -> None:
        # Runs inline on the loop or on the copier's worker thread.
        for t in batch:
            lease = t.lease
            if lease is None:
                continue
            try:
                if lease.event is not None:
                    lease.event.synchronize()
                # finalized (not status): a request the producer just marked
                    # failed still gets the frames computed before the failure.
                    if not t.request.finalized:
                        t.data = lease.buffer.clone()
                t.copy_s = time.monotonic() - t.issued_at
            finally:
                t.lease = None
                t.src = None
                self._pool.release(lease)

    def drain(self) -> None:
        """Finish every queued ticket without delivering (shutdown): leases go back."""
        batch = list(self._inbox)
        self._inbox.clear()
        if batch:
            self._complete(batch)
