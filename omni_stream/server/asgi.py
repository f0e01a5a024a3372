"""``create_app``: the server as an ASGI application (Starlette), standalone or mounted.

Routes (docs/protocol.md, docs/http.md)::

    GET  /  /index.html            the preview page
    GET  /health                   engine + server health (no token needed)
    GET  /metrics                  Prometheus text (token unless metrics_public)
    GET  /models                   the model, its params, preview options, limits
    WS   /ws                       the websocket protocol
    POST /v1/generations           start one (202 | event stream | ?wait=true result)
    GET  /v1/generations           the queue
    GET  /v1/generations/{id}      its status
    GET  /v1/generations/{id}/events    Server-Sent Events
    GET  /v1/generations/{id}/output    the result
    GET  /v1/generations/{id}/preview   the newest preview
    DELETE /v1/generations/{id}    cancel

Every route answers HEAD like GET without a body, other methods 405 with
``Allow``, unknown paths 404, all errors as ``{"error", "message"}`` JSON.

Who runs what: the :class:`FrontDoor` holds the :class:`Service` (the
core: requests and their rules). Standalone, the app's lifespan enters it
(and the engine, when the app was given a model). Mounted in a host app
(Starlette does not run a mounted app's lifespan), the host runs
:meth:`OmniStreamApp.lifespan`: as its own (``Starlette(lifespan=omni.lifespan)``)
or inside its own (``async with omni.lifespan(app): ...``). Until then
``/health`` answers 503 ``not_started`` and every request 503
``engine_unavailable``, both naming what is missing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from .. import protocol
from ..engine.group import engine_for
from ..engine.like import looks_like_engine
from ..errors import ParamsError
from ..model import StepModel
from ..preview import Previewer
from ..core import origin as security
from . import responses
from .connection import ClientConnection
from .http_api import HttpApi
from ..core.limits import ServerLimits, resolve_origins, resolve_token
from .metrics import CONTENT_TYPE
from .service import Service

__all__ = ["FrontDoor", "OmniStreamApp", "create_app"]

logger = logging.getLogger("omni_stream.server")

#: An HTTP route's handler.
Handler = Callable[[Request], Awaitable[Response]]


class FrontDoor:
    """What every route shares: the service, the token and Origin rules (see the module docstring)."""

    def __init__(
        self,
        service: Service,
        *,
        allow_origins: frozenset[str] | tuple[str, ...],
        metrics_public: bool,
    ) -> None:
        self.service = service
        self.allow_origins = allow_origins
        self.metrics_public = metrics_public
        #: Open websocket connections, by id (shutdown closes them with 1001).
        self.websockets: dict[str, ClientConnection] = {}

    @property
    def token(self) -> str | None:
        return self.service.token

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[FrontDoor]:
        """Run the service for the duration of the block (the host app's lifespan, when mounted).

        On leaving: refuse new work, give running requests
        ``shutdown_timeout_s``, cancel the rest, close the websockets (1001).
        """
        async with self.service:
            try:
                yield self
            finally:
                await self.shutdown()

    async def shutdown(self, forced: anyio.Event | None = None) -> None:
        """Requests first (graceful, bounded), then every open websocket with 1001. Idempotent."""
        service = self.service
        if not service.started:
            return
        await service.shutdown_requests(grace_s=service.limits.shutdown_timeout_s, forced=forced)
        for conn in list(self.websockets.values()):
            conn.close_soon(protocol.CLOSE_GOING_AWAY, "server shutting down")
        with anyio.move_on_after(service.limits.close_timeout_s * 2):
            await service.wait_connections_idle()

    def authenticated(self, conn: HTTPConnection) -> bool:
        """The caller presented the token (always False on a server without one)."""
        token = self.token
        return token is not None and security.token_ok(token, conn.headers, conn.url.query)

    def refuse_token(self, conn: HTTPConnection) -> Response | None:
        """401 unless the server is open or the caller presented the token."""
        if self.token is None or self.authenticated(conn):
            return None
        self.service.metrics.handshakes_refused.labels("unauthorized").inc()
        return responses.error_response(
            401,
            "unauthorized",
            "this server needs a token: send 'Authorization: Bearer TOKEN' or ?token=TOKEN",
            extra={"WWW-Authenticate": 'Bearer realm="omni_stream"'},
        )

    def refuse_origin(self, conn: HTTPConnection) -> Response | None:
        """403 for a browser page of another origin (docs/protocol.md's rules)."""
        origin = conn.headers.get("origin")
        server = conn.scope.get("server") or ("", 0)
        host, port = str(server[0] or ""), int(server[1] or 0)
        if security.origin_allowed(
            origin,
            allowed=self.allow_origins,
            own=security.own_origins(host, port) if host else frozenset(),
            bound_host=host,
            host_header=conn.headers.get("host"),
        ):
            return None
        self.service.metrics.handshakes_refused.labels("forbidden_origin").inc()
        return responses.error_response(
            403,
            "forbidden_origin",
            f"origin {protocol.clip(str(origin))!r} is not allowed; start the server with allow_origins "
            "(OMNI_STREAM_ALLOW_ORIGINS) to allow it",
        )


def create_app(
    engine_or_model: Any,
    *,
    token: str | None = None,
    allow_origins: Sequence[str] | str | None = (),
    device: str = "auto",
    previewer: Previewer | None = None,
    stay_dead: bool = False,
    metrics_public: bool = False,
    **limits: Any,
) -> OmniStreamApp:
    """The server as a Starlette application (see the module docstring).

    ``engine_or_model``: an engine (``Engine``, ``EngineGroup``, anything
    EngineLike; its owner runs it) or a :class:`~omni_stream.StepModel`
    (the app creates an engine on ``device`` and its lifespan runs it).
    ``limits`` are :class:`ServerLimits`' keyword arguments. Raises
    ParamsError for a bad option, TypeError for an engine that lacks what
    a server needs (naming it). Mounted, the host runs ``app.lifespan``.
    """
    door = build_front_door(
        engine_or_model,
        token=token,
        allow_origins=allow_origins,
        device=device,
        previewer=previewer,
        stay_dead=stay_dead,
        metrics_public=metrics_public,
        limits=limits,
    )
    return app_for(door)


def build_front_door(
    engine_or_model: Any,
    *,
    token: str | None,
    allow_origins: Sequence[str] | str | None,
    device: str,
    previewer: Previewer | None,
    stay_dead: bool,
    metrics_public: bool,
    limits: dict[str, Any],
    on_fatal: Any = None,
) -> FrontDoor:
    """The front door :func:`create_app` serves (``Server`` builds one too); raises ParamsError."""
    if not isinstance(stay_dead, bool):
        raise ParamsError(f"stay_dead must be true or false, got {stay_dead!r}", field="stay_dead")
    if not isinstance(metrics_public, bool):
        raise ParamsError(
            f"metrics_public must be true or false, got {metrics_public!r}", field="metrics_public"
        )
    if looks_like_engine(engine_or_model):
        # The Service checks it has what a server needs (a TypeError naming what is missing).
        engine, owns = engine_or_model, False
    elif isinstance(engine_or_model, StepModel) or callable(engine_or_model):
        # A model (or a factory: one model per device of a group) the server
        # runs on ``device``: "cuda:0,cuda:1" or "all" makes an EngineGroup.
        engine, owns = engine_for(engine_or_model, device=device), True
    else:
        raise ParamsError(
            "the server needs an engine (omni_stream.Engine, EngineGroup, or anything EngineLike), "
            f"a StepModel or a model factory, got {type(engine_or_model).__name__}",
            field="engine_or_model",
        )
    server_limits = ServerLimits.from_env(limits)
    service = Service(
        engine,
        limits=server_limits,
        token=resolve_token(token),
        owns_engine=owns,
        previewer=previewer,
        stay_dead=stay_dead,
        on_fatal=on_fatal,
    )
    return FrontDoor(service, allow_origins=resolve_origins(allow_origins), metrics_public=metrics_public)


def app_for(door: FrontDoor) -> OmniStreamApp:
    """The Starlette application serving ``door``."""
    api = HttpApi(door)
    service = door.service

    def guarded(handler: Handler, *, public: bool = False) -> Handler:
        async def endpoint(request: Request) -> Response:
            if not public:
                refused = door.refuse_token(request)
                if refused is not None:
                    return refused
            return await handler(request)

        return endpoint

    async def page(request: Request) -> Response:
        return responses.page_response()

    async def health(request: Request) -> Response:
        status, payload = service.health_payload()
        return responses.json_response(status, payload)

    async def metrics(request: Request) -> Response:
        return responses.respond(200, service.metrics.render(), CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return responses.json_response(
            200, responses.models_payload(service.model, service.default_preview, service.limits)
        )

    async def ws_over_http(request: Request) -> Response:
        # The websocket's refusals first (a page diagnosing a failed
        # connection asks here), then: not an upgrade.
        refused = handshake_refusal(door, request)
        if refused is not None:
            return refused
        return responses.error_response(
            426,
            "upgrade_required",
            "/ws is a websocket endpoint: connect with a websocket client",
            extra={"Upgrade": "websocket", "Connection": "Upgrade"},
        )

    async def websocket(ws: WebSocket) -> None:
        await _serve_websocket(door, ws)

    def methods(path: str, **handlers: Handler) -> Route:
        # One route per path, so a wrong method's 405 lists every allowed one.
        allowed = tuple(handlers) + (("HEAD",) if "GET" in handlers else ())

        async def endpoint(request: Request) -> Response:
            method = "GET" if request.method == "HEAD" else request.method
            handler = handlers.get(method)
            if handler is None:
                return responses.method_not_allowed(request.method, path, allow=allowed)
            return await handler(request)

        return Route(path, endpoint, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])

    app_routes = [
        # The page is a static file with nothing secret in it: served to all, so
        # that a visitor without the token is told what is missing.
        methods("/", GET=guarded(page, public=True)),
        methods("/index.html", GET=guarded(page, public=True)),
        methods("/health", GET=guarded(health, public=True)),
        methods("/metrics", GET=guarded(metrics, public=door.metrics_public)),
        methods("/models", GET=guarded(models)),
        WebSocketRoute("/ws", websocket),
        methods("/ws", GET=ws_over_http),
        methods("/v1/generations", GET=guarded(api.listing), POST=guarded(api.create)),
        methods("/v1/generations/{request_id}", GET=guarded(api.status), DELETE=guarded(api.cancel)),
        methods("/v1/generations/{request_id}/events", GET=guarded(api.events)),
        methods("/v1/generations/{request_id}/output", GET=guarded(api.output)),
        methods("/v1/generations/{request_id}/preview", GET=guarded(api.preview)),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "GET, HEAD")
            return responses.method_not_allowed(
                request.method, request.url.path, allow=tuple(allow.split(", "))
            )
        if exc.status_code == 404:
            return responses.error_response(
                404,
                "not_found",
                f"no route {protocol.clip(request.url.path)!r}; try /, /ws, /health, /metrics, /models, "
                "/v1/generations",
            )
        return responses.error_response(exc.status_code, "bad_request", str(exc.detail))

    return OmniStreamApp(door, routes=app_routes, exception_handlers={HTTPException: http_error})


class OmniStreamApp(Starlette):
    """The omni_stream server as a Starlette application; :meth:`lifespan` runs it.

    ``state.omni_stream`` (and :attr:`door`) is its :class:`FrontDoor`.
    """

    def __init__(self, door: FrontDoor, **options: Any) -> None:
        super().__init__(lifespan=self.lifespan, **options)
        self.door = door
        self.state.omni_stream = door

    @property
    def engine(self) -> Any:
        """The engine behind it (the one it created, when given a model): for the host's own code."""
        return self.door.service.engine

    def lifespan(self, app: object = None) -> AbstractAsyncContextManager[None]:
        """Serve for the duration of the block: the service, and the engine when the app created it.

        The app's own lifespan, and the one a host app must run when it
        mounts it (a host does not run a mounted app's): pass it as the
        host's, ``Starlette(lifespan=omni.lifespan)`` / ``FastAPI(lifespan=
        omni.lifespan)``, or enter it in the host's own, ``async with engine,
        omni.lifespan(app): yield``. ``app`` (the host) is not used. On
        leaving: the graceful shutdown of :meth:`FrontDoor.running`. Raises
        LifecycleError when entered a second time.
        """
        return self._serving()

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        async with self.door.running():
            yield


def handshake_refusal(door: FrontDoor, conn: HTTPConnection) -> Response | None:
    """Why a websocket handshake is refused (401, 403, 503), as the HTTP answer; None to accept."""
    refused = door.refuse_token(conn) or door.refuse_origin(conn)
    if refused is None:
        refusal = door.service.connection_refusal()
        if refusal is not None:
            status, code, message = refusal
            door.service.metrics.handshakes_refused.labels(code).inc()
            refused = responses.error_response(status, code, message)
    return refused


async def _serve_websocket(door: FrontDoor, ws: WebSocket) -> None:
    """One websocket: the handshake rules, then a :class:`ClientConnection` until it closes."""
    service = door.service
    refused = handshake_refusal(door, ws)
    if refused is not None:
        try:
            await ws.send_denial_response(refused)
        except RuntimeError:  # an ASGI server without the denial extension
            await ws.close(protocol.CLOSE_POLICY_VIOLATION, "refused")
        return
    await ws.accept()
    conn_id = service.connect()
    conn = ClientConnection(
        ws,
        conn_id=conn_id,
        limits=service.limits,
        metrics=service.metrics,
        dispatch=lambda c, data: service.handle(c.id, c.outbox, data),
        budget=service.memory,
    )
    door.websockets[conn_id] = conn
    logger.debug("connection %s from %s", conn_id, conn.remote)
    try:
        await conn.run()
    finally:
        del door.websockets[conn_id]
        service.disconnect(conn_id)
        logger.debug("connection %s closed (%s)", conn_id, conn.close_text())
