"""The server's core, shared by every front door: requests, their rules, their consumers.

:class:`Service` knows nothing of sockets or HTTP. A front door (the
websocket in ``websocket.py``, the HTTP API and its event streams in
``http_api.py``) hands it client messages and an :class:`Outbox` to reply
into; the service applies the rules of docs/protocol.md (admission,
ownership, attach, cancel, limits), starts one consumer task per accepted
request and publishes what it produces into the request's
:class:`RequestRecord`, which fans out to the outboxes watching it. Every
method a front door calls is synchronous: handling a message never waits,
so no client is ever blocked behind another.

Lifecycle: ``async with service:`` (one task enters and leaves it) starts
the engine when the service owns it, the task group of the consumers and
the watchers (engine death, retained results, file descriptors), and on
leaving cancels what still runs. :meth:`shutdown_requests` is the graceful
part of shutting down.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .. import protocol
from ..engine.like import RendersFrames, missing_stream_members, server_stream_keywords
from ..errors import (
    EngineDeadError,
    EngineError,
    LifecycleError,
    OmniStreamError,
    ParamsError,
    ServerBusyError,
    ServerFailedError,
)
from ..lifecycle import Lifecycle
from ..model import StepModel
from ..preview import Previewer, PreviewSpec, RenderRequest
from ..core import admission
from . import responses
from .consumer import stream_request
from ..core.gate import Gate
from ..core.limits import ServerLimits
from .metrics import ServerMetrics
from ..core.outbox import MemoryBudget, MemoryReservation, Outbox
from ..core.records import RequestRecord, RequestRegistry

if TYPE_CHECKING:
    from ..engine.like import EngineLike, FrameStreamLike

__all__ = ["NOT_STARTED", "Service"]

logger = logging.getLogger("omni_stream.server")

#: Why a service that was never entered serves nothing (what ``/health`` and a generate say).
NOT_STARTED = (
    "the server is not started: a mounted app needs its lifespan run by the host app "
    "(Starlette(lifespan=omni.lifespan), FastAPI(lifespan=omni.lifespan), or "
    "`async with omni.lifespan(app)` in the host's own; docs/http.md, Mounting)"
)

#: How often the service looks at engine.health() for a dead engine.
_ENGINE_WATCH_S = 0.2
#: How often it counts its open file descriptors, and how few free ones it
#: calls "out of descriptors".
_FD_WATCH_S = 5.0
_FD_HEADROOM = 8
_FD_WARN_EVERY_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Admitted:
    """What an admitted request needs to go into the engine, now or when the gate lets it in."""

    record: RequestRecord
    params: Any
    spec: PreviewSpec
    output: admission.OutputSpec
    memory: MemoryReservation
    priority: int


class Service:
    """Requests and their rules for every front door (see the module docstring).

    ``engine``: anything :class:`~omni_stream.engine.like.EngineLike` (an
    ``Engine``, an ``EngineGroup``), or less: what ``SERVER_NEEDS`` names,
    its ``stream`` given only the keywords it takes; ``owns_engine`` makes
    ``async with`` start and close it. ``token`` is the resolved token
    (None: open server). ``on_fatal`` is called once, with the error, when
    the engine dies or a task of the service fails, unless ``stay_dead``.
    Raises TypeError naming what ``engine`` lacks (``server_stream_keywords``).
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        limits: ServerLimits,
        token: str | None,
        owns_engine: bool = False,
        previewer: Previewer | None = None,
        stay_dead: bool = False,
        on_fatal: Callable[[OmniStreamError], None] | None = None,
    ) -> None:
        #: The keywords besides request_id that engine.stream takes, read once here.
        self.stream_keywords = server_stream_keywords(engine)
        self.engine = engine
        self.model: StepModel = engine.model
        self.limits = limits
        self.token = token
        self._owns_engine = owns_engine
        self.previewer = previewer or Previewer(threads=limits.preview_threads)
        # The default preview for this model (the wire may override "decoder").
        self.default_decoder = admission.default_decoder(self.model)
        self.default_preview = admission.cap_preview(PreviewSpec(decoder=self.default_decoder), limits)
        # Bytes held for clients, queued and retained: max_memory_bytes (outbox.py).
        self.memory = MemoryBudget(limits.max_memory_bytes)
        self.registry = RequestRegistry(
            retention_s=limits.retention_s, max_retained=limits.max_retained, budget=self.memory
        )
        self.metrics = ServerMetrics(engine, running=lambda: len(self.registry.running()))
        self.metrics.watch_memory(self.memory)
        #: Engines computing on this host's CPU (max_active's default depends on it).
        self.host_engines = admission.host_engines(engine)
        #: At most max_active requests in the engine; the other admitted ones wait here.
        self.gate = Gate(
            lambda: self.limits.active_bound(self.engine.max_batch_size, host_engines=self.host_engines)
        )
        #: Open client connections (websockets and event streams), by id.
        self.connections: set[str] = set()
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._state = Lifecycle.NEW
        self._requests_idle = anyio.Event()
        self._connections_idle = anyio.Event()
        self._stay_dead = stay_dead
        self._on_fatal = on_fatal
        self._fatal: OmniStreamError | None = None
        self.fd_warning = FdWarning()

    # -- state -------------------------------------------------------------------

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
        return self._fatal

    def begin_shutdown(self) -> None:
        """Refuse new work from now on (``shutting_down``); what runs goes on."""
        if self._state is Lifecycle.RUNNING:
            self._state = Lifecycle.CLOSING

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Service:
        if self._state is not Lifecycle.NEW:
            raise LifecycleError("a server can be started once; create a new one")
        self._state = Lifecycle.RUNNING
        stack = AsyncExitStack()
        try:
            if self._owns_engine:
                await stack.enter_async_context(self.engine)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
        except BaseException:
            self._state = Lifecycle.CLOSED
            await stack.aclose()
            raise
        self._stack = stack
        self._tg.start_soon(self._supervised, "retention sweep", self._sweep_retained)
        self._tg.start_soon(self._supervised, "engine watch", self._watch_engine)
        self._tg.start_soon(self._supervised, "file descriptor watch", self._watch_file_descriptors)
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
        if self._stack is None:
            self._state = Lifecycle.CLOSED
            return
        stack, self._stack = self._stack, None
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await stack.aclose()
        finally:
            self._state = Lifecycle.CLOSED

    async def shutdown_requests(self, *, grace_s: float, forced: anyio.Event | None = None) -> None:
        """The graceful part of shutting down: refuse new work, let what runs finish.

        Waits up to ``grace_s`` (less if ``forced`` is set) for running
        requests, cancels the rest (reason ``shutdown``), waits a little for
        them to end, and ends for their watchers any still rendering.
        """
        self.begin_shutdown()
        with anyio.move_on_after(grace_s):
            async with anyio.create_task_group() as wait:
                if forced is not None:

                    async def cut_short() -> None:
                        await forced.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(cut_short)
                await self.wait_requests_idle()
                wait.cancel_scope.cancel()
        for record in self.registry.running():
            self._stop(record, "shutdown")
        # Cancelled requests end within one step (plus a preview render).
        with anyio.move_on_after(self.limits.close_timeout_s):
            await self.wait_requests_idle()
        for record in self.registry.running():
            # Still rendering a preview: its watchers hear the outcome now
            # (finish is idempotent; the consumer's own finish is ignored).
            record.finish(protocol.cancelled(record.id, reason="shutdown"), now=time.monotonic())

    async def wait_requests_idle(self) -> None:
        while self.registry.running():
            self._requests_idle = anyio.Event()
            await self._requests_idle.wait()

    async def wait_connections_idle(self) -> None:
        while self.connections:
            self._connections_idle = anyio.Event()
            await self._connections_idle.wait()

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str) -> None:
        """Run ``fn(*args)`` in the service's task group (a front door's background work).

        Raises LifecycleError before the service started.
        """
        if self._tg is None:
            raise LifecycleError("the server is not started")
        self._tg.start_soon(fn, *args, name=name)

    # -- connections -------------------------------------------------------------

    def connection_refusal(self) -> tuple[int, str, str] | None:
        """Why a new connection is refused now, as (HTTP status, code, message); None to accept."""
        if self.closing:
            return 503, "shutting_down", "the server is shutting down"
        if len(self.connections) >= self.limits.max_connections:
            return (
                503,
                "too_many_connections",
                f"the server has {self.limits.max_connections} connections open "
                "(max_connections, OMNI_STREAM_MAX_CONNECTIONS)",
            )
        return None

    def connect(self) -> str:
        """Register a new connection; returns its id (its owner identity)."""
        conn_id = uuid.uuid4().hex
        self.connections.add(conn_id)
        self.metrics.connections.inc()
        self.metrics.connections_opened.inc()
        return conn_id

    def disconnect(self, conn_id: str) -> None:
        """The connection is gone: nothing more is sent to it; its own requests are cancelled."""
        for record in self.registry.disconnect(conn_id):
            self._stop(record, "disconnect")
        if conn_id in self.connections:
            self.connections.discard(conn_id)
            self.metrics.connections.dec()
        if not self.connections:
            self._connections_idle.set()

    # -- client messages (the websocket's, and the HTTP API's in the same form) ---

    def handle(self, conn_id: str, outbox: Outbox, data: str | bytes) -> None:
        """Handle one client message; every reply (and error) goes to ``outbox``.

        Synchronous on purpose: handling a message never waits, so one
        connection's reader is never blocked behind anything.
        """
        msg: protocol.ClientMessage | None = None
        try:
            msg = protocol.parse_client_message(data)
            if isinstance(msg, protocol.Generate):
                self.generate(conn_id, outbox, msg)
            elif isinstance(msg, protocol.Cancel):
                self.cancel(conn_id, msg.id)
            else:
                self.attach(conn_id, outbox, msg.id)
        except protocol.MessageError as exc:
            request_id = exc.request_id
            if isinstance(msg, protocol.Generate) and msg.id is None:
                request_id = None  # an id the server made up means nothing to the client
            outbox.put(protocol.dumps(self.error_reply(exc, request_id=request_id)), "error")
        except Exception as exc:
            request_id = getattr(msg, "id", None)
            logger.exception("handling a message from connection %s failed", conn_id)
            outbox.put(
                protocol.dumps(
                    protocol.error("internal", f"internal server error: {exc!r}", request_id=request_id)
                ),
                "error",
            )

    def error_reply(self, exc: protocol.MessageError, *, request_id: str | None) -> dict[str, Any]:
        """The ``error`` message for a refused client message (``busy`` carries ``retry_after_s``)."""
        reply = protocol.error(exc.code, exc.message, request_id=request_id, field=exc.field)
        if isinstance(exc, ServerBusyError):
            reply["retry_after_s"] = exc.retry_after_s
        return reply

    def generate(
        self, conn_id: str, outbox: Outbox | None, msg: protocol.Generate
    ) -> RequestRecord:
        """Admit ``msg``; ``outbox`` (if any) watches it. It goes into the engine now, or waits in the gate.

        Raises MessageError (ServerBusyError for ``busy``) with the code to answer;
        every refusal is counted by its code.
        """
        try:
            record, admitted = self._admit(conn_id, msg)
            stream = self._open_stream(admitted) if self.gate.has_room() else None
        except protocol.MessageError as exc:
            self.metrics.rejections.labels(exc.code).inc()
            self.metrics.requests.labels("rejected").inc()
            raise
        self.registry.add(record)
        if outbox is not None:
            record.watch(conn_id, outbox, attached=False)
        if stream is None:
            # The engine holds max_active requests already: this one waits,
            # unstarted, in the gate (gate.py), and goes in when one leaves.
            self.gate.wait(record.id, conn_id, msg.priority, admitted, cost=record.total)
            self._let_in()  # in case the bound grew (a remote engine's replicas came up)
        else:
            self._start_consumer(admitted, stream)
        return record

    def _admit(self, conn_id: str, msg: protocol.Generate) -> tuple[RequestRecord, _Admitted]:
        """Apply every admission rule to ``msg`` (load, params, memory); raises MessageError."""
        request_id = msg.id or uuid.uuid4().hex
        if self._tg is None:
            raise protocol.MessageError("engine_unavailable", NOT_STARTED, request_id=request_id)
        if self.closing:
            raise protocol.MessageError(
                "shutting_down", "the server is shutting down", request_id=request_id
            )
        if self._fatal is not None:
            # Kept up by stay_dead after a fatal error: it serves no new work.
            raise protocol.MessageError(
                "engine_unavailable", f"the server failed: {self._fatal}", request_id=request_id
            )
        health = self.engine.health()
        if not health.ok:
            raise protocol.MessageError(
                "engine_unavailable",
                f"the engine is {health.status}: {health.reason}",
                request_id=request_id,
            )
        self.registry.check_new(request_id, detach=msg.detach)
        limit = self.limits.max_requests_per_connection
        own = self.registry.running_owned_by(conn_id)
        if own >= limit:
            raise protocol.MessageError(
                "too_many_requests",
                f"this connection already runs {limit} requests "
                "(max_requests_per_connection, OMNI_STREAM_MAX_REQUESTS_PER_CONNECTION)",
                request_id=request_id,
            )
        # Before the params are read: refusing an overloaded server's work
        # must cost less than the work (a data: URL image is up to 1 MiB).
        load = self.load(health)
        admission.check_load(
            load,
            own=own,
            connections=max(len(self.connections), 1),
            retry_after_s=lambda: self.retry_after(load),
            request_id=request_id,
        )
        spec = admission.preview_spec(
            msg.preview,
            default=self.default_preview,
            decoder=self.default_decoder,
            limits=self.limits,
            request_id=request_id,
            model=self.model,
        )
        output = admission.output_spec(
            msg.output, video=bool(getattr(self.model, "produces_video", False)), request_id=request_id
        )
        total = admission.check_params(self.model, msg.params, self.limits, request_id=request_id)
        memory = admission.reserve_memory(
            self.memory, self.model, msg.params, engine=self.engine, request_id=request_id,
            retry_after_s=lambda: self.retry_after(load),
        )
        record = RequestRecord(
            request_id,
            owner=conn_id,
            detach=msg.detach,
            total=total,
            preview=responses.preview_wire(spec),
            output=output.wire(),
            created_at=time.monotonic(),
            priority=msg.priority,
        )
        return record, _Admitted(record, msg.params, spec, output, memory, msg.priority)

    def _open_stream(self, admitted: _Admitted) -> FrameStreamLike:
        """Submit an admitted request to the engine; its stream.

        Raises MessageError ``bad_params`` (params only the engine refuses)
        or ``engine_unavailable``, having released its memory.
        """
        request_id = admitted.record.id
        spec, output = admitted.spec, admitted.output
        try:
            wanted: dict[str, Any] = {
                "policy": "latest",
                "preview_every": spec.every,
                "priority": admitted.priority,
                "render": self._render_request(spec, output),
            }
            # Only what the engine takes (an engine of one's own may take less).
            options = {k: v for k, v in wanted.items() if k in self.stream_keywords and v is not None}
            # The raw params: the engine validates them itself (the same checks).
            stream = self.engine.stream(admitted.params, request_id=request_id, **options)
        except ParamsError as exc:
            admitted.memory.release()
            raise protocol.MessageError(
                "bad_params", exc.message, field=exc.field, request_id=request_id
            ) from None
        except EngineError as exc:
            admitted.memory.release()
            raise protocol.MessageError(
                "engine_unavailable", exc.message, request_id=request_id
            ) from None
        missing = missing_stream_members(stream)
        if missing:
            # The engine's own type: nothing a client did. Said once per request
            # here rather than as an `internal` in the middle of its stream.
            admitted.memory.release()
            self.engine.cancel(request_id)
            message = (
                f"the engine's stream() returned a {type(stream).__name__}, which lacks "
                f"{', '.join(missing)} (omni_stream.engine.like.FrameStreamLike)"
            )
            logger.error("request %s: %s", request_id, message)
            raise protocol.MessageError("engine_unavailable", message, request_id=request_id)
        return stream

    def _start_consumer(self, admitted: _Admitted, stream: FrameStreamLike) -> None:
        record = admitted.record
        self.gate.entered(record.owner, record.total)
        assert self._tg is not None
        self._tg.start_soon(
            self._consume, record, stream, admitted.spec, admitted.output, admitted.memory,
            name=f"omni_stream request {record.id}",
        )

    def _let_in(self) -> None:
        """Submit waiting requests while the engine has room (a request left it, or the bound grew)."""
        while not self.closing and (item := self.gate.pop()) is not None:
            admitted: _Admitted = item.payload
            try:
                stream = self._open_stream(admitted)
            except protocol.MessageError as exc:
                # Accepted already: it ends, with what the engine said.
                code = "engine_error" if exc.code == "engine_unavailable" else "step_failed"
                self._finish(
                    admitted.record,
                    protocol.error(code, exc.message, request_id=admitted.record.id, field=exc.field),
                )
                continue
            self._start_consumer(admitted, stream)

    def _stop(self, record: RequestRecord, reason: str) -> None:
        """Cancel a running request (``reason`` for its ``cancelled``), in the engine or in the gate."""
        record.cancel_reason = record.cancel_reason or reason
        item = self.gate.remove(record.id)
        if item is None:
            self.engine.cancel(record.id)
            return
        item.payload.memory.release()
        self._finish(record, protocol.cancelled(record.id, reason=record.cancel_reason))

    def _render_request(self, spec: PreviewSpec, output: admission.OutputSpec) -> RenderRequest | None:
        """What to ask an engine that renders where it makes frames (a Ray replica); None to render here.

        Then the network carries each preview's and the result's bytes,
        not raw frames (omni_stream/preview/remote.py).
        """
        if "render" not in self.stream_keywords or not (
            isinstance(self.engine, RendersFrames) and self.engine.renders_frames
        ):
            return None
        return RenderRequest.of(spec, output.format, output.quality)

    def cancel(self, conn_id: str, request_id: str, *, authenticated: bool | None = None) -> RequestRecord:
        """Cancel a request ``conn_id`` may see; raises MessageError ``not_found``."""
        record = self.lookup(conn_id, request_id, authenticated=authenticated)
        if not record.ended:  # else its terminal message was already sent
            self._stop(record, "client")
        return record

    def attach(self, conn_id: str, outbox: Outbox, request_id: str) -> RequestRecord:
        """``outbox`` watches the request from now on, after its replay; raises MessageError."""
        record = self.lookup(conn_id, request_id)
        if record.is_watched_by(conn_id):
            raise protocol.MessageError(
                "already_attached",
                f"this connection already watches request {request_id!r}",
                field="id",
                request_id=request_id,
            )
        record.watch(conn_id, outbox, attached=True)
        return record

    def lookup(self, conn_id: str, request_id: str, *, authenticated: bool | None = None) -> RequestRecord:
        """The record ``conn_id`` may see (records.py's rule); raises MessageError ``not_found``."""
        if authenticated is None:
            authenticated = self.token is not None
        return self.registry.lookup(request_id, conn_id, authenticated=authenticated)

    # -- load and health ---------------------------------------------------------

    def load(self, health: Any | None = None) -> admission.Load:
        stats = (health or self.engine.health()).statistics
        # What the engine holds (its own count, in case others share it) and what waits in the gate.
        in_engine = max(self.gate.in_engine, stats.active + stats.queued)
        return admission.Load.of(
            in_engine, self.gate.waiting, self.limits, engine_batch_size=self.engine.max_batch_size,
            host_engines=self.host_engines,
        )

    def retry_after(self, load: admission.Load) -> float:
        return admission.retry_after(
            (r.total - r.latest_step for r in self.registry.running()),
            held=load.held,
            step_s=self.metrics.recent_step_s,
            batch_size=self.metrics.recent_batch_size,
            whole_requests=bool(getattr(self.model, "runs_whole_requests", False)),
        )

    def health_payload(self) -> tuple[int, dict[str, Any]]:
        """``/health``: (HTTP status, body). 200 while it can serve, busy included."""
        health = self.engine.health()
        payload = health.to_dict()
        load = self.load(health)
        # One meaning for active and queued: the server's (load's), which
        # counts the requests waiting in the gate; the engine's own counts
        # (where requests sit inside it) are under "engine".
        engine_view = {"active": payload["active"], "queued": payload["queued"]}
        payload.update(active=load.active, queued=load.queued, engine=engine_view)
        payload["server"] = {
            "connections": len(self.connections),
            "requests": len(self.registry.running()),
            "retained": len(self.registry.retained()),
        }
        payload["load"] = load.to_dict()
        if not self.started:
            # Mounted without its lifespan: a 200 here would be a zombie
            # that passes every probe and refuses every request.
            payload.update(status="not_started", ok=False, reason=NOT_STARTED)
        elif self.closing and health.ok:
            payload.update(status="shutting_down", ok=False, reason="the server is shutting down")
        elif health.ok and load.busy:
            # 200: a full server is healthy (a 503 would make a liveness
            # probe restart it, killing the work it is busy with).
            payload.update(
                status="busy",
                reason=f"the server holds {load.held} requests, max_active + max_queued; "
                "a generate gets error busy",
            )
            payload["load"]["retry_after_s"] = self.retry_after(load)
        if self._fatal is not None and payload["ok"]:
            # A failed server task (stay_dead keeps the process up): not
            # able to serve, though the engine is.
            payload.update(status="dead", ok=False, reason=str(self._fatal))
        return (200 if payload["ok"] else 503), payload

    def queue_positions(self) -> dict[str, int]:
        """Position (0 = next) of every request that has not started a step yet.

        Those in the engine first, in the order its scheduler takes them
        (higher priority first, then arrival; its ageing can move an old
        request up sooner), then those waiting in the gate, in the order it
        lets them in.
        """
        starting = [
            r for r in self.registry.running() if r.latest_step == 0 and r.id not in self.gate
        ]
        starting.sort(key=lambda r: (-r.priority, r.created_at))
        order = [r.id for r in starting] + self.gate.order()
        return {rid: i for i, rid in enumerate(order)}

    # -- one consumer per request ------------------------------------------------

    async def _consume(
        self,
        record: RequestRecord,
        stream: FrameStreamLike,
        spec: PreviewSpec,
        output: admission.OutputSpec,
        memory: MemoryReservation | None = None,
    ) -> None:
        message: dict[str, Any] | None = None
        try:
            message = await stream_request(
                record,
                stream,
                spec,
                output=output,
                params={"model": self.model.name, **stream.params},
                previewer=self.previewer,
                metrics=self.metrics,
                memory=memory,
                # Pacing an unread request relies on "latest" (the engine
                # replaces what the server has not taken); under another
                # policy the engine would wait on it.
                paced="policy" in self.stream_keywords,
            )
        except Exception as exc:
            logger.exception("request %s: the server failed while streaming it", record.id)
            message = protocol.error("internal", f"internal server error: {exc!r}", request_id=record.id)
        finally:
            if message is None:  # the service's task group was cancelled
                message = protocol.cancelled(record.id, reason="shutdown")
            self.gate.left(record.owner)
            self._finish(record, message)
            self._let_in()

    def _finish(self, record: RequestRecord, message: dict[str, Any]) -> None:
        """End ``record`` with its terminal ``message``: its watchers, the books, the log line."""
        try:
            record.finish(message, now=time.monotonic())
            self.registry.ended(record)
            self.metrics.requests.labels(record.outcome or "error").inc()
            _log_request_done(record, message, model=self.model.name)
        except Exception as exc:  # noqa: BLE001 - die() logs it, with its traceback
            # The server's own books are wrong now (a record that never
            # ends holds shutdown and its client): die loudly.
            error = ServerFailedError(f"finishing request {record.id} failed: {exc!r}")
            error.__cause__ = exc
            self.die(error)
        finally:
            if not self.registry.running():
                self._requests_idle.set()

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
        if self._fatal is not None:
            return
        self._fatal = error
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

    async def _watch_file_descriptors(self) -> None:
        # uvloop (serve()'s loop) accepts and drops connections silently when
        # the process is out of descriptors (libuv's EMFILE trick), so count
        # them: what asyncio's own loop reports goes through serve()'s
        # exception handler to the same once-a-minute warning.
        limit = _fd_soft_limit()
        if limit is None or _open_fds() is None:
            return  # no RLIMIT_NOFILE or no /proc/self/fd (/dev/fd) here
        while True:
            await anyio.sleep(_FD_WATCH_S)
            count = _open_fds()
            limit = _fd_soft_limit() or limit
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


