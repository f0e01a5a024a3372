"""The client's half of docs/protocol.md, with no I/O: constants, parsing, encoding.

Server text messages become events (:class:`Accepted`, :class:`Progress`,
:class:`Done`, :class:`Cancelled`, :class:`ErrorMessage`) and binary frames
become :class:`PreviewFrame`; both parsers are strict and raise
ProtocolError naming what is wrong. The client's own messages are encoded
here too, after their arguments are checked (ParamsError naming the field).
:func:`server_error` maps an ``error`` code to the exception a caller sees.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from PIL import Image

from ..errors import (
    BusyError,
    ClientError,
    ParamsError,
    ParamsRejectedError,
    ProtocolError,
    RequestFailedError,
    RequestRejectedError,
)

__all__ = [
    "BusyError",
    "CLOSE_PROTOCOL_ERROR",
    "FORMATS",
    "ID_PATTERN",
    "MAX_HEADER_BYTES",
    "MAX_ID_LENGTH",
    "PARAMS_CODES",
    "REJECTION_CODES",
    "REQUEST_ENDING_CODES",
    "Accepted",
    "Cancelled",
    "Done",
    "ErrorMessage",
    "Event",
    "PreviewFrame",
    "Progress",
    "attach_message",
    "cancel_message",
    "check_request_id",
    "generate_message",
    "parse_message",
    "parse_preview_frame",
    "server_error",
]

# One definition of the shared wire constants: the messages module beside
# this one (importing it loads neither the server nor the engine).
from .messages import (  # noqa: E402
    ID_PATTERN,
    MAX_ID_LENGTH,
    MAX_PRIORITY,
    MIN_PRIORITY,
    REJECTION_CODES,
    REQUEST_ENDING_CODES,
)

#: Rejections that mean "your input is wrong": raised as ParamsRejectedError.
PARAMS_CODES: Final = frozenset({"bad_params", "invalid_field", "limit_exceeded"})


#: Preview formats and the MIME type each header must carry.
FORMATS: Final[Mapping[str, str]] = {
    "jpeg": "image/jpeg",
    "png": "image/png",
    "webp": "image/webp",
    "raw": "application/octet-stream",
    # Results of video models (docs/protocol.md, ``output``).
    "mp4": "video/mp4",
    "gif": "image/gif",
}
_PILLOW_FORMATS: Final = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF"}
# A real header is ~150 bytes; a length far beyond that is a corrupt frame
# (or not a preview at all), not a header worth allocating for.
MAX_HEADER_BYTES: Final = 64 * 1024
#: The close code for a message or frame that breaks the protocol.
CLOSE_PROTOCOL_ERROR: Final = 1002


# ---- what the server sends (pure parsing) -----------------------------------


@dataclass(frozen=True, slots=True)
class PreviewFrame:
    """One binary preview: its header's fields and the encoded image in ``data``.

    ``data`` is a complete JPEG, PNG or WebP file, or for ``raw`` ``width *
    height * 3`` bytes of 8-bit RGB, rows top to bottom. ``final`` marks the
    result.
    """

    id: str
    step: int
    total: int
    final: bool
    format: str
    width: int
    height: int
    data: bytes = field(repr=False)

    @property
    def mime(self) -> str:
        return FORMATS[self.format]

    def image(self) -> Image.Image:
        """Decode ``data`` with Pillow (an RGB image for raw).

        Raises ProtocolError when the bytes do not decode as the header's
        format, or decode to a size other than the header's.
        """
        size = (self.width, self.height)
        if self.format == "raw":
            return Image.frombytes("RGB", size, self.data)
        if self.format == "mp4":
            raise ValueError(
                f"request {self.id}: the result is an MP4 video; write .data to a file (save())"
            )
        try:
            image = Image.open(io.BytesIO(self.data), formats=[_PILLOW_FORMATS[self.format]])
            image.load()
        except (OSError, ValueError, SyntaxError) as exc:
            raise ProtocolError(
                f"preview of step {self.step} does not decode as {self.format}: {exc}",
                request_id=self.id,
            ) from exc
        if image.size != size:
            raise ProtocolError(
                f"preview of step {self.step} decodes to {image.size[0]}x{image.size[1]}, "
                f"its header says {self.width}x{self.height}",
                request_id=self.id,
            )
        return image

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the image or video as the server encoded it (raw: as a PNG); returns the path.

        Raises ValueError when the suffix does not fit the format (``.png``
        for png and raw, ``.jpg``/``.jpeg``, ``.webp``, ``.gif``, ``.mp4``).
        """
        path = Path(path)
        suffix = path.suffix.lower()
        fits = _SUFFIXES.get(self.format, ())
        if suffix not in fits:
            raise ValueError(
                f"request {self.id}: a {self.format} result cannot be saved as {suffix or 'no suffix'!r}; "
                f"use {', '.join(fits)} (or ask the server for another output format)"
            )
        if self.format == "raw":
            self.image().save(path, format="PNG")
        else:
            path.write_bytes(self.data)
        return path


