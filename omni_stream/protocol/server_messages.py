"""The server's text messages, one class each: the server builds them, the client parses them (pure).

Each of :class:`Accepted`, :class:`Queued`, :class:`Loading`, :class:`Progress`, :class:`Done`,
:class:`Cancelled`, :class:`ErrorMessage`, :class:`Paused`, :class:`Resumed` and
:class:`Restarted` is one frozen record of what goes on the wire, with

- ``build(...)``: the server's constructor, which applies the server's rules
  (rounding, clipping what a client sent, refusing undocumented codes and
  reasons: ValueError);
- ``to_dict()`` / ``serialize()``: its wire form (the field order is fixed:
  tests pin the bytes);
- ``from_dict(obj)``: the client's parser, strict: ProtocolError naming the
  field that is missing or ill-typed. A parser accepts what a newer server
  may add: unknown fields, and unknown error codes and cancel reasons.

:func:`parse_server_message` reads a text frame as the client must; a type
it does not know is None, not an error. Binary frames are ``frames.py``'s.
A new message type is one class here, added to :data:`SERVER_MESSAGES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar

from ..errors import ProtocolError
from .codec import clip, dumps, load_object, optional, require, require_id, require_steps
from .codes import (
    CANCEL_REASONS,
    MAX_ERROR_MESSAGE,
    PAUSE_REASONS,
    REJECTION_CODES,
    REQUEST_ENDING_CODES,
    RESTART_REASONS,
    RESUME_REASONS,
)

__all__ = [
    "SERVER_MESSAGES",
    "Accepted",
    "Cancelled",
    "Done",
    "ErrorMessage",
    "Loading",
    "Queued",
    "Paused",
    "Progress",
    "Restarted",
    "Resumed",
    "ServerMessage",
    "parse_server_message",
]

_S = TypeVar("_S", bound="_ServerMessage")


class _ServerMessage:
    """What every server text message has: a type, a wire form and a strict parser.

    The server's currency inside the core is the message object; only the
    websocket writer sends :attr:`wire`, encoded once and cached, so a
    message fanned out to many watchers costs one encoding.
    """

    # The cached wire form (unset until first read); not a dataclass field,
    # so equality, repr and the parsers ignore it.
    __slots__ = ("_wire",)
    _wire: str

    TYPE: ClassVar[str]

    @property
    def kind(self) -> str:
        """What an outbox and the metrics call it: its ``type``."""
        return self.TYPE

    @property
    def wire(self) -> str:
        """The text frame that carries it (:meth:`serialize`), encoded on first use and kept."""
        try:
            return self._wire
        except AttributeError:
            text = self.serialize()
            object.__setattr__(self, "_wire", text)  # frozen: the cache is not state
            return text

    def to_dict(self) -> dict[str, Any]:
        """The message as a JSON object, in wire order."""
        raise NotImplementedError

    def serialize(self) -> str:
        """The message as the text frame that carries it; raises ValueError for NaN or infinities."""
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls: type[_S], obj: Mapping[str, Any]) -> _S:
        """The message the server sent as ``obj``; raises ProtocolError naming what is wrong."""
        kind = require(obj, "type", "str", "server message")
        if kind != cls.TYPE:
            raise ProtocolError(f"expected a {cls.TYPE!r} message, got {kind!r:.40}")
        return cls._read(obj, f"{cls.TYPE!r} message")

    @classmethod
    def _read(cls: type[_S], obj: Mapping[str, Any], where: str) -> _S:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Accepted(_ServerMessage):
    """``accepted``: a generate started, or an attach succeeded; the effective settings.

    ``output`` is None from a server that did not say (the wire omits it).
    ``seed`` is the seed the request runs with (drawn by the server when the
    request named none, or -1), None for a model without one.
    """

    TYPE: ClassVar[str] = "accepted"

    id: str
    total: int
    detach: bool
    attached: bool
    preview: dict[str, Any]
    output: dict[str, Any] | None = None
    seed: int | None = None
    #: The model that runs it, from a server of several (None from one of one).
    model: str | None = None

    @classmethod
    def build(
        cls,
        request_id: str,
        *,
        total: int,
        detach: bool,
        attached: bool,
        preview: Mapping[str, Any],
        output: Mapping[str, Any] | None = None,
        seed: int | None = None,
        model: str | None = None,
    ) -> Accepted:
        """``accepted`` as the server sends it (the settings copied)."""
        copied = None if output is None else dict(output)
        return cls(request_id, total, detach, attached, dict(preview), copied, seed, model)

    def to_dict(self) -> dict[str, Any]:
        message = {
            "type": self.TYPE,
            "id": self.id,
            "total": self.total,
            "detach": self.detach,
            "attached": self.attached,
            "preview": dict(self.preview),
        }
        if self.output is not None:
            message["output"] = dict(self.output)
        if self.seed is not None:
            message["seed"] = self.seed
        if self.model is not None:
            message["model"] = self.model
        return message

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Accepted:
        total = require(obj, "total", "int", where)
        if total < 1:
            raise ProtocolError(f"{where} has total {total}; need >= 1")
        return cls(
            require_id(obj, where),
            total,
            require(obj, "detach", "bool", where),
            require(obj, "attached", "bool", where),
            require(obj, "preview", "object", where),
            optional(obj, "output", "object", where),
            optional(obj, "seed", "int", where),
            optional(obj, "model", "str", where),
        )


@dataclass(frozen=True, slots=True)
class Queued(_ServerMessage):
    """``queued``: the request has not started a step; ``position`` requests go before it (0:
    next). Where a stream opens on a request that waits (``generate``, ``attach``, SSE), in
    the place of its progress; its first ``progress`` replaces it."""

    TYPE: ClassVar[str] = "queued"

    id: str
    position: int

    @classmethod
    def build(cls, request_id: str, *, position: int) -> Queued:
        if position < 0:
            raise ValueError(f"queue position {position} is negative")
        return cls(request_id, position)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "position": self.position}

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Queued:
        position = require(obj, "position", "int", where)
        if position < 0:
            raise ProtocolError(f"{where} has position {position}; need >= 0")
        return cls(require_id(obj, where), position)


@dataclass(frozen=True, slots=True)
class Loading(_ServerMessage):
    """``loading``: the request waits for its model to load (a server of several models that
    keeps only some on the device); its first ``progress`` comes once it has."""

    TYPE: ClassVar[str] = "loading"

    id: str
    model: str

    @classmethod
    def build(cls, request_id: str, *, model: str) -> Loading:
        return cls(request_id, model)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "model": self.model}

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Loading:
        return cls(require_id(obj, where), require(obj, "model", "str", where))


@dataclass(frozen=True, slots=True)
class Progress(_ServerMessage):
    """``progress``: ``step`` of ``total`` done, ``eta_s`` seconds left (estimated); ``cached``:
    the step reused the request's step cache (on the wire only when true)."""

    TYPE: ClassVar[str] = "progress"

    id: str
    step: int
    total: int
    eta_s: float
    cached: bool = False

    @classmethod
    def build(cls, request_id: str, *, step: int, total: int, eta_s: float, cached: bool = False) -> Progress:
        """``progress`` as the server sends it: ``eta_s`` clamped to >= 0 and rounded to ms."""
        return cls(request_id, step, total, round(max(0.0, eta_s), 3), cached)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.TYPE, "id": self.id, "step": self.step, "total": self.total, "eta_s": self.eta_s}
        if self.cached:
            out["cached"] = True
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Progress:
        step, total = require_steps(obj, where)
        eta_s = require(obj, "eta_s", "number", where)
        if eta_s < 0:
            raise ProtocolError(f"{where} has a negative eta_s {eta_s}")
        cached = bool(optional(obj, "cached", "bool", where))
        return cls(require_id(obj, where), step, total, float(eta_s), cached)


