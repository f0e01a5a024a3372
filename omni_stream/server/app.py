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

import logging
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
from ..errors import EngineError, ParamsError
from ..model import StepModel
from ..preview import Previewer, PreviewSpec
from . import admission, protocol, routes, security
from .connection import ClientConnection
from .consumer import stream_request
from .limits import ServerLimits, resolve_origins, resolve_token
from .metrics import CONTENT_TYPE, ServerMetrics
from .session import RequestRecord, RequestRegistry

__all__ = ["Server", "serve"]

logger = logging.getLogger("omni_stream.server")


class Server:
    """The omni_stream websocket server (docs/protocol.md).

    ``engine_or_model``: a running :class:`~omni_stream.Engine` (the caller
    starts and closes it), or a :class:`~omni_stream.StepModel`, for which
    the server creates an engine on ``device`` and owns it. ``port=0`` picks
    a free port; read it back from :attr:`port`. ``limits`` are the keyword
    arguments of :class:`ServerLimits`. Raises ParamsError for a bad option.

    ``async with Server(model, port=0) as server: ...`` serves until the
    block ends, then shuts down gracefully (see :meth:`aclose`).
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
        **limits: Any,
    ) -> None:
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
        self._registry = RequestRegistry(
            retention_s=self.limits.retention_s, max_retained=self.limits.max_retained
        )
        self.metrics = ServerMetrics(self._engine, running=lambda: len(self._registry.running()))
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
        self._tg.start_soon(self._sweep_retained)
        logger.info("omni_stream server listening on %s (model %s)", self.http_url, self.model.name)

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
        if path == "/ws":
            return self._check_handshake(request, parts.query)
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
        if self.closing and health.ok:
            payload.update(status="shutting_down", ok=False, reason="the server is shutting down")
        return routes.json_response(200 if payload["ok"] else 503, payload)

    # -- connections -------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if len(self._connections) >= self.limits.max_connections or self.closing:
            # Two handshakes raced past the check in _check_handshake.
            reason = "server shutting down" if self.closing else "too many connections"
            code = protocol.CLOSE_GOING_AWAY if self.closing else protocol.CLOSE_TRY_AGAIN_LATER
            await ws.close(code, reason)
            return
        conn = ClientConnection(ws, limits=self.limits, metrics=self.metrics, dispatch=self._dispatch)
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
        request_id = msg.id or uuid.uuid4().hex
        if self.closing:
            raise protocol.MessageError(
                "shutting_down", "the server is shutting down", request_id=request_id
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
                msg.params, request_id=request_id, policy="latest", preview_every=spec.every
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
            record.finish(message, now=time.monotonic())
            self._registry.ended(record)
            self.metrics.requests.labels(record.outcome or "error").inc()
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


def serve(
    model: StepModel | str,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    allow_origins: Sequence[str] | str | None = (),
    device: str = "auto",
    **limits: Any,
) -> None:
    """Run the engine and the websocket server until SIGINT or SIGTERM (blocking).

    ``model`` is a StepModel or a name for ``omni_stream.models.load_model``
    (``"mixture"``, ``"synthetic"``, ``"module:attr"``). Uses uvloop when it
    is installed. Inside async code use ``async with Server(...) as server:
    await server.serve_forever()`` instead. Raises ParamsError for a bad
    option or model name.
    """
    if isinstance(model, str):
        from ..models.registry import load_model

        model = load_model(model)
    server = Server(
        model, host=host, port=port, token=token, allow_origins=allow_origins, device=device, **limits
    )

    async def main() -> None:
        async with server:
            await server.serve_forever()

    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        options: dict[str, Any] = {}
    else:
        options = {"use_uvloop": True}
    anyio.run(main, backend="asyncio", backend_options=options)

