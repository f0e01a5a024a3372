"""The wire format, both sides (pure: no I/O): docs/protocol.md in code.

Client messages are parsed and checked here into :class:`Generate`,
:class:`Cancel` and :class:`Attach`; anything else raises
:class:`MessageError` carrying the ``error`` code to send back. Server
messages are built by the functions below, and binary previews are laid out
by :func:`pack_preview` (and read back by :func:`unpack_preview`)::

    4 bytes  big-endian unsigned length N of the header
    N bytes  UTF-8 JSON header: id, step, total, final, format, width, height, mime
    rest     the encoded image
"""

from __future__ import annotations

import heapq
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..errors import MessageError

# MessageError is defined in errors.py with every other error; re-exported here,
# where the wire's rules raise it.
__all__ = [
    "CANCEL_REASONS",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_TRY_AGAIN_LATER",
    "ID_PATTERN",
    "MAX_ECHO",
    "MAX_ERROR_MESSAGE",
    "MAX_ID_LENGTH",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "REJECTION_CODES",
    "REQUEST_ENDING_CODES",
    "Attach",
    "Cancel",
    "ClientMessage",
    "Generate",
    "MessageError",
    "PreviewHeader",
    "accepted",
    "cancelled",
    "check_id",
    "clip",
    "decode_json",
    "done",
    "dumps",
    "error",
    "pack_preview",
    "parse_client_message",
    "parse_client_object",
    "progress",
    "unpack_preview",
]

MAX_ID_LENGTH: Final = 128
#: Ids end up in logs, headers and file names of clients: keep them plain.
ID_PATTERN: Final = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_LENGTH}}}")

#: ``error`` codes that reject one client message; nothing was started or changed.
REJECTION_CODES: Final = frozenset(
    {
        "bad_json",
        "bad_message",
        "invalid_field",
        "unknown_type",
        "bad_params",
        "limit_exceeded",
        "duplicate_id",
        "too_many_requests",
        "not_found",
        "already_attached",
        "shutting_down",
        "engine_unavailable",
        "busy",
    }
)
#: ``error`` codes that end an accepted request (terminal, sent to every watcher).
REQUEST_ENDING_CODES: Final = frozenset(
    {"step_failed", "step_timeout", "engine_error", "preview_failed", "internal"}
)
CANCEL_REASONS: Final = frozenset({"client", "disconnect", "shutdown", "engine"})
#: ``generate``'s ``priority`` range (the engine scheduler's, restated: this
#: module must not import the engine).
MIN_PRIORITY: Final = -10
MAX_PRIORITY: Final = 10

CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_MESSAGE_TOO_BIG: Final = 1009
CLOSE_INTERNAL_ERROR: Final = 1011
CLOSE_TRY_AGAIN_LATER: Final = 1013

_HEADER_LENGTH = struct.Struct(">I")

#: Most characters of client input an error echoes (in ``field`` and in the
#: message): a reply must not grow with what the client sent.
MAX_ECHO: Final = 64
#: Most characters of an error's ``message``: a backstop for messages built
#: outside this module (model params, admission) that echo client input.
MAX_ERROR_MESSAGE: Final = 512


@dataclass(frozen=True, slots=True)
class Generate:
    """``{"type": "generate", ...}``; ``preview`` and ``output`` are None when the client sent none."""

    id: str | None
    params: dict[str, Any]
    preview: dict[str, Any] | None
    detach: bool
    output: dict[str, Any] | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Cancel:
    """``{"type": "cancel", "id": ...}``."""

    id: str


@dataclass(frozen=True, slots=True)
class Attach:
    """``{"type": "attach", "id": ...}``."""

    id: str


ClientMessage = Generate | Cancel | Attach

_FIELDS: Final[dict[str, tuple[frozenset[str], frozenset[str]]]] = {
    # type: (required, optional) besides "type"
    "generate": (frozenset({"params"}), frozenset({"id", "preview", "detach", "output", "priority"})),
    "cancel": (frozenset({"id"}), frozenset()),
    "attach": (frozenset({"id"}), frozenset()),
}
#: Every field a type may carry ("type" included), built once: a hostile
#: message may carry 20,000 keys, each checked against it.
_KNOWN: Final[dict[str, frozenset[str]]] = {
    kind: required | optional | {"type"} for kind, (required, optional) in _FIELDS.items()
}


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON; a client
    # that sends them has a bug worth naming.
    raise ValueError(f"{name} is not valid JSON")