@dataclass(frozen=True, slots=True)
class Done(_ServerMessage):
    """``done``: the request finished; its final preview came before it. ``repeat``: it was an
    exact repeat of a finished request, answered with that one's results (on the wire only
    when true)."""

    TYPE: ClassVar[str] = "done"

    id: str
    total: int
    elapsed_s: float
    repeat: bool = False

    @classmethod
    def build(cls, request_id: str, *, total: int, elapsed_s: float, repeat: bool = False) -> Done:
        """``done`` as the server sends it: ``elapsed_s`` rounded to ms."""
        return cls(request_id, total, round(elapsed_s, 3), repeat)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.TYPE, "id": self.id, "total": self.total, "elapsed_s": self.elapsed_s}
        if self.repeat:
            out["repeat"] = True
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Done:
        return cls(
            require_id(obj, where),
            require(obj, "total", "int", where),
            float(require(obj, "elapsed_s", "number", where)),
            bool(optional(obj, "repeat", "bool", where)),
        )


@dataclass(frozen=True, slots=True)
class Cancelled(_ServerMessage):
    """``cancelled``; ``reason`` is client, disconnect, shutdown or engine (CANCEL_REASONS)."""

    TYPE: ClassVar[str] = "cancelled"

    id: str
    reason: str

    @classmethod
    def build(cls, request_id: str, *, reason: str) -> Cancelled:
        """``cancelled`` as the server sends it; raises ValueError for a reason outside CANCEL_REASONS."""
        if reason not in CANCEL_REASONS:
            raise ValueError(f"cancel reason must be one of {sorted(CANCEL_REASONS)}, got {reason!r}")
        return cls(request_id, reason)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "reason": self.reason}

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Cancelled:
        return cls(require_id(obj, where), require(obj, "reason", "str", where))


