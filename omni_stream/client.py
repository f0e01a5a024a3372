"""The async websocket client for an omni_stream server (docs/protocol.md).

>>> import omni_stream as om
>>> async with om.client.connect("ws://127.0.0.1:8765/ws") as client:   # doctest: +SKIP
...     async for frame in client.generate({"prompt": "red circle", "steps": 20}):
...         print(frame.step, frame.total, frame.final, frame.width, frame.height)
...     frame.image().save("result.png")

Shape: one connection, one reader task in the client's anyio task group.
The reader parses every server message (strictly: a frame or message that
breaks the protocol closes the connection with 1002 and fails every request
on it with :class:`ProtocolError`) and hands it to the request it names, so
several ``generate()`` iterations run at once on one connection.

Who waits on whom: the reader never waits on a consumer. Each request
buffers what arrived for it; when its consumer falls ``max_buffered`` items
behind, the oldest intermediate progress and previews are dropped (latest
wins, as on the server). The final preview and the outcome (``done``,
``cancelled``, ``error``) are never dropped.

Errors: the client raises the engine's own errors where the meaning is the
same, so code written against ``engine.stream()`` reads the same remotely::

    OmniStreamError
    └── ClientError                       .code (the server's error code) and .field, where known
        ├── ConnectError                  the connection could not be opened: refused, unreachable,
        │                                 timed out, or the handshake refused (.status: 401, 403, 503)
        ├── ConnectionClosedError         the websocket closed under a request, or the client is
        │                                 used after closing (.close_code, .close_reason)
        ├── ProtocolError                 the server sent something docs/protocol.md does not allow
        ├── RequestRejectedError          an ``error`` rejecting generate / attach: nothing started
        │   └── ParamsRejectedError       also om.ParamsError: bad_params, invalid_field, limit_exceeded
        ├── RequestFailedError            also om.RequestError: an ``error`` ending an accepted request
        └── RemoteCancelledError          also om.RequestCancelledError: ``cancelled`` (.reason)

Every error raised while serving a request carries its ``request_id``.
Bad arguments (a malformed id, params that are not a JSON object) raise
om.ParamsError naming the field, before anything is sent.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import uuid
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Generic, Literal, TypeVar, overload

import anyio
import anyio.abc
from PIL import Image
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as _ws_connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)

from .errors import OmniStreamError, ParamsError, RequestCancelledError, RequestError

__all__ = [
    "DEFAULT_MAX_SIZE",
    "FORMATS",
    "Client",
    "ClientError",
    "ConnectError",
    "ConnectionClosedError",
    "ParamsRejectedError",
    "PreviewFrame",
    "Progress",
    "ProtocolError",
    "RemoteCancelledError",
    "RequestFailedError",
    "RequestRejectedError",
    "RequestStream",
    "connect",
    "parse_preview_frame",
]

logger = logging.getLogger("omni_stream.client")

# The wire constants below restate omni_stream/server/protocol.py on purpose:
# the client must not import the server package (and its engine). A test
# (tests/test_client.py) keeps the two in step.
MAX_ID_LENGTH: Final = 128
ID_PATTERN: Final = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_LENGTH}}}")
#: ``error`` codes that end an accepted request.
REQUEST_ENDING_CODES: Final = frozenset(
    {"step_failed", "step_timeout", "engine_error", "preview_failed", "internal"}
)
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
    }
)
#: Rejections that mean "your input is wrong": raised as ParamsRejectedError.
PARAMS_CODES: Final = frozenset({"bad_params", "invalid_field", "limit_exceeded"})
#: Preview formats and the MIME type each header must carry.
FORMATS: Final[Mapping[str, str]] = {
    "jpeg": "image/jpeg",
    "png": "image/png",
    "webp": "image/webp",
    "raw": "application/octet-stream",
}
_PILLOW_FORMATS: Final = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
# A real header is ~150 bytes; a length far beyond that is a corrupt frame
# (or not a preview at all), not a header worth allocating for.
MAX_HEADER_BYTES: Final = 64 * 1024
#: Default websocket message limit: a raw 2048 x 2048 RGB preview (12 MiB) fits.
DEFAULT_MAX_SIZE: Final = 32 * 1024 * 1024
CLOSE_PROTOCOL_ERROR: Final = 1002


# ---- errors ----------------------------------------------------------------


class ClientError(OmniStreamError):
    """The server or the connection ended a client call.

    ``code`` is the server's ``error`` code (or the handshake's, for
    ConnectError) where there is one; ``field`` names the field at fault.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        # Explicit, not super(): subclasses also derive from ParamsError or
        # RequestError, whose own __init__ signatures differ.
        OmniStreamError.__init__(self, message, request_id=request_id)
        self.code = code
        self.field = field


