"""Device-to-host copies: issued on the producer thread, awaited off the loop.

``submit`` (producer thread) casts on the device if asked, leases a pool
buffer and issues the copy on the device's copy stream (or, for frames
already in host memory, copies once into a tensor the caller will own); it
returns a ticket that keeps the source tensor referenced, because a tensor
freed while the copy stream still reads it is recycled by the caching
allocator and the copy would read the next step's data.

``post`` (producer thread) hands tickets to the loop through a
``Handover``: one wake-up of the loop for every ticket posted before it
came round, not one per step. ``run`` (an event-loop task) takes tickets
in the order they were issued, waits for their events and hands the owned
frames on. Tickets with nothing to wait for, arriving while nothing is
queued or in progress, are handed on directly from the loop callback that
receives them (``_receive``), with no task switch. Events
are waited on through ``anyio.to_thread`` with a one-token limiter of our own: waiting
never blocks the loop and never takes tokens from anyio's shared limiter.
When every event in a batch has already completed and the bytes are few,
the batch is finished inline instead: a thread hop costs a few hundred
microseconds, more than such a copy. A device whose frames already live in
host memory (the CPU) copies each frame once in ``submit`` and uses no pool
buffer (``Device.copy_owned``); its tickets arrive complete.

Per ticket, in this order: wait for the copy; clone the host buffer into a
tensor the caller owns (unless the request already ended); release the
lease; drop the source. The lease goes back only after its event has
completed, even for a cancelled or timed-out request, so a buffer with a
copy in flight is never handed to anyone else.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from .._backend import ThreadsafeLoop
from .._handover import Handover
from .._wakeup import Wakeup
from ..device import Device, PinnedBufferPool
from ..device.base import wait_event
from ..device.pool import BufferLease
from .request import Request

__all__ = ["CopyTicket", "Copier"]

# Above this many bytes per batch, cloning on the loop would stall it.
_INLINE_MAX_BYTES = 1 << 20
# Longest one worker-thread wait for copy events before it returns to the loop.
_WAIT_SLICE_S = 0.25


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
    #: The frame is decoded pixels (Frame.decoded), and what decoding cost.
    decoded: bool = False
    decode_s: float = 0.0


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
        # Wakes ``run`` for tickets in the inbox or a failed hand-over.
        self._wakeup = Wakeup()
        self._limiter = anyio.CapacityLimiter(1)
        # Producer -> loop: ``post`` queues, ``_receive`` gets each batch.
        self._handover: Handover[CopyTicket] = Handover(self._receive)
        #: ``post(tickets)`` (producer thread): hand tickets to the loop in issue
        #: order; thread-safe, never blocks. The loop is woken only if it has no
        #: drain pending: tickets posted while it is busy (a reader's work,
        #: another request's frames) ride along with the ones before them, in
        #: order. Raises RuntimeError if the loop has finished. The Handover's
        #: own method, not one of ours around it: a Python call fewer a step.
        self.post: Callable[[list[CopyTicket]], None] = self._handover.post
        self._deliver: Callable[[list[CopyTicket]], Any] | None = None
        # True from taking a batch off the inbox until it is delivered: later
        # tickets must not overtake it.
        self._busy = False
        # A failure of the inline hand-over, re-raised by ``run``.
        self._failure: BaseException | None = None
        # The batch a worker thread waits on, from the wait's start until it completed. A
        # cancelled ``run`` (shutdown) leaves it here for ``drain``: it is in no queue any
        # more, and its copies may never land (a wedged device).
        self._waited: list[CopyTicket] | None = None
        # Who gives a waited batch's leases back, its (abandoned) worker or ``drain``: each
        # lease is taken off its ticket under this lock, by whichever comes first.
        self._claim = threading.Lock()
        #: issue time of the oldest copy being waited on, None when not waiting
        #: (read by health: a copy that never completes means a hung device).
        self.waiting_since: float | None = None

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
        decoded: bool = False,
        decode_s: float = 0.0,
    ) -> CopyTicket:
        """Issue the copy of one step's output; returns at once on async devices."""
        # A tensor in an autograd graph is copied as data; one that is not needs no detach (a
        # torch call a frame the producer would make for nothing).
        src = out.detach() if out.requires_grad else out
        target = self._device.torch_device
        if src.is_cuda and target.type == "cuda" and src.device != target:
            # The copy must run on our device's copy stream for our event to
            # cover it; a D2H copy is issued on the *source* device's stream.
            src = src.to(target)
        if self._frame_dtype is not None and not decoded and src.dtype != self._frame_dtype:
            # (Not decoded pixels: a uint8 image cast to floats would read as 0-255.)
            # Cast on the device, before the copy: a dtype-changing .to("cpu")
            # silently goes through pageable memory.
            src = src.to(self._frame_dtype)
        issued_at = time.monotonic()
        owned = self._device.copy_owned(src)
        if owned is not None:
            # Host-resident frames (CPU): copied once, here; no lease to wait on.
            # Positional, in the fields' order (request, step, queued_s, compute_s,
            # batch_size, src, lease, issued_at, copy_s, data, error, decoded,
            # decode_s): keywords cost twice as much, once a frame on this thread.
            return CopyTicket(
                request, step, queued_s, compute_s, batch_size, None, None,
                issued_at, time.monotonic() - issued_at, owned, None, decoded, decode_s,
            )
        lease = self._pool.acquire(tuple(src.shape), src.dtype)
        try:
            lease.event = self._device.copy_to_host(src, lease.buffer)
        except BaseException:
            self._pool.release(lease)
            raise
        # (Positional, as above.)
        return CopyTicket(
            request, step, queued_s, compute_s, batch_size, src, lease,
            issued_at, 0.0, None, None, decoded, decode_s,
        )

    @property
    def loop(self) -> ThreadsafeLoop | None:
        """The loop ``post`` wakes (asyncio's or trio's: ``_backend.running_loop``).

        Set by ``Engine.start`` before the producer thread exists, not by
        ``run``: trio may run the producer's task before this one, and a
        post could then come first.
        """
        return self._handover.loop

    @loop.setter
    def loop(self, loop: ThreadsafeLoop | None) -> None:
        self._handover.loop = loop

    @property
    def wakeups(self) -> int:
        """How many times ``post`` has woken the loop (at most once per post)."""
        return self._handover.wakeups

    # -- event loop ----------------------------------------------------------

    def _receive(self, tickets: list[CopyTicket]) -> None:
        deliver = self._deliver
        direct = deliver is not None and self._failure is None and not self._busy and not self._inbox
        if direct:
            # (A loop, not all() over a generator: this runs once a wake-up.)
            for t in tickets:
                if t.lease is not None:
                    direct = False
                    break
        if direct:
            assert deliver is not None
            # Nothing to wait for (host-resident frames, failed steps) and
            # nothing queued ahead of them: hand them on from this callback.
            # Waking the copier task would cost a task switch a frame, on the
            # loop thread whose GIL the producer's next step is waiting for.
            try:
                deliver(tickets)
            except Exception as exc:
                # Raised from the copier's task, so the engine dies visibly:
                # in a callback it would only reach asyncio's exception
                # handler, and the engine would live on as a zombie (on trio
                # it would crash the whole run).
                self._failure = exc
                self._wakeup.wake()
            return
        # Behind a failed hand-over too: nothing may be delivered after a gap.
        self._inbox.extend(tickets)
        self._wakeup.wake()

    async def run(self, deliver: Callable[[list[CopyTicket]], Any]) -> None:
        """Forever: wait for tickets, finish their copies, ``deliver`` them in order."""
        self._deliver = deliver
        while True:
            while not self._inbox and self._failure is None:
                await self._wakeup.wait()
            if self._failure is not None:
                raise self._failure
            while self._inbox:
                batch = list(self._inbox)
                self._inbox.clear()
                self._busy = True
                if self._ready_inline(batch):
                    self._complete(batch)
                else:
                    self.waiting_since = min(t.issued_at for t in batch)
                    self._waited = batch
                    try:
                        # Bounded waits, repeated: a worker never blocks for
                        # long, so shutdown (and interpreter exit) never waits
                        # on a wedged device. abandon_on_cancel: nor does the loop.
                        while not await anyio.to_thread.run_sync(
                            self._wait_and_complete, batch, limiter=self._limiter,
                            abandon_on_cancel=True,
                        ):
                            pass
                    finally:
                        self.waiting_since = None
                    self._waited = None  # (not on a cancel: drain looks at it then)
                deliver(batch)
                self._busy = False

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

    def _wait_and_complete(self, batch: list[CopyTicket]) -> bool:
        """Worker thread: wait a bounded time for the batch's copies; complete it once all landed."""
        for t in batch:
            lease = t.lease
            if lease is not None and lease.event is not None and not wait_event(lease.event, _WAIT_SLICE_S):
                return False
        self._complete(batch)
        return True

    def _complete(self, batch: list[CopyTicket]) -> None:
        # Runs inline on the loop or on the copier's worker thread. A failure
        # here belongs to one ticket (one request), never to the copier.
        with self._claim:
            # A worker abandoned at shutdown may get here while ``drain`` runs: a lease
            # already taken by drain is drain's to give back.
            leases = [t.lease for t in batch]
            for t in batch:
                t.lease = None
        for t, lease in zip(batch, leases, strict=True):
            if lease is None:
                continue
            try:
                if lease.event is not None:
                    lease.event.synchronize()
                # finalized (not status): a request the producer just marked
                # failed still gets the frames computed before the failure.
                if not t.request.finalized:
                    t.data = _owned_copy(lease.buffer)
                t.copy_s = time.monotonic() - t.issued_at
            except Exception as exc:
                t.error = exc
            finally:
                t.src = None
                if lease.in_flight:
                    # synchronize() raised: the copy may still write into
                    # this buffer, so it must never be handed out again.
                    self._pool.forget(lease)
                else:
                    self._pool.release(lease)

    def drain(self) -> int:
        """Release the leases of queued tickets whose copies completed; never blocks.

        For shutdown, after ``run`` was cancelled. Returns how many tickets
        still had a copy in flight: their buffers are abandoned (a late copy
        may still write into them). The batch the cancelled ``run`` was
        waiting on counts too, unless its worker, still finishing its last
        bounded wait, completed it first.
        """
        stuck = 0
        # Posted tickets the loop never came round to receive count too.
        self._inbox.extend(self._handover.take())
        waited, self._waited = self._waited or [], None
        with self._claim:
            claimed = [(t, t.lease) for t in (*waited, *self._inbox)]
            for t, _ in claimed:
                t.lease = None
        for t, lease in claimed:
            if lease is None:
                continue
            t.src = None
            if lease.in_flight:
                stuck += 1
                self._pool.forget(lease)
            else:
                self._pool.release(lease)
        self._inbox.clear()
        return stuck


# torch's grain size: below it a copy never starts an OpenMP parallel region.
_PARALLEL_GRAIN = 32768


def _owned_copy(buffer: torch.Tensor) -> torch.Tensor:
    """A fresh CPU tensor with ``buffer``'s bytes.

    Large frames go through a plain numpy memcpy, not ``torch.clone``: on a
    CPU build a large torch copy runs as an OpenMP parallel region, and a
    second thread running parallel torch ops gets its own OpenMP team, which
    fights the producer's compute for the cores (docs/performance.md). Small
    frames use ``clone`` (no parallel region; six fewer GIL hand-offs).
    """
    if buffer.numel() < _PARALLEL_GRAIN:
        return buffer.clone()
    flat = buffer.reshape(-1)
    raw = flat.view(torch.uint8).numpy().copy()
    return torch.from_numpy(raw).view(buffer.dtype).reshape(buffer.shape)