@dataclass(frozen=True, slots=True)
class ErrorMessage(_ServerMessage):
    """``error``; ``id`` None: the server could not tell the request; ``field`` None: no field to blame."""

    TYPE: ClassVar[str] = "error"

    code: str
    message: str
    id: str | None
    field: str | None
    #: ``busy`` only: seconds the server suggests waiting before trying again.
    retry_after_s: float | None = None

    @classmethod
    def build(
        cls,
        code: str,
        message: str,
        *,
        request_id: str | None = None,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> ErrorMessage:
        """``error`` as the server sends it; raises ValueError for a code docs/protocol.md does not list.

        ``field`` is clipped to MAX_ECHO characters and ``message`` to
        MAX_ERROR_MESSAGE: both may echo what a client sent.
        """
        if code not in REJECTION_CODES and code not in REQUEST_ENDING_CODES:
            raise ValueError(f"unknown error code {code!r}")
        return cls(
            code,
            clip(message, MAX_ERROR_MESSAGE),
            request_id,
            None if field is None else clip(field),
            retry_after_s,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "code": self.code, "message": self.message}
        if self.id is not None:
            out["id"] = self.id
        if self.field is not None:
            out["field"] = self.field
        if self.retry_after_s is not None:
            out["retry_after_s"] = self.retry_after_s
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> ErrorMessage:
        request_id = require_id(obj, where) if obj.get("id") is not None else None
        field = optional(obj, "field", "str", where)
        retry = optional(obj, "retry_after_s", "number", where)
        if retry is not None and retry < 0:
            raise ProtocolError(f"{where} has a negative retry_after_s {retry}")
        return cls(
            require(obj, "code", "str", where),
            require(obj, "message", "str", where),
            request_id,
            field,
            None if retry is None else float(retry),
        )


@dataclass(frozen=True, slots=True)
class Paused(_ServerMessage):
    """``paused``: the request stopped between steps (its ``step`` done); no progress comes until
    ``resumed``. ``reason`` (PAUSE_REASONS; None from a server before it): ``client`` (a
    ``pause``), ``preempted`` (the server's gate gave its place to a shorter request)."""

    TYPE: ClassVar[str] = "paused"

    id: str
    step: int
    reason: str | None = None

    @classmethod
    def build(cls, request_id: str, *, step: int, reason: str | None = None) -> Paused:
        """Raises ValueError for a reason outside PAUSE_REASONS."""
        if reason is not None and reason not in PAUSE_REASONS:
            raise ValueError(f"unknown pause reason {reason!r}")
        return cls(request_id, step, reason)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "id": self.id, "step": self.step}
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Paused:
        # An unknown reason is kept: a newer server may add some.
        return cls(
            require_id(obj, where), require(obj, "step", "int", where), optional(obj, "reason", "str", where)
        )


