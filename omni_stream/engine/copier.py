"""Device-to-host copies: issued on the producer thread, waited for on a thread of their own.

``submit`` (producer thread) casts on the device if asked, leases a pool
buffer and issues the copy on the device's copy stream (or, for frames
already in host memory, copies once into a tensor the caller will own); it
returns a ticket that keeps the source tensor referenced, because a tensor
freed while the copy stream still reads it is recycled by the caching
allocator and the copy would read the next step's data.

``post`` (producer thread) sends tickets on, in issue order, never blocking:

* On a device whose copies are asynchronous (CUDA, the simulator) they go
  to the copier's **waiting thread**, which takes them in order, blocks in
  each copy's ``event.synchronize()`` (a ``blocking=True`` CUDA event
  sleeps in the driver; torch releases the GIL there), and completes each
  ticket: the frame becomes the pool buffer itself, lent to the reader
  (``PinnedBufferPool.lend``: a large frame is copied once, by the device),
  or for a small frame, or a reader holding its share of lent buffers, a
  clone, and the buffer goes back. Completed tickets go to the loop through
  a ``Handover``: one wake-up of the loop for all those completed before it
  came round, and none for tickets still in flight. Before blocking on a
  copy that has not landed, the thread first hands on what it completed, so
  a frame never waits for a later one.
* Where frames already live in host memory (the CPU), tickets arrive
  complete and go straight to the loop through the Handover.

On the loop, ``_receive`` hands each batch to ``deliver`` from the callback
itself (no task switch), or, behind a failed hand-over, to the copier's task
(``run``), which exists to raise that failure so the engine dies visibly.

Why a thread of its own rather than ``anyio.to_thread`` per batch: each such
hop costs a worker wake-up and a loop wake-up (a few hundred microseconds of
two threads taking the GIL the producer needs), and a timed host wait on a
CUDA event does not exist (only ``query`` and ``synchronize``): polling
``query`` took the GIL a few dozen times a frame. The thread is a daemon and
never joined, so a wedged device (a copy that never lands) can neither stall
shutdown nor keep the interpreter from exiting; health sees it through
``waiting_since``.

A buffer goes back to the pool only after its event completed, even for a
cancelled or timed-out request, so a buffer with a copy in flight is never
handed to anyone else; at shutdown, ``drain`` gives back what landed and
forgets (never reuses) what did not.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._backend import ThreadsafeLoop
from .._handover import Handover
from .._wakeup import Wakeup
from ..device import Device, PinnedBufferPool
from ..device.pool import BufferLease
from .request import Request

__all__ = ["CopyTicket", "Copier"]

logger = logging.getLogger("omni_stream.engine")

# A frame this large or larger is lent to its reader rather than cloned: below it, a
# clone (a few microseconds) costs less than lending and gives the buffer back at once.
LEND_MIN_BYTES = 64 * 1024


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
    #: The step reused the request's step cache (StepTimings.cached).
    cached: bool = False


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
        # Whether the device records a buffer's last event again (``copy_to_host(..., event)``):
        # a device written before that parameter existed still works, with a new event a copy.
        self._reuse_events = "event" in inspect.signature(device.copy_to_host).parameters
        # Loop side: tickets received while a failure, or no deliver yet, keeps them from the reader.
        self._inbox: deque[CopyTicket] = deque()
        # Wakes ``run`` for tickets in the inbox or a failed hand-over.
        self._wakeup = Wakeup()
        # Completed tickets -> loop: ``_receive`` gets each batch.
        self._handover: Handover[CopyTicket] = Handover(self._receive)
        self._deliver: Callable[[list[CopyTicket]], Any] | None = None
        # A failure of the hand-over, re-raised by ``run``.
        self._failure: BaseException | None = None
        # Producer -> waiting thread (asynchronous devices): lists of tickets, in issue order;
        # None tells the thread to stop.
        self._pending: queue.SimpleQueue[list[CopyTicket] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._waiter_lock = threading.Lock()
        # A synchronous device posted a copy still in flight (its copy_to_host returned early,
        # as a GPU's does): from then on every ticket goes by the waiting thread, in order.
        self._detoured = False
        # The list the waiting thread is working through: ``drain`` claims what it has not done.
        self._waited: list[CopyTicket] | None = None
        # Who gives a lease back, the waiting thread or ``drain``: each lease is taken off its
        # ticket under this lock, by whichever comes first; ``_stopped`` is set under it too.
        self._claim = threading.Lock()
        self._stopped = False
        #: ``post(tickets)`` (producer thread): send tickets on in issue order; thread-safe,
        #: never blocks. A C call (the queue's put, or the Handover's own method): no Python
        #: frame of ours a step.
        self.post: Callable[[list[CopyTicket]], None] = (
            self._pending.put if device.asynchronous_copies else self._post_completed
        )
        #: issue time of the copy the waiting thread is blocked on, None when not waiting
        #: (read by health: a copy that never completes means a hung device).
        self.waiting_since: float | None = None
        #: Frames handed to readers as lent pool buffers, and frames cloned on the host
        #: after their device copy, with the bytes cloned (the second copy lending avoids).
        self.frames_lent = 0
        self.frames_cloned = 0
        self.host_copy_bytes = 0

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
        cached: bool = False,
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
            # decode_s, cached): keywords cost twice as much, once a frame on this thread.
            return CopyTicket(
                request,
                step,
                queued_s,
                compute_s,
                batch_size,
                None,
                None,
                issued_at,
                time.monotonic() - issued_at,
                owned,
                None,
                decoded,
                decode_s,
                cached,
            )
        lease = self._pool.acquire(tuple(src.shape), src.dtype)
        try:
            if self._reuse_events and lease.event is not None:
                # The buffer's last event, recorded again: no event made and destroyed a frame.
                lease.event = self._device.copy_to_host(src, lease.buffer, lease.event)
            else:
                lease.event = self._device.copy_to_host(src, lease.buffer)
        except BaseException:
            lease.event = None  # not recorded: nothing in flight
            self._pool.release(lease)
            raise
        # (Positional, as above.)
        return CopyTicket(
            request,
            step,
            queued_s,
            compute_s,
            batch_size,
            src,
            lease,
            issued_at,
            0.0,
            None,
            None,
            decoded,
            decode_s,
            cached,
        )

    def _post_completed(self, tickets: list[CopyTicket]) -> None:
        """``post`` of a device whose copies are done when issued (the CPU): straight to the loop.

        Unless a copy is still in flight after all (a device that said its copies are
        synchronous but whose event has not completed): the loop must never block on it,
        so that ticket and every later one go by the waiting thread, in order.
        """
        if not self._detoured:
            for t in tickets:
                lease = t.lease
                if lease is not None and lease.in_flight:
                    self._detoured = True
                    self._start_waiter()
                    break
            else:
                self._handover.post(tickets)
                return
        self._pending.put(tickets)

    @property
    def loop(self) -> ThreadsafeLoop | None:
        """The loop completed tickets go to (asyncio's or trio's: ``_backend.running_loop``).

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
        """How many times the loop was woken for frames (at most once per hand-over)."""
        return self._handover.wakeups

    # -- the waiting thread (asynchronous devices) ---------------------------------

    def _start_waiter(self) -> None:
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = threading.Thread(
                    target=self._wait_thread, name="omni-stream-copier", daemon=True
                )
                self._waiter.start()

    def _wait_thread(self) -> None:
        try:
            self._wait_loop()
        except BaseException as exc:  # a bug in the machinery: the engine must die of it, visibly
            loop = self._handover.loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to tell
                    loop.call_soon_threadsafe(self._fail, exc)
            if not isinstance(exc, Exception):
                raise

    def _fail(self, exc: BaseException) -> None:
        # On the loop: ``run`` raises it.
        if self._failure is None:
            self._failure = exc
        self._wakeup.wake()

    def _wait_loop(self) -> None:
        """The waiting thread's body: complete posted tickets in order, hand them to the loop."""
        pending = self._pending
        while True:
            tickets = pending.get()
            if tickets is None:
                return
            with self._claim:
                stopped = self._stopped
                if not stopped:
                    self._waited = tickets
            if stopped:
                self._abandon(tickets)  # drain ran between our get and now
                return
            handed = 0
            for i, t in enumerate(tickets):
                lease = t.lease
                if lease is not None and lease.event is not None and not lease.event.query():
                    if i > handed and not self._hand(tickets[handed:i]):
                        return
                    handed = i
                    self.waiting_since = t.issued_at
                    try:
                        lease.event.synchronize()
                    except Exception:  # noqa: BLE001 - _complete raises it again, for its ticket
                        pass
                    finally:
                        self.waiting_since = None
                self._complete(t)
            with self._claim:
                self._waited = None
                if self._stopped:
                    return
            if not self._hand(tickets[handed:]):
                return

    def _hand(self, tickets: list[CopyTicket]) -> bool:
        """Completed tickets to the loop; False once there is no loop to take them (stop)."""
        try:
            self._handover.post(tickets)
        except RuntimeError:
            # The loop has finished (the engine is gone with it): nobody is left to read them.
            return False
        return True

    def _complete(self, t: CopyTicket) -> None:
        # Waiting thread, or the loop for a synchronous device's copy. A failure here belongs
        # to one ticket (one request), never to the copier.
        with self._claim:
            # A lease already taken by ``drain`` (shutdown) is drain's to give back.
            lease, t.lease = t.lease, None
        if lease is None:
            return
        pool = self._pool
        kept = False  # the lease became the frame (lent)
        try:
            if lease.event is not None:
                lease.event.synchronize()  # at once: it landed (raises if the copy failed)
            # finalized (not status): a request the producer just marked
            # failed still gets the frames computed before the failure.
            if not t.request.finalized:
                nbytes = lease.nbytes
                data = pool.lend(lease, t.request.arrival) if nbytes >= LEND_MIN_BYTES else None
                if data is not None:
                    kept = True
                    self.frames_lent += 1
                else:
                    data = _owned_copy(lease.buffer)
                    self.frames_cloned += 1
                    self.host_copy_bytes += nbytes
                t.data = data
            t.copy_s = time.monotonic() - t.issued_at
        except Exception as exc:
            t.error = exc
        finally:
            t.src = None
            if not kept:
                if lease.in_flight:
                    # synchronize() raised: the copy may still write into
                    # this buffer, so it must never be handed out again.
                    pool.forget(lease)
                else:
                    pool.release(lease)

    def _abandon(self, tickets: list[CopyTicket]) -> int:
        """Give back the leases of ``tickets`` not yet claimed; returns how many were in flight."""
        with self._claim:
            claimed = [(t, t.lease) for t in tickets]
            for t in tickets:
                t.lease = None
        stuck = 0
        for t, lease in claimed:
            if lease is None:
                continue
            t.src = None
            if lease.in_flight:
                stuck += 1
                self._pool.forget(lease)
            else:
                self._pool.release(lease)
        return stuck

    # -- event loop ----------------------------------------------------------

    def _receive(self, tickets: list[CopyTicket]) -> None:
        for t in tickets:
            if t.lease is not None:
                # A synchronous device's output it could not own (a sparse tensor, another
                # device's): copied into a pool buffer by the time it was posted.
                self._complete(t)
        deliver = self._deliver
        if deliver is not None and self._failure is None and not self._inbox:
            # Every ticket here is complete (its copy landed, or it had none): hand them on
            # from this callback. Waking the copier task would cost a task switch a frame, on
            # the loop thread whose GIL the producer's next step is waiting for.
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
        # Before ``run`` started, or behind a failed hand-over: nothing may be delivered
        # after a gap.
        self._inbox.extend(tickets)
        self._wakeup.wake()

    async def run(self, deliver: Callable[[list[CopyTicket]], Any]) -> None:
        """Forever: start the waiting thread; hand on what arrives before ``deliver`` is known; raise
        a failed hand-over. Cancelled at shutdown (then ``drain``)."""
        self._deliver = deliver
        if self._device.asynchronous_copies:
            self._start_waiter()
        while True:
            while not self._inbox and self._failure is None:
                await self._wakeup.wait()
            if self._failure is not None:
                raise self._failure
            batch = list(self._inbox)
            self._inbox.clear()
            deliver(batch)

    def drain(self) -> int:
        """Release the leases of tickets whose copies completed; never blocks.

        For shutdown, after ``run`` was cancelled and the producer stopped.
        Stops the waiting thread (or leaves it to end by itself, if a copy
        that never lands holds it). Returns how many tickets still had a
        copy in flight: their buffers are abandoned (a late copy may still
        write into them).
        """
        tickets: list[CopyTicket] = [*self._inbox, *self._handover.take()]
        self._inbox.clear()
        with self._claim:
            self._stopped = True
            if self._waited is not None:
                tickets.extend(self._waited)
                self._waited = None
            while True:
                try:
                    posted = self._pending.get_nowait()
                except queue.Empty:
                    break
                if posted is not None:
                    tickets.extend(posted)
        self._pending.put(None)  # the waiting thread, once it looks again, stops
        return self._abandon(tickets)


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
