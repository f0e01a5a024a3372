"""The server's HTTP responses (Starlette), built for the routes in asgi.py and http_api.py.

Builders only: no I/O but reading the page file.

Every JSON error body is ``{"error": code, "message": message}`` with the
same codes as the websocket's ``error`` messages (docs/protocol.md).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..core.admission import preview_wire
from ..core.limits import ServerLimits
from ..core.memory import MemoryBudget
from ..params import describe
from ..preview import (
    DECODERS,
    FORMATS,
    IMAGE_OUTPUTS,
    VIDEO_OUTPUTS,
    PreviewSpec,
    has_video_encoder,
)

__all__ = [
    "PAGE",
    "STATIC_DIR",
    "error_response",
    "json_response",
    "method_not_allowed",
    "catalog_payload",
    "models_payload",
    "page_response",
    "preview_wire",
    "respond",
    "BufferResponse",
    "ErrorResponse",
    "until_or_gone",
    "until_sent",
]

STATIC_DIR = Path(__file__).parent / "static"
PAGE = STATIC_DIR / "index.html"

#: Headers on every answer: nothing here may be cached or sniffed.
_COMMON = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def respond(
    status: int, body: bytes, content_type: str, *, extra: Mapping[str, str] | None = None
) -> Response:
    """A response with ``body`` (Content-Length set) and the common headers."""
    headers = {**_COMMON, **(extra or {})}
    return Response(body, status_code=status, headers=headers, media_type=content_type)


def json_response(status: int, payload: Any, *, extra: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    return respond(status, body, "application/json", extra=extra)


class ErrorResponse(Response):
    """Our error answer, ``{"error": code, "message": message, **fields}``, keeping what it says:
    a door with another error shape (the OpenAI routes') rebuilds it from these, not the body."""

    def __init__(
        self, status: int, code: str, message: str, *, extra: Mapping[str, str] | None, fields: dict[str, Any]
    ) -> None:
        payload = {"error": code, "message": message, **fields}
        body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        headers = {**_COMMON, **(extra or {})}
        super().__init__(body, status_code=status, headers=headers, media_type="application/json")
        self.code = code
        self.message = message
        self.fields = fields


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    extra: Mapping[str, str] | None = None,
    **fields: Any,
) -> ErrorResponse:
    """``{"error": code, "message": message, **fields}`` with ``status``."""
    return ErrorResponse(status, code, message, extra=extra, fields=fields)


def method_not_allowed(method: str, path: str, *, allow: tuple[str, ...]) -> Response:
    """405 ``method_not_allowed`` with the ``Allow`` header listing ``allow``."""
    allowed = ", ".join(allow)
    return error_response(
        405,
        "method_not_allowed",
        f"{method} is not allowed on {path}; use {allowed}",
        extra={"Allow": allowed},
    )


def page_response(page: Path | None = None) -> Response:
    """The preview page (``PAGE`` unless given), read on every request; 404 JSON if missing.

    Read each time: it is small, and the file may be replaced while serving.
    """
    page = PAGE if page is None else page
    try:
        body = page.read_bytes()
    except FileNotFoundError:
        return error_response(404, "not_found", f"the preview page is not installed ({page.name})")
    # The page talks to this origin only; keep other sites from framing it.
    return respond(
        200,
        body,
        "text/html; charset=utf-8",
        extra={"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"},
    )


def models_payload(model: Any, default_preview: PreviewSpec, limits: ServerLimits) -> dict[str, Any]:
    """The ``/models`` body: the model, its params, preview options and request limits."""
    return {
        "name": model.name,
        "description": model.describe(),
        "params": describe(model.params),
        # The LoRAs a request may name in params.loras (serve --lora).
        "loras": list(getattr(model, "lora_names", ())),
        "preview": {
            "formats": list(FORMATS),
            "decoders": list(DECODERS),
            "default": preview_wire(default_preview),
        },
        "output": _output_payload(bool(getattr(model, "produces_video", False))),
        "limits": {
            "max_steps": limits.max_steps,
            "max_image_size": limits.max_image_size,
            "max_requests_per_principal": limits.max_requests_per_principal,
            "max_connections_per_principal": limits.max_connections_per_principal,
            "max_message_bytes": limits.max_message_bytes,
        },
    }


