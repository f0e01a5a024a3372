"""OpenAI's error shape, from ours (pure).

OpenAI's API answers every error as ``{"error": {"message", "type",
"param", "code"}}`` with the status its SDKs map to an exception class
(400 ``BadRequestError``, 401 ``AuthenticationError``, 403
``PermissionDeniedError``, 404 ``NotFoundError``, 409 ``ConflictError``,
429 ``RateLimitError``, 5xx ``InternalServerError``). The OpenAI doors
answer that way, whatever refused the call: the front door (a token, a
host, an origin), the core (admission, limits, params) or the request's
own end (a failed step). Our codes keep their meaning in ``code``.

One mapping differs from ``/v1/generations``: a refusal of the params
(our 422 ``bad_params``, ``limit_exceeded``) is OpenAI's 400
``invalid_request_error`` with ``param`` naming the field, and a busy server
is 429 with ``Retry-After`` (the SDK retries those after the time it says).

:class:`OpenAIError` is defined with every other error in ``omni_stream.errors``
(one tree) and kept importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ..errors import OpenAIError

__all__ = ["OpenAIError", "STATUS", "error_body", "from_ours"]

#: Our code -> (HTTP status, OpenAI error type).
STATUS: Final[Mapping[str, tuple[int, str]]] = {
    "bad_json": (400, "invalid_request_error"),
    "bad_message": (400, "invalid_request_error"),
    "invalid_field": (400, "invalid_request_error"),
    "unknown_type": (400, "invalid_request_error"),
    "bad_params": (400, "invalid_request_error"),
    "limit_exceeded": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "body_timeout": (408, "invalid_request_error"),
    "unauthorized": (401, "invalid_request_error"),
    "forbidden_origin": (403, "invalid_request_error"),
    "forbidden_host": (421, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "not_ready": (409, "invalid_request_error"),
    "cancelled": (409, "invalid_request_error"),
    "duplicate_id": (409, "invalid_request_error"),
    "already_attached": (409, "invalid_request_error"),
    "too_many_requests": (429, "rate_limit_exceeded"),
    "too_many_connections": (429, "rate_limit_exceeded"),
    "busy": (429, "rate_limit_exceeded"),
    "shutting_down": (503, "server_error"),
    "engine_unavailable": (503, "server_error"),
    "step_failed": (500, "server_error"),
    "step_timeout": (500, "server_error"),
    "engine_error": (500, "server_error"),
    "internal": (500, "server_error"),
}


def error_body(message: str, *, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as ``OpenAIError.body()`` for a raised one."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_ours(
    code: str, message: str, *, field: str | None = None, retry_after_s: float | None = None
) -> OpenAIError:
    """Our error code and words as OpenAI's error (unknown codes: a 500 ``server_error``)."""
    status, kind = STATUS.get(code, (500, "server_error"))
    return OpenAIError(status, message, code, param=field, type=kind, retry_after_s=retry_after_s)
