"""AUTOMATIC1111's error shape, from our codes (pure).

A1111's API (FastAPI, ``modules/api/api.py``'s ``api_middleware``) answers
every exception as ``{"error": <its class name>, "detail": ..., "body": ...,
"errors": str(exc)}`` with the exception's status: ``HTTPException`` for
its own refusals (401 wrong credentials, 404 model not found, 422 script
not found), 500 for a generation that raised. The A1111 door answers the
same way, whatever refused the call (the front door's token, Host and
Origin checks, the core's admission and limits, the model's params) or
ended the request (a failed step). ``detail`` is the message, naming the
field in A1111's terms; two keys of ours say the same for programs:
``code`` (our error code) and ``field`` (the A1111 field, or null).

A refusal of the params is 422, as FastAPI's validation is; an unknown
model 404; a busy server 429 with ``Retry-After``; a body over the bound
413. ``body`` is always ``""``: A1111 echoes the request's body there, and
an img2img body is megabytes of base64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["STATUS", "error_body", "status_of"]

#: Our code -> the status A1111's clients get.
STATUS: Final[Mapping[str, int]] = {
    "bad_json": 422,
    "bad_message": 422,
    "invalid_field": 422,
    "unknown_type": 422,
    "bad_params": 422,
    "limit_exceeded": 422,
    "unsupported": 422,
    "body_timeout": 408,
    "unauthorized": 401,
    "forbidden_origin": 403,
    "forbidden_host": 421,
    "not_found": 404,
    "not_ready": 409,
    "cancelled": 409,
    "duplicate_id": 409,
    "already_attached": 409,
    "too_many_requests": 429,
    "too_many_connections": 429,
    "busy": 429,
    "shutting_down": 503,
    "engine_unavailable": 503,
    "step_failed": 500,
    "step_timeout": 500,
    "preview_failed": 500,
    "engine_error": 500,
    "internal": 500,
}


def status_of(code: str) -> int:
    """The HTTP status for our ``code`` (an unknown one: 500)."""
    return STATUS.get(code, 500)


def error_body(status: int, code: str, message: str, *, field: str | None = None) -> dict[str, Any]:
    """``{"error", "detail", "body", "errors", "code", "field"}``: A1111's shape (see the module
    docstring) for a refusal (``HTTPException``) or a request that failed (``RuntimeError``)."""
    return {
        "error": "HTTPException" if status < 500 else "RuntimeError",
        "detail": message,
        "body": "",
        "errors": f"{status}: {message}",
        "code": code,
        "field": field,
    }