def catalog_payload(
    models: Mapping[str, Any],
    previews: Mapping[str, PreviewSpec],
    limits: ServerLimits,
    *,
    loaded: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The ``/models`` body: the default model's card (:func:`models_payload`) as it always
    was, and ``models``: every served model's, under the name a request's ``model`` takes,
    with ``loaded`` (None where every model always is), the default first."""
    cards = []
    for name, model in models.items():
        card = models_payload(model, previews[name], limits)
        del card["limits"]  # the server's, once, at the top
        on_device = None if loaded is None else name in loaded
        cards.append({**card, "name": name, "model": model.name, "loaded": on_device})
    first = next(iter(models))
    return {**models_payload(models[first], previews[first], limits), "default": first, "models": cards}


def _output_payload(video: bool) -> dict[str, Any]:
    """The result formats this model's requests may ask for (``output.format``), default first."""
    formats = list(VIDEO_OUTPUTS if video else IMAGE_OUTPUTS)
    if video and not has_video_encoder():
        formats.remove("mp4")  # PyAV missing: animated WebP is the default
    return {"formats": formats, "default": {"format": formats[0], "quality": None}}


#: Bytes a :class:`BufferResponse` hands the transport at once. uvicorn
#: waits for a paused transport to drain before each send, so a client that
#: does not read holds at most about two of these (plus the transport's
#: 64 KiB high-water mark), not the whole body.
CHUNK_BYTES = 64 << 10


class BufferResponse(Response):
    """A body sent from a buffer it does not copy, in :data:`CHUNK_BYTES` sends.

    A result is held once, in its request's record (counted there against
    ``max_memory_bytes``); each client fetching it costs what is in flight
    to it, counted in ``budget`` while it is sent, not a copy of the whole
    (200 never-reading clients of a 3 MiB result once held +600 MiB). Each
    send is bounded by the app's send timeout (http11.BoundedSend).
    """

    def __init__(
        self,
        body: memoryview,
        *,
        status_code: int,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        super().__init__(
            b"", status_code=status_code, headers={**_COMMON, **(headers or {})}, media_type=media_type
        )
        self._view = body
        self._budget = budget
        self.headers["content-length"] = str(len(body))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        view, budget = self._view, self._budget
        counted = min(len(view), 2 * CHUNK_BYTES)
        if budget is not None:
            budget.add(counted)
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            if not view:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            for offset in range(0, len(view), CHUNK_BYTES):
                end = offset + CHUNK_BYTES
                chunk = bytes(view[offset:end])
                await send({"type": "http.response.body", "body": chunk, "more_body": end < len(view)})
        finally:
            if budget is not None:
                budget.release(counted)


class _UntilSent(Response):
    """``inner``, then ``on_close`` once it is sent or abandoned (see :func:`until_sent`)."""

    def __init__(self, inner: Any, on_close: Callable[[], None]) -> None:
        # Not Response.__init__: status and headers are the inner response's
        # (the same list: headers added here are the ones it sends).
        self._inner = inner
        self._on_close = on_close
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._on_close()


def until_sent(response: Any, *, on_close: Callable[[], None]) -> Response:
    """``response``, calling ``on_close`` once it has been sent, however that ends.

    An HTTP call is a client of the core until its answer is out (an event
    stream, a result to a slow reader): then it is disconnected.
    """
    return _UntilSent(response, on_close)


async def until_or_gone(request: Request, until: Callable[[], Awaitable[None]]) -> bool:
    """Run ``until`` while watching the caller: False when it hung up first (``until`` is then
    cancelled), True once ``until`` returned. For a door whose answer waits on a request."""
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        await until()
        tg.cancel_scope.cancel()
    return not gone
