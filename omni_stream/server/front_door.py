"""``FrontDoor``: what every door of the server shares, the service and the checks at the door.

Every door applies the same checks, here: ``Host`` on every request, the
token (where configured) on all but the page and ``/health``, ``Origin`` on
the websocket handshake and on every request that changes state (POST,
DELETE), CORS headers only for origins configured in ``allow_origins``, and
the core's refusal of one more client. A caller is a *principal*
(core/principal.py): its token's name, else (websocket) its connection or
(HTTP) its address. asgi.py wraps each route in these checks; a refusal is
the HTTP answer, counted in the metrics by its reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from .. import protocol
from ..core import origin as security
from ..core.principal import Principal, TrustedProxies
from . import responses
from .service import Service

if TYPE_CHECKING:
    from .websocket import ClientConnection

__all__ = ["STATE_CHANGING", "FrontDoor", "handshake_refusal"]

#: Methods that change state: their Origin is checked (a browser sends one
#: with every cross-site POST, even a "simple" text/plain one).
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class FrontDoor:
    """What every door shares: the service and the checks at the door (see the module docstring)."""

    def __init__(
        self,
        service: Service,
        *,
        allow_origins: frozenset[str] | tuple[str, ...],
        metrics_public: bool,
        allowed_hosts: tuple[str, ...] = (),
        trusted_proxies: TrustedProxies | None = None,
    ) -> None:
        self.service = service
        self.rules = service.rules
        self.allow_origins = allow_origins
        self.allowed_hosts = allowed_hosts
        self.trusted_proxies = trusted_proxies or TrustedProxies()
        self.metrics_public = metrics_public
        #: Open websocket connections, by client id (shutdown closes them with 1001).
        self.websockets: dict[str, ClientConnection] = {}

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

    # -- who is calling ---------------------------------------------------------------

    def authenticated(self, conn: HTTPConnection) -> bool:
        """The caller presented a configured token (always False on a server without one)."""
        tokens = self.service.tokens
        return bool(tokens) and tokens.identify(conn.headers, conn.url.query) is not None

    def address(self, conn: HTTPConnection) -> str:
        """The caller's address: the peer's, or what a trusted proxy says it forwarded."""
        peer = conn.client.host if conn.client is not None else "unknown"
        return self.trusted_proxies.client_address(peer, conn.headers.get("x-forwarded-for"))

    def http_principal(self, conn: HTTPConnection) -> Principal:
        return self.rules.principal_of_address(self.address(conn), headers=conn.headers, query=conn.url.query)

    # -- the checks at the door -----------------------------------------------------------

    def refuse_token(self, conn: HTTPConnection) -> Response | None:
        """401 unless the server is open or the caller presented a configured token."""
        if not self.service.tokens or self.authenticated(conn):
            return None
        self._refused("unauthorized", conn)
        return responses.error_response(
            401,
            "unauthorized",
            "this server needs a token: send 'Authorization: Bearer TOKEN' or ?token=TOKEN",
            extra={"WWW-Authenticate": 'Bearer realm="omni_stream"'},
        )

    def refuse_origin(self, conn: HTTPConnection) -> Response | None:
        """403 for a browser page of another origin (docs/protocol.md's rules)."""
        origin = conn.headers.get("origin")
        host, port = _server(conn)
        if security.origin_allowed(
            origin,
            allowed=self.allow_origins,
            own=security.own_origins(host, port) if host else frozenset(),
            bound_host=host,
            host_header=conn.headers.get("host"),
        ):
            return None
        self._refused("forbidden_origin", conn)
        return responses.error_response(
            403,
            "forbidden_origin",
            f"origin {protocol.clip(str(origin))!r} is not allowed; start the server with allow_origins "
            "(OMNI_STREAM_ALLOW_ORIGINS) to allow it",
        )

    def refuse_host(self, conn: HTTPConnection) -> Response | None:
        """421 for a ``Host`` this server does not answer to (DNS rebinding; origin.py)."""
        host_header = conn.headers.get("host")
        bound, _ = _server(conn)
        if security.host_allowed(host_header, bound_host=bound, allowed=self.allowed_hosts):
            return None
        self._refused("forbidden_host", conn)
        return responses.error_response(
            421,
            "forbidden_host",
            f"this server does not answer to host {protocol.clip(str(host_header))!r}; start it with "
            "allowed_hosts (OMNI_STREAM_ALLOWED_HOSTS) to add it",
        )

    def cors_headers(self, conn: HTTPConnection) -> dict[str, str]:
        """CORS headers for a configured origin (``allow_origins``); none otherwise."""
        origin = conn.headers.get("origin")
        if origin is None or not self.allow_origins:
            return {}
        norm = origin.strip().rstrip("/").lower()
        if "*" not in self.allow_origins and norm not in self.allow_origins:
            return {}
        return {
            "Access-Control-Allow-Origin": origin.strip(),
            "Access-Control-Allow-Headers": "Authorization, Content-Type, Last-Event-ID",
            "Access-Control-Allow-Methods": "GET, HEAD, POST, DELETE, OPTIONS",
            "Access-Control-Expose-Headers": "Location, Retry-After, X-Omni-Stream-Step, "
            "X-Omni-Stream-Width, X-Omni-Stream-Height",
            "Vary": "Origin",
        }

    def refuse_declared_body(self, request: Request) -> Response | None:
        """413 at once for a body declaring more than ``max_message_bytes``: nothing read or paced."""
        declared = request.headers.get("content-length", "")
        limit = self.service.limits.max_message_bytes
        if not declared.isdigit() or int(declared) <= limit:
            return None
        self._refused("limit_exceeded", request)
        return responses.error_response(
            413,
            "limit_exceeded",
            f"the body is over {limit} bytes (max_message_bytes, OMNI_STREAM_MAX_MESSAGE_BYTES)",
            extra={"Connection": "close"},
        )

    def _refused(self, reason: str, conn: HTTPConnection) -> None:
        if conn.scope["type"] == "websocket":
            self.rules.metrics.handshakes_refused.labels(reason).inc()
        else:
            self.rules.metrics.http_refused.labels(reason).inc()

    def refuse_client(self, principal: Principal, conn: HTTPConnection) -> Response | None:
        """503 / 429 when the core refuses one more client of ``principal`` (``Connection: close``)."""
        refusal = self.rules.connection_refusal(principal)
        if refusal is None:
            return None
        self._refused(refusal.code, conn)
        return responses.error_response(
            refusal.status, refusal.code, refusal.message, extra={"Connection": "close"}
        )


def handshake_refusal(door: FrontDoor, conn: HTTPConnection, principal: Principal) -> Response | None:
    """Why a websocket handshake is refused (421, 401, 403, 503, 429), as the HTTP answer; None to accept."""
    return (
        door.refuse_host(conn)
        or door.refuse_token(conn)
        or door.refuse_origin(conn)
        or door.refuse_client(principal, conn)
    )


def _server(conn: HTTPConnection) -> tuple[str, int]:
    server = conn.scope.get("server") or ("", 0)
    return str(server[0] or ""), int(server[1] or 0)
