"""The client's messages, one class each: the client builds them, the server parses them (pure).

Each of :class:`Generate`, :class:`Cancel` and :class:`Attach` is one frozen
record of its fields, with

- ``build(...)``: the client's constructor, which checks the caller's
  arguments (ParamsError naming the field) before anything is sent;
- ``to_dict()`` / ``serialize()``: its wire form (the field order is fixed:
  tests pin the bytes);
- ``from_dict(obj)``: the server's parser, which checks what a client sent
  (MessageError carrying the ``error`` code to answer, and the request id
  when the message carries a valid one).

:func:`parse_client_message` reads one websocket frame as the server must:
binary frames, bad JSON, non-objects and unknown types are refused there.
A new message type is one class here, added to :data:`CLIENT_MESSAGES`.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar

from ..errors import MessageError, ParamsError
from ..ids import id_problem, is_valid_id, model_name_problem
from .codec import clip, decode_json, dumps, type_name
from .codes import MAX_PRIORITY, MIN_PRIORITY

__all__ = [
    "CLIENT_MESSAGES",
    "DEFAULT_WEBHOOK_EVENTS",
    "MAX_DEADLINE_S",
    "MAX_WEBHOOK_URL_CHARS",
    "WEBHOOK_EVENTS",
    "Attach",
    "Cancel",
    "ClientMessage",
    "Generate",
    "Pause",
    "Resume",
    "check_id",
    "check_request_id",
    "deadline_problem",
    "parse_client_message",
    "parse_client_object",
    "parse_duration",
]

_M = TypeVar("_M", bound="_ClientMessage")

#: What a ``generate``'s ``webhook.events`` may name (docs/webhooks.md), and what it
#: gets without one: the three ends of a request; ``progress`` only when asked for.
WEBHOOK_EVENTS: Final = ("completed", "failed", "cancelled", "progress")
DEFAULT_WEBHOOK_EVENTS: Final = ("completed", "failed", "cancelled")
#: The longest ``webhook.url`` read: a URL is held per request and sent with every try.
MAX_WEBHOOK_URL_CHARS: Final = 2048


def check_id(value: Any, *, field: str = "id") -> str:
    """The server's check: ``value`` if it is a request id; raises MessageError (invalid_field)."""
    if isinstance(value, str) and is_valid_id(value):
        return value
    raise MessageError("invalid_field", str(id_problem(value, name=field)), field=field)


def check_request_id(value: Any) -> str:
    """The client's check: ``value`` if it is a request id; raises ParamsError (field ``id``)."""
    if isinstance(value, str) and is_valid_id(value):
        return value
    raise ParamsError(str(id_problem(value, name="request id")), field="id")


class _ClientMessage:
    """What every client message has: a type, its fields' names, a wire form and a parser."""

    __slots__ = ()

    TYPE: ClassVar[str]
    #: Field names besides ``type``: what a message must carry, what it may.
    REQUIRED: ClassVar[frozenset[str]]
    OPTIONAL: ClassVar[frozenset[str]]

    def to_dict(self) -> dict[str, Any]:
        """The message as a JSON object, in wire order."""
        raise NotImplementedError

    def serialize(self) -> str:
        """The message as the text frame that carries it."""
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls: type[_M], obj: Mapping[str, Any]) -> _M:
        """The message a client sent as ``obj`` (its ``type`` this class's).

        Raises MessageError ``invalid_field`` (``field`` names it) for a
        wrong type, an unknown, missing or ill-typed field; the request id,
        when ``obj`` carries a valid one, is set on the error.
        """
        with _naming_request(obj):
            if obj.get("type") != cls.TYPE:
                raise MessageError(
                    "invalid_field", f"type must be {cls.TYPE!r} for {cls.__name__}", field="type"
                )
            _check_names(cls, obj)
            return cls._read(obj)

    @classmethod
    def _read(cls: type[_M], obj: Mapping[str, Any]) -> _M:
        raise NotImplementedError