class FdWarning:
    """The out-of-file-descriptors warning, at most once a minute (it recurs on every accept)."""

    def __init__(self) -> None:
        self._last: float | None = None

    def warn(self, detail: str) -> bool:
        """Log it unless it was logged less than a minute ago; returns whether it was."""
        now = time.monotonic()
        if self._last is not None and now - self._last < _FD_WARN_EVERY_S:
            return False
        self._last = now
        logger.warning(
            "out of file descriptors (%s): new connections are refused or dropped unanswered; "
            "raise the limit (ulimit -n, systemd LimitNOFILE=) or lower max_connections",
            detail,
        )
        return True


def _fd_soft_limit() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _open_fds() -> int | None:
    """Descriptors this process has open; None where it cannot tell."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Listing needs a descriptor itself: none is left.
                return _fd_soft_limit()
    return None


def _kv(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def _log_request_done(record: RequestRecord, message: dict[str, Any], *, model: str) -> None:
    """One INFO line per request as it ends: key=value text, the same fields in ``extra``."""
    outcome = record.outcome or str(message.get("type"))
    same = outcome == message.get("type")  # (shutdown may have ended it first)
    fields: dict[str, Any] = {
        "request_id": record.id,
        "connection": record.owner,
        "model": model,
        "outcome": outcome,
        "code": message.get("code") if same else None,
        "reason": message.get("reason") if same else None,
        "steps": record.latest_step,
        "total_steps": record.total,
        # Frames the server took from the engine, those the engine replaced
        # with newer ones while the server was busy (latest-wins), previews sent.
        "frames": record.frames_taken,
        "frames_dropped": max(0, record.latest_step - record.frames_taken),
        "previews": record.previews_sent,
        "elapsed_s": round((record.ended_at or time.monotonic()) - record.created_at, 3),
        "detach": record.detach,
    }
    names = {"request_id": "id", "connection": "conn", "total_steps": "total"}
    text = " ".join(f"{names.get(k, k)}={_kv(v)}" for k, v in fields.items() if v is not None)
    logger.info("request done %s", text, extra=fields)
