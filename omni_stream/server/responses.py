"""The server's HTTP responses (Starlette), built for the routes in asgi.py and http_api.py.

Builders only: no I/O but reading the page file.

Every JSON error body is ``{"error": code, "message": message}`` with the
same codes as the websocket's ``error`` messages (docs/protocol.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.responses import Response

from ..params import describe
from ..preview import (
    DECODERS,
    DEFAULT_QUALITY,
    FORMATS,
    IMAGE_OUTPUTS,
    VIDEO_OUTPUTS,
    PreviewSpec,
    has_video_encoder,
)
from ..core.limits import ServerLimits

__all__ = [
    "PAGE",
    "STATIC_DIR",
    "error_response",
    "json_response",
    "method_not_allowed",
    "models_payload",
    "page_response",
    "preview_wire",
    "respond",
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


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    extra: Mapping[str, str] | None = None,
    **fields: Any,
) -> Response:
    """``{"error": code, "message": message, **fields}`` with ``status``."""
    return json_response(status, {"error": code, "message": message, **fields}, extra=extra)


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


def preview_wire(spec: PreviewSpec) -> dict[str, Any]:
    """The effective preview settings as ``accepted`` and ``/models`` report them."""
    decoder = spec.decoder
    name = decoder if isinstance(decoder, str) else getattr(decoder, "__name__", "custom")
    quality = spec.quality if spec.quality is not None else DEFAULT_QUALITY.get(spec.format)
    return {
        "every": spec.every,
        "format": spec.format,
        "max_size": spec.max_size,
        "quality": quality,
        "decoder": name,
        "video": spec.video,
    }


def models_payload(model: Any, default_preview: PreviewSpec, limits: ServerLimits) -> dict[str, Any]:
    """The ``/models`` body: the model, its params, preview options and request limits."""
    return {
        "name": model.name,
        "description": model.describe(),
        "params": describe(model.params),
        "preview": {
            "formats": list(FORMATS),
            "decoders": list(DECODERS),
            "default": preview_wire(default_preview),
        },
        "output": _output_payload(bool(getattr(model, "produces_video", False))),
        "limits": {
            "max_steps": limits.max_steps,
            "max_image_size": limits.max_image_size,
            "max_requests_per_connection": limits.max_requests_per_connection,
            "max_message_bytes": limits.max_message_bytes,
        },
    }


def _output_payload(video: bool) -> dict[str, Any]:
    """The result formats this model's requests may ask for (``output.format``), default first."""
    formats = list(VIDEO_OUTPUTS if video else IMAGE_OUTPUTS)
    if video and not has_video_encoder():
        formats.remove("mp4")  # PyAV missing: animated WebP is the default
    return {"formats": formats, "default": {"format": formats[0], "quality": None}}