class ConnectError(ClientError):
    """The websocket could not be opened; ``status`` is the HTTP status of a refused handshake."""

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status


class ConnectionClosedError(ClientError):
    """The websocket closed while a request was in flight, or the client was used after closing."""

    def __init__(
        self,
        message: str,
        *,
        close_code: int | None = None,
        close_reason: str = "",
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.close_code = close_code
        self.close_reason = close_reason


class ProtocolError(ClientError):
    """The server sent a message or frame that docs/protocol.md does not allow."""


class RequestRejectedError(ClientError):
    """The server rejected a ``generate`` or ``attach``; nothing was started."""


class ParamsRejectedError(RequestRejectedError, ParamsError):
    """The server rejected the request's params or fields; ``field`` names the one at fault."""


class RequestFailedError(ClientError, RequestError):
    """The server ended an accepted request with an ``error`` (step_failed, step_timeout, ...)."""


class RemoteCancelledError(ClientError, RequestCancelledError):
    """The request was cancelled; ``reason`` is client, disconnect, shutdown or engine."""

    def __init__(self, message: str, *, reason: str, request_id: str | None = None) -> None:
        super().__init__(message, code="cancelled", request_id=request_id)
        self.reason = reason


def _server_error(
    code: str, message: str, *, field: str | None, request_id: str | None, accepted: bool
) -> ClientError:
    if accepted:
        return RequestFailedError(message, code=code, field=field, request_id=request_id)
    if code in PARAMS_CODES:
        return ParamsRejectedError(message, code=code, field=field, request_id=request_id)
    return RequestRejectedError(message, code=code, field=field, request_id=request_id)


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


@dataclass(frozen=True, slots=True)
class Progress:
    """A ``progress`` message: ``step`` of ``total`` done, ``eta_s`` seconds left (estimated)."""

    id: str
    step: int
    total: int
    eta_s: float


@dataclass(frozen=True, slots=True)
class _Accepted:
    id: str
    total: int
    detach: bool
    attached: bool
    preview: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Done:
    id: str
    total: int
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class _Cancelled:
    id: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Error:
    code: str
    message: str
    id: str | None
    field: str | None


_Event = _Accepted | Progress | PreviewFrame | _Done | _Cancelled | _Error


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
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def _parse_text(text: str) -> _Event | None:
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
        return _Accepted(
            _want_id(obj, where),
            total,
            _want(obj, "detach", "bool", where),
            _want(obj, "attached", "bool", where),
            _want(obj, "preview", "object", where),
        )
    if kind == "done":
        return _Done(
            _want_id(obj, where),
            _want(obj, "total", "int", where),
            float(_want(obj, "elapsed_s", "number", where)),
        )
    if kind == "cancelled":
        return _Cancelled(_want_id(obj, where), _want(obj, "reason", "str", where))
    if kind == "error":
        request_id = _want_id(obj, where) if obj.get("id") is not None else None
        field_name = _want(obj, "field", "str", where) if obj.get("field") is not None else None
        return _Error(
            _want(obj, "code", "str", where),
            _want(obj, "message", "str", where),
            request_id,
            field_name,
        )
    return None


# ---- one request's inbox (pure state machine: the reader feeds, the consumer takes) ----


class _Inbox:
    """What arrived for one request, waiting for its consumer; never blocks the feeder."""

    def __init__(self, request_id: str, *, want_progress: bool, max_buffered: int) -> None:
        self.id = request_id
        self.want_progress = want_progress
        self.max_buffered = max_buffered
        self.items: deque[Progress | PreviewFrame] = deque()
        self.accepted: _Accepted | None = None
        self.done: _Done | None = None
        self.last_progress: Progress | None = None
        self.final_seen = False
        self.dropped = 0
        self.finished = False  # an outcome arrived (or the connection ended)
        self.outcome: ClientError | None = None  # None with finished: done
        self._raised = False
        self._wakeup: anyio.Event | None = None

    def feed(self, event: _Event) -> None:
        """Take one event routed to this request. Never raises, never waits."""
        if self.finished:
            logger.debug("request %s: ignoring %s after its outcome", self.id, type(event).__name__)
            return
        if isinstance(event, _Error):
            self._feed_error(event)
        elif isinstance(event, _Accepted):
            if self.accepted is not None:
                self.fail(ProtocolError("second 'accepted' for one request", request_id=self.id))
            else:
                self.accepted = event
        elif self.accepted is None:
            # docs/protocol.md: accepted comes first. Anything else first means
            # the server and this client disagree about the request's state.
            self.fail(
                ProtocolError(
                    f"server sent {type(event).__name__} before 'accepted'", request_id=self.id
                )
            )
        elif isinstance(event, Progress):
            self.last_progress = event
            if self.want_progress:
                self._push(event)
        elif isinstance(event, PreviewFrame):
            self.final_seen = self.final_seen or event.final
            self._push(event)
        elif isinstance(event, _Done):
            if not self.final_seen:
                self.fail(
                    ProtocolError("server sent 'done' without a final preview", request_id=self.id)
                )
                return
            self.done = event
            self._finish(None)
        elif isinstance(event, _Cancelled):
            self._finish(
                RemoteCancelledError(
                    f"request cancelled ({event.reason})", reason=event.reason, request_id=self.id
                )
            )

    def _feed_error(self, event: _Error) -> None:
        accepted = self.accepted is not None
        if accepted and event.code in REJECTION_CODES:
            # A rejection naming a running request rejects some later message
            # about it (a cancel racing its end gets not_found): the request
            # itself goes on, and its own outcome is still to come. Unknown
            # codes end it: a newer server's new failure must not hang us.
            logger.debug("request %s: server rejected a message about it: %s", self.id, event.message)
            return
        self._finish(
            _server_error(
                event.code, event.message, field=event.field, request_id=self.id, accepted=accepted
            )
        )

    def _push(self, item: Progress | PreviewFrame) -> None:
        self.items.append(item)
        if len(self.items) > self.max_buffered:
            # Latest wins: drop the oldest intermediate item; finals stay.
            for i, old in enumerate(self.items):
                if not (isinstance(old, PreviewFrame) and old.final):
                    del self.items[i]
                    self.dropped += 1
                    break
        self._wake()

    def fail(self, error: ClientError) -> None:
        """End the request with ``error`` unless it already ended."""
        if not self.finished:
            self._finish(error)

    def _finish(self, outcome: ClientError | None) -> None:
        self.finished = True
        self.outcome = outcome
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def get(self) -> Progress | PreviewFrame:
        """The next item; raises StopAsyncIteration after ``done``, the error once after others."""
        while True:
            if self.items:
                return self.items.popleft()
            if self.finished:
                if self.outcome is not None and not self._raised:
                    self._raised = True
                    raise self.outcome
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            await self._wakeup.wait()


# ---- the public stream and client --------------------------------------------

T = TypeVar("T")


class RequestStream(Generic[T]):
    """One request's previews (and ``Progress`` items, if asked for), ending on ``done``.

    Made by :meth:`Client.generate` and :meth:`Client.attach`; the message is
    sent on the first ``__anext__`` (or ``async with``). Iteration raises
    RemoteCancelledError on ``cancelled``, RequestFailedError /
    RequestRejectedError / ParamsRejectedError on ``error``,
    ConnectionClosedError when the connection ends first, and ParamsError
    when this connection already watches a request with this id.

    Leaving early cancels a generate that was not detached; an attach only
    stops watching (the request runs on). Leaving ``async with`` or calling
    ``aclose()`` cancels at once. A plain ``break`` (or an exception out of
    the loop) cancels when the stream is garbage collected: in CPython right
    after the loop, once nothing refers to it, but an exception's traceback
    keeps it alive as long as the exception is kept; use ``async with``
    where that matters.
    """

    def __init__(
        self,
        client: Client,
        request_id: str,
        message: str,
        *,
        kind: Literal["generate", "attach"],
        cancel_on_exit: bool,
        want_progress: bool,
        max_buffered: int,
    ) -> None:
        self.id = request_id
        self.kind = kind
        self._client = client
        self._message = message
        self._cancel_on_exit = cancel_on_exit
        self._inbox = _Inbox(request_id, want_progress=want_progress, max_buffered=max_buffered)
        self._state: Literal["new", "started", "closed"] = "new"
        self._finalizer: weakref.finalize[[_Inbox, bool], RequestStream[T]] | None = None

    # -- what the server said about it --

    @property
    def accepted(self) -> bool:
        """True once the server accepted the request."""
        return self._inbox.accepted is not None

    @property
    def total(self) -> int | None:
        """Steps in the request (from ``accepted``), or None before it."""
        a = self._inbox.accepted
        return None if a is None else a.total

    @property
    def preview_settings(self) -> dict[str, Any] | None:
        """The effective preview settings from ``accepted``, or None before it."""
        a = self._inbox.accepted
        return None if a is None else dict(a.preview)

    @property
    def last_progress(self) -> Progress | None:
        """The latest ``progress`` seen (kept even when progress items are not yielded)."""
        return self._inbox.last_progress

    @property
    def elapsed_s(self) -> float | None:
        """Server-side seconds from ``accepted`` to the final step, once ``done`` arrived."""
        d = self._inbox.done
        return None if d is None else d.elapsed_s

    @property
    def dropped(self) -> int:
        """Intermediate items dropped because this consumer fell ``max_buffered`` behind."""
        return self._inbox.dropped

    @property
    def finished(self) -> bool:
        """True once the request's outcome arrived (or the connection ended)."""
        return self._inbox.finished

    # -- iteration --

    def __aiter__(self) -> RequestStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._state == "new":
            await self._start()
        if self._state == "closed":
            raise StopAsyncIteration
        try:
            item = await self._inbox.get()
        except (StopAsyncIteration, ClientError):
            self._settle()
            raise
        return item  # type: ignore[return-value]

    async def result(self) -> PreviewFrame:
        """Iterate to the end and return the final preview (the result); raises as iteration does."""
        final: PreviewFrame | None = None
        async with self:
            async for item in self:
                if isinstance(item, PreviewFrame) and item.final:
                    final = item
        if final is None:  # pragma: no cover - _Inbox refuses 'done' without a final
            raise ProtocolError("request ended without a final preview", request_id=self.id)
        return final

    async def __aenter__(self) -> RequestStream[T]:
        if self._state == "new":
            await self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop iterating; cancels an unfinished, non-detached generate. Never raises."""
        if self._state != "started":
            self._state = "closed"
            return
        unfinished = not self._inbox.finished
        self._settle()
        if unfinished and self._cancel_on_exit:
            # Queued, not awaited: leaving `async with` inside a cancelled
            # scope must still cancel, and closing must never block on a send.
            self._client._queue_cancel(self.id)

    async def _start(self) -> None:
        self._state = "started"
        try:
            await self._client._open_request(self._inbox, self._message)
        except BaseException:
            self._state = "closed"
            raise
        # On garbage collection after an early ``break``: unregister, and
        # cancel unless detached. Refers to the client and inbox, not to self.
        self._finalizer = weakref.finalize(
            self, self._client._abandon, self._inbox, self._cancel_on_exit
        )
        self._finalizer.atexit = False

    def _settle(self) -> None:
        """Done with this stream: unregister its inbox, without cancelling."""
        self._state = "closed"
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._client._forget(self._inbox)


def _check_request_id(value: Any) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ParamsError(
            f"request id must be 1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 . _ : -, "
            f"got {value!r:.80}",
            field="id",
        )
    return value


class Client:
    """One websocket connection to an omni_stream server; use ``async with``.

    ``token`` is sent as ``Authorization: Bearer TOKEN``. ``max_buffered``
    bounds the items one request buffers for a slow consumer (see the module
    docstring). Other keyword arguments go to ``websockets.asyncio.client.connect``
    (``open_timeout``, ``max_size`` (default DEFAULT_MAX_SIZE), ``ping_interval``,
    ...). Entering raises ConnectError; ParamsError for a bad url, token or option.
    """

    def __init__(
        self, url: str, token: str | None = None, *, max_buffered: int = 64, **connect_kwargs: Any
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("ws://", "wss://")):
            raise ParamsError(f"url must be a ws:// or wss:// URL, got {url!r:.120}", field="url")
        if token is not None and (not isinstance(token, str) or not token):
            raise ParamsError("token must be a non-empty string or None", field="token")
        if isinstance(max_buffered, bool) or not isinstance(max_buffered, int) or max_buffered < 1:
            raise ParamsError(
                f"max_buffered must be an integer >= 1, got {max_buffered!r}", field="max_buffered"
            )
        self.url = url
        self._token = token
        self._max_buffered = max_buffered
        self._connect_kwargs = connect_kwargs
        self._ws: ClientConnection | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Cancels of streams closed or dropped early, sent by one task of ours.
        self._cancels_send, self._cancels_receive = anyio.create_memory_object_stream[str](
            math.inf
        )
        self._inboxes: dict[str, _Inbox] = {}
        self._closed: ConnectionClosedError | None = None
        self._state: Literal["new", "open", "closed"] = "new"

    # -- lifecycle --

    async def __aenter__(self) -> Client:  # noqa: PYI034 - subclasses are not expected
        if self._state != "new":
            raise RuntimeError("a Client can be entered once; create a new one")
        self._state = "open"
        try:
            self._ws = await self._connect()
        except BaseException:
            self._state = "closed"
            raise
        self._loop = asyncio.get_running_loop()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_loop)
        self._tg.start_soon(self._send_queued_cancels)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        try:
            # Shielded: a cancelled body still closes the socket (bounded by
            # close_timeout) and must still leave the task group it entered.
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            tg.cancel_scope.cancel()  # the reader ended with the socket; stop the rest
            # The body's own exception propagates as it is: handing it to the
            # task group would wrap it in an ExceptionGroup.
            await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the websocket (1000); requests still running end with ConnectionClosedError."""
        self._state = "closed"
        self._cancels_send.close()
        if self._ws is not None:
            await self._ws.close()
        self._fail_all(self._closed_error())

    @property
    def closed(self) -> bool:
        """True once the connection closed, from either side."""
        return self._closed is not None or self._state == "closed"

    @property
    def close_code(self) -> int | None:
        return None if self._closed is None else self._closed.close_code

    @property
    def close_reason(self) -> str:
        return "" if self._closed is None else self._closed.close_reason

    async def _connect(self) -> ClientConnection:
        kwargs: dict[str, Any] = {
            # The server never negotiates permessage-deflate (previews are
            # already compressed); do not offer it.
            "compression": None,
            "max_size": DEFAULT_MAX_SIZE,
            "open_timeout": 10.0,
        }
        kwargs.update(self._connect_kwargs)
        headers = list(dict(kwargs.pop("additional_headers", None) or {}).items())
        if self._token is not None:
            headers.append(("Authorization", f"Bearer {self._token}"))
        try:
            return await _ws_connect(self.url, additional_headers=headers, **kwargs)
        except InvalidStatus as exc:
            raise _refused(exc) from None
        except InvalidURI as exc:
            raise ParamsError(f"url {self.url!r} is not a websocket URL: {exc}", field="url") from None
        except TimeoutError as exc:
            raise ConnectError(f"timed out connecting to {self.url}") from exc
        except (OSError, InvalidHandshake) as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc}") from exc

    # -- requests --

    @overload
    def generate(
        self,
        params: Mapping[str, Any] | None = ...,
        *,
        preview: Mapping[str, Any] | None = ...,
        id: str | None = ...,
        detach: bool = ...,
        progress: Literal[False] = ...,
    ) -> RequestStream[PreviewFrame]: ...

    @overload
    def generate(
        self,
        params: Mapping[str, Any] | None = ...,
        *,
        preview: Mapping[str, Any] | None = ...,
        id: str | None = ...,
        detach: bool = ...,
        progress: Literal[True],
    ) -> RequestStream[PreviewFrame | Progress]: ...

    def generate(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        preview: Mapping[str, Any] | None = None,
        id: str | None = None,
        detach: bool = False,
        progress: bool = False,
    ) -> RequestStream[Any]:
        """Start a request (on first iteration) and stream its previews, the final one last.

        ``preview``: ``every``, ``format``, ``max_size``, ``quality``,
        ``decoder`` (docs/protocol.md); None for the server's defaults.
        ``id``: None makes a random one (``uuid4``; needed to ``attach`` to a
        detached request from another connection). ``detach``: the request
        survives this connection and leaving the iteration early.
        ``progress``: also yield :class:`Progress` items. Raises ParamsError
        for a malformed id, params or preview that are not JSON objects, or
        values JSON cannot carry (NaN, infinities, other types).
        """
        request_id = uuid.uuid4().hex if id is None else _check_request_id(id)
        if not isinstance(detach, bool):
            raise ParamsError(f"detach must be a bool, got {detach!r}", field="detach")
        if not isinstance(progress, bool):
            raise ParamsError(f"progress must be a bool, got {progress!r}", field="progress")
        message: dict[str, Any] = {
            "type": "generate",
            "id": request_id,
            "params": _json_object(params, "params"),
            "detach": detach,
        }
        if preview is not None:
            message["preview"] = _json_object(preview, "preview")
        return RequestStream(
            self,
            request_id,
            json.dumps(message, separators=(",", ":"), allow_nan=False),
            kind="generate",
            cancel_on_exit=not detach,
            want_progress=progress,
            max_buffered=self._max_buffered,
        )

    @overload
    def attach(self, id: str, *, progress: Literal[False] = ...) -> RequestStream[PreviewFrame]: ...

    @overload
    def attach(self, id: str, *, progress: Literal[True]) -> RequestStream[PreviewFrame | Progress]: ...

    def attach(self, id: str, *, progress: bool = False) -> RequestStream[Any]:
        """Watch a request by id (after a reconnect): the latest preview, the rest, the result.

        Leaving early only stops watching; use :meth:`cancel` to stop the
        request. Iteration raises RequestRejectedError (``not_found``,
        ``already_attached``) and otherwise as :meth:`generate`. Raises
        ParamsError for a malformed id.
        """
        request_id = _check_request_id(id)
        if not isinstance(progress, bool):
            raise ParamsError(f"progress must be a bool, got {progress!r}", field="progress")
        message = json.dumps({"type": "attach", "id": request_id}, separators=(",", ":"))
        return RequestStream(
            self,
            request_id,
            message,
            kind="attach",
            cancel_on_exit=False,
            want_progress=progress,
            max_buffered=self._max_buffered,
        )

    async def cancel(self, id: str) -> None:
        """Ask the server to cancel request ``id``; watchers then get ``cancelled``.

        No reply of its own: an unknown id is answered with a ``not_found``
        error that only a stream of that id would see. Raises ParamsError for
        a malformed id and ConnectionClosedError when the connection is gone.
        """
        request_id = _check_request_id(id)
        await self._send(json.dumps({"type": "cancel", "id": request_id}, separators=(",", ":")))

    # -- internals shared with RequestStream --

    async def _open_request(self, inbox: _Inbox, message: str) -> None:
        if self._state != "open" or self._closed is not None:
            raise self._closed_error(inbox.id)
        if inbox.id in self._inboxes:
            raise ParamsError(
                f"request {inbox.id!r} is already being watched on this connection",
                field="id",
                request_id=inbox.id,
            )
        self._inboxes[inbox.id] = inbox
        try:
            await self._send(message, request_id=inbox.id)
        except BaseException:
            self._forget(inbox)
            raise

    def _forget(self, inbox: _Inbox) -> None:
        if self._inboxes.get(inbox.id) is inbox:
            del self._inboxes[inbox.id]

    def _abandon(self, inbox: _Inbox, cancel: bool) -> None:
        # Runs from a weakref finalizer: inside whatever code dropped the last
        # reference, in theory on another thread. So it only hands the id to
        # the loop, where _send_queued_cancels sends it.
        unfinished = not inbox.finished
        self._forget(inbox)
        if not (unfinished and cancel) or self._loop is None or self.closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue_cancel, inbox.id)
        except RuntimeError:
            pass  # the loop is closed: the server cancels on disconnect

    def _queue_cancel(self, request_id: str) -> None:
        try:
            self._cancels_send.send_nowait(request_id)
        except anyio.ClosedResourceError:
            pass  # closing: the server cancels on disconnect

    async def _send_queued_cancels(self) -> None:
        async with self._cancels_receive:
            async for request_id in self._cancels_receive:
                try:
                    await self.cancel(request_id)
                except ClientError:
                    return  # the connection is gone: the server cancels on disconnect

    async def _send(self, text: str, *, request_id: str | None = None) -> None:
        if self._ws is None or self._state != "open" or self._closed is not None:
            raise self._closed_error(request_id)
        try:
            await self._ws.send(text)
        except ConnectionClosed:
            raise self._closed_error(request_id) from None

    def _closed_error(self, request_id: str | None = None) -> ConnectionClosedError:
        base = self._closed
        if base is None:
            if self._ws is not None and self._ws.close_code is not None:
                base = _closed_from(self._ws)
            else:
                base = ConnectionClosedError("the client is closed", close_code=None)
        return ConnectionClosedError(
            base.message,
            close_code=base.close_code,
            close_reason=base.close_reason,
            request_id=request_id,
        )

    def _fail_all(self, error: ConnectionClosedError | ProtocolError) -> None:
        for inbox in list(self._inboxes.values()):
            exc: ClientError
            if isinstance(error, ConnectionClosedError):
                exc = ConnectionClosedError(
                    error.message,
                    close_code=error.close_code,
                    close_reason=error.close_reason,
                    request_id=inbox.id,
                )
            else:
                exc = ProtocolError(error.message, code=error.code, request_id=inbox.id)
            inbox.fail(exc)

    # -- the reader --

    async def _read_loop(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            async for message in ws:
                try:
                    self._dispatch(message)
                except ProtocolError as exc:
                    logger.error("closing the connection to %s: %s", self.url, exc)
                    self._fail_all(exc)
                    await ws.close(CLOSE_PROTOCOL_ERROR, str(exc)[:120])
                    return
        except ConnectionClosed:
            pass
        finally:
            self._closed = _closed_from(ws)
            self._fail_all(self._closed)

    def _dispatch(self, message: str | bytes) -> None:
        event: _Event | None
        if isinstance(message, str):
            event = _parse_text(message)
            if event is None:
                logger.warning("ignoring a server message of an unknown type: %.200s", message)
                return
        else:
            event = parse_preview_frame(message)
        request_id = event.id
        if request_id is None:
            assert isinstance(event, _Error)
            # The server could not tell which message it rejected: it can only
            # be one still waiting for 'accepted'; failing those beats a hang.
            logger.warning("server error without a request id: %s: %s", event.code, event.message)
            for waiting in list(self._inboxes.values()):
                if waiting.accepted is None:
                    waiting.feed(event)
            return
        inbox = self._inboxes.get(request_id)
        if inbox is None:
            # Left early (cancel in flight), or watched without a stream.
            logger.debug("dropping %s for request %s: nobody iterates it", type(event).__name__, request_id)
            return
        inbox.feed(event)


def _closed_from(ws: ClientConnection) -> ConnectionClosedError:
    code = ws.close_code
    reason = ws.close_reason or ""
    if code == 1000:
        text = "the connection closed"
    elif code is None or code == 1006:
        text = "the connection dropped (no close frame)"
    else:
        text = f"the server closed the connection with {code}" + (f": {reason}" if reason else "")
    return ConnectionClosedError(text, close_code=code, close_reason=reason)


def _refused(exc: InvalidStatus) -> ConnectError:
    response = exc.response
    status = response.status_code
    code: str | None = None
    detail = ""
    try:
        body = json.loads(bytes(response.body or b"").decode())
        if isinstance(body, dict):
            if isinstance(body.get("error"), str):
                code = body["error"]
            if isinstance(body.get("message"), str):
                detail = body["message"]
    except (UnicodeDecodeError, ValueError):
        pass
    text = f"server refused the websocket connection: HTTP {status}"
    if code:
        text += f" {code}"
    if detail:
        text += f": {detail}"
    return ConnectError(text, code=code, status=status)


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


def connect(url: str, token: str | None = None, **kwargs: Any) -> Client:
    """A :class:`Client` for ``url`` (``ws://HOST:PORT/ws``); open it with ``async with``.

    >>> async with connect("ws://127.0.0.1:8765/ws", token="secret") as client:  # doctest: +SKIP
    ...     final = await client.generate({"steps": 20}).result()

    Keyword arguments are :class:`Client`'s. Raises ParamsError for a bad
    url or option; entering raises ConnectError.
    """
    return Client(url, token, **kwargs)
