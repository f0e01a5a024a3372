"""The server's shell around the core: tasks, consumers, watchers and dying loudly.

The rules every door shares live in :class:`~omni_stream.core.rules.Rules`
(sans-I/O: no task, no socket). :class:`Service` runs them: it enters the
engine when it owns it, holds the task group of the per-request consumers
and of the watchers (engine death, retained results, file descriptors),
decodes input images off the event loop for the doors (:meth:`prepare`),
logs one line per request, and shuts down gracefully
(:meth:`shutdown_requests`). The doors (the websocket in ``websocket.py``,
the HTTP API and its event streams in ``http_api.py``) call the rules
through :attr:`rules` and the few async steps here. What it reports has
a module each: the request's log line (``request_log.py``), ``/health``'s
body (``health.py``), the descriptors counted (``descriptors.py``).

Lifecycle: ``async with service:`` (one task enters and leaves it) starts
the engine when the service owns it and the task group; on leaving it
cancels what still runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from .. import protocol
from ..core import inputs, retries
from ..core.limits import ServerLimits
from ..core.rules import NOT_STARTED, Admitted, Client, Rules
from ..core.tokens import Tokens
from ..core.webhooks import WebhookConfig
from ..device.heap import trim_heap
from ..errors import EngineDeadError, LifecycleError, OmniStreamError, ParamsError, ServerFailedError
from ..lifecycle import Lifecycle
from ..preview import Previewer
from .consumer import stream_request
from .descriptors import FdWarning, fd_soft_limit, open_fds
from .health import health_payload
from .request_log import log_request_done
from .state import StateKeeper, StateOptions

if TYPE_CHECKING:
    from ..core.records import RequestRecord, Terminal
    from ..core.webhooks import Delivery
    from ..engine.like import EngineLike, FrameStreamLike
    from .webhooks import WebhookSender

__all__ = ["NOT_STARTED", "FdWarning", "Service"]

logger = logging.getLogger("omni_stream.server")

#: How often the service looks at engine.health() for a dead engine.
_ENGINE_WATCH_S = 0.2
#: How often it counts its open file descriptors, and how few free ones it
#: calls "out of descriptors".
_FD_WATCH_S = 5.0
_FD_HEADROOM = 8
#: Input images decoded at once (each a worker thread, off the event loop):
#: one, so decoding never takes both cores of a small box from the producer.
_DECODE_THREADS = 1


class Service:
    """The core's shell for every door (see the module docstring).

    ``engine``: anything :class:`~omni_stream.engine.like.EngineLike` (an
    ``Engine``, an ``EngineGroup``), or less: what ``SERVER_NEEDS`` names,
    its ``stream`` given only the keywords it takes; ``owns_engine`` makes
    ``async with`` start and close it. ``tokens``: the configured tokens
    (none: an open server). ``on_fatal`` is called once, with the error,
    when the engine dies or a task of the service fails, unless
    ``stay_dead``. ``webhooks``: the webhook settings (core/webhooks.py;
    None: every webhook is refused), sent by a :class:`WebhookSender` in the
    service's task group. ``state``: the state directory's settings
    (server/state.py; none or no folder: nothing survives the process).
    Raises TypeError naming what ``engine`` lacks, ParamsError when webhooks
    are configured without the ``webhooks`` extra; entering it raises
    StoreError when the state directory cannot be opened.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        limits: ServerLimits,
        tokens: Tokens | None = None,
        owns_engine: bool = False,
        previewer: Previewer | None = None,
        stay_dead: bool = False,
        on_fatal: Callable[[OmniStreamError], None] | None = None,
        webhooks: WebhookConfig | None = None,
        state: StateOptions | None = None,
    ) -> None:
        self.rules = Rules(engine, limits=limits, tokens=tokens, webhooks=webhooks)
        #: The state directory (requests, checkpoints, results on disk), None without one.
        self.state = StateKeeper(self.rules, state) if state is not None and state.path is not None else None
        self.webhooks: WebhookSender | None = None
        if webhooks is not None:
            try:
                from .webhooks import WebhookSender
            except ImportError as exc:
                raise ParamsError(
                    f"webhooks need the webhooks extra: pip install 'omni-stream[webhooks]' ({exc})",
                    field="webhook_allow",
                ) from None
            self.webhooks = WebhookSender(webhooks)
        self._timers_changed = anyio.Event()
        self.engine = engine
        self.model = self.rules.model
        self.limits = limits
        self.tokens = self.rules.tokens
        self._owns_engine = owns_engine
        self.previewer = previewer or Previewer(threads=limits.preview_threads)
        self._decode_limiter = anyio.CapacityLimiter(_DECODE_THREADS)
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._state = Lifecycle.NEW
        self._requests_idle = anyio.Event()
        self._connections_idle = anyio.Event()
        self._stay_dead = stay_dead
        self._on_fatal = on_fatal
        self.fd_warning = FdWarning()
        self._trimming = False
        # Last: the core acts through this service (core/effects.py's Shell) from here on.
        self.rules.bind(self)

    # -- what the doors read --------------------------------------------------------

    @property
    def registry(self) -> Any:
        return self.rules.registry

    @property
    def gate(self) -> Any:
        return self.rules.gate

    @property
    def memory(self) -> Any:
        return self.rules.memory

    @property
    def metrics(self) -> Any:
        return self.rules.metrics

    @property
    def default_preview(self) -> Any:
        return self.rules.default_preview

    @property
    def running(self) -> bool:
        """Entered and not yet shutting down."""
        return self._state is Lifecycle.RUNNING

    @property
    def started(self) -> bool:
        return self._state is not Lifecycle.NEW

    @property
    def closing(self) -> bool:
        return self._state.ending

    @property
    def fatal(self) -> OmniStreamError | None:
        """Why the service cannot go on (engine dead, a task failed); None while it can."""
        return self.rules.fatal

    def begin_shutdown(self) -> None:
        """Refuse new work from now on (``shutting_down``); what runs goes on, queued work too."""
        if self._state is Lifecycle.RUNNING:
            self._state = Lifecycle.CLOSING
        self.rules.closing = True

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Service:
        if self._state is not Lifecycle.NEW:
            raise LifecycleError("a server can be started once; create a new one")
        self._state = Lifecycle.RUNNING
        stack = AsyncExitStack()
        try:
            if self._owns_engine:
                await stack.enter_async_context(self.engine)
            if self.state is not None:
                # Closed after the task group is done: no write is left in flight then.
                stack.push_async_callback(self.state.close)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self.rules.started = True
            if self.state is not None:
                # Before the doors open (a Server listens after this): what the folder
                # holds is served, and resumed, before any new request is admitted.
                await self.state.start(self._tg)
        except BaseException:
            self.rules.started = False
            self._state = Lifecycle.CLOSED
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            await stack.aclose()
            raise
        self._stack = stack
        self._tg.start_soon(self._supervised, "retention sweep", self._sweep_retained)
        self._tg.start_soon(self._supervised, "engine watch", self._watch_engine)
        self._tg.start_soon(self._supervised, "timers", self._keep_time)
        self._tg.start_soon(self._supervised, "file descriptor watch", self._watch_file_descriptors)
        if self.webhooks is not None:
            config = self.webhooks.config
            if config.generated_secret:
                # Once, at start: receivers cannot verify anything without it.
                logger.warning(
                    "webhooks: no secret configured (--webhook-secret, OMNI_STREAM_WEBHOOK_SECRET); "
                    "signing with this one, made up for this run: %s",
                    config.secret,
                )
            logger.info("webhooks allowed to %s", ", ".join(config.allow))
            self._tg.start_soon(self._supervised, "webhook sender", self.webhooks.run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel what still runs, stop the tasks, close the engine if owned. Idempotent."""
        self.begin_shutdown()
        self.rules.letting_in = False
        if self._stack is None:
            self._state = Lifecycle.CLOSED
            return
        stack, self._stack = self._stack, None
        assert self._tg is not None
        if self.state is not None:
            # The ends just recorded reach the disk before the folder closes.
            with anyio.move_on_after(self.limits.close_timeout_s):
                await self.state.flush()
        self._tg.cancel_scope.cancel()
        try:
            await stack.aclose()
        finally:
            self._state = Lifecycle.CLOSED

    async def shutdown_requests(self, *, grace_s: float, forced: anyio.Event | None = None) -> None:
        """The graceful part of shutting down: refuse new work, let what runs finish.

        Waits up to ``grace_s`` (less if ``forced`` is set) for the requests
        held, running or queued (a queued one still goes into the engine
        when it has room: a shutdown with an idle engine must not strand
        it), cancels the rest (reason ``shutdown``), waits a little for them
        to end, and ends for their watchers any still rendering.
        """
        self.begin_shutdown()
        self.rules.let_in()
        with anyio.move_on_after(grace_s):
            async with anyio.create_task_group() as wait:
                if forced is not None:

                    async def cut_short() -> None:
                        await forced.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(cut_short)
                await self.wait_requests_idle()
                wait.cancel_scope.cancel()
        self.rules.letting_in = False
        for record in self.registry.running():
            self.rules.stop(record, "shutdown")
        # Cancelled requests end within one step (plus a preview render).
        with anyio.move_on_after(self.limits.close_timeout_s):
            await self.wait_requests_idle()
        for record in self.registry.running():
            # Still rendering a preview: its watchers hear the outcome now
            # (finish is idempotent; the consumer's own finish is ignored).
            record.finish(protocol.Cancelled.build(record.id, reason="shutdown"), now=time.monotonic())
        if self.webhooks is not None:
            # The ends just sent get a short grace to reach their receivers;
            # what is still pending then is dropped, with a log line.
            forced_now = forced is not None and forced.is_set()
            await self.webhooks.drain(0.0 if forced_now else self.limits.close_timeout_s)

    async def wait_requests_idle(self) -> None:
        while self.registry.running():
            self._requests_idle = anyio.Event()
            await self._requests_idle.wait()

    async def wait_connections_idle(self) -> None:
        while self.rules.clients:
            self._connections_idle = anyio.Event()
            await self._connections_idle.wait()

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str) -> None:
        """Run ``fn(*args)`` in the service's task group (a door's background work).

        Raises LifecycleError before the service started.
        """
        if self._tg is None:
            raise LifecycleError("the server is not started")
        self._tg.start_soon(fn, *args, name=name)

    # -- what the doors call --------------------------------------------------------

    async def prepare(self, client: Client, msg: protocol.ClientMessage) -> protocol.ClientMessage:
        """``msg`` with its input images decoded, off the event loop (core/inputs.py).

        Each image's header is checked first, on the loop (its size against
        ``max_image_size``); then, unless the rules would refuse the request
        anyway (``Rules.precheck``: a busy server does not decode for work it
        refuses), its pixels are decoded in a worker thread. Raises
        MessageError (``bad_params``, ``limit_exceeded``, what precheck raises).
        """
        if not isinstance(msg, protocol.Generate):
            return msg
        _, model = self.rules.model_for(msg.model, request_id=msg.id)
        pending = inputs.check_images(model, msg.params, self.limits, request_id=msg.id)
        if not pending:
            return msg
        # Refused for its state, load or memory (the images at their header's
        # sizes): then without a decode.
        self.rules.precheck(client, msg, pending)
        decoded = await anyio.to_thread.run_sync(
            lambda: inputs.decode_images(pending, request_id=msg.id), limiter=self._decode_limiter
        )
        return dataclasses.replace(msg, params=inputs.with_images(msg.params, decoded))

    async def submit(
        self, client: Client, msg: protocol.Generate, *, note: tuple[str, Mapping[str, Any]] | None = None
    ) -> RequestRecord:
        """The one way a door puts a ``generate`` into the core: its images prepared (:meth:`prepare`),
        then admitted (``Rules.generate``); ``client``'s outbox, if it has one, watches it.

        ``note``: ``(key, value)`` the state directory writes down with the request (a door's
        own record of it, such as an OpenAI video job), atomically with its admission.
        A retry (the same id and message, from the same principal: core/retries.py) returns
        the request it made. Raises MessageError with the code to answer, the refusal counted
        once by its code, whichever step refused it (the metrics agree across doors).
        """
        sent = retries.fingerprint(msg)
        again = self.rules.retried(client, msg, sent)
        if again is not None:
            return again  # a retry of its own submit: the job it made (nothing decoded again)
        try:
            prepared = await self.prepare(client, msg)
        except protocol.MessageError as exc:
            self.rules.refused(exc, msg.model)
            raise
        assert isinstance(prepared, protocol.Generate)
        if note is None or self.state is None or prepared.id is None:
            record = self.rules.generate(client, prepared)
        else:
            with self.state.written_with(prepared.id, *note):
                record = self.rules.generate(client, prepared)
        record.fingerprint = sent
        return record

    async def receive(self, client: Client, data: str | bytes) -> None:
        """One websocket message, start to end: parsed, a ``generate`` submitted (:meth:`submit`), the
        others acted on; every reply in the client's outbox."""
        msg = self.rules.receive(client, data)
        if msg is None:
            return
        if not isinstance(msg, protocol.Generate):
            self.rules.dispatch(client, msg)
            return
        try:
            await self.submit(client, msg)
        except protocol.MessageError as exc:
            # An id the server made up means nothing to the client.
            request_id = None if msg.id is None else exc.request_id
            self.rules.reply_error(client, exc, request_id=request_id)
        except Exception as exc:
            # A bug: this message gets ``internal``; the client and the server go on.
            logger.exception("handling a message from client %s failed", client.id)
            self.rules.reply_error(
                client,
                protocol.MessageError("internal", f"internal server error: {exc!r}"),
                request_id=msg.id,
            )

    def health_payload(self) -> tuple[int, dict[str, Any]]:
        """``/health``: (HTTP status, body). 200 while it can serve, busy included (health.py)."""
        return health_payload(self)

    # -- one consumer per request ------------------------------------------------

    # -- the core's effects (core/effects.py's Shell) ----------------------------------

    def send_webhook(self, delivery: Delivery) -> None:
        assert self.webhooks is not None  # the core refuses webhooks on a server without them
        self.webhooks.submit(delivery)

    def timers_changed(self) -> None:
        self._timers_changed.set()

    def requests_idle(self) -> None:
        self._requests_idle.set()

    def clients_idle(self) -> None:
        self._connections_idle.set()

    def start_consumer(self, admitted: Admitted, stream: FrameStreamLike) -> None:
        if self._tg is None:
            raise LifecycleError("the server is not started")
        self._tg.start_soon(self._consume, admitted, stream, name=f"omni_stream request {admitted.record.id}")

    def _result_params(self, admitted: Admitted, params: Mapping[str, Any]) -> dict[str, Any]:
        # What a result's PNG says of how it was made (preview/infotext.py): its params, its
        # served model, and the hashes of its weights where the model knows them (A1111's
        # "Model hash" and "Lora hashes", so its png-info reproduces it).
        out = {"model": admitted.model, **params}
        hashes = getattr(self.rules.models.get(admitted.model), "weight_hashes", None)
        if callable(hashes):
            found = hashes(params)
            if found:
                out["hashes"] = found
        return out

    async def _consume(self, admitted: Admitted, stream: FrameStreamLike) -> None:
        record = admitted.record
        journal = self.rules.journal
        message: Terminal | None = None
        if getattr(stream, "loading", False):
            # Its model is not on the device yet (engine/router.py): its first
            # frame waits for the load; say so until it comes.
            record.publish_loading(admitted.model)
        try:
            message = await stream_request(
                record,
                stream,
                admitted.spec,
                output=admitted.output,
                params=self._result_params(admitted, stream.params),
                previewer=self.previewer,
                metrics=self.metrics,
                memory=admitted.memory,
                # Pacing an unread request relies on "latest" (the engine
                # replaces what the server has not taken); under another
                # policy the engine would wait on it.
                paced="policy" in self.rules.stream_keywords,
                on_resume_refused=None if journal is None else journal.resume_refused,
                on_handed_over=None if journal is None else journal.handed_over,
            )
        except Exception as exc:
            logger.exception("request %s: the server failed while streaming it", record.id)
            message = protocol.ErrorMessage.build(
                "internal", f"internal server error: {exc!r}", request_id=record.id
            )
        finally:
            if message is None:  # the service's task group was cancelled
                message = protocol.Cancelled.build(record.id, reason="shutdown")
            try:
                self.rules.consumer_done(record, message)
                log_request_done(record, message, model=admitted.model)
                if not self.registry.running() and not self._trimming and self._tg is not None:
                    self._trimming = True
                    self._tg.start_soon(self._trim_heap, name="omni_stream heap trim")
            except Exception as exc:  # noqa: BLE001 - die() logs it, with its traceback
                # The server's own books are wrong now (a record that never
                # ends holds shutdown and its client): die loudly.
                error = ServerFailedError(f"finishing request {record.id} failed: {exc!r}")
                error.__cause__ = exc
                self.die(error)

    async def _trim_heap(self) -> None:
        # Idle: give back what glibc keeps of the frames and temporaries the
        # requests freed (hundreds of MiB after large frames, held for good
        # otherwise, where no bound sees them). A walk of the heap: in a thread.
        try:
            await anyio.to_thread.run_sync(trim_heap, abandon_on_cancel=True)
        finally:
            self._trimming = False

    # -- dying loudly, and the watchers --------------------------------------------

    async def _supervised(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        # A background task of the server that raises is a bug: shut down
        # loudly (its exception in the task group would instead cancel every
        # request without a word to the clients).
        try:
            await fn()
        except Exception as exc:  # noqa: BLE001 - die() logs it, with its traceback
            error = ServerFailedError(f"the server's {name} task failed: {exc!r}")
            error.__cause__ = exc
            self.die(error)

    def die(self, error: OmniStreamError) -> None:
        """Record why the server cannot go on, log it once, and tell ``on_fatal`` unless ``stay_dead``."""
        if self.rules.fatal is not None:
            return
        self.rules.fatal = error
        exc_info = error.__cause__ if isinstance(error, ServerFailedError) else None
        if self._stay_dead:
            logger.error("%s; staying up as asked (stay_dead), /health answers 503", error, exc_info=exc_info)
            return
        logger.error(
            "%s; shutting down so that a supervisor can restart the process "
            "(stay_dead / --stay-dead keeps it up)",
            error,
            exc_info=exc_info,
        )
        if self._on_fatal is not None:
            self._on_fatal(error)

    async def _watch_engine(self) -> None:
        # The engine has no death callback; health() is a cheap snapshot.
        # Dead is final; stalled may recover, and closed is the owner's call.
        while True:
            await anyio.sleep(_ENGINE_WATCH_S)
            health = self.engine.health()
            if health.status == "dead":
                self.die(EngineDeadError(f"the engine died: {health.reason}"))
                return

    async def _keep_time(self) -> None:
        # A client's pause ends by itself after max_pause_s, a request at its deadline_s
        # (Rules.expire_pauses and expire_deadlines decide which and when; this only keeps the
        # time): woken when the next is due, or when a pause begins or a deadline is set.
        while True:
            self._timers_changed = anyio.Event()
            dues = [d for d in (self.rules.expire_pauses(), self.rules.expire_deadlines()) if d is not None]
            with anyio.move_on_after(min(dues, default=math.inf)):
                await self._timers_changed.wait()

    async def _watch_file_descriptors(self) -> None:
        # uvloop (serve()'s loop) accepts and drops connections silently when
        # the process is out of descriptors (libuv's EMFILE trick), so count
        # them: what asyncio's own loop reports goes through serve()'s
        # exception handler to the same once-a-minute warning.
        limit = fd_soft_limit()
        if limit is None or open_fds() is None:
            return  # no RLIMIT_NOFILE or no /proc/self/fd (/dev/fd) here
        while True:
            await anyio.sleep(_FD_WATCH_S)
            count = open_fds()
            limit = fd_soft_limit() or limit
            if count is not None and count >= limit - _FD_HEADROOM:
                self.fd_warning.warn(f"{count} of RLIMIT_NOFILE={limit} descriptors are open")

    async def _sweep_retained(self) -> None:
        # Detached results must not outlive retention_s even when nobody
        # looks them up (lookups also prune); a memory leak otherwise.
        interval = min(max(self.limits.retention_s / 4, 0.05), 5.0)
        while True:
            await anyio.sleep(interval)
            for record in self.registry.prune():
                logger.debug("forgot detached request %s (retention over)", record.id)
            self.rules.rates.sweep(self.rules.clock())
            if self.state is not None:
                await self.state.prune()