def check_id(value: Any, *, field: str = "id") -> str:
    """Return ``value`` if it is a valid request id; raise MessageError (invalid_field) if not."""
    if not isinstance(value, str):
        raise MessageError(
            "invalid_field", f"{field} must be a string, got {_type_name(value)}", field=field
        )
    if not ID_PATTERN.fullmatch(value):
        raise MessageError(
            "invalid_field",
            f"{field} must be 1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 . _ : -, "
            f"got {_clip(value)!r}",
            field=field,
        )
    return value


def parse_client_message(data: str | bytes) -> ClientMessage:
    """Parse and check one client message.

    Raises MessageError with code ``bad_message`` (binary frame, not an
    object), ``bad_json``, ``invalid_field`` (missing, unknown or ill-typed
    field; ``field`` names it) or ``unknown_type``. The request id, when the
    message carries a valid one, is set on the error.
    """
    if not isinstance(data, str):
        raise MessageError("bad_message", "binary messages are not accepted; send JSON text")
    obj = decode_json(data)
    if not isinstance(obj, dict):
        raise MessageError(
            "bad_message", f"message must be a JSON object, got {_type_name(obj)}"
        )
    return parse_client_object(obj)


def decode_json(data: str | bytes) -> Any:
    """JSON text (or UTF-8 bytes) to a value; raises MessageError ``bad_json`` naming the problem."""
    try:
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("utf-8")
        return json.loads(data, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise MessageError("bad_json", "invalid JSON: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise MessageError("bad_json", _json_problem(exc)) from None


def parse_client_object(obj: dict[str, Any]) -> ClientMessage:
    """:func:`parse_client_message` for a decoded JSON object (the HTTP API builds one)."""
    raw_id = obj.get("id")
    known_id = raw_id if isinstance(raw_id, str) and ID_PATTERN.fullmatch(raw_id) else None
    try:
        return _parse_object(obj)
    except MessageError as exc:
        if exc.request_id is None:
            exc.request_id = known_id
        raise


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters (an error never echoes more of the client's input)."""
    return _clip(text, limit)


def _parse_object(obj: dict[str, Any]) -> ClientMessage:
    if "type" not in obj:
        raise MessageError("invalid_field", "message has no 'type'", field="type")
    kind = obj["type"]
    if not isinstance(kind, str):
        raise MessageError(
            "invalid_field", f"type must be a string, got {_type_name(kind)}", field="type"
        )
    if kind not in _FIELDS:
        raise MessageError(
            "unknown_type",
            f"unknown message type {_clip(kind)!r}; known: {', '.join(_FIELDS)}",
            field="type",
        )
    required, optional = _FIELDS[kind]
    known = _KNOWN[kind]
    unknown = [k for k in obj if k not in known]
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        # The first three by name, without sorting all of them (O(n), not O(n log n)).
        first = heapq.nsmallest(3, unknown)
        named = ", ".join(repr(_clip(k)) for k in first)
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise MessageError(
            "invalid_field",
            f"unknown field(s) {named}{more} in {kind}; known: {allowed}",
            field=_clip(first[0]),
        )
    missing = sorted(required - obj.keys())
    if missing:
        raise MessageError(
            "invalid_field", f"{kind} needs {', '.join(map(repr, missing))}", field=missing[0]
        )
    if kind == "cancel":
        return Cancel(check_id(obj["id"]))
    if kind == "attach":
        return Attach(check_id(obj["id"]))
    request_id = check_id(obj["id"]) if obj.get("id") is not None else None
    params = obj["params"]
    if not isinstance(params, dict):
        raise MessageError(
            "invalid_field",
            f"params must be a JSON object, got {_type_name(params)}",
            field="params",
            request_id=request_id,
        )
    preview = obj.get("preview")
    if preview is not None and not isinstance(preview, dict):
        raise MessageError(
            "invalid_field",
            f"preview must be a JSON object, got {_type_name(preview)}",
            field="preview",
            request_id=request_id,
        )
    output = obj.get("output")
    if output is not None and not isinstance(output, dict):
        raise MessageError(
            "invalid_field",
            f"output must be a JSON object, got {_type_name(output)}",
            field="output",
            request_id=request_id,
        )
    detach = obj.get("detach", False)
    if not isinstance(detach, bool):
        raise MessageError(
            "invalid_field",
            f"detach must be true or false, got {_type_name(detach)}",
            field="detach",
            request_id=request_id,
        )
    priority = obj.get("priority", 0)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise MessageError(
            "invalid_field",
            f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, "
            f"got {_clip(repr(priority)) if isinstance(priority, int) else _type_name(priority)}",
            field="priority",
            request_id=request_id,
        )
    return Generate(
        id=request_id, params=params, preview=preview, detach=detach, output=output, priority=priority
    )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _clip(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _json_problem(exc: BaseException) -> str:
    # Say what is wrong and where, in JSON's terms: Python's own wording can
    # name interpreter internals (sys.set_int_max_str_digits, recursion).
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at line {exc.lineno} column {exc.colno}: {_clip(exc.msg)}"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    text = str(exc)
    if "is not valid JSON" in text:  # _reject_constant: NaN, Infinity
        return f"invalid JSON: {_clip(text)}"
    if "digits" in text:
        return "invalid JSON: an integer literal is too long"
    return "invalid JSON"


# ---- server messages ------------------------------------------------------


def dumps(message: Mapping[str, Any]) -> str:
    """Serialize a server message compactly; raises ValueError for NaN or infinities."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False)


def accepted(
    request_id: str,
    *,
    total: int,
    detach: bool,
    attached: bool,
    preview: Mapping[str, Any],
    output: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``accepted``: a generate started, or an attach succeeded; echoes the effective settings."""
    message = {
        "type": "accepted",
        "id": request_id,
        "total": total,
        "detach": detach,
        "attached": attached,
        "preview": dict(preview),
    }
    if output is not None:
        message["output"] = dict(output)
    return message


def progress(request_id: str, *, step: int, total: int, eta_s: float) -> dict[str, Any]:
    """``progress`` after a step; ``eta_s`` is clamped to >= 0 and rounded to ms."""
    return {
        "type": "progress",
        "id": request_id,
        "step": step,
        "total": total,
        "eta_s": round(max(0.0, eta_s), 3),
    }


def done(request_id: str, *, total: int, elapsed_s: float) -> dict[str, Any]:
    """``done``: the final preview was sent before it."""
    return {"type": "done", "id": request_id, "total": total, "elapsed_s": round(elapsed_s, 3)}


def cancelled(request_id: str, *, reason: str) -> dict[str, Any]:
    """``cancelled``; raises ValueError for a reason outside CANCEL_REASONS."""
    if reason not in CANCEL_REASONS:
        raise ValueError(f"cancel reason must be one of {sorted(CANCEL_REASONS)}, got {reason!r}")
    return {"type": "cancelled", "id": request_id, "reason": reason}


def error(
    code: str, message: str, *, request_id: str | None = None, field: str | None = None
) -> dict[str, Any]:
    """``error``; raises ValueError for a code that docs/protocol.md does not list.

    ``field`` is clipped to MAX_ECHO characters and ``message`` to
    MAX_ERROR_MESSAGE: both may echo what a client sent.
    """
    if code not in REJECTION_CODES and code not in REQUEST_ENDING_CODES:
        raise ValueError(f"unknown error code {code!r}")
    out: dict[str, Any] = {
        "type": "error",
        "code": code,
        "message": _clip(message, MAX_ERROR_MESSAGE),
    }
    if request_id is not None:
        out["id"] = request_id
    if field is not None:
        out["field"] = _clip(field)
    return out


# ---- binary previews ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreviewHeader:
    """The JSON header of a binary preview frame."""

    id: str
    step: int
    total: int
    final: bool
    format: str
    width: int
    height: int
    mime: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "step": self.step,
            "total": self.total,
            "final": self.final,
            "format": self.format,
            "width": self.width,
            "height": self.height,
            "mime": self.mime,
        }


def pack_preview(header: PreviewHeader, image: bytes | bytearray | memoryview) -> bytes:
    """Lay out one binary preview frame: length, JSON header, image."""
    head = dumps(header.to_dict()).encode()
    return b"".join((_HEADER_LENGTH.pack(len(head)), head, image))


def unpack_preview(frame: bytes | bytearray | memoryview) -> tuple[PreviewHeader, memoryview]:
    """Split a binary preview frame into its header and a view of the image bytes.

    Raises ValueError when the frame is truncated or its header is not the
    JSON object docs/protocol.md describes.
    """
    view = memoryview(frame)
    if len(view) < _HEADER_LENGTH.size:
        raise ValueError(f"preview frame of {len(view)} bytes is shorter than its length prefix")
    (length,) = _HEADER_LENGTH.unpack_from(view)
    end = _HEADER_LENGTH.size + length
    if end > len(view):
        raise ValueError(f"preview header length {length} runs past the frame ({len(view)} bytes)")
    try:
        head = json.loads(bytes(view[_HEADER_LENGTH.size : end]).decode())
        header = PreviewHeader(**head)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"preview header is not valid: {exc}") from None
    return header, view[end:]
