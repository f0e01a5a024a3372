"""The output processor: copied frames to their readers, and every request's ending.

The loop-side half of the data path, between the copier and the readers
(``docs/design.md`` draws it)::

    copier ──ticket batches──▶ deliver ──dispatch──▶ Delivery ──▶ FrameStream
                                                                     (consumed, abandon,
                                                                      step_timeout,
                                                                      time_left,
                                                                      time_out)

``Engine`` (the facade) and every ``FrameStream`` hold the same
``OutputProcessor``: the engine feeds it and ends requests through it
(cancel, shutdown, death); a stream reports what its reader took, gave up
or timed out on. Neither calls the other's private methods.

Dispatch runs in the call that hands a batch over, on the loop (the
copier's receiving callback, or its task after a wait for copy events):
no task of its own, so a frame costs no task switch between the producer's
wake-up of the loop and its reader's.

Loop-only: every method runs on the event loop except
``abandon_threadsafe``, which only schedules ``abandon`` there. What the
producer thread also reads (``delivered``, ``consumed``, ``status``) is
written under the request table's lock, and each such change wakes the
producer: it is the backpressure.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

from .._backend import ThreadsafeLoop
from ..config import STEP_TIMEOUT_ENV, timeout as default_timeout
from ..errors import OmniStreamError, RequestCancelledError, StepFailedError, StepTimeoutError
from ..frame import engine_frame
from ..model import StepModel
from .copier import CopyTicket
from .request import Request, Status
from .table import RequestTable

__all__ = ["OutputProcessor", "ProducerActivity"]

# The engine's logger: these records were always the engine's.
logger = logging.getLogger("omni_stream.engine")


class ProducerActivity(Protocol):
    """What a timeout message reads of the producer (``Producer`` has both)."""

    #: monotonic time the running step began, None between steps.
    busy_since: float | None
    #: the request ids (or the model call) the running step is for.
    busy_with: tuple[str, ...]


class OutputProcessor:
    """Hands copied frames to their requests' readers and finalises requests; see the module docstring."""

    def __init__(self, table: RequestTable, producer: ProducerActivity, model: StepModel | None) -> None:
        """``model`` may be None until :meth:`set_model` (a model built on the producer thread)."""
        self._table = table
        self._producer = producer
        self._model = model
        #: Live requests by id (loop-only): the engine adds, ``end`` removes.
        self.by_id: dict[str, Request] = {}
        #: Ended requests by outcome, and frames handed to readers / replaced unread.
        self.counts = {s: 0 for s in Status if s.ended}
        self.frames_delivered = 0
        self.frames_dropped = 0
        #: The loop ``abandon_threadsafe`` schedules onto (asyncio's or trio's);
        #: set by ``Engine.start``.
        self.loop: ThreadsafeLoop | None = None

    def set_model(self, model: StepModel) -> None:
        """The model, once built on the producer thread (before any request runs)."""
        self._model = model

    # -- frames to their readers --------------------------------------------------

    def deliver(self, tickets: list[CopyTicket]) -> None:
        """Dispatch every ticket in order; never raises for one request's failure.

        The copier's ``deliver``, called with each batch there and then (loop-only). It
        used to queue the batch for a consumer task: one more task switch, and
        one more pass of the loop holding the GIL, for every frame.
        """
        for t in tickets:
            try:
                self.dispatch(t)
            except Exception as exc:
                # Contained: one request's delivery failing ends that request,
                # never the copier's hand-over (the zombie upstream).
                logger.exception("request %s: delivering step %d failed", t.request.id, t.step)
                err = OmniStreamError(f"delivering step {t.step} failed: {exc!r}", request_id=t.request.id)
                err.__cause__ = exc
                self.end(t.request, Status.FAILED, err)

    def dispatch(self, t: CopyTicket) -> None:
        """One ticket: its frame to the request's Delivery, or its error ends the request."""
        r = t.request
        if t.error is not None:
            err = t.error
            if not isinstance(err, OmniStreamError):
                err = StepFailedError(
                    f"copying step {t.step}/{r.total} to the host failed: {err!r}",
                    request_id=r.id,
                    step=t.step,
                )
                err.__cause__ = t.error
            # Drained: the frames before the failed step are real and were paid for.
            self.end(r, Status.FAILED, err, drain=True)
            return
        table = self._table
        with table.lock:
            r.delivered += 1
            if table.producer_waiting:
                table.cond.notify()
        if t.data is None or r.finalized:
            return  # the request ended while its copy was in flight
        frame = engine_frame(
            r.id,
            t.step,
            r.total,
            t.data,
            t.queued_s,
            t.compute_s,
            t.copy_s,
            t.batch_size,
            t.decode_s,
            t.decoded,
            r.images,
            t.cached,
        )
        replaced = r.delivery.put(frame)
        self.frames_delivered += 1
        if replaced is not None:
            self.frames_dropped += 1
            self.consumed(r)
        if t.step == r.total:  # frame.final
            self.end(r, Status.FINISHED, None)

    # -- request endings ---------------------------------------------------------

    def end(self, r: Request, status: Status, error: BaseException | None, *, drain: bool = False) -> bool:
        """Finalise ``r`` once: set its status, count it, tell its reader. False if it had ended."""
        if r.finalized:
            return False
        r.finalized = True
        with self._table.cond:
            r.status = status
            self._table.cond.notify_all()
        if self.by_id.get(r.id) is r:
            del self.by_id[r.id]
        self.counts[status] += 1
        r.delivery.end(error, drain=drain)
        return True

    # -- the reader's side (FrameStream) -----------------------------------------

    def consumed(self, r: Request) -> None:
        """The reader took a frame of ``r``: the producer may run it further."""
        table = self._table
        with table.lock:
            r.consumed += 1
            if table.producer_waiting:
                table.cond.notify()

    def abandon(self, r: Request) -> None:
        """Nobody will read ``r`` any more: cancel it (nothing if it has ended)."""
        self.end(
            r,
            Status.CANCELLED,
            RequestCancelledError("the stream was closed before its final frame", request_id=r.id),
        )

    def abandon_threadsafe(self, r: Request) -> None:
        """``abandon`` from any thread (a garbage-collected stream); never raises."""
        loop = self.loop
        if loop is None or r.finalized:
            return
        # Loop closed (trio: RunFinishedError, a RuntimeError): the engine is gone with it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.abandon, r)

    def step_timeout(self, r: Request) -> float:
        """Seconds the reader of ``r`` waits for one step: its ``timeout=``, else the config's, now."""
        return r.timeout if r.timeout is not None else default_timeout()

    def clock(self) -> float:
        """Now, on the clock the producer stamps ``handed_at`` with (the table's)."""
        return self._table.clock()

    def step_deadline(self, r: Request, waiting_since: float, bound: float) -> float | None:
        """When the reader of ``r``, waiting since ``waiting_since`` (``clock()``), times out.

        A stepped model gives every queued request a step within a batch or
        two, so the bound covers queueing too: ``waiting_since + bound``. A
        whole-request model (``runs_whole_requests``) runs one request to
        its end first, which may take far longer than one step's bound:
        such a wait is a queue, not a stalled step (health watches the
        running one). Its bound starts when the producer hands ``r`` the
        device (``handed_at``, stamped on the same clock), and None means
        it has not yet: no bound runs.

        A paused request (``Engine.pause``) has no bound while it is paused,
        and a wait that spans a pause is bounded from the resume.
        """
        # Read without the lock (a wait's hot path): each is one attribute,
        # and a stale read only moves the next look by one timer.
        if r.paused:
            return None
        resumed_at = r.resumed_at
        if resumed_at is not None:
            waiting_since = max(waiting_since, resumed_at)
        if self._model is None or not self._model.runs_whole_requests:
            return waiting_since + bound
        with self._table.cond:
            handed_at = r.handed_at
        if handed_at is None:
            return None
        return max(waiting_since, handed_at) + bound

    def time_left(self, r: Request, waiting_since: float, bound: float) -> float:
        """Seconds the reader of ``r``, waiting since ``waiting_since``, may still wait; <= 0: it timed out.

        ``step_deadline`` measured from now (the reader asks once a frame, in one call), and
        ``bound`` while no bound runs (queued behind a whole run, or paused).
        """
        deadline = self.step_deadline(r, waiting_since, bound)
        return bound if deadline is None else deadline - self._table.clock()

    def time_out(self, r: Request, bound: float) -> StepTimeoutError:
        """End ``r`` as timed out after ``bound`` seconds without a frame; returns the error to raise."""
        step = min(r.delivered + 1, r.total)
        stage = self.waiting_on(r, step)
        source = "the request's timeout=" if r.timeout is not None else STEP_TIMEOUT_ENV
        err = StepTimeoutError(
            f"step {step}/{r.total} produced no output within {bound:.1f} s "
            f"(bound from {source}); it was {stage}. "
            f"Set {STEP_TIMEOUT_ENV} (or timeout=) to a larger value to allow slower steps",
            request_id=r.id,
            step=step,
            bound_s=bound,
        )
        logger.warning(
            "request %s timed out after %.1f s waiting for step %d/%d (%s); "
            "set %s to a larger value to allow slower steps",
            r.id,
            bound,
            step,
            r.total,
            stage,
            STEP_TIMEOUT_ENV,
        )
        self.end(r, Status.TIMED_OUT, err)
        return err

    def waiting_on(self, r: Request, step: int) -> str:
        """What the step's output was waiting on, for the timeout message."""
        if r.issued >= step:
            return f"copying step {step}/{r.total} to the host"
        busy = self._producer.busy_with if self._producer.busy_since is not None else ()
        if r.id in busy:
            return f"computing step {step}/{r.total}"
        if busy:
            return f"queued behind a running step of request(s) {', '.join(busy)}"
        if r.unconsumed >= self._table.limits.queue_size and r.policy == "all":
            return "paused: its reader is behind"
        return f"queued for step {step}/{r.total}"