_SUFFIXES: Final[Mapping[str, tuple[str, ...]]] = {
    "png": (".png",), "raw": (".png",), "jpeg": (".jpg", ".jpeg"), "webp": (".webp",),
    "gif": (".gif",), "mp4": (".mp4",),
}


@dataclass(frozen=True, slots=True)
class Progress:
    """A ``progress`` message: ``step`` of ``total`` done, ``eta_s`` seconds left (estimated)."""

    id: str
    step: int
    total: int
    eta_s: float


@dataclass(frozen=True, slots=True)
class Accepted:
    """An ``accepted`` message: the request runs (or, for ``attach``, is being watched)."""

    id: str
    total: int
    detach: bool
    attached: bool
    preview: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Done:
    """A ``done`` message: the request finished; its final preview came before it."""

    id: str
    total: int
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A ``cancelled`` message; ``reason`` is client, disconnect, shutdown or engine."""

    id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """An ``error`` message; ``id`` is None where the server could not tell the request."""

    code: str
    message: str
    id: str | None
    field: str | None
    #: ``busy`` only: seconds the server suggests waiting before trying again.
    retry_after_s: float | None = None


#: Everything :func:`parse_message` and :func:`parse_preview_frame` return.
Event = Accepted | Progress | PreviewFrame | Done | Cancelled | ErrorMessage


def _want(obj: Mapping[str, Any], key: str, kind: str, where: str) -> Any:
    """``obj[key]`` checked against ``kind``; raises ProtocolError naming the field."""
    if key not in obj:
        raise ProtocolError(f"{where} has no {key!r}")
    value = obj[key]
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        # bool is an int subclass; JSON true is not a step number.
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        raise ProtocolError(f"{where} field {key!r} must be a {kind}, got {value!r:.80}")
    return value


def _want_id(obj: Mapping[str, Any], where: str) -> str:
    value: str = _want(obj, "id", "str", where)
    if not ID_PATTERN.fullmatch(value):
        raise ProtocolError(f"{where} carries a malformed id {value!r:.80}")
    return value


def _want_steps(obj: Mapping[str, Any], where: str) -> tuple[int, int]:
    step = _want(obj, "step", "int", where)
    total = _want(obj, "total", "int", where)
    if total < 1 or not 1 <= step <= total:
        raise ProtocolError(f"{where} has step {step} of {total}; need 1 <= step <= total")
    return step, total


def parse_preview_frame(frame: bytes | bytearray | memoryview) -> PreviewFrame:
    """Parse one binary preview frame: 4-byte big-endian header length, JSON header, image.

    Strict: raises ProtocolError (naming what is wrong) for a truncated
    frame, a header that is not UTF-8 JSON, a missing or ill-typed header
    field, an unknown format, a MIME type that does not match it, a raw image
    whose size is not ``width * height * 3``, or an encoded image whose first
    bytes are not its format's signature. Unknown extra header fields are
    allowed (a newer server may add some).
    """
    view = memoryview(frame)
    if len(view) < 4:
        raise ProtocolError(f"preview frame of {len(view)} bytes is shorter than its 4-byte length")
    length = int.from_bytes(view[:4], "big")
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"preview header length {length} exceeds {MAX_HEADER_BYTES} bytes")
    end = 4 + length
    if end > len(view):
        raise ProtocolError(
            f"preview header length {length} runs past the frame ({len(view)} bytes)"
        )
    try:
        header = json.loads(bytes(view[4:end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"preview header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"preview header must be a JSON object, got {header!r:.80}")
    where = "preview header"
    request_id = _want_id(header, where)
    step, total = _want_steps(header, where)
    final = _want(header, "final", "bool", where)
    fmt = _want(header, "format", "str", where)
    if fmt not in FORMATS:
        raise ProtocolError(f"preview format {fmt!r:.40} is not one of {', '.join(FORMATS)}")
    width = _want(header, "width", "int", where)
    height = _want(header, "height", "int", where)
    if width < 1 or height < 1:
        raise ProtocolError(f"preview size {width}x{height} is not positive")
    mime = _want(header, "mime", "str", where)
    if mime != FORMATS[fmt]:
        raise ProtocolError(f"preview mime {mime!r:.60} does not match format {fmt!r}")
    data = bytes(view[end:])
    if fmt == "raw":
        if len(data) != width * height * 3:
            raise ProtocolError(
                f"raw preview of {width}x{height} needs {width * height * 3} bytes, got {len(data)}"
            )
    elif not _has_signature(fmt, data):
        raise ProtocolError(
            f"preview of step {step} claims {fmt} but its bytes do not start like one "
            f"({len(data)} bytes)"
        )
    return PreviewFrame(request_id, step, total, final, fmt, width, height, data)


def _has_signature(fmt: str, data: bytes) -> bool:
    if fmt == "jpeg":
        return data[:3] == b"\xff\xd8\xff"
    if fmt == "png":
        return data[:8] == b"\x89PNG\r\n\x1a\n"
    if fmt == "gif":
        return data[:4] == b"GIF8"
    if fmt == "mp4":
        return data[4:8] == b"ftyp"
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def parse_message(text: str) -> Event | None:
    """One server text message as an event; None for a type this client does not know.

    Raises ProtocolError for invalid JSON, a non-object, or a known type with
    missing or ill-typed fields.
    """
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"server message is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"server message must be a JSON object, got {obj!r:.80}")
    kind = _want(obj, "type", "str", "server message")
    where = f"{kind!r} message"
    if kind == "progress":
        step, total = _want_steps(obj, where)
        eta_s = _want(obj, "eta_s", "number", where)
        if eta_s < 0:
            raise ProtocolError(f"{where} has a negative eta_s {eta_s}")
        return Progress(_want_id(obj, where), step, total, float(eta_s))
    if kind == "accepted":
        total = _want(obj, "total", "int", where)
        if total < 1:
            raise ProtocolError(f"{where} has total {total}; need >= 1")
        return Accepted(
            _want_id(obj, where),
            total,
            _want(obj, "detach", "bool", where),
            _want(obj, "attached", "bool", where),
            _want(obj, "preview", "object", where),
        )
    if kind == "done":
        return Done(
            _want_id(obj, where),
            _want(obj, "total", "int", where),
            float(_want(obj, "elapsed_s", "number", where)),
        )
    if kind == "cancelled":
        return Cancelled(_want_id(obj, where), _want(obj, "reason", "str", where))
    if kind == "error":
        request_id = _want_id(obj, where) if obj.get("id") is not None else None
        field_name = _want(obj, "field", "str", where) if obj.get("field") is not None else None
        retry = obj.get("retry_after_s")
        if retry is not None:
            retry = float(_want(obj, "retry_after_s", "number", where))
            if retry < 0:
                raise ProtocolError(f"{where} has a negative retry_after_s {retry}")
        return ErrorMessage(
            _want(obj, "code", "str", where),
            _want(obj, "message", "str", where),
            request_id,
            field_name,
            retry,
        )
    return None


def server_error(
    code: str,
    message: str,
    *,
    field: str | None,
    request_id: str | None,
    accepted: bool,
    retry_after_s: float | None = None,
) -> ClientError:
    """The exception for an ``error`` about one request.

    Once the server ``accepted`` the request, an error ends it:
    RequestFailedError, whatever the code. Before that, the request was
    rejected: ParamsRejectedError for the codes that blame the input,
    BusyError (with ``retry_after_s``) for ``busy``, RequestRejectedError
    for the rest.
    """
    if accepted:
        return RequestFailedError(message, code=code, field=field, request_id=request_id)
    if code == "busy":
        return BusyError(message, retry_after_s=retry_after_s, request_id=request_id)
    if code in PARAMS_CODES:
        return ParamsRejectedError(message, code=code, field=field, request_id=request_id)
    return RequestRejectedError(message, code=code, field=field, request_id=request_id)


# ---- what the client sends -------------------------------------------------------


def check_request_id(value: Any) -> str:
    """``value`` if it is a well-formed request id; raises ParamsError (field ``id``)."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ParamsError(
            f"request id must be 1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 . _ : -, "
            f"got {value!r:.80}",
            field="id",
        )
    return value


