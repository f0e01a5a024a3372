"""JSON text, both ways, for every message (pure): one serializer, and the readers of each side.

- :func:`dumps` is how every text message is written, by either side: compact,
  ASCII, no NaN or infinities. Pinning it pins the wire bytes.
- :func:`decode_json` reads a client's text as the server must: any problem
  is a :class:`MessageError` ``bad_json`` worded in JSON's terms, and
  :func:`clip` / :func:`type_name` keep what an error echoes short.
- :func:`require` and its kin read a server message's fields as the client
  must: strictly, a :class:`ProtocolError` naming the field at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

from ..errors import MessageError, ProtocolError
from ..ids import is_valid_id
from .codes import MAX_ECHO

__all__ = [
    "Kind",
    "clip",
    "decode_json",
    "dumps",
    "load_object",
    "optional",
    "require",
    "require_id",
    "require_steps",
    "type_name",
]

#: What :func:`require` checks a field against.
Kind = Literal["str", "bool", "int", "number", "object"]


def dumps(message: Mapping[str, Any]) -> str:
    """Serialize a message compactly; raises ValueError for NaN or infinities."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False)


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters (an error never echoes more of the client's input)."""
    return text if len(text) <= limit else text[:limit] + "..."


def type_name(value: Any) -> str:
    """A JSON value's kind in words (``a number``, ``null``...), for an error about it."""
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


# ---- the server reading a client --------------------------------------------------


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


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON; a client
    # that sends them has a bug worth naming.
    raise ValueError(f"{name} is not valid JSON")


def _json_problem(exc: BaseException) -> str:
    # Say what is wrong and where, in JSON's terms: Python's own wording can
    # name interpreter internals (sys.set_int_max_str_digits, recursion).
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at line {exc.lineno} column {exc.colno}: {clip(exc.msg)}"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    text = str(exc)
    if "is not valid JSON" in text:  # _reject_constant: NaN, Infinity
        return f"invalid JSON: {clip(text)}"
    if "digits" in text:
        return "invalid JSON: an integer literal is too long"
    return "invalid JSON"


# ---- the client reading the server ------------------------------------------------

_CHECKS: Final[Mapping[Kind, Callable[[Any], bool]]] = {
    "str": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
    # bool is an int subclass; JSON true is not a step number.
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ),
    "object": lambda value: isinstance(value, dict),
}


def load_object(text: str | bytes | bytearray | memoryview, where: str) -> dict[str, Any]:
    """A server's JSON object; raises ProtocolError when ``text`` is not (UTF-8) JSON or not an object."""
    json_name = "JSON"
    try:
        if not isinstance(text, str):
            json_name = "UTF-8 JSON"
            text = bytes(text).decode("utf-8")
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"{where} is not {json_name}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} must be a JSON object, got {obj!r:.80}")
    return obj


def require(obj: Mapping[str, Any], key: str, kind: Kind, where: str) -> Any:
    """``obj[key]`` checked against ``kind``; raises ProtocolError naming the field."""
    if key not in obj:
        raise ProtocolError(f"{where} has no {key!r}")
    value = obj[key]
    if not _CHECKS[kind](value):
        raise ProtocolError(f"{where} field {key!r} must be a {kind}, got {value!r:.80}")
    return value


def optional(obj: Mapping[str, Any], key: str, kind: Kind, where: str) -> Any:
    """:func:`require` for a field that may be absent or null (then None)."""
    return None if obj.get(key) is None else require(obj, key, kind, where)


def require_id(obj: Mapping[str, Any], where: str, key: str = "id") -> str:
    """``obj[key]``, a request id (omni_stream.ids); raises ProtocolError naming what is wrong."""
    value: str = require(obj, key, "str", where)
    if not is_valid_id(value):
        raise ProtocolError(f"{where} carries a malformed id {value!r:.80}")
    return value


def require_steps(obj: Mapping[str, Any], where: str) -> tuple[int, int]:
    """``step`` and ``total``, with 1 <= step <= total; raises ProtocolError."""
    step: int = require(obj, "step", "int", where)
    total: int = require(obj, "total", "int", where)
    if total < 1 or not 1 <= step <= total:
        raise ProtocolError(f"{where} has step {step} of {total}; need 1 <= step <= total")
    return step, total
