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
    /prompt, /history, /view, /queue, /interrupt, /object_info, /system_stats, /upload/image,
    WS /ws?clientId=...            ComfyUI's API (comfyui_api.py, comfyui_ws.py; docs/comfyui.md)
    /v1/images/..., /v1/videos/..., GET /v1/models[/{id}]   OpenAI's (openai_api.py, openai_videos.py)
    /sdapi/v1/...                  AUTOMATIC1111's API (a1111_api.py; docs/a1111.md)

Every route answers HEAD like GET without a body, other methods 405 with
``Allow``, unknown paths 404, all errors as ``{"error", "message"}`` JSON.

Every door applies the same checks, in one place: :class:`FrontDoor`
(front_door.py), wrapped around each route here. Each call to the HTTP
API is a client of the core for as long as it is open (an open POST, a
``?wait``, an event stream, a result being sent), counted against
``max_connections`` and its principal's share, and its messages against
its principal's rate.

Who runs what: the :class:`FrontDoor` holds the :class:`Service` (the
core's shell). Standalone, the app's lifespan enters it (and the engine,
when the app was given a model). Mounted in a host app (Starlette does
not run a mounted app's lifespan), the host runs
:meth:`OmniStreamApp.lifespan`: as its own (``Starlette(lifespan=omni.lifespan)``)
or inside its own (``async with omni.lifespan(app): ...``). Until then
``/health`` answers 503 ``not_started`` and every request 503
``engine_unavailable``, both naming what is missing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from .. import protocol
from ..core.limits import ServerLimits, resolve_hosts, resolve_origins, resolve_proxies, resolve_tokens
from ..core.metrics import CONTENT_TYPE
from ..core.rules import Client
from ..core.webhooks import resolve_webhooks
from ..engine.group import engine_for
from ..engine.like import looks_like_engine
from ..errors import ParamsError
from ..model import StepModel
from ..preview import Previewer
from . import responses, sessions
from .a1111_api import A1111Api, a1111_shaped, with_basic_as_bearer
from .comfyui_api import ComfyUIApi, comfy_shaped
from .comfyui_ws import ComfyConnection
from .front_door import STATE_CHANGING, FrontDoor, handshake_refusal
from .http11 import BoundedSend
from .http_api import HttpApi
from .openai_api import OpenAIApi, openai_shaped
from .openai_videos import OpenAIVideos
from .service import Service
from .state import StateOptions
from .websocket import ClientConnection

__all__ = ["FrontDoor", "OmniStreamApp", "create_app"]

logger = logging.getLogger("omni_stream.server")

#: An HTTP route's handler; an API handler also gets the call's client.
Handler = Callable[[Request], Awaitable[Response]]
ApiHandler = Callable[[Request, Client], Awaitable[Response]]


def create_app(
    engine_or_model: Any,
    *,
    token: Any = None,
    tokens_file: str | None = None,
    allow_origins: Sequence[str] | str | None = (),
    allowed_hosts: Sequence[str] | str | None = (),
    trusted_proxies: Sequence[str] | str | None = None,
    device: str = "auto",
    previewer: Previewer | None = None,
    stay_dead: bool = False,
    metrics_public: bool = False,
    webhook_secret: str | None = None,
    webhook_allow: Sequence[str] | str | None = None,
    **limits: Any,
) -> OmniStreamApp:
    """The server as a Starlette application (see the module docstring).

    ``engine_or_model``: an engine (``Engine``, ``EngineGroup``, anything
    EngineLike; its owner runs it) or a :class:`~omni_stream.StepModel`
    (the app creates an engine on ``device`` and its lifespan runs it).
    ``token``: one ``SECRET`` or ``NAME=SECRET``, several, or a name ->
    secret mapping (core/tokens.py); ``tokens_file``: a file of them.
    ``allowed_hosts``: host names it answers to besides its address;
    ``trusted_proxies``: the proxies whose ``X-Forwarded-For`` names the
    client. ``webhook_allow``: URL patterns webhooks may call (none: no
    webhooks), ``webhook_secret``: their signing secret, ``whsec_`` base64
    (docs/webhooks.md). ``limits`` are :class:`ServerLimits`' keyword arguments. Raises
    ParamsError for a bad option, TypeError for an engine that lacks what
    a server needs (naming it). Mounted, the host runs ``app.lifespan``.
    """
    door = build_front_door(
        engine_or_model,
        token=token,
        tokens_file=tokens_file,
        allow_origins=allow_origins,
        allowed_hosts=allowed_hosts,
        trusted_proxies=trusted_proxies,
        device=device,
        previewer=previewer,
        stay_dead=stay_dead,
        metrics_public=metrics_public,
        limits=limits,
        webhook_secret=webhook_secret,
        webhook_allow=webhook_allow,
    )
    return app_for(door)


def build_front_door(
    engine_or_model: Any,
    *,
    token: Any,
    allow_origins: Sequence[str] | str | None,
    device: str,
    previewer: Previewer | None,
    stay_dead: bool,
    metrics_public: bool,
    limits: dict[str, Any],
    on_fatal: Any = None,
    tokens_file: str | None = None,
    allowed_hosts: Sequence[str] | str | None = (),
    trusted_proxies: Sequence[str] | str | None = None,
    webhook_secret: str | None = None,
    webhook_allow: Sequence[str] | str | None = None,
) -> FrontDoor:
    """The front door :func:`create_app` serves (``Server`` builds one too); raises ParamsError."""
    if not isinstance(stay_dead, bool):
        raise ParamsError(f"stay_dead must be true or false, got {stay_dead!r}", field="stay_dead")
    if not isinstance(metrics_public, bool):
        raise ParamsError(
            f"metrics_public must be true or false, got {metrics_public!r}", field="metrics_public"
        )
    limits = dict(limits)
    # The engine's own options, for an engine the server makes (Engine(scheduling=, quantum=)).
    engine_options = {k: limits.pop(k) for k in ("scheduling", "quantum") if k in limits}
    if looks_like_engine(engine_or_model):
        if engine_options:
            raise ParamsError(
                f"{', '.join(engine_options)} configure an engine the server makes; this one is yours: "
                "give them to it",
                field=next(iter(engine_options)),
            )
        # The Service checks it has what a server needs (a TypeError naming what is missing).
        engine, owns = engine_or_model, False
    elif isinstance(engine_or_model, Mapping):
        # {name: model}: several models, each its own engine on ``device``, all
        # loaded at start (a ModelRouter of one's own sets max_loaded).
        from ..engine.router import ModelRouter

        engine, owns = ModelRouter(dict(engine_or_model), device=device, **engine_options), True
    elif isinstance(engine_or_model, StepModel) or callable(engine_or_model):
        # A model (or a factory: one model per device of a group) the server
        # runs on ``device``: "cuda:0,cuda:1" or "all" makes an EngineGroup.
        engine, owns = engine_for(engine_or_model, device=device, **engine_options), True
    else:
        raise ParamsError(
            "the server needs an engine (omni_stream.Engine, EngineGroup, or anything EngineLike), "
            f"a StepModel or a model factory, got {type(engine_or_model).__name__}",
            field="engine_or_model",
        )
    state = StateOptions.take(limits)  # the state directory's keywords, the rest are limits
    server_limits = ServerLimits.from_env(limits)
    tokens = resolve_tokens(token, tokens_file)
    origins = resolve_origins(allow_origins)
    hosts = resolve_hosts(allowed_hosts)
    proxies = resolve_proxies(trusted_proxies)
    webhooks = resolve_webhooks(webhook_secret, webhook_allow)
    service = Service(
        engine,
        limits=server_limits,
        tokens=tokens,
        owns_engine=owns,
        previewer=previewer,
        stay_dead=stay_dead,
        on_fatal=on_fatal,
        webhooks=webhooks,
        state=state,
    )
    return FrontDoor(
        service,
        allow_origins=origins,
        metrics_public=metrics_public,
        allowed_hosts=hosts,
        trusted_proxies=proxies,
    )


def app_for(door: FrontDoor) -> OmniStreamApp:
    """The Starlette application serving ``door``."""
    api = HttpApi(door)
    openai_api = OpenAIApi(door)
    comfy = ComfyUIApi(door)
    a1111 = A1111Api(door)
    videos = OpenAIVideos(door)
    service = door.service
    rules = door.rules

    def guarded(handler: Handler, *, public: bool = False) -> Handler:
        async def endpoint(request: Request) -> Response:
            refused = door.refuse_host(request) or (None if public else door.refuse_token(request))
            if refused is None and request.method in STATE_CHANGING:
                refused = door.refuse_origin(request)
            response = refused or await handler(request)
            response.headers.update(door.cors_headers(request))
            return response

        return endpoint

    def session_of(request: Request) -> tuple[str | None, str | None]:
        """The browser session of a call to a server without tokens (sessions.py), and the
        ``Set-Cookie`` to answer with when the call came without one; (None, None) with tokens."""
        if service.tokens:
            return None, None
        found = sessions.read(request.cookies)
        if found is not None:
            return found, None
        new = sessions.mint()
        path = request.scope.get("root_path") or "/"
        return new, sessions.cookie_header(new, path=path, secure=request.url.scheme == "https")

    def call(handler: ApiHandler) -> Handler:
        """An API call as a client of the core, for as long as its answer is being sent."""

        async def endpoint(request: Request) -> Response:
            principal = door.http_principal(request)
            refused = door.refuse_client(principal, request) or door.refuse_declared_body(request)
            if refused is not None:
                return refused
            client = rules.connect(principal, "http")
            client.session, cookie = session_of(request)
            client.session_returned = client.session is not None and cookie is None
            try:
                # Its principal's rate: a call over it is answered later, never refused.
                delay = rules.pace(client, int(request.headers.get("content-length") or 0))
                if delay > 0.0:
                    await anyio.sleep(delay)
                response = await handler(request, client)
            except BaseException:
                rules.disconnect(client)
                raise
            if cookie is not None:
                response.headers.append("set-cookie", cookie)
            return responses.until_sent(response, on_close=lambda: rules.disconnect(client))

        return guarded(endpoint)

    def shaped_call(
        shape: Callable[[Response], Response], *, basic_auth: bool = False
    ) -> Callable[[ApiHandler], Handler]:
        """API calls on another API's routes: every refusal, the door's too, in that API's error
        ``shape``; with ``basic_auth``, HTTP basic auth read as the token (A1111's and ComfyUI's
        clients send only that: a1111/auth.py)."""

        def wrap(handler: ApiHandler) -> Handler:
            inner = call(handler)

            async def endpoint(request: Request) -> Response:
                if basic_auth:
                    with_basic_as_bearer(request)
                return shape(await inner(request))

            return endpoint

        return wrap

    openai_call = shaped_call(openai_shaped)
    comfy_call = shaped_call(comfy_shaped, basic_auth=True)
    a1111_call = shaped_call(a1111_shaped, basic_auth=True)

    async def page(request: Request) -> Response:
        response = responses.page_response()
        cookie = session_of(request)[1]  # first contact: the websocket it opens carries it
        if cookie is not None and response.status_code == 200:
            response.headers.append("set-cookie", cookie)
        return response

    async def health(request: Request) -> Response:
        status, payload = service.health_payload()
        return responses.json_response(status, payload)

    async def metrics(request: Request) -> Response:
        return responses.respond(200, rules.metrics.render(), CONTENT_TYPE)

    async def models(request: Request) -> Response:
        loaded = getattr(service.engine, "loaded", None)
        return responses.json_response(
            200,
            responses.catalog_payload(
                rules.models,
                rules.preview_defaults,
                service.limits,
                loaded=None if loaded is None else tuple(loaded),
            ),
        )

    async def preflight(request: Request) -> Response:
        # CORS only where configured: an origin not in allow_origins gets no
        # Access-Control-* headers, and the browser refuses the request.
        return responses.respond(204, b"", "text/plain", extra={"Access-Control-Max-Age": "600"})

    async def ws_over_http(request: Request) -> Response:
        # The websocket's refusals first (a page diagnosing a failed
        # connection asks here), then: not an upgrade.
        refused = handshake_refusal(door, request, door.http_principal(request))
        if refused is not None:
            return refused
        return responses.error_response(
            426,
            "upgrade_required",
            "/ws is a websocket endpoint: connect with a websocket client",
            extra={"Upgrade": "websocket", "Connection": "Upgrade"},
        )

    async def websocket(ws: WebSocket) -> None:
        await _serve_websocket(door, ws, comfy)

    def methods(path: str, **handlers: Handler) -> Route:
        # One route per path, so a wrong method's 405 lists every allowed one.
        allowed = tuple(handlers) + (("HEAD",) if "GET" in handlers else ())
        if door.allow_origins and "OPTIONS" not in handlers:
            handlers["OPTIONS"] = guarded(preflight, public=True)

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
        methods("/v1/generations", GET=call(api.listing), POST=call(api.create)),
        methods("/v1/generations/{request_id}", GET=call(api.status), DELETE=call(api.cancel)),
        methods("/v1/generations/{request_id}/events", GET=call(api.events)),
        methods("/v1/generations/{request_id}/output", GET=call(api.output)),
        methods("/v1/generations/{request_id}/preview", GET=call(api.preview)),
        methods("/v1/generations/{request_id}/pause", POST=call(api.pause)),
        methods("/v1/generations/{request_id}/resume", POST=call(api.resume)),
        # OpenAI's Images API and model list (server/openai_api.py, docs/openai.md).
        methods("/v1/images/generations", POST=openai_call(openai_api.image_generations)),
        methods("/v1/images/edits", POST=openai_call(openai_api.image_edits)),
        methods("/v1/models", GET=openai_call(openai_api.models)),
        methods("/v1/models/{model:path}", GET=openai_call(openai_api.model)),
        methods("/v1/videos", GET=openai_call(videos.listing), POST=openai_call(videos.create)),
        methods("/v1/videos/{video_id}", GET=openai_call(videos.retrieve), DELETE=openai_call(videos.delete)),
        methods("/v1/videos/{video_id}/content", GET=openai_call(videos.content)),
        # ComfyUI's API (server/comfyui_api.py, docs/comfyui.md); its websocket is /ws?clientId=.
        methods("/prompt", GET=comfy_call(comfy.get_prompt), POST=comfy_call(comfy.post_prompt)),
        methods("/history", GET=comfy_call(comfy.history)),
        methods("/history/{prompt_id}", GET=comfy_call(comfy.history_of)),
        methods("/view", GET=comfy_call(comfy.view)),
        methods("/queue", GET=comfy_call(comfy.get_queue), POST=comfy_call(comfy.post_queue)),
        methods("/interrupt", POST=comfy_call(comfy.interrupt)),
        methods("/object_info", GET=comfy_call(comfy.object_info)),
        methods("/object_info/{node_class}", GET=comfy_call(comfy.object_info_of)),
        methods("/system_stats", GET=comfy_call(comfy.system_stats)),
        methods("/embeddings", GET=comfy_call(comfy.embeddings)),
        methods("/upload/image", POST=comfy_call(comfy.upload_image)),
        # AUTOMATIC1111's API (server/a1111_api.py, docs/a1111.md).
        *(
            methods(path, **{method: a1111_call(handler) for method, handler in handlers.items()})
            for path, handlers in a1111.routes().items()
        ),
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
        # Every unknown path is a 404 (docs/http.md), never Starlette's 307 to
        # the path without its trailing slash.
        self.router.redirect_slashes = False
        self.door = door
        self.state.omni_stream = door
        self._bounded = BoundedSend(super().__call__, timeout_s=door.service.limits.send_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Every HTTP response's sends are bounded (http11.BoundedSend): a
        # client that stops reading is cut off, whatever route answered it.
        await self._bounded(scope, receive, send)

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


async def _serve_websocket(door: FrontDoor, ws: WebSocket, comfy: ComfyUIApi) -> None:
    """One websocket: the handshake rules, then a :class:`ClientConnection` until it closes (a
    ComfyUI client's, ``?clientId=``, a :class:`ComfyConnection`: comfyui_ws.py)."""
    service, rules = door.service, door.rules
    # Without a token, a websocket is its own principal (rules.connect names it).
    principal = rules.principal_of_connection("pending", headers=ws.headers, query=ws.url.query)
    refused = handshake_refusal(door, ws, principal)
    if refused is not None:
        try:
            await ws.send_denial_response(refused)
        except RuntimeError:  # an ASGI server without the denial extension
            await ws.close(protocol.CLOSE_POLICY_VIOLATION, "refused")
        return
    await ws.accept()
    client_id = ws.query_params.get("clientId")
    conn = (
        ClientConnection(ws, rules=rules, service=service, principal=principal)
        if client_id is None
        else ComfyConnection(
            ws,
            rules=rules,
            service=service,
            principal=principal,
            # What its prompts were posted as: its token's name, else its address (comfyui/book.py).
            owner=door.http_principal(ws).key,
            client_id=client_id,
            book=comfy.book,
            sockets=comfy.sockets,
        )
    )
    if not service.tokens:  # the page's session (sessions.py): its requests are its to list
        conn.client.session = sessions.read(ws.cookies)
        conn.client.session_returned = conn.client.session is not None
    door.websockets[conn.id] = conn
    logger.debug("connection %s (%s) from %s", conn.id, conn.client.principal, conn.remote)
    try:
        await conn.run()
    finally:
        del door.websockets[conn.id]
        rules.disconnect(conn.client)
        logger.debug("connection %s closed (%s)", conn.id, conn.close_text())
