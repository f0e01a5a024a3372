"""The step producer: the one thread that owns the accelerator.

It loops on its own: pick a batch, run ``model.step`` on it, issue the
copies, post the tickets to the loop, repeat. The event loop is never on
the path between two steps; the producer waits only when no request may
advance, because each is either done, ``max_run_ahead`` steps ahead of its
copies, or (policy "all") ``queue_size`` frames ahead of its reader. Those
bounds are what backpressure means here: a slow reader slows its own
request and nobody else's.

Model errors fail only the requests they belong to: a batched ``step`` that
raises is retried one state at a time (the model contract says a raising
step leaves its states untouched), so one bad request in a batch cannot
take its neighbours down; a bad output, or one that cannot be copied, fails
its own request. Anything else raised here is a bug in the machinery (or a
device error); it propagates, and the engine declares itself dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import STEP_TIMEOUT_ENV, timeout as default_timeout
from ..device import Device, PoolClosedError
from ..device.openmp import set_torch_threads_here
from ..errors import OmniStreamError, ParamsError, StepFailedError, StepTimeoutError
from ..model import RequestStopped, StepModel
from .copier import Copier, CopyTicket
from .request import _QUEUED, _RUNNING, Request, Status
from .scheduler import BatchLimits, pick_batch
from .table import RequestTable

__all__ = ["Producer"]

logger = logging.getLogger("omni_stream.engine")


class Producer:
    """Runs on its own thread; see the module docstring."""

    def __init__(
        self,
        model: StepModel | None,
        device: Device,
        copier: Copier,
        table: RequestTable,
        *,
        torch_threads: int = 1,
        build: Callable[[], StepModel] | None = None,
        on_ready: Callable[[StepModel], None] | None = None,
    ) -> None:
        """``model``, or None and ``build``: called first thing on the thread (see :meth:`run`).

        ``on_ready(model)`` is called on the thread once the model is built
        (when ``build`` was given) and loaded, before any request runs.
        """
        if (model is None) == (build is None):
            raise TypeError("Producer takes a model or a build function, not both or neither")
        self._model: StepModel = model  # type: ignore[assignment]  # set by run() when None
        self._step_reused: Callable[[list[Any]], Sequence[bool]] | None = None
        self._build = build
        self._on_ready = on_ready
        self._torch_threads = torch_threads
        self._device = device
        self._copier = copier
        self._table = table
        # Until a built model says otherwise: the engine's option.
        self._batch_limits = BatchLimits(
            table.limits.max_batch_size, table.limits.scheduling, table.limits.quantum
        )
        if model is not None:
            self._batch_limits = self._limits_for(model)
        self._seq = 0
        # The device's after-step hook, None where it is the default that does nothing
        # (a Python call a step saved on the CPU and CUDA devices).
        self._after_step: Callable[[], None] | None = (
            None if type(device).after_step is Device.after_step else device.after_step
        )
        # Tickets of the last batch, posted to the loop at the next flush
        # (see _flush): before any model code runs or the thread waits.
        self._unposted: list[CopyTicket] = []
        #: monotonic time the running step began, None between steps (read by health).
        self.busy_since: float | None = None
        self.busy_with: tuple[str, ...] = ()
        self._busy_cm = _Busy(self)
        self.steps = 0
        self.batches = 0
        self.batch_sizes: dict[int, int] = {}

    def run(self) -> None:
        """The thread's body; returns when the table says stop."""
        try:
            self._device.prepare_thread()
            if self._device.computes_on_cpu:
                # The model's CPU compute runs here, on a team of the chosen
                # size (config.default_torch_threads says how many by default); the
                # engine released the loop thread's idle team when it started.
                # Only this thread's setting changes, not the process default.
                set_torch_threads_here(self._torch_threads)
            if self._build is not None:
                # Built here, on the thread (and with the device) it will run
                # on: its weights are allocated where they are used, and an
                # engine group builds one member's model at a time.
                with self._busy(("model_factory",)):
                    model = self._build()
                if not isinstance(model, StepModel):
                    raise ParamsError(
                        f"the model factory returned {type(model).__name__}, not an omni_stream.StepModel",
                        field="model",
                    )
                self._model = model
                self._batch_limits = self._limits_for(model)
            # A model with step caching says which of a step's requests reused their cache.
            self._step_reused = getattr(self._model, "step_reused", None)
            with self._busy(("model.load",)):
                self._model.load(self._device.torch_device)
            if self._on_ready is not None:
                self._on_ready(self._model)
            while True:
                batch = self._next_batch()
                if batch is None:
                    break
                self._run_batch(batch)
        except BaseException:
            self._wind_down(dying=True)
            raise
        self._wind_down(dying=False)

    def _wind_down(self, *, dying: bool) -> None:
        """On the way out of :meth:`run`: post what was computed, then close every started state.

        The states are closed even when the post raises (the loop gone, the
        copier broken). Dying, the error that killed the thread is the one
        that propagates, and the post's is logged.
        """
        try:
            try:
                # Frames computed before a stop or a failure still reach the
                # copier (it frees their buffers, and readers get them).
                self._flush()
            except Exception:
                if not dying:
                    raise
                logger.exception("the producer died, and its last frames could not be posted either")
        finally:
            # Stopping or dying: every started state is closed here, on this
            # thread, exactly once ("close" is part of the model contract).
            with self._table.cond:
                live = list(self._table.live.values())
                self._table.live.clear()
            for r in live:
                self._close(r)

    def _limits_for(self, model: StepModel) -> BatchLimits:
        limit = min(self._table.limits.max_batch_size, max(1, int(model.max_batch_size)))
        if model.runs_whole_requests:
            limit = 1  # run() takes one request: never start a second that would wait
        return BatchLimits(limit, self._table.limits.scheduling, self._table.limits.quantum)

    def _busy(self, what: tuple[str, ...]) -> _Busy:
        """Mark the thread as inside model code, for health's stall check (a ``with`` block)."""
        busy = self._busy_cm
        busy.what = what
        return busy

    # -- choosing ------------------------------------------------------------

    def _next_batch(self) -> list[Request] | None:
        table = self._table
        limits = table.limits
        max_run_ahead, queue_size = limits.max_run_ahead, limits.queue_size
        while True:
            with table.lock:
                while True:
                    if table.stopping:
                        self._flush()
                        return None
                    # One pass over the table (this runs once a step): the
                    # runnable requests, unless some request first needs its
                    # state closed (it ended) or moved to the host (paused).
                    runnable: list[Request] = []
                    chores = False
                    for r in table.live.values():
                        status = r.status  # not status.ended, written out: once per request a step
                        if (status is not _QUEUED and status is not _RUNNING) or (
                            r.paused and r.to_host and _movable(r)
                        ):
                            chores = True
                            break
                        if r.runnable(max_run_ahead, queue_size):
                            runnable.append(r)
                    if chores:
                        break  # close and retire ended requests first, outside the lock
                    batch = runnable if len(runnable) == 1 else list(pick_batch(runnable, self._batch_limits))
                    if batch:
                        self._seq += 1
                        # The moment each gets the device, stamped here where it
                        # is known: a reader queued behind a whole run bounds
                        # its wait from it rather than guess it afterwards.
                        handed_at = table.clock()
                        for r in batch:
                            # Consecutive rounds: the preemptive policy's quantum counts them.
                            r.run_streak = r.run_streak + 1 if r.last_scheduled == self._seq - 1 else 1
                            r.last_scheduled = self._seq
                            r.status = Status.RUNNING
                            r.handed_at = handed_at
                        return batch
                    # Nothing may run until frames are delivered or read:
                    # the ones computed must be on their way first.
                    self._flush()
                    table.producer_waiting = True
                    try:
                        table.cond.wait()
                    finally:
                        table.producer_waiting = False
            self._retire()
            self._offload()

    def _retire(self) -> None:
        """Close the model state of ended requests and drop them from the table."""
        table = self._table
        with table.cond:
            ended = [r for r in table.live.values() if r.status.ended]
            for r in ended:
                del table.live[r.arrival]
        for r in ended:
            self._close(r)

    def _offload(self) -> None:
        """Move the state of requests paused ``to_host`` off the device: a checkpoint on the host
        (``model.snapshot``), the device state closed; the request restores it when it runs again.

        A model that cannot snapshot keeps the state where it is (the pause holds anyway).
        """
        with self._table.lock:
            moving = [r for r in self._table.live.values() if r.paused and r.to_host and _movable(r)]
        for r in moving:
            try:
                with self._busy((r.id,)):
                    checkpoint = self._model.snapshot(r.state)
            except Exception as exc:  # noqa: BLE001 - the pause still holds; the state stays on the device
                logger.warning("request %s: its paused state stays on the device: %s", r.id, exc)
                r.to_host = False
                continue
            # The checkpoint holds the request from here: the device state is
            # dropped before its close runs, so a close that raises still
            # counts as its one close (a state kept after it would be closed
            # again when the request ends, or stepped after its close).
            state = r.state
            r.state = None
            r.resume_from = checkpoint
            r.started = False
            r.to_host = False
            try:
                with self._busy((r.id,)):
                    self._model.close(state)
            except Exception:
                logger.exception(
                    "request %s: model.close() raised as its state moved to the host; ignored", r.id
                )

    def _close(self, r: Request) -> None:
        if r.started and not r.closed:
            r.closed = True
            try:
                with self._busy((r.id,)):
                    self._model.close(r.state)
            except Exception:
                logger.exception("request %s: model.close() raised; ignored", r.id)
            r.state = None

    # -- running -------------------------------------------------------------

    def _run_batch(self, batch: list[Request]) -> None:
        started_at = time.monotonic()
        tickets: list[CopyTicket] = []
        try:
            ready: list[Request] = []
            for r in batch:
                if not r.started:
                    try:
                        with self._busy((r.id,)):
                            device = self._device.torch_device
                            if r.resume_from is not None:
                                # From a checkpoint: a restart's, or its own state brought back.
                                r.state = self._model.restore(r.resume_from, device)
                                r.resume_from = None
                            else:
                                r.state = self._model.start(r.params, device)
                        r.started = True
                    except Exception as start_exc:
                        tickets.append(self._failure(r, start_exc))
                        continue
                ready.append(r)
            if ready and self._model.runs_whole_requests:
                # A whole-request model posts its own tickets from emit().
                for r in ready:
                    self._run_whole(r, started_at)
                return
            for r, out, exc, compute_s in self._step(ready) if ready else ():
                n = r.issued + 1
                decoded, decode_s = False, 0.0
                if exc is None and n == r.total and r.params.get("output") == "image":
                    out, decoded, exc, decode_s = self._decode(r, out, self._model.decode)
                    compute_s += decode_s
                elif exc is None and r.preview_every is not None and r.previewed(n):
                    out, decoded, exc, decode_s = self._decode(r, out, self._model.decode_preview, aside=True)
                    compute_s += decode_s
                if exc is None:
                    try:
                        ticket = self._copier.submit(
                            # (ready_at changes only in the finally below, after every submit.)
                            r,
                            n,
                            out,
                            queued_s=started_at - r.ready_at,
                            compute_s=compute_s,
                            batch_size=len(ready),
                            decoded=decoded,
                            decode_s=decode_s,
                            cached=r.step_cached,
                        )
                    except PoolClosedError:
                        raise  # shutting down
                    except Exception as copy_exc:
                        # This request's output cannot be copied (a sparse
                        # tensor, an allocation failure): its failure, not ours.
                        exc = copy_exc
                if exc is not None:
                    tickets.append(self._failure(r, exc))
                    continue
                tickets.append(ticket)
                if r.checkpoint_every and n % r.checkpoint_every == 0 and n < r.total:
                    self._checkpoint(r, n)
        finally:
            # Issued copies must reach the copier whatever happens: it keeps
            # their sources alive until their events complete, then frees
            # their buffers. One lock round for the whole batch (hot path).
            if tickets:
                now = time.monotonic()
                with self._table.lock:
                    for t in tickets:
                        if t.error is None:
                            t.request.issued = t.step
                            t.request.ready_at = now
                self._unposted.extend(tickets)

    def _checkpoint(self, r: Request, step: int) -> None:
        """A periodic checkpoint of ``r`` after its step, to its ``on_checkpoint`` (which hands it off:
        serialising and writing it happen elsewhere, off this thread's critical path)."""
        callback = r.on_checkpoint
        if callback is None:
            return
        try:
            with self._busy((r.id,)):
                checkpoint = self._model.snapshot(r.state)
            callback(r.id, checkpoint)
        except Exception as exc:  # noqa: BLE001 - a checkpoint is insurance, not the request
            logger.warning("request %s: no checkpoint at step %d: %s", r.id, step, exc)

    def _flush(self) -> None:
        """Post the last batch's tickets to the loop (one wake-up for them all).

        Called before any model code runs (``_busy``), before the thread
        waits, when it stops, and when it dies: never later than the next
        step begins. Not at the end of the batch: waking the loop there
        made it take the GIL for the frames' delivery while this thread
        still had the next batch to choose (tens of microseconds of Python
        on each side, run by turns, a GIL hand-over each way); posted at
        the start of the next step, the loop's part overlaps the step. The
        counters the scheduler reads (``issued``) are set before, under the
        lock, so backpressure is unchanged.
        """
        if self._unposted:
            tickets, self._unposted = self._unposted, []
            self._copier.post(tickets)

    def _step(self, batch: list[Request]) -> list[tuple[Request, Any, BaseException | None, float]]:
        single = len(batch) == 1
        t0 = time.monotonic()
        try:
            # ``_flush`` and the busy mark (``_busy``) written out: this runs once a step.
            unposted = self._unposted
            if unposted:
                self._unposted = []
                self._copier.post(unposted)
            self.busy_with = (batch[0].id,) if single else tuple(r.id for r in batch)
            self.busy_since = t0
            try:
                outs = self._model.step([batch[0].state] if single else [r.state for r in batch])
            finally:
                self.busy_since = None
        except Exception as exc:
            if len(batch) == 1:
                return [(batch[0], None, exc, 0.0)]
            # The contract says a raising step left its states untouched, so
            # each can be retried alone and only the one at fault fails.
            logger.warning("a batched step of %d requests raised %r; retrying each alone", len(batch), exc)
            results = []
            for r in batch:
                results.extend(self._step([r]))
            return results
        # A device error here is the machinery's, not a request's: propagate.
        if self._after_step is not None:
            self._after_step()
        compute_s = time.monotonic() - t0
        n = len(batch)
        self.steps += n
        self.batches += 1
        self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
        # The states have advanced: a bad output fails its request, and
        # nothing is ever stepped twice.
        if not (type(outs) is list or isinstance(outs, Sequence)) or len(outs) != n:
            got = len(outs) if isinstance(outs, Sequence) else type(outs).__name__
            err = TypeError(f"model.step returned {got} frames for {n} states")
            return [(r, None, err, compute_s) for r in batch]
        if self._step_reused is not None:
            for r, reused in zip(batch, self._step_reused([r.state for r in batch]), strict=True):
                r.step_cached = bool(reused)
        if single:
            out = outs[0]
            bad = None if isinstance(out, torch.Tensor) else self._check_output(out)
            return [(batch[0], out, bad, compute_s)]
        return [(r, out, self._check_output(out), compute_s) for r, out in zip(batch, outs, strict=True)]

    def _decode(
        self,
        r: Request,
        frame: torch.Tensor,
        decode: Callable[[Any, torch.Tensor], Any],
        *,
        aside: bool = False,
    ) -> tuple[Any, bool, BaseException | None, float]:
        """Run ``model.decode`` (the final frame) or ``model.decode_preview`` (``aside``: where the
        device runs preview decodes, beside the next step on a GPU) here.

        Returns (frame, decoded, error, seconds). When the model returns the
        frame itself (its frames are pictures already) or None (no preview
        network) the frame goes out as it is, not marked decoded.
        """
        t0 = time.monotonic()
        try:
            with self._busy((r.id,)):
                out = self._device.decode_aside(decode, r.state, frame) if aside else decode(r.state, frame)
        except Exception as exc:
            return None, False, exc, time.monotonic() - t0
        if out is frame or out is None:
            return frame, False, None, 0.0
        if self._after_step is not None:
            self._after_step()
        decode_s = time.monotonic() - t0
        if not isinstance(out, torch.Tensor):
            err = TypeError(f"{decode.__name__} must return a tensor, got {type(out).__name__}")
            return None, False, err, decode_s
        return out, True, None, decode_s

    # -- whole-request models ----------------------------------------------------

    def _run_whole(self, r: Request, started_at: float) -> None:
        """Run one request of a ``runs_whole_requests`` model to its end (or its stop)."""
        emit = _Emitter(self, r, queued_s=started_at - r.ready_at)
        try:
            with self._busy((r.id,)):
                emit.mark()
                self._model.run(r.state, emit)
        except PoolClosedError:
            raise
        except (Exception, RequestStopped) as exc:
            # A RequestStopped that emit did not raise (the model raised it
            # itself) fails the request like any error: returning quietly
            # would leave it runnable, to be run again from a used state.
            if not emit.stopped:
                self._copier.post([self._failure(r, exc, held=emit.final)])
            return
        if emit.stopped:
            return
        if emit.final is None:
            err = RuntimeError(f"model.run returned after {r.issued} of {r.total} frames")
            self._copier.post([self._failure(r, err)])
            return
        self._post_one(emit.final)

    def _post_one(self, ticket: CopyTicket) -> None:
        with self._table.cond:
            ticket.request.issued = ticket.step
            ticket.request.ready_at = time.monotonic()
        self._copier.post([ticket])

    def _wait_runnable(self, r: Request, bound_s: float) -> str:
        """Block until ``r``, inside a whole run, may take its next step: ``"go"``, ``"stop"`` (it
        ended, or the engine is stopping) or ``"stalled"`` (its reader took nothing for ``bound_s``,
        on the table's clock, as every other step bound is)."""
        table = self._table
        limits = table.limits
        clock = table.clock
        deadline = clock() + bound_s
        with table.cond:
            while True:
                if table.stopping or r.status.ended:
                    return "stop"
                # Not ``r.runnable``: a whole run cannot hold a pause. It is inside the
                # model's loop, holding the device for every other request, so Engine.pause
                # refuses it; one set anyway must neither park everyone behind it until the
                # bound runs out nor then fail this request with a timeout that blames its
                # reader. Only the reader and the copies hold it back.
                if _has_room(r, limits.max_run_ahead, limits.queue_size):
                    return "go"
                left = deadline - clock()
                if left <= 0:
                    return "stalled"
                table.producer_waiting = True
                try:
                    table.cond.wait(left)
                finally:
                    table.producer_waiting = False

    @staticmethod
    def _check_output(out: Any) -> BaseException | None:
        if isinstance(out, torch.Tensor):
            return None
        return TypeError(f"model.step must return tensors, got {type(out).__name__}")

    def _failure(self, r: Request, exc: BaseException, *, held: CopyTicket | None = None) -> CopyTicket:
        # A held ticket (a copy issued but not posted) carries the error
        # instead of its frame: the copier still waits for its copy and
        # returns its buffer to the pool.
        n = held.step if held is not None else r.issued + 1
        if isinstance(exc, OmniStreamError) and exc.request_id == r.id:
            err: BaseException = exc  # already says what went wrong with this request
        else:
            err = StepFailedError(
                f"{self._model.name} raised at step {n}/{r.total}: {type(exc).__name__}: {exc}",
                request_id=r.id,
                step=n,
            )
            err.__cause__ = exc
        with self._table.cond:
            if not r.status.ended:
                r.status = Status.FAILED
        # INFO: the caller gets the error itself; this is for the operator's trail.
        logger.info("request %s failed at step %d: %r", r.id, n, exc)
        if held is not None:
            held.error = err
            return held
        return CopyTicket(request=r, step=n, error=err)