def generate_message(
    request_id: str,
    params: Mapping[str, Any] | None,
    preview: Mapping[str, Any] | None,
    *,
    detach: bool,
    output: Mapping[str, Any] | None = None,
    priority: int | None = None,
) -> str:
    """A ``generate`` message for a checked id.

    Raises ParamsError (field ``params``, ``preview`` or ``output``) for a
    value that is not a mapping or holds what JSON cannot carry (NaN,
    infinities, other types), and (field ``priority``) for a priority that
    is not an int from MIN_PRIORITY to MAX_PRIORITY.
    """
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise ParamsError(
            f"priority must be an int from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r:.40}",
            field="priority",
        )
    message: dict[str, Any] = {
        "type": "generate",
        "id": request_id,
        "params": _json_object(params, "params"),
        "detach": detach,
    }
    if preview is not None:
        message["preview"] = _json_object(preview, "preview")
    if output is not None:
        message["output"] = _json_object(output, "output")
    if priority is not None:
        message["priority"] = priority
    return json.dumps(message, separators=(",", ":"), allow_nan=False)


def attach_message(request_id: str) -> str:
    """An ``attach`` message for a checked id."""
    return json.dumps({"type": "attach", "id": request_id}, separators=(",", ":"))


def cancel_message(request_id: str) -> str:
    """A ``cancel`` message for a checked id."""
    return json.dumps({"type": "cancel", "id": request_id}, separators=(",", ":"))


def _json_object(value: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParamsError(f"{name} must be a mapping, got {type(value).__name__}", field=name)
    out = dict(value)
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ParamsError(f"{name} cannot be sent as JSON: {exc}", field=name) from None
    return out