@dataclass(frozen=True, slots=True)
class Resumed(_ServerMessage):
    """``resumed``: a paused request runs again. ``reason`` (RESUME_REASONS; None from a server
    before it): ``client`` (a ``resume``), ``max_pause`` (it was paused ``max_pause_s`` in all,
    and resumed by itself), ``preempted`` (let in again after a preemption)."""

    TYPE: ClassVar[str] = "resumed"

    id: str
    step: int
    reason: str | None = None

    @classmethod
    def build(cls, request_id: str, *, step: int, reason: str | None = None) -> Resumed:
        """Raises ValueError for a reason outside RESUME_REASONS."""
        if reason is not None and reason not in RESUME_REASONS:
            raise ValueError(f"unknown resume reason {reason!r}")
        return cls(request_id, step, reason)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "id": self.id, "step": self.step}
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Resumed:
        return cls(
            require_id(obj, where), require(obj, "step", "int", where), optional(obj, "reason", "str", where)
        )


@dataclass(frozen=True, slots=True)
class Restarted(_ServerMessage):
    """``restarted``: the server restarted (a crash, ``kill -9``, a deploy) and runs the request
    again from ``from_step`` (the steps done that are not redone: its checkpoint's, else 0);
    ``reason`` is one of RESTART_REASONS (a parser takes a newer server's others)."""

    TYPE: ClassVar[str] = "restarted"

    id: str
    from_step: int
    reason: str

    @classmethod
    def build(cls, request_id: str, *, from_step: int, reason: str) -> Restarted:
        """``restarted`` as the server sends it; raises ValueError for a reason outside
        RESTART_REASONS, or a negative step."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"restart reason must be one of {sorted(RESTART_REASONS)}, got {reason!r}")
        if from_step < 0:
            raise ValueError(f"from_step must be >= 0, got {from_step}")
        return cls(request_id, from_step, reason)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "from_step": self.from_step, "reason": self.reason}

    @classmethod
    def _read(cls, obj: Mapping[str, Any], where: str) -> Restarted:
        step = require(obj, "from_step", "int", where)
        if step < 0:
            raise ProtocolError(f"{where} has a negative from_step {step}")
        return cls(require_id(obj, where), step, require(obj, "reason", "str", where))


ServerMessage = (
    Accepted | Queued | Loading | Progress | Done | Cancelled | ErrorMessage | Paused | Resumed | Restarted
)

#: Every server text message class by its ``type``.
SERVER_MESSAGES: Final[
    Mapping[
        str,
        type[Accepted]
        | type[Queued]
        | type[Loading]
        | type[Progress]
        | type[Done]
        | type[Cancelled]
        | type[ErrorMessage]
        | type[Paused]
        | type[Resumed]
        | type[Restarted],
    ]
] = {
    Accepted.TYPE: Accepted,
    Queued.TYPE: Queued,
    Loading.TYPE: Loading,
    Paused.TYPE: Paused,
    Resumed.TYPE: Resumed,
    Restarted.TYPE: Restarted,
    Progress.TYPE: Progress,
    Done.TYPE: Done,
    Cancelled.TYPE: Cancelled,
    ErrorMessage.TYPE: ErrorMessage,
}


def parse_server_message(text: str | bytes) -> ServerMessage | None:
    """One server text message, as the client reads it; None for a type this client does not know.

    Raises ProtocolError for invalid JSON, a non-object, a missing ``type``,
    or a known type with missing or ill-typed fields.
    """
    obj = load_object(text, "server message")
    kind = require(obj, "type", "str", "server message")
    cls = SERVER_MESSAGES.get(kind)
    return None if cls is None else cls.from_dict(obj)