def _has_room(r: Request, max_run_ahead: int, queue_size: int) -> bool:
    """Whether ``r``'s copies and reader let it compute its next frame (``Request.runnable``'s
    bounds, without its status or a pause)."""
    issued = r.issued
    if issued - r.delivered >= max_run_ahead:
        return False
    return r.policy == "latest" or issued - r.consumed < queue_size


def _movable(r: Request) -> bool:
    """Whether a request paused ``to_host`` has a device state to move (the producer's part)."""
    return r.started and not r.closed and r.state is not None


class _Busy:
    """``with producer._busy(what)``: the thread is inside model code, for health's stall check.

    One instance per producer, reused (the producer is one thread and busy
    blocks do not nest): a class, not ``contextlib.contextmanager``, whose
    generator and wrapper would be built again on every step.
    """

    __slots__ = ("_producer", "what")

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.what: tuple[str, ...] = ()

    def __enter__(self) -> None:
        producer = self._producer
        # Model code may run long: what is computed goes to the loop first.
        producer._flush()
        producer.busy_with = self.what
        producer.busy_since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self._producer.busy_since = None


class _Emitter:
    """The ``emit`` a whole-request model calls once per step (producer thread).

    Each call is one step of the request as the engine counts them: the
    frame goes to the copier, the request's counters advance, and the call
    returns once the request may take another step (its reader keeps up,
    its copies land), so backpressure works as for stepped models. A
    request that has ended (cancelled, timed out, failed) or an engine that
    is stopping makes it raise RequestStopped, which unwinds the model's
    loop within one step.
    """

    def __init__(self, producer: Producer, r: Request, *, queued_s: float) -> None:
        self._producer = producer
        self._r = r
        self._queued_s = queued_s
        self._last = time.monotonic()
        #: Set once this request must not be delivered to any more.
        self.stopped = False
        #: The final frame's ticket, held until run() returns.
        self.final: CopyTicket | None = None
        self.emitted = 0

    def mark(self) -> None:
        self._last = time.monotonic()

    def __call__(self, frame: torch.Tensor, *, decoded: bool = False) -> None:
        producer, r = self._producer, self._r
        if self.stopped:
            raise RequestStopped(f"request {r.id} was stopped")
        n = self.emitted + 1
        if n > r.total:
            raise RuntimeError(f"model.run emitted frame {n} of a request with {r.total} steps")
        self.emitted = n
        err = producer._check_output(frame)
        if err is not None:
            raise err
        decode_s = 0.0
        if not decoded and r.previewed(n):
            t0 = time.monotonic()
            pixels = producer._device.decode_aside(producer._model.decode_preview, r.state, frame)
            if pixels is not None:
                if not isinstance(pixels, torch.Tensor):
                    raise TypeError(
                        f"model.decode_preview must return a tensor or None, got {type(pixels).__name__}"
                    )
                frame, decoded, decode_s = pixels, True, time.monotonic() - t0
        if producer._after_step is not None:
            producer._after_step()
        now = time.monotonic()
        compute_s = now - self._last
        producer.steps += 1
        producer.batches += 1
        producer.batch_sizes[1] = producer.batch_sizes.get(1, 0) + 1
        ticket = producer._copier.submit(
            r,
            n,
            frame,
            queued_s=self._queued_s,
            compute_s=compute_s,
            batch_size=1,
            decoded=decoded,
            decode_s=decode_s,
        )
        if n == r.total:
            # The final frame goes out once run() returns: a model that then
            # emits again or raises fails its request instead of having
            # delivered a "final" frame that was not its last word.
            self.final = ticket
            self.mark()
            return
        producer._post_one(ticket)
        # Waiting for the reader is not model time: health must not call it a stall.
        producer.busy_since = None
        waited_from = time.monotonic()
        bound = r.timeout if r.timeout is not None else default_timeout()
        outcome = producer._wait_runnable(r, bound)
        now = time.monotonic()
        if outcome == "stalled":
            # A stepped request whose reader stalls just pauses; this one
            # holds the producer (and the device) inside the library's loop,
            # so every other request would wait on this reader. It fails.
            err = StepTimeoutError(
                f"step {n + 1}/{r.total}: the reader took no frame for {bound:.1f} s while the "
                f"model's loop held the device for it (a whole-request model cannot pause); "
                f"read with policy='latest', or raise {STEP_TIMEOUT_ENV}",
                request_id=r.id,
                step=n + 1,
                bound_s=bound,
            )
            producer._copier.post([producer._failure(r, err)])
            self.stopped = True
            raise RequestStopped(f"request {r.id}: its reader stalled")
        if outcome == "stop":
            self.stopped = True
            raise RequestStopped(f"request {r.id} was stopped")
        producer.busy_since = now
        self._queued_s = now - waited_from
        self._last = now