#: The longest deadline a request may name: a week (a deadline is a bound, not a schedule).
MAX_DEADLINE_S: Final = 7 * 24 * 3600.0


def deadline_problem(value: Any) -> str | None:
    """Why ``value`` is not a ``deadline_s`` (a number of seconds, over 0, at most a week); None if it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"deadline_s must be a number of seconds, got {type_name(value)}"
    if not 0 < value <= MAX_DEADLINE_S or value != value:
        return f"deadline_s must be over 0 and at most {MAX_DEADLINE_S:g} s (a week), got {value!r:.40}"
    return None


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds in a Replicate-style duration (``Cancel-After: 30s``, ``5m``, ``1h30m``, ``500ms``;
    a bare number is seconds); raises MessageError (``bad_message``, field ``Cancel-After``)."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    spelled = text.strip().lower()
    try:
        seconds = float(spelled)
    except ValueError:
        parts = _DURATION_PART.findall(spelled)
        if not parts or "".join(n + u for n, u in parts) != spelled:
            raise MessageError(
                "bad_message",
                f"Cancel-After must be a duration such as 30s, 5m, 1h30m or 500ms, got {clip(text)!r}",
                field="Cancel-After",
            ) from None
        seconds = sum(float(n) * units[u] for n, u in parts)
    problem = deadline_problem(seconds)
    if problem is not None:
        raise MessageError("bad_message", problem.replace("deadline_s", "Cancel-After"), field="Cancel-After")
    return seconds


@dataclass(frozen=True, slots=True)
class Generate(_ClientMessage):
    """``{"type": "generate", ...}``; ``preview`` and ``output`` are None when the client sent none.

    ``id`` is None when the client left it to the server. ``priority`` 0 is
    the default, and is not written on the wire.
    """

    TYPE: ClassVar[str] = "generate"
    REQUIRED: ClassVar[frozenset[str]] = frozenset({"params"})
    OPTIONAL: ClassVar[frozenset[str]] = frozenset(
        {"id", "preview", "detach", "output", "priority", "model", "webhook", "deadline_s"}
    )

    id: str | None
    params: dict[str, Any]
    preview: dict[str, Any] | None
    detach: bool
    output: dict[str, Any] | None = None
    priority: int = 0
    #: The served model to run on (a server of several; None: its first).
    model: str | None = None
    #: Where to be told how it ended: ``{"url", "events"}`` (events defaulted), None without one.
    #: Only its shape is checked here; the server's allow-list is core/webhooks.py's.
    webhook: dict[str, Any] | None = None
    #: Seconds from its admission after which it is ended: ``expired`` if it has not started,
    #: cancelled (reason ``deadline``) if it runs. None: no deadline.
    deadline_s: float | None = None

    @classmethod
    def build(
        cls,
        request_id: str,
        params: Mapping[str, Any] | None = None,
        preview: Mapping[str, Any] | None = None,
        *,
        detach: bool = False,
        output: Mapping[str, Any] | None = None,
        priority: int | None = None,
        model: str | None = None,
        webhook: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
    ) -> Generate:
        """A ``generate`` as the client sends it (``params`` None: ``{}``).

        Raises ParamsError naming the field: ``id`` for a malformed request
        id, ``detach`` for a non-bool, ``priority`` for one that is not an
        int from MIN_PRIORITY to MAX_PRIORITY, and ``params``, ``preview``
        or ``output`` for a value that is not a mapping or holds what JSON
        cannot carry (NaN, infinities, other types), ``model`` for a name
        outside omni_stream/ids.py's rule, ``webhook.url`` / ``webhook.events``
        (or ``webhook``) for a webhook the server would refuse to parse.
        """
        check_request_id(request_id)
        if model is not None and (problem := model_name_problem(model)) is not None:
            raise ParamsError(problem, field="model")
        if not isinstance(detach, bool):
            raise ParamsError(f"detach must be a bool, got {detach!r:.40}", field="detach")
        if priority is not None and not _is_priority(priority):
            raise ParamsError(
                f"priority must be an int from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r:.40}",
                field="priority",
            )
        try:
            hook = None if webhook is None else _read_webhook(webhook)
        except MessageError as exc:
            raise ParamsError(exc.message, field=exc.field or "webhook") from None
        if deadline_s is not None and (problem := deadline_problem(deadline_s)) is not None:
            raise ParamsError(problem, field="deadline_s")
        return cls(
            id=request_id,
            params=_json_object(params, "params"),
            preview=None if preview is None else _json_object(preview, "preview"),
            detach=detach,
            output=None if output is None else _json_object(output, "output"),
            priority=0 if priority is None else priority,
            model=model,
            webhook=hook,
            deadline_s=None if deadline_s is None else float(deadline_s),
        )

    def to_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.TYPE}
        if self.id is not None:
            message["id"] = self.id
        message["params"] = self.params
        message["detach"] = self.detach
        if self.preview is not None:
            message["preview"] = self.preview
        if self.output is not None:
            message["output"] = self.output
        if self.priority != 0:
            message["priority"] = self.priority
        if self.model is not None:
            message["model"] = self.model
        if self.webhook is not None:
            message["webhook"] = self.webhook
        if self.deadline_s is not None:
            message["deadline_s"] = self.deadline_s
        return message

    @classmethod
    def _read(cls, obj: Mapping[str, Any]) -> Generate:
        request_id = check_id(obj["id"]) if obj.get("id") is not None else None

        def bad(field: str, text: str) -> MessageError:
            return MessageError("invalid_field", text, field=field, request_id=request_id)

        params = obj["params"]
        if not isinstance(params, dict):
            raise bad("params", f"params must be a JSON object, got {type_name(params)}")
        preview = obj.get("preview")
        if preview is not None and not isinstance(preview, dict):
            raise bad("preview", f"preview must be a JSON object, got {type_name(preview)}")
        output = obj.get("output")
        if output is not None and not isinstance(output, dict):
            raise bad("output", f"output must be a JSON object, got {type_name(output)}")
        detach = obj.get("detach", False)
        if not isinstance(detach, bool):
            raise bad("detach", f"detach must be true or false, got {type_name(detach)}")
        priority = obj.get("priority", 0)
        if not _is_priority(priority):
            shown = clip(repr(priority)) if isinstance(priority, int) else type_name(priority)
            raise bad(
                "priority",
                f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {shown}",
            )
        model = obj.get("model")
        if model is not None and (problem := model_name_problem(model)) is not None:
            raise bad("model", problem)
        raw_hook = obj.get("webhook")
        try:
            webhook = None if raw_hook is None else _read_webhook(raw_hook)
        except MessageError as exc:
            exc.request_id = request_id
            raise
        deadline = obj.get("deadline_s")
        if deadline is not None and (problem := deadline_problem(deadline)) is not None:
            raise bad("deadline_s", problem)
        return cls(
            id=request_id,
            params=params,
            preview=preview,
            detach=detach,
            output=output,
            priority=priority,
            model=model,
            webhook=webhook,
            deadline_s=None if deadline is None else float(deadline),
        )


@dataclass(frozen=True, slots=True)
class Cancel(_ClientMessage):
    """``{"type": "cancel", "id": ...}``."""

    TYPE: ClassVar[str] = "cancel"
    REQUIRED: ClassVar[frozenset[str]] = frozenset({"id"})
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    id: str

    @classmethod
    def build(cls, request_id: str) -> Cancel:
        """A ``cancel`` as the client sends it; raises ParamsError (field ``id``) for a malformed id."""
        return cls(check_request_id(request_id))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}

    @classmethod
    def _read(cls, obj: Mapping[str, Any]) -> Cancel:
        return cls(check_id(obj["id"]))


@dataclass(frozen=True, slots=True)
class Attach(_ClientMessage):
    """``{"type": "attach", "id": ...}``."""

    TYPE: ClassVar[str] = "attach"
    REQUIRED: ClassVar[frozenset[str]] = frozenset({"id"})
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    id: str

    @classmethod
    def build(cls, request_id: str) -> Attach:
        """An ``attach`` as the client sends it; raises ParamsError (field ``id``) for a malformed id."""
        return cls(check_request_id(request_id))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}

    @classmethod
    def _read(cls, obj: Mapping[str, Any]) -> Attach:
        return cls(check_id(obj["id"]))


@dataclass(frozen=True, slots=True)
class Pause(_ClientMessage):
    """``{"type": "pause", "id": ..., "to_host"?: bool}``: pause a running request between two
    steps (``to_host``: its state to host memory until it resumes)."""

    TYPE: ClassVar[str] = "pause"
    REQUIRED: ClassVar[frozenset[str]] = frozenset({"id"})
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"to_host"})

    id: str
    to_host: bool = False

    @classmethod
    def build(cls, request_id: str, *, to_host: bool = False) -> Pause:
        """A ``pause`` as the client sends it; raises ParamsError (field ``id``) for a malformed id."""
        return cls(check_request_id(request_id), bool(to_host))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "id": self.id}
        if self.to_host:
            out["to_host"] = True
        return out

    @classmethod
    def _read(cls, obj: Mapping[str, Any]) -> Pause:
        request_id = check_id(obj["id"])
        to_host = obj.get("to_host", False)
        if not isinstance(to_host, bool):
            raise MessageError(
                "invalid_field",
                f"to_host must be true or false, got {type_name(to_host)}",
                field="to_host",
                request_id=request_id,
            )
        return cls(request_id, to_host)


@dataclass(frozen=True, slots=True)
class Resume(_ClientMessage):
    """``{"type": "resume", "id": ...}``: let a paused request run again."""

    TYPE: ClassVar[str] = "resume"
    REQUIRED: ClassVar[frozenset[str]] = frozenset({"id"})
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    id: str

    @classmethod
    def build(cls, request_id: str) -> Resume:
        """A ``resume`` as the client sends it; raises ParamsError (field ``id``) for a malformed id."""
        return cls(check_request_id(request_id))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}

    @classmethod
    def _read(cls, obj: Mapping[str, Any]) -> Resume:
        return cls(check_id(obj["id"]))


ClientMessage = Generate | Cancel | Attach | Pause | Resume

#: Every client message class by its ``type``, in the order errors list them.
CLIENT_MESSAGES: Final[
    Mapping[str, type[Generate] | type[Cancel] | type[Attach] | type[Pause] | type[Resume]]
] = {
    Generate.TYPE: Generate,
    Cancel.TYPE: Cancel,
    Attach.TYPE: Attach,
    Pause.TYPE: Pause,
    Resume.TYPE: Resume,
}
#: Every field a type may carry ("type" included), built once: a hostile
#: message may carry 20,000 keys, each checked against it.
_KNOWN: Final[dict[str, frozenset[str]]] = {
    kind: cls.REQUIRED | cls.OPTIONAL | {"type"} for kind, cls in CLIENT_MESSAGES.items()
}


def parse_client_message(data: str | bytes) -> ClientMessage:
    """Parse and check one client message, as the server reads it.

    Raises MessageError with code ``bad_message`` (binary frame, not an
    object), ``bad_json``, ``invalid_field`` (missing, unknown or ill-typed
    field; ``field`` names it) or ``unknown_type``. The request id, when the
    message carries a valid one, is set on the error.
    """
    if not isinstance(data, str):
        raise MessageError("bad_message", "binary messages are not accepted; send JSON text")
    obj = decode_json(data)
    if not isinstance(obj, dict):
        raise MessageError("bad_message", f"message must be a JSON object, got {type_name(obj)}")
    return parse_client_object(obj)


def parse_client_object(obj: dict[str, Any]) -> ClientMessage:
    """:func:`parse_client_message` for a decoded JSON object (the HTTP API builds one)."""
    with _naming_request(obj):
        if "type" not in obj:
            raise MessageError("invalid_field", "message has no 'type'", field="type")
        kind = obj["type"]
        if not isinstance(kind, str):
            raise MessageError("invalid_field", f"type must be a string, got {type_name(kind)}", field="type")
        cls = CLIENT_MESSAGES.get(kind)
        if cls is None:
            raise MessageError(
                "unknown_type",
                f"unknown message type {clip(kind)!r}; known: {', '.join(CLIENT_MESSAGES)}",
                field="type",
            )
        return cls.from_dict(obj)


@contextmanager
def _naming_request(obj: Mapping[str, Any]) -> Iterator[None]:
    # An error about a message that names a request goes to that request's
    # watchers too: the client matches replies by id.
    try:
        yield
    except MessageError as exc:
        if exc.request_id is None:
            raw_id = obj.get("id")
            exc.request_id = raw_id if is_valid_id(raw_id) else None
        raise


def _check_names(cls: type[_ClientMessage], obj: Mapping[str, Any]) -> None:
    known = _KNOWN[cls.TYPE]
    unknown = [k for k in obj if k not in known]
    if unknown:
        allowed = ", ".join(sorted(cls.REQUIRED | cls.OPTIONAL))
        # The first three by name, without sorting all of them (O(n), not O(n log n)).
        first = heapq.nsmallest(3, unknown)
        named = ", ".join(repr(clip(k)) for k in first)
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise MessageError(
            "invalid_field",
            f"unknown field(s) {named}{more} in {cls.TYPE}; known: {allowed}",
            field=clip(first[0]),
        )
    missing = sorted(cls.REQUIRED - obj.keys())
    if missing:
        raise MessageError(
            "invalid_field", f"{cls.TYPE} needs {', '.join(map(repr, missing))}", field=missing[0]
        )


def _read_webhook(value: Any) -> dict[str, Any]:
    """A ``webhook`` object's shape: ``{"url": str, "events"?: [names]}``, events defaulted.

    Raises MessageError ``invalid_field`` naming ``webhook``, ``webhook.url``
    or ``webhook.events``. Whether the server calls that URL is not decided
    here (core/webhooks.py: its allow-list, schemes, credentials).
    """
    if not isinstance(value, Mapping):
        raise MessageError(
            "invalid_field",
            f'webhook must be a JSON object {{"url": ..., "events": [...]}}, got {type_name(value)}',
            field="webhook",
        )
    unknown = [k for k in value if k not in ("url", "events")]
    if unknown:
        raise MessageError(
            "invalid_field",
            f"unknown field {clip(str(min(unknown)))!r} in webhook; known: events, url",
            field="webhook",
        )
    url = value.get("url")
    if not isinstance(url, str) or not url:
        raise MessageError(
            "invalid_field",
            f"webhook.url must be a non-empty string, got {type_name(url)}",
            field="webhook.url",
        )
    if len(url) > MAX_WEBHOOK_URL_CHARS:
        raise MessageError(
            "invalid_field",
            f"webhook.url is {len(url)} characters; at most {MAX_WEBHOOK_URL_CHARS}",
            field="webhook.url",
        )
    events = value.get("events", list(DEFAULT_WEBHOOK_EVENTS))
    known = ", ".join(WEBHOOK_EVENTS)
    if not isinstance(events, list) or not events or len(events) > len(WEBHOOK_EVENTS):
        raise MessageError(
            "invalid_field",
            f"webhook.events must be a list of 1 to {len(WEBHOOK_EVENTS)} of {known}; got "
            + (f"{len(events)} entries" if isinstance(events, list) else type_name(events)),
            field="webhook.events",
        )
    for event in events:
        if not isinstance(event, str) or event not in WEBHOOK_EVENTS:
            shown = repr(clip(event)) if isinstance(event, str) else type_name(event)
            raise MessageError(
                "invalid_field", f"webhook.events: {shown} is not one of {known}", field="webhook.events"
            )
    if len(set(events)) != len(events):
        raise MessageError("invalid_field", "webhook.events names an event twice", field="webhook.events")
    return {"url": url, "events": list(events)}


def _is_priority(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and MIN_PRIORITY <= value <= MAX_PRIORITY


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
