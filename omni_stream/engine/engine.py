"""Engine: the facade. The task group, and submit / stream / cancel / health / statistics.

The data path (``docs/design.md`` draws it)::

    producer thread ──tickets──▶ copier task ──frames──▶ OutputProcessor.dispatch ──▶ Delivery ──▶ FrameStream
    (model.step, copy issue;     (waits on events,       (on the loop, in the       (all | latest)  (bounded
     CPU: the owned copy)         clones, releases;       copier's hand-over:                        per step)
                                  CPU frames skip it)     contained errors)

One anyio task group runs the producer's supervisor and the copier (the
frames are dispatched where the copier hands them over: no task between
them, _handover.py). If either dies, the engine is
dead: every pending and every later request fails at once with
EngineDeadError and ``check_health`` says so; there is no zombie that
accepts work and runs none.

Loop-side state (live requests by id, counters, deliveries) belongs to the
OutputProcessor and is touched only on the event loop; what the producer
also touches lives in the RequestTable under its lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..checkpoint import Checkpoint
from ..config import (
    STEP_TIMEOUT_ENV,
    TORCH_THREADS_ENV,
    timeout as default_timeout,
    torch_threads as default_torch_threads,
)
from ..device import Device, PinnedBufferPool, resolve_device
from ..device.openmp import release_idle_team, set_torch_threads_here
from ..errors import (
    CheckpointError,
    EngineClosedError,
    EngineDeadError,
    ParamsError,
    RequestCancelledError,
    StepFailedError,
)
from ..lifecycle import Lifecycle
from ..model import StepModel
from ..params import positive_int
from .copier import Copier
from .delivery import Delivery
from .facade import EngineFacade
from .intake import CheckedRequest, already_running, as_params_error, check_checkpointed, check_request_id
from .options import Checkpointing, CheckpointOptions, Ordering, RequestOptions, pick, stream_keywords
from .output_processor import OutputProcessor
from .producer import Producer
from .request import Request, Status
from .scheduler import check_policy
from .stats import EngineStatistics, Health
from .stream import FrameStream
from .table import Limits, RequestTable

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = ["Engine", "HandedOver", "pause_refusal"]

logger = logging.getLogger("omni_stream.engine")


class Engine(EngineFacade):
    """Streams every step of a model's generation; use as ``async with Engine(model) as engine``.

    Options: ``device`` ("auto", "cpu", "cuda", "cuda:N", "sim" or a Device);
    ``max_batch_size`` (requests advanced in one model call); ``max_run_ahead``
    (steps a request may compute before its earlier copies reach its reader);
    ``queue_size`` (frames a "all" reader may lag behind before its request
    pauses); ``max_buffers`` (host buffer pool cap; CPU devices use no
    pool); ``frame_dtype`` (cast on the device before copying);
    ``shutdown_timeout`` (seconds ``aclose`` waits for a step stuck on the
    device); ``torch_threads`` (torch threads
    of the producer on CPU devices; default ``OMNI_STREAM_TORCH_THREADS``,
    else from the core count: ``config.default_torch_threads``);
    ``scheduling`` ("preemptive", the default: the shortest remaining work
    first, aged, with ``quantum`` rounds (default 1) a running request keeps
    its place; "round-robin"; "fcfs": engine/scheduler.py; the default was
    chosen from ``python -m benchmarks --only scheduling``, docs/performance.md).
    Bad options raise ParamsError.
    Enter and leave the engine from the same task.

    ``model`` is a StepModel, or a callable returning one: then it is called
    on the producer thread when the engine starts (with the device set up
    for that thread), so the model is built where it runs; ``start()``
    returns once it is built and loaded (``model.load``), and raises what
    building it raised. Until then ``engine.model`` raises EngineClosedError.
    A model instance is loaded on the producer thread after ``start()``
    returns (requests queue meanwhile); ``wait_loaded()`` waits for it.

    ``start()`` (or entering it) starts its task group and producer thread;
    ``aclose()`` ends pending streams with EngineClosedError and joins the
    threads, a step stuck on the device delaying it by at most
    ``shutdown_timeout`` (logged; the producer thread is then abandoned).
    """

    _noun = "engine"

    def __init__(
        self,
        model: StepModel | Callable[[], StepModel],
        *,
        device: str | Device = "auto",
        max_batch_size: int = 8,
        max_run_ahead: int = 3,
        queue_size: int = 8,
        max_buffers: int | None = None,
        frame_dtype: torch.dtype | None = None,
        shutdown_timeout: float = 10.0,
        torch_threads: int | None = None,
        scheduling: str = "preemptive",
        quantum: int = 1,
    ) -> None:
        factory: Callable[[], StepModel] | None = None
        if not isinstance(model, StepModel):
            if not callable(model):
                raise ParamsError(
                    f"Engine needs an omni_stream.StepModel (or a callable returning one), got "
                    f"{type(model).__name__}; wrap a generator with omni_stream.from_generator",
                    field="model",
                )
            factory = model
        limits = Limits(
            max_batch_size=positive_int(max_batch_size, "max_batch_size"),
            max_run_ahead=positive_int(max_run_ahead, "max_run_ahead"),
            queue_size=positive_int(queue_size, "queue_size"),
            scheduling=check_policy(scheduling),
            quantum=positive_int(quantum, "quantum"),
        )
        if max_buffers is None:
            max_buffers = max(16, 2 * limits.max_batch_size * limits.max_run_ahead)
        positive_int(max_buffers, "max_buffers")
        # A batch holds one lease per output until it is posted: a batch
        # larger than the pool would wait on itself forever. Devices that
        # hand frames over without a buffer (CPU, ``copy_owned``) lease one
        # only for an output they cannot own (sparse, another device): there
        # the pool grows to a batch instead (allocated lazily, so it costs
        # nothing until used) and max_buffers does not cap the batch.
        device = resolve_device(device)  # (an instance resolves to itself below)
        if type(device).copy_owned is not Device.copy_owned:
            max_buffers = max(max_buffers, limits.max_batch_size)
        else:
            limits = dataclasses.replace(limits, max_batch_size=min(limits.max_batch_size, max_buffers))
        if frame_dtype is not None and not isinstance(frame_dtype, torch.dtype):
            raise ParamsError(f"frame_dtype must be a torch.dtype, got {frame_dtype!r}", field="frame_dtype")
        if not isinstance(shutdown_timeout, (int, float)) or not shutdown_timeout > 0:
            raise ParamsError(
                f"shutdown_timeout must be a positive number, got {shutdown_timeout!r}",
                field="shutdown_timeout",
            )
        if torch_threads is None:
            torch_threads = default_torch_threads()
        positive_int(torch_threads, "torch_threads", env=TORCH_THREADS_ENV)
        super().__init__()
        self._model: StepModel | None = None if factory is not None else model  # type: ignore[assignment]
        self.device = resolve_device(device)
        self._shutdown_timeout = float(shutdown_timeout)
        self._table = RequestTable(limits)
        # Frames of large outputs are the pool's buffers themselves, lent to their readers
        # (device/pool.py): never so many that a batch's copies a run-ahead deep could not get
        # buffers, and no more to one request than its reader's queue and the frame in hand.
        self._pool = PinnedBufferPool(
            self.device.host_buffer,
            max_buffers=max_buffers,
            max_lent=max(0, max_buffers - limits.max_batch_size * limits.max_run_ahead),
            max_lent_per_owner=limits.queue_size + 2,
        )
        self._copier = Copier(self.device, self._pool, frame_dtype=frame_dtype)
        self._producer = Producer(
            self._model,
            self.device,
            self._copier,
            self._table,
            torch_threads=torch_threads,
            build=factory,
            on_ready=self._model_ready_threadsafe,
        )
        # Set once the model is loaded on the producer thread (``_loaded``), or
        # the thread ended, or the engine closed: what wait_loaded() waits on.
        self._model_ready = anyio.Event()
        self._loaded = False
        # Callers of wait_loaded() that will be told how loading ended: while
        # there are any, a failure to load is theirs to report, not the log's.
        self._load_waiters = 0
        # The per-frame hand-over, the request endings and their counters.
        # Every FrameStream holds it too.
        self._output = OutputProcessor(self._table, self._producer, self._model)
        # The processor's own dict, not a copy: ending a request removes it.
        self._by_id: dict[str, Request] = self._output.by_id
        self._dead: BaseException | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._thread: threading.Thread | None = None
        self._producer_done = anyio.Event()
        self._producer_error: BaseException | None = None
        # model.prepare() runs one request at a time (made in start(), on the loop).
        self._prepare_limiter: anyio.CapacityLimiter | None = None

    # -- lifecycle -------------------------------------------------------------

    async def _start(self) -> None:
        """The task group and the producer thread; with a model factory, the model loaded."""
        # The loop start() found: the producer thread hands each batch of frames to it.
        self._copier.loop = self._output.loop = self._loop
        if self.device.computes_on_cpu:
            # The loop thread usually built the model, so it may keep an idle
            # OpenMP team; beside the producer's, that makes libgomp sleep on
            # a futex at every parallel region. Freed here, the producer's is
            # the only team (device/openmp.py, docs/performance.md).
            release_idle_team()
        self._prepare_limiter = anyio.CapacityLimiter(1)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._supervised, "copier", self._copier.run, self._output.deliver)
        tg.start_soon(self._supervised, "producer", self._run_producer)
        # Let the tasks start (the producer thread with them) before returning.
        # The copier's loop is bound above, not in its task: trio runs new
        # tasks in any order, and the producer could post first.
        await anyio.sleep(0)
        if self._model is None:
            await self.wait_loaded()  # failed or cancelled: start() closes the engine

    async def wait_loaded(self) -> None:
        """Return once the model is built and loaded onto the device (``model.load`` returned).

        ``start()`` waits for this itself only for a model built by a factory.
        Raises EngineClosedError if the engine is not started, or closed
        before its model loaded; the ParamsError a factory raised; or
        EngineDeadError (building or loading the model failed, or the
        engine died meanwhile; the cause attached).
        """
        if self._state is Lifecycle.NEW:
            raise EngineClosedError("the engine is not started (use `async with Engine(...)`)")
        self._load_waiters += 1
        try:
            await self._model_ready.wait()
        except BaseException:
            self._load_waiters -= 1  # cancelled: this caller will not report the outcome
            raise
        if self._loaded and self._dead is None:
            return
        error = self._dead or self._producer_error
        if error is None:
            raise EngineClosedError("the engine was shut down before its model loaded")
        # Recorded here too, whichever of this and the supervisor runs first:
        # the engine is dead (health, later requests), quietly, as the error is raised.
        self._die(error, where="producer")
        if isinstance(error, ParamsError):
            raise error
        raise EngineDeadError(self._death_reason(error)) from error

    def _death_reason(self, error: BaseException) -> str:
        """What failed: before the model was ready, the stage the producer was in."""
        if self._loaded:
            return f"engine machinery failed: {error!r}"
        stages: dict[tuple[str, ...], str] = {
            ("model_factory",): "building the model",
            ("model.load",): "loading the model",
        }
        stage = stages.get(self._producer.busy_with, "starting the producer thread")
        return f"{stage} failed: {error!r}"

    def _model_ready_threadsafe(self, model: StepModel) -> None:
        # Producer thread: the model is built and loaded, no request ran yet.
        loop = self._loop
        assert loop is not None
        loop.call_soon_threadsafe(self._set_model, model)

    def _set_model(self, model: StepModel) -> None:
        self._model = model
        self._output.set_model(model)
        self._loaded = True
        self._model_ready.set()

    @property
    def model(self) -> StepModel:
        """The model; raises EngineClosedError while one built by a factory is not ready yet."""
        if self._model is None:
            raise EngineClosedError(
                "the engine builds its model on its producer thread when it starts; "
                "use it inside `async with engine`"
            )
        return self._model

    async def _shutdown(self) -> None:
        """Pending streams end with EngineClosedError, threads are joined.

        A step stuck on the device delays this by at most ``shutdown_timeout``
        (logged); the producer thread is then abandoned (it is a daemon).
        """
        if self._tg is None:  # start() failed before anything ran
            self._model_ready.set()
            return
        try:
            # Shielded: aclose often runs *because* an outer scope was
            # cancelled, and leaving early would skip the task group's exit.
            # Every wait inside is bounded (shutdown_timeout).
            with anyio.CancelScope(shield=True):
                for r in list(self._by_id.values()):
                    self._output.end(
                        r, Status.CANCELLED, EngineClosedError("the engine was shut down", request_id=r.id)
                    )
                self._stop_producer()
                with anyio.move_on_after(self._shutdown_timeout) as scope:
                    await self._producer_done.wait()
                if scope.cancelled_caught:
                    logger.warning(
                        "shutdown: the producer thread is still inside model code after %.1f s "
                        "(%s); abandoning it",
                        self._shutdown_timeout,
                        ", ".join(self._producer.busy_with) or "-",
                    )
            # Outside the shield: a task group must be exited from its own
            # scope level. Its exit waits for its (cancelled) children even
            # when an outer cancellation is pending, then re-raises it.
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        finally:
            if self._producer_done.is_set():
                # No copy can be issued any more: give back every lease whose
                # copy completed. One still in flight means a wedged device.
                stuck = self._copier.drain()
                if stuck:
                    logger.warning(
                        "shutdown: %d device-to-host copies never completed; their buffers are abandoned",
                        stuck,
                    )
                self.device.close()
            self._model_ready.set()  # a wait_loaded() still waiting learns the engine closed

    def _stop_producer(self) -> None:
        with self._table.cond:
            self._table.stopping = True
            self._table.cond.notify_all()
        self._pool.close()

    async def _supervised(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            await fn(*args)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._die(exc, where=name)
        else:
            if self._state is Lifecycle.RUNNING:
                self._die(RuntimeError(f"the {name} stopped unexpectedly"), where=name)

    async def _run_producer(self) -> None:
        self._thread = threading.Thread(target=self._producer_main, name="omni-stream-producer", daemon=True)
        self._thread.start()
        await self._producer_done.wait()
        error = self._producer_error
        if error is not None and self._state is Lifecycle.RUNNING:
            if not isinstance(error, Exception):
                # SystemExit and friends from the thread must not cancel the
                # task that owns the engine: the engine dies, visibly.
                raise RuntimeError(f"the producer thread exited with {error!r}") from error
            raise error

    def _producer_main(self) -> None:
        error: BaseException | None = None
        try:
            self._producer.run()
        except BaseException as exc:  # reported to the loop, which decides
            error = exc
        loop = self._loop
        assert loop is not None
        # The loop is gone (trio: RunFinishedError, a RuntimeError); nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._producer_exited, error)

    def _producer_exited(self, error: BaseException | None) -> None:
        self._producer_error = error
        self._producer_done.set()
        self._model_ready.set()  # a start() waiting for the model wakes (to the error)

    def _die(self, exc: BaseException, *, where: str) -> None:
        if self._dead is not None or self._state is not Lifecycle.RUNNING:
            return
        self._dead = exc
        if self._load_waiters and not self._loaded:
            # wait_loaded() raises it to its caller (start(), an EngineGroup),
            # who reports it: once, not here as well.
            logger.debug("engine dead before its model loaded: the %s failed: %r", where, exc)
        else:
            logger.error("engine dead: the %s failed: %r", where, exc, exc_info=exc)
        for r in list(self._by_id.values()):
            err = EngineDeadError(f"the engine died ({where}: {exc!r})", request_id=r.id)
            err.__cause__ = exc
            self._output.end(r, Status.FAILED, err)
        self._stop_producer()

    # -- submitting ----------------------------------------------------------------

    def _check_open(self, request_id: str | None = None) -> None:
        # Dead before closed: what killed it is the news, whatever its state since.
        if self._dead is not None:
            raise EngineDeadError(
                f"the engine is dead: {self._dead!r}", request_id=request_id
            ) from self._dead
        super()._check_open(request_id)

    @stream_keywords(CheckpointOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[CheckpointOptions[Checkpoint]]
    ) -> FrameStream:
        """Submit a request; returns its frames as an async iterator.

        ``request_id``: 1-128 characters from ``A-Z a-z 0-9 . _ : -``, not
        "." or ".." (omni_stream/ids.py); None gets a fresh one.

        ``priority`` (an int from -10 to 10, higher first) orders it against
        the other requests; waiting ages every request, so none starves
        (docs/design.md, "Scheduling and batching"). ``group`` and ``rank``:
        the requests of one group take the places the policy gives that group
        in the order of their rank, highest first (a server passes each
        request's principal and its own priority, which must not rank it
        against other principals'; engine/scheduler.py).

        ``preview_every``: the steps a reader will preview (every Nth, as
        ``PreviewSpec.every``); on those the model's preview decoder network,
        if it has one (``StepModel.decode_preview``, e.g. a tiny VAE), turns
        the frame into pixels on the producer's device. None decodes none.

        ``resume``: start from this checkpoint (``model.restore``; its params
        are the checkpoint's, ``params`` is not read): the frames continue at
        ``resume.step + 1``. ``checkpoint_every`` N with ``on_checkpoint``:
        every N steps (not after the last) the producer snapshots the request
        and calls ``on_checkpoint(request_id, checkpoint)`` on its thread: it
        must hand the checkpoint off and return (serialise and write it
        elsewhere). Both need a model that can snapshot the request
        (``model.can_snapshot``; docs/models.md).

        Raises ParamsError (bad params, request_id, policy, timeout,
        preview_every, priority or a duplicate request_id; engine/intake.py),
        CheckpointError (a checkpoint the model refuses, or checkpoints asked
        of a model that cannot make them),
        EngineDeadError or EngineClosedError at once. Iterating raises
        StepFailedError, StepTimeoutError, RequestCancelledError,
        EngineDeadError or EngineClosedError.
        """
        request_id = options["request_id"] = check_request_id(options["request_id"])
        # Before the rest: a closed engine says so whatever the params, and
        # a model still being built has nothing to check them against.
        self._check_open(request_id)
        checked = check_checkpointed(
            self.model,
            params,
            resume=options["resume"],
            checkpoint_every=options["checkpoint_every"],
            **pick(options, RequestOptions),
        )
        return self.submit(checked, **pick(options, Checkpointing), **pick(options, Ordering))

    def submit(
        self,
        request: CheckedRequest,
        *,
        resume: Checkpoint | None = None,
        checkpoint_every: int | None = None,
        on_checkpoint: Callable[[str, Checkpoint], None] | None = None,
        group: Hashable | None = None,
        rank: int = 0,
    ) -> FrameStream:
        """Submit a request ``check_request`` passed; returns its frames as ``stream`` does
        (``group`` and ``rank``: engine/options.py's Ordering).

        For a front that checks requests once for several engines (an
        EngineGroup checks against its first member's model, and each member's
        is built alike): ``request`` is not checked against this model again.
        Raises ParamsError (a duplicate request_id, or params this model's
        ``batch_key`` refuses), EngineDeadError or EngineClosedError.
        """
        request_id = request.request_id
        self._check_open(request_id)
        if request_id in self._by_id:
            raise already_running(request_id)
        with as_params_error(self.model, request_id):
            key = self.model.batch_key(request.params)
        with self._table.cond:
            self._table.arrivals += 1
            r = Request(
                request_id=request_id,
                params=request.params,
                total=request.total,
                batch_key=key,
                policy=request.policy,
                timeout=request.timeout,
                preview_every=request.preview_every,
                arrival=self._table.arrivals,
                priority=request.priority,
                group=group,
                rank=rank,
                # Its wait ages from here (the producer counts rounds under this lock).
                arrival_round=self._producer._seq,
                delivery=Delivery(request.policy),
                resume_from=resume,
                checkpoint_every=checkpoint_every,
                on_checkpoint=on_checkpoint,
            )
            if _needs_prepare(self._model, request.params):
                # Not runnable until the model prepared it, in a worker thread:
                # the producer keeps stepping everyone else meanwhile.
                r.preparing = True
            self._table.live[r.arrival] = r
            self._table.wake_producer()
        self._by_id[request_id] = r
        if r.preparing:
            assert self._tg is not None  # _check_open: running
            self._tg.start_soon(self._prepare, r, name=f"omni_stream prepare {request_id}")
        return FrameStream(self._output, r)

    async def _prepare(self, r: Request) -> None:
        """Run ``model.prepare`` for ``r`` in a worker thread (one at a time), then let it run.

        A failure fails ``r`` alone (StepFailedError, step 0). A request
        cancelled meanwhile just ends; its preparation finishes in the
        background (a thread cannot be interrupted) and is dropped.
        """
        model = self.model
        prepare = model.prepare  # type: ignore[attr-defined]
        device = self.device.torch_device
        on_cpu = self.device.computes_on_cpu

        def job() -> None:
            if on_cpu:
                # One thread, no OpenMP team: a second team beside the
                # producer's slows every parallel region of both (openmp.py).
                set_torch_threads_here(1)
            prepare(r.params, device)

        try:
            await anyio.to_thread.run_sync(job, limiter=self._prepare_limiter, abandon_on_cancel=True)
        except Exception as exc:
            error = StepFailedError(
                f"{model.name} failed preparing the request: {type(exc).__name__}: {exc}",
                request_id=r.id,
                step=0,
            )
            error.__cause__ = exc
            logger.info("request %s failed while prepared: %r", r.id, exc)
            self._output.end(r, Status.FAILED, error)
            return
        with self._table.cond:
            r.preparing = False
            self._table.wake_producer()

    def cancel(self, request_id: str) -> bool:
        """Cancel a request from anywhere; True if it was still running.

        Its reader gets RequestCancelledError. Safe to call from any thread.
        """
        r = self._by_id.get(request_id)
        if r is None or r.finalized:
            return False
        # Bound to this request object, not the name: a later request
        # reusing the id must not be hit by this cancel.
        scheduled = self._call_soon_threadsafe(self._cancel_request, r)
        return self._cancel_request(r) if scheduled is None else scheduled

    def _cancel_request(self, r: Request) -> bool:
        return self._output.end(r, Status.CANCELLED, RequestCancelledError("cancelled", request_id=r.id))

    # -- pause and resume ----------------------------------------------------------

    def pause(self, request_id: str, *, to_host: bool = False) -> bool:
        """Pause a request between two steps; True if it was running and not paused already.

        A paused request is not runnable and holds no batch place: the step
        it is in (if any) completes, and no next one starts until
        :meth:`resume`. Its state stays on the device, or with ``to_host``
        moves to host memory (a checkpoint, ``model.snapshot``) and comes
        back when it runs again (a state the model then fails to capture
        stays on the device). The per-step timeout does not count paused
        time. Resumed, its frames and result equal an uninterrupted run's.

        False, whatever the request's progress, where its model cannot stop
        it between two steps (:func:`pause_refusal`; :meth:`pause_refusal`
        says why). Safe from any thread.
        """
        r = self._by_id.get(request_id)
        if r is None or r.finalized or pause_refusal(self.model, r.params, request_id) is not None:
            return False
        with self._table.cond:
            if r.paused or r.status.ended:
                return False
            r.paused = True
            r.to_host = bool(to_host)
            self._table.wake_producer()  # it may have the state to move
        return True

    def pause_refusal(self, request_id: str) -> str | None:
        """Why :meth:`pause` refuses ``request_id`` whatever its progress (its model cannot stop it
        between two steps), or None: it can, or no such request is here."""
        r = self._by_id.get(request_id)
        if r is None or r.finalized:
            return None
        return pause_refusal(self.model, r.params, request_id)

    def resume(self, request_id: str) -> bool:
        """Let a paused request run again; True if it was paused. Safe from any thread."""
        r = self._by_id.get(request_id)
        if r is None or r.finalized:
            return False
        with self._table.cond:
            if not r.paused:
                return False
            now = self._table.clock()
            r.paused = False
            r.to_host = False
            # Its next step may run now: the wait for it counts from here.
            r.ready_at = now
            r.resumed_at = now
            self._table.wake_producer()
        return True

    def offload(self, request_id: str) -> bool:
        """Pause a request (if it is not paused already) and move its state to the host, so that
        :meth:`hand_over` can take it out; True if it is on its way (or there already).

        False for a request not here or ended, and for one its model cannot stop between two
        steps (:func:`pause_refusal`). A client's pause stays a pause: only where its state is
        changes. Safe from any thread.
        """
        r = self._by_id.get(request_id)
        if r is None or r.finalized or pause_refusal(self.model, r.params, request_id) is not None:
            return False
        with self._table.cond:
            if r.status.ended:
                return False
            r.paused = True
            r.to_host = True
            self._table.wake_producer()  # it has the state to move
        return True

    def hand_over(self, request_id: str) -> HandedOver | None:
        """Take a request :meth:`offload` paused out of this engine, to go on in another (a model
        router unloading its model); None until its state is on the host and every frame it made
        has reached its stream. Call :meth:`offload` first.

        Its stream yields those frames, then raises RequestCancelledError (the router's stream
        goes on where the next engine takes it up). Not counted as cancelled. Raises
        CheckpointError when its state cannot leave the device (its model failed to snapshot
        it; the pause holds), RequestCancelledError for a request not here or ended.
        """
        r = self._by_id.get(request_id)
        if r is None or r.finalized:
            raise RequestCancelledError(
                f"request {request_id} is not in this engine: nothing to hand over", request_id=request_id
            )
        with self._table.cond:
            if r.started:
                # Its state is on the device, or on its way off it: the producer clears
                # ``to_host`` last, after ``resume_from`` and ``started``, and only then when
                # the snapshot failed does the state stay (offload() set it before asking).
                if r.paused and not r.to_host and not r.closed and r.state is not None:
                    raise CheckpointError(
                        f"request {request_id}: its state could not be moved to the host "
                        f"({self.model.name}.snapshot failed; the log says why), so it stays in "
                        "this engine",
                        request_id=request_id,
                    )
                return None
            if not r.paused or r.issued != r.delivered:
                return None
            checkpoint, step = r.resume_from, r.issued
        # Drained: the frames it made are real, and the next engine goes on after them.
        self._output.end(
            r,
            Status.CANCELLED,
            RequestCancelledError(f"request {request_id} was handed over to another engine", request_id=r.id),
            drain=True,
        )
        self._output.counts[Status.CANCELLED] -= 1  # it did not end: it goes on elsewhere
        return HandedOver(checkpoint, step)

    @property
    def scheduling(self) -> str:
        """The scheduling policy (engine/scheduler.py)."""
        return self._table.limits.scheduling

    @property
    def quantum(self) -> int:
        """The preemptive policy's quantum, in rounds (a request's steps, for the server's gate)."""
        return self._table.limits.quantum

    def is_paused(self, request_id: str) -> bool:
        """Whether the request is paused now."""
        r = self._by_id.get(request_id)
        return r is not None and r.paused and not r.finalized

    # -- health and statistics -----------------------------------------------------

    def health(self) -> Health:
        """The engine's state for ``/health``: ok, stalled, dead or closed."""
        stats = self.statistics()
        name = self.device.name
        if self._dead is not None:
            return Health("dead", self._death_reason(self._dead), stats, name)
        closed = self._lifecycle_health(stats, name)
        if closed is not None:
            return closed
        if self._thread is not None and not self._thread.is_alive() and self._producer_done.is_set():
            return Health("dead", "the producer thread exited", stats, name)
        # A wedged device shows as model code that never returns (CPU, or a
        # synchronising CUDA call) or as a copy that never lands (CUDA kernels
        # are queued asynchronously, so the hang surfaces at the copy).
        bound = default_timeout()
        now = time.monotonic()
        busy, waiting = self._producer.busy_since, self._copier.waiting_since
        if busy is not None and now - busy > bound:
            reason = (
                f"model code ({', '.join(self._producer.busy_with)}) has been running for "
                f"{now - busy:.1f} s, longer than {STEP_TIMEOUT_ENV}={bound:.1f} s; the device looks hung"
            )
            return Health("stalled", reason, stats, name)
        if waiting is not None and now - waiting > bound:
            reason = (
                f"a device-to-host copy issued {now - waiting:.1f} s ago has not completed "
                f"({STEP_TIMEOUT_ENV}={bound:.1f} s); the device looks hung"
            )
            return Health("stalled", reason, stats, name)
        return Health("ok", None, stats, name)

    def _death_cause(self) -> BaseException | None:
        return self._dead

    @property
    def max_batch_size(self) -> int:
        """The most requests one model call advances (the option, capped by the model and the pool)."""
        return self._producer._batch_limits.max_batch_size

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of counters, queue depth and host buffers."""
        active = queued = 0
        for r in list(self._by_id.values()):
            if r.status is Status.RUNNING:
                active += 1
            elif r.status is Status.QUEUED:
                queued += 1
        pool = self._pool.statistics()
        p = self._producer
        out = self._output
        return EngineStatistics(
            active=active,
            queued=queued,
            completed=out.counts[Status.FINISHED],
            cancelled=out.counts[Status.CANCELLED],
            failed=out.counts[Status.FAILED],
            timed_out=out.counts[Status.TIMED_OUT],
            buffers_total=pool.buffers_total,
            buffers_in_use=pool.buffers_in_use,
            buffers_in_flight=pool.buffers_in_flight,
            steps=p.steps,
            batches=p.batches,
            frames_delivered=out.frames_delivered,
            frames_dropped=out.frames_dropped,
            batch_sizes=dict(p.batch_sizes),
            buffers_lent=pool.buffers_lent,
            frames_lent=self._copier.frames_lent,
            frames_cloned=self._copier.frames_cloned,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class HandedOver:
    """A request taken out of an engine (:meth:`Engine.hand_over`): its state as a checkpoint on
    the host, and the steps its frames covered (``checkpoint.step``; 0 and no checkpoint for
    one that had not started, or its own ``resume`` checkpoint if it was given one)."""

    checkpoint: Checkpoint | None
    step: int


def pause_refusal(model: StepModel, params: Mapping[str, Any], request_id: str) -> str | None:
    """Why a request of ``model`` with these checked ``params`` cannot be paused; None when it can.

    A pause holds a request between two steps, nothing running for it, until
    it resumes (its state on the device, or on the host as a checkpoint). A
    whole-request model (callback mode) cannot stop there: it is inside the
    library's loop, and could only wait in it holding the device from every
    other request, until its step bound failed it. A model that cannot
    snapshot the request (``model.can_snapshot`` false: a ``from_generator``
    loop, a sampler with hidden state) does not say that its state between
    two steps is all there is of it: its requests are never paused
    (model.py, "Snapshot and restore").
    """
    if model.runs_whole_requests:
        return (
            f"request {request_id} cannot be paused: model {model.name} runs each request in one "
            "call (runs_whole_requests, callback mode) and cannot stop it between two steps"
        )
    try:
        snapshots = bool(model.can_snapshot(params))
    except Exception as exc:  # noqa: BLE001 - a model's bug refuses the pause; it fails no request
        return f"request {request_id} cannot be paused: {model.name}.can_snapshot raised {exc!r}"
    if not snapshots:
        return (
            f"request {request_id} cannot be paused: model {model.name} cannot snapshot its state "
            "between two steps (StepModel.can_snapshot), and only such a request is paused"
        )
    return None


def _needs_prepare(model: Any, params: Mapping[str, Any]) -> bool:
    """Whether ``model.prepare`` has work for a request (model.py, Preparing); asked on the loop."""
    if not callable(getattr(model, "prepare", None)):
        return False
    needs = getattr(model, "needs_prepare", None)
    return bool(needs(params)) if callable(needs) else True
