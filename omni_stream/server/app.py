"""The websocket server: ``Server`` (async context manager) and ``serve()`` (blocking).

Shape of the running server, all in one anyio task group per server plus
one per connection:

- websockets accepts connections on one port; its ``process_request`` hook
  answers the HTTP routes and refuses bad handshakes (401/403/503) before
  the upgrade.
- per connection: a reader (this module's ``_read``, parsing and handling
  each message synchronously, so it never waits on anything but the
  socket) and a writer draining the connection's :class:`Outbox`.
- per request: one consumer task iterating ``engine.stream(...,
  policy="latest")``, rendering previews (once, shared by every watcher)
  and publishing into the request's :class:`RequestRecord`, which fans out
  to the watchers' outboxes without ever waiting on a client.

Who waits on whom: the engine never waits on the server ("latest" replaces
unread frames); a consumer waits only on its own preview renders; a writer
waits on its own socket, bounded by ``send_timeout_s``. Nothing waits on a
slow client except that client's writer.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
from websockets.asyncio.server import Server as _WSServer
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as _ws_serve
from websockets.http11 import Request, Response

from ..engine import Engine, FrameStream
from ..errors import EngineDeadError, EngineError, OmniStreamError, ParamsError
from ..model import StepModel
from ..preview import Previewer, PreviewSpec
from . import admission, protocol, routes, security
from .connection import ClientConnection
from .consumer import stream_request
from .limits import ServerLimits, resolve_origins, resolve_token
from .metrics import CONTENT_TYPE, ServerMetrics
from .outbox import MemoryBudget
from .session import RequestRecord, RequestRegistry

__all__ = ["Server", "ServerFailedError", "serve"]

logger = logging.getLogger("omni_stream.server")


class Server:
    """The omni_stream websocket server (docs/protocol.md).

    ``engine_or_model``: a running :class:`~omni_stream.Engine` (the caller
    starts and closes it), or a :class:`~omni_stream.StepModel`, for which
    the server creates an engine on ``device`` and owns it. ``port=0`` picks
    a free port; read it back from :attr:`port`. ``limits`` are the keyword
    arguments of :class:`ServerLimits`. Raises ParamsError for a bad option.

    ``async with Server(model, port=0) as server: ...`` serves until the
    block ends, then shuts down gracefully (see :meth:`aclose`). When the
    engine dies or a task of the server fails, the server logs why and shuts
    itself down (:attr:`fatal` says why; ``serve()`` raises it), so that a
    supervisor replaces the process; ``stay_dead=True`` keeps it up instead
    (``/health`` answers 503 ``dead``), for debugging.
    """

    def __init__(
        self,
        engine_or_model: Engine | StepModel,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        allow_origins: Sequence[str] | str | None = (),
        device: str = "auto",
        previewer: Previewer | None = None,
        stay_dead: bool = False,
        **limits: Any,
    ) -> None:
        if not isinstance(stay_dead, bool):
            raise ParamsError(f"stay_dead must be true or false, got {stay_dead!r}", field="stay_dead")
        if isinstance(engine_or_model, Engine):
            self._engine = engine_or_model
            self._owns_engine = False
        elif isinstance(engine_or_model, StepModel):
            self._engine = Engine(engine_or_model, device=device)
            self._owns_engine = True
        else:
            raise ParamsError(
                "Server needs an omni_stream.Engine or StepModel, "
                f"got {type(engine_or_model).__name__}",
                field="engine_or_model",
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ParamsError(f"port must be an integer from 0 to 65535, got {port!r}", field="port")
        if not isinstance(host, str):
            raise ParamsError(f"host must be a string, got {host!r}", field="host")
        self.model: StepModel = self._engine.model
        self.limits = ServerLimits.from_env(limits)
        self._host = host
        self._requested_port = port
        self._token = resolve_token(token)
        self._allow_origins = resolve_origins(allow_origins)
        self._previewer = previewer or Previewer(threads=self.limits.preview_threads)
        # The default preview for this model (the wire may override "decoder").
        self._default_decoder = admission.default_decoder(self.model)
        self._default_preview = admission.cap_preview(
            PreviewSpec(decoder=self._default_decoder), self.limits
        )
        # Bytes held for clients, queued and retained: max_memory_bytes (outbox.py).
        self._memory = MemoryBudget(self.limits.max_memory_bytes)
        self._registry = RequestRegistry(
            retention_s=self.limits.retention_s,
            max_retained=self.limits.max_retained,
            budget=self._memory,
        )
        self.metrics = ServerMetrics(self._engine, running=lambda: len(self._registry.running()))
        self.metrics.watch_memory(self._memory)
        self._connections: dict[str, ClientConnection] = {}
        self._own_origins: frozenset[str] = frozenset()
        self._port: int | None = None
        self._ws_server: _WSServer | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._stopped_listening = False
        self._state = "new"  # new -> running -> closing -> closed
        self._shutdown_requested = anyio.Event()
        self._force_shutdown = anyio.Event()
        self._shutdown_done = anyio.Event()
        self._requests_idle = anyio.Event()
        self._connections_idle = anyio.Event()
        # Dies loudly: a dead engine or a failed server task shuts the server
        # down (serve() then raises this), unless stay_dead keeps it up.
        self._stay_dead = stay_dead
        self._fatal: OmniStreamError | None = None
        self._fd_warning = _FdWarning()

    # -- properties ------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port; raises RuntimeError before the server started."""
        if self._port is None:
            raise RuntimeError("the server is not started; use `async with Server(...)`")
        return self._port

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` (the page is at ``/``)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The websocket endpoint, ``ws://HOST:PORT/ws``."""
        return "ws" + self.http_url.removeprefix("http") + "/ws"

    @property
    def closing(self) -> bool:
        return self._state in ("closing", "closed")

    @property
    def fatal(self) -> OmniStreamError | None:
        """Why the server shut itself down (or, with ``stay_dead``, would have); None if it did not.

        EngineDeadError when the engine died, ServerFailedError when a task
        of the server failed (``__cause__`` is what it raised).
        """
        return self._fatal

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the engine (if owned) and listen. Raises RuntimeError if started twice."""
        if self._state != "new":
            raise RuntimeError("a Server can be started once; create a new one")
        self._state = "running"
        stack = AsyncExitStack()
        try:
            if self._owns_engine:
                await stack.enter_async_context(self._engine)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._ws_server = await _ws_serve(
                self._handle,
                self._host,
                self._requested_port,
                process_request=self._process_request,
                # Previews are compressed images: deflating them again would
                # only burn the event loop (~60x fewer messages a second).
                compression=None,
                max_size=self.limits.max_message_bytes,
                close_timeout=self.limits.close_timeout_s,
                logger=_websockets_logger(),
            )
        except BaseException:
            self._state = "closed"
            await stack.aclose()
            raise
        self._stack = stack
        self._port = self._ws_server.sockets[0].getsockname()[1]
        self._own_origins = security.own_origins(self._host, self._port)
        self._tg.start_soon(self._supervised, "retention sweep", self._sweep_retained)
        self._tg.start_soon(self._supervised, "engine watch", self._watch_engine)
        self._tg.start_soon(self._supervised, "file descriptor watch", self._watch_file_descriptors)
        logger.info("omni_stream server listening on %s (model %s)", self.http_url, self.model.name)
        # The addresses actually bound ("localhost" may bind ::1 and 127.0.0.1).
        bound = {str(sock.getsockname()[0]) for sock in self._ws_server.sockets}
        exposed = sorted(h for h in bound if not security.is_loopback(h))
        if exposed and self._token is None:
            logger.warning(
                "listening on %s, not a loopback address, without a token: anyone who can reach "
                "the port can run requests; set a token (--token, OMNI_STREAM_TOKEN) or bind 127.0.0.1",
                ", ".join(exposed),
            )

    def request_shutdown(self) -> None:
        """Ask :meth:`serve_forever` to return; a second call also skips the grace period."""
        if self._shutdown_requested.is_set():
            self._force_shutdown.set()
        self._shutdown_requested.set()

    async def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM or :meth:`request_shutdown`, then :meth:`shutdown`.

        A second signal during shutdown skips the wait for in-flight requests.
        Signals can only be watched from the main thread. Leaving ``async
        with`` (or :meth:`aclose`) afterwards releases the rest.
        """
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        logger.info(
                            "%s: shutting down%s",
                            signal.Signals(signum).name,
                            " now" if self._shutdown_requested.is_set() else "",
                        )
                        self.request_shutdown()

            tg.start_soon(watch_signals)
            await self._shutdown_requested.wait()
            await self.shutdown()
            tg.cancel_scope.cancel()

    async def shutdown(self) -> None:
        """Shut down gracefully (docs/protocol.md, "Shutdown"); idempotent, from any task.

        Refuses new work; gives running requests ``shutdown_timeout_s`` to
        finish (cut short by a second :meth:`request_shutdown`); cancels the
        rest; stops listening; lets each client's send path flush, then
        closes it with 1001. Returns when done, also to concurrent callers.
        The engine and the server's tasks are released by :meth:`aclose`.
        """
        if self._state == "new":
            self._state = "closed"
            return
        if self._state != "running":
            await self._shutdown_done.wait()
            return
        self._state = "closing"
        self._shutdown_requested.set()
        assert self._ws_server is not None
        limits = self.limits
        try:
            # Keep listening through the grace period: probes see /health
            # 503 and new websockets get 503 shutting_down (_check_handshake).
            with anyio.move_on_after(limits.shutdown_timeout_s):
                async with anyio.create_task_group() as wait:

                    async def forced() -> None:
                        await self._force_shutdown.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(forced)
                    await self._wait_requests_idle()
                    wait.cancel_scope.cancel()
            for record in self._registry.running():
                record.cancel_reason = record.cancel_reason or "shutdown"
                self._engine.cancel(record.id)
            # Cancelled requests end within one step (plus a preview render).
            with anyio.move_on_after(limits.close_timeout_s):
                await self._wait_requests_idle()
            for record in self._registry.running():
                # Still rendering a preview: its watchers hear the outcome now
                # (finish is idempotent; the consumer's own finish is ignored).
                record.finish(protocol.cancelled(record.id, reason="shutdown"), now=time.monotonic())
            self._ws_server.server.close()  # stop listening
            self._stopped_listening = True
            for conn in list(self._connections.values()):
                conn.close_soon(protocol.CLOSE_GOING_AWAY, "server shutting down")
            with anyio.move_on_after(limits.close_timeout_s * 2):
                await self._wait_connections_idle()
            self._ws_server.close(
                close_connections=True, code=protocol.CLOSE_GOING_AWAY, reason="server shutting down"
            )
            with anyio.move_on_after(limits.close_timeout_s * 2):
                await self._ws_server.wait_closed()
        finally:
            self._shutdown_done.set()

    async def aclose(self) -> None:
        """:meth:`shutdown`, then stop the server's tasks and close the engine if it owns it.

        Call it from the task that called :meth:`start` (``async with`` does),
        outside any task group or cancel scope opened since: the server's
        task group and the engine were entered there and must be left there.
        Idempotent.
        """
        await self.shutdown()
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await stack.aclose()
        finally:
            self._state = "closed"
            logger.info("omni_stream server on port %s closed", self._port)

    async def _wait_requests_idle(self) -> None:
        while self._registry.running():
            self._requests_idle = anyio.Event()
            await self._requests_idle.wait()

    async def _wait_connections_idle(self) -> None:
        while self._connections:
            self._connections_idle = anyio.Event()
            await self._connections_idle.wait()

    async def _supervised(self, name: str, fn: Any) -> None:
        # A background task of the server that raises is a bug: shut down
        # loudly (its exception in the task group would instead cancel every
        # request without a word to the clients).
        try:
            await fn()
        except Exception as exc:  # noqa: BLE001 - _die logs it, with its traceback
            error = ServerFailedError(f"the server's {name} task failed: {exc!r}")
            error.__cause__ = exc
            self._die(error)

    def _die(self, error: OmniStreamError) -> None:
        """Record why the server cannot go on, log it once, and shut down unless ``stay_dead``."""
        if self._fatal is not None:
            return
        self._fatal = error
        exc_info = error.__cause__ if isinstance(error, ServerFailedError) else None
        if self._stay_dead:
            logger.error(
                "%s; staying up as asked (stay_dead), /health answers 503", error, exc_info=exc_info
            )
            return
        logger.error(
            "%s; shutting down so that a supervisor can restart the process "
            "(stay_dead / --stay-dead keeps it up)",
            error,
            exc_info=exc_info,
        )
        # Wakes serve_forever; shutdown() itself also runs here for servers
        # used without it (it is idempotent and answers concurrent callers).
        self.request_shutdown()
        if self._tg is not None and self._state == "running":
            self._tg.start_soon(self.shutdown, name="omni_stream fatal shutdown")

    async def _watch_engine(self) -> None:
        # The engine has no death callback; health() is a cheap snapshot.
        # Dead is final; stalled may recover, and closed is the owner's call.
        while True:
            await anyio.sleep(_ENGINE_WATCH_S)
            health = self._engine.health()
            if health.status == "dead":
                self._die(EngineDeadError(f"the engine died: {health.reason}"))
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
                self._fd_warning.warn(f"{count} of RLIMIT_NOFILE={limit} descriptors are open")

    async def _sweep_retained(self) -> None:
        # Detached results must not outlive retention_s even when nobody
        # looks them up (lookups also prune); a memory leak otherwise.
        interval = min(max(self.limits.retention_s / 4, 0.05), 5.0)
        while True:
            await anyio.sleep(interval)
            for record in self._registry.prune():
                logger.debug("forgot detached request %s (retention over)", record.id)

    # -- HTTP --------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if self._stopped_listening:
            # A TCP connection accepted before we stopped listening (a browser
            # preconnect) must not be answered after close: drop it, so the
            # client sees the server gone, not a server still shutting down.
            connection.transport.abort()
            return routes.error_response(503, "shutting_down", "the server is shutting down")
        parts = urlsplit(request.path)
        path = parts.path
        # websockets 17 hands every method to this hook; older releases drop
        # anything but GET unanswered before it (docs/protocol.md).
        method = getattr(request, "method", "GET")
        if path == "/ws" and method == "GET":
            return self._check_handshake(request, parts.query)
        if path == "/ws":
            response = routes.method_not_allowed(method, path, allow=("GET",))
        elif path in routes.READ_ONLY_ROUTES and method not in ("GET", "HEAD"):
            response = routes.method_not_allowed(method, path, allow=("GET", "HEAD"))
        else:
            response = self._route(path)
        # HEAD: GET's status and headers (Content-Length included), never a body.
        return routes.without_body(response) if method == "HEAD" else response

    def _route(self, path: str) -> Response:
        if path in ("/", "/index.html"):
            return routes.page_response()
        if path == "/health":
            return self._health_response()
        if path == "/metrics":
            return routes.respond(200, self.metrics.render(), CONTENT_TYPE)
        if path == "/models":
            return routes.json_response(
                200, routes.models_payload(self.model, self._default_preview, self.limits)
            )
        return routes.error_response(404, "not_found", f"no route {path!r}; try /, /ws, /health, /metrics, /models")

    def _check_handshake(self, request: Request, query: str) -> Response | None:
        refused = self.metrics.handshakes_refused
        if self.closing:
            refused.labels("shutting_down").inc()
            return routes.error_response(503, "shutting_down", "the server is shutting down")
        if self._token is not None and not security.token_ok(self._token, request.headers, query):
            refused.labels("unauthorized").inc()
            return routes.error_response(
                401,
                "unauthorized",
                "this server needs a token: send 'Authorization: Bearer TOKEN' or ?token=TOKEN",
                extra={"WWW-Authenticate": 'Bearer realm="omni_stream"'},
            )
        origin = request.headers.get("Origin")
        if not security.origin_allowed(
            origin,
            allowed=self._allow_origins,
            own=self._own_origins,
            bound_host=self._host,
            host_header=request.headers.get("Host"),
        ):
            refused.labels("forbidden_origin").inc()
            return routes.error_response(
                403,
                "forbidden_origin",
                f"origin {origin!r} is not allowed; start the server with allow_origins "
                "(OMNI_STREAM_ALLOW_ORIGINS) to allow it",
            )
        if len(self._connections) >= self.limits.max_connections:
            refused.labels("too_many_connections").inc()
            return routes.error_response(
                503,
                "too_many_connections",
                f"the server has {self.limits.max_connections} connections open "
                "(max_connections, OMNI_STREAM_MAX_CONNECTIONS)",
            )
        return None

    def _health_response(self) -> Response:
        health = self._engine.health()
        payload = health.to_dict()
        payload["server"] = {
            "connections": len(self._connections),
            "requests": len(self._registry.running()),
            "retained": len(self._registry.retained()),
        }
        stats = health.statistics
        load = admission.Load.of(
            stats.active, stats.queued, self.limits, engine_batch_size=self._engine.max_batch_size
        )
        payload["load"] = load.to_dict()
        if self.closing and health.ok:
            payload.update(status="shutting_down", ok=False, reason="the server is shutting down")
        elif health.ok and load.busy:
            # 200: a full server is healthy (a 503 would make a liveness
            # probe restart it, killing the work it is busy with).
            payload.update(
                status="busy",
                reason=f"the server holds {load.held} requests, max_active + max_queued; "
                "a generate gets error busy",
            )
            payload["load"]["retry_after_s"] = self._retry_after(load)
        if self._fatal is not None and payload["ok"]:
            # A failed server task (stay_dead keeps the process up): not
            # able to serve, though the engine is.
            payload.update(status="dead", ok=False, reason=str(self._fatal))
        return routes.json_response(200 if payload["ok"] else 503, payload)

    # -- connections -------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if len(self._connections) >= self.limits.max_connections or self.closing:
            # Two handshakes raced past the check in _check_handshake.
            reason = "server shutting down" if self.closing else "too many connections"
            code = protocol.CLOSE_GOING_AWAY if self.closing else protocol.CLOSE_TRY_AGAIN_LATER
            await ws.close(code, reason)
            return
        conn = ClientConnection(
            ws, limits=self.limits, metrics=self.metrics, dispatch=self._dispatch, budget=self._memory
        )
        self._connections[conn.id] = conn
        self.metrics.connections.inc()
        self.metrics.connections_opened.inc()
        logger.debug("connection %s from %s", conn.id, conn.remote)
        try:
            await conn.run()
        finally:
            for record in self._registry.disconnect(conn.id):
                record.cancel_reason = record.cancel_reason or "disconnect"
                self._engine.cancel(record.id)
            del self._connections[conn.id]
            self.metrics.connections.dec()
            if not self._connections:
                self._connections_idle.set()
            logger.debug("connection %s closed (%s)", conn.id, conn.close_text())

    # -- client messages ---------------------------------------------------------

    def _dispatch(self, conn: ClientConnection, data: str | bytes) -> None:
        # Synchronous on purpose: handling a message never waits, so one
        # connection's reader is never blocked behind anything.
        msg: protocol.ClientMessage | None = None
        try:
            msg = protocol.parse_client_message(data)
            if isinstance(msg, protocol.Generate):
                self._generate(conn, msg)
            elif isinstance(msg, protocol.Cancel):
                self._cancel(conn, msg)
            else:
                self._attach(conn, msg)
        except protocol.MessageError as exc:
            request_id = exc.request_id
            if isinstance(msg, protocol.Generate):
                self.metrics.requests.labels("rejected").inc()
                if msg.id is None:
                    request_id = None  # an id the server made up means nothing to the client
            conn.outbox.put(
                protocol.dumps(
                    protocol.error(exc.code, exc.message, request_id=request_id, field=exc.field)
                ),
                "error",
            )
        except Exception as exc:
            request_id = getattr(msg, "id", None)
            logger.exception("handling a message from connection %s failed", conn.id)
            conn.outbox.put(
                protocol.dumps(
                    protocol.error("internal", f"internal server error: {exc!r}", request_id=request_id)
                ),
                "error",
            )

    def _generate(self, conn: ClientConnection, msg: protocol.Generate) -> None:
        # Every refusal is counted by its code; busy is answered here, its
        # error carrying retry_after_s.
        try:
            self._admit(conn, msg)
        except admission.BusyError as exc:
            self.metrics.rejections.labels(exc.code).inc()
            self.metrics.requests.labels("rejected").inc()
            # No id when the client sent none (as _dispatch: a made-up id means nothing to it).
            reply = protocol.error(exc.code, exc.message, request_id=msg.id)
            reply["retry_after_s"] = exc.retry_after_s
            conn.outbox.put(protocol.dumps(reply), "error")
        except protocol.MessageError as exc:
            self.metrics.rejections.labels(exc.code).inc()
            raise

    def _admit(self, conn: ClientConnection, msg: protocol.Generate) -> None:
        request_id = msg.id or uuid.uuid4().hex
        if self.closing:
            raise protocol.MessageError(
                "shutting_down", "the server is shutting down", request_id=request_id
            )
        if self.fatal is not None:
            # Kept up by stay_dead after a fatal error: it serves no new work.
            raise protocol.MessageError(
                "engine_unavailable", f"the server failed: {self.fatal}", request_id=request_id
            )
        health = self._engine.health()
        if not health.ok:
            raise protocol.MessageError(
                "engine_unavailable",
                f"the engine is {health.status}: {health.reason}",
                request_id=request_id,
            )
        self._registry.check_new(request_id, detach=msg.detach)
        limit = self.limits.max_requests_per_connection
        if self._registry.running_owned_by(conn.id) >= limit:
            raise protocol.MessageError(
                "too_many_requests",
                f"this connection already runs {limit} requests "
                "(max_requests_per_connection, OMNI_STREAM_MAX_REQUESTS_PER_CONNECTION)",
                request_id=request_id,
            )
        # Before the params are read: refusing an overloaded server's work
        # must cost less than the work (a data: URL image is up to 1 MiB).
        stats = health.statistics
        load = admission.Load.of(
            stats.active, stats.queued, self.limits, engine_batch_size=self._engine.max_batch_size
        )
        admission.check_load(
            load,
            own=self._registry.running_owned_by(conn.id),
            connections=len(self._connections),
            retry_after_s=lambda: self._retry_after(load),
            request_id=request_id,
        )
        spec = admission.preview_spec(
            msg.preview,
            default=self._default_preview,
            decoder=self._default_decoder,
            limits=self.limits,
            request_id=request_id,
        )
        output = admission.output_spec(
            msg.output, video=bool(getattr(self.model, "produces_video", False)), request_id=request_id
        )
        total = admission.check_params(self.model, msg.params, self.limits, request_id=request_id)
        try:
            # The raw params: the engine validates them itself (the same checks).
            stream = self._engine.stream(
                msg.params, request_id=request_id, policy="latest", preview_every=spec.every,
                priority=msg.priority,
            )
        except ParamsError as exc:
            raise protocol.MessageError(
                "bad_params", exc.message, field=exc.field, request_id=request_id
            ) from None
        except EngineError as exc:
            raise protocol.MessageError(
                "engine_unavailable", exc.message, request_id=request_id
            ) from None
        record = RequestRecord(
            request_id,
            owner=conn.id,
            detach=msg.detach,
            total=total,
            preview=routes.preview_wire(spec),
            output=output.wire(),
            created_at=time.monotonic(),
        )
        self._registry.add(record)
        record.watch(conn.id, conn.outbox, attached=False)
        assert self._tg is not None
        self._tg.start_soon(
            self._consume, record, stream, spec, output,
            name=f"omni_stream request {request_id}",
        )

    def _retry_after(self, load: admission.Load) -> float:
        return admission.retry_after(
            (r.total - r.latest_step for r in self._registry.running()),
            held=load.held,
            step_s=self.metrics.recent_step_s,
            batch_size=self.metrics.recent_batch_size,
            whole_requests=bool(getattr(self.model, "runs_whole_requests", False)),
        )

    def _cancel(self, conn: ClientConnection, msg: protocol.Cancel) -> None:
        record = self._registry.lookup(msg.id, conn.id, authenticated=self._token is not None)
        if record.ended:
            return  # its terminal message was already sent
        record.cancel_reason = record.cancel_reason or "client"
        self._engine.cancel(record.id)

    def _attach(self, conn: ClientConnection, msg: protocol.Attach) -> None:
        record = self._registry.lookup(msg.id, conn.id, authenticated=self._token is not None)
        if record.is_watched_by(conn.id):
            raise protocol.MessageError(
                "already_attached",
                f"this connection already watches request {msg.id!r}",
                field="id",
                request_id=msg.id,
            )
        record.watch(conn.id, conn.outbox, attached=True)

    # -- one consumer per request ------------------------------------------------

    async def _consume(
        self,
        record: RequestRecord,
        stream: FrameStream,
        spec: PreviewSpec,
        output: admission.OutputSpec,
    ) -> None:
        message: dict[str, Any] | None = None
        try:
            message = await stream_request(
                record, stream, spec, output=output, params={"model": self.model.name, **stream.params},
                previewer=self._previewer, metrics=self.metrics,
            )
        except Exception as exc:
            logger.exception("request %s: the server failed while streaming it", record.id)
            message = protocol.error(
                "internal", f"internal server error: {exc!r}", request_id=record.id
            )
        finally:
            if message is None:  # the server's task group was cancelled
                message = protocol.cancelled(record.id, reason="shutdown")
            try:
                record.finish(message, now=time.monotonic())
                self._registry.ended(record)
                self.metrics.requests.labels(record.outcome or "error").inc()
                _log_request_done(record, message, model=self.model.name)
            except Exception as exc:  # noqa: BLE001 - _die logs it, with its traceback
                # The server's own books are wrong now (a record that never
                # ends holds shutdown and its client): die loudly.
                error = ServerFailedError(f"finishing request {record.id} failed: {exc!r}")
                error.__cause__ = exc
                self._die(error)
            finally:
                if not self._registry.running():
                    self._requests_idle.set()


def _websockets_logger() -> logging.Logger:
    # websockets logs every HTTP response ("connection rejected (200 OK)"
    # for each /health probe) and every connection at INFO; keep that out
    # of INFO logs unless the user set this logger's level themselves.
    log = logging.getLogger("omni_stream.server.websockets")
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
    return log


class ServerFailedError(OmniStreamError):
    """A task of the server itself failed, so it shut down; ``__cause__`` is what that task raised."""


#: How often the server looks at engine.health() for a dead engine.
_ENGINE_WATCH_S = 0.2
#: How often it counts its open file descriptors, and how few free ones it
#: calls "out of descriptors".
_FD_WATCH_S = 5.0
_FD_HEADROOM = 8
_FD_WARN_EVERY_S = 60.0


class _FdWarning:
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


def _loop_exception_handler(warning: _FdWarning) -> Any:
    """For serve()'s loop: asyncio's loop reports a failed accept() here, up to 100 times a tick.

    EMFILE / ENFILE become the once-a-minute warning; the rest goes to the
    loop's default handler.
    """

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            warning.warn(f"{context.get('message', 'accept failed')}: {exc.strerror}")
            return
        loop.default_exception_handler(context)

    return handle


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
        "elapsed_s": round((record.ended_at or time.monotonic()) - record.created_at, 3),
        "detach": record.detach,
    }
    names = {"request_id": "id", "connection": "conn", "total_steps": "total"}
    text = " ".join(f"{names.get(k, k)}={_kv(v)}" for k, v in fields.items() if v is not None)
    logger.info("request done %s", text, extra=fields)


def serve(
    model: StepModel | str,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    allow_origins: Sequence[str] | str | None = (),
    device: str = "auto",
    stay_dead: bool = False,
    **limits: Any,
) -> None:
    """Run the engine and the websocket server until SIGINT or SIGTERM (blocking).

    ``model`` is a StepModel or a name for ``omni_stream.models.load_model``
    (``"mixture"``, ``"synthetic"``, ``"module:attr"``). Uses uvloop when it
    is installed. Inside async code use ``async with Server(...) as server:
    await server.serve_forever()`` instead.

    When the engine dies (or a task of the server fails) it answers the
    requests in flight, shuts down and raises EngineDeadError (or
    ServerFailedError), so that the process exits and a supervisor restarts
    it; ``stay_dead=True`` keeps serving ``/health`` 503 until a signal, then
    raises the same. Raises ParamsError for a bad option or model name.
    """
    if isinstance(model, str):
        from ..models.registry import load_model

        model = load_model(model)
    server = Server(
        model, host=host, port=port, token=token, allow_origins=allow_origins, device=device,
        stay_dead=stay_dead, **limits,
    )

    async def main() -> None:
        # Our own loop: out-of-descriptors reports become one clear warning.
        asyncio.get_running_loop().set_exception_handler(_loop_exception_handler(server._fd_warning))
        async with server:
            await server.serve_forever()

    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        options: dict[str, Any] = {}
    else:
        options = {"use_uvloop": True}
    anyio.run(main, backend="asyncio", backend_options=options)
    if server.fatal is not None:
        raise server.fatal
