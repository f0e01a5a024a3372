"""The HTTP API: ``/v1/generations`` (docs/http.md), beside the websocket, on one core.

A generation started over HTTP is a websocket ``generate`` with
``detach: true`` and an owner of its own: it runs whether or not anyone
watches, its id is the capability to see it (or the token, when one is
set), and its result is kept ``retention_s`` after it ends (at most
``max_retained`` of them). Every refusal has the websocket's error code,
here with an HTTP status (:data:`STATUS`); ``busy`` also sets
``Retry-After``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from .. import protocol
from . import responses
from .events import EventStream, parse_last_event_id
from ..core.outbox import Outbox
from ..core.records import RequestRecord

if TYPE_CHECKING:
    from .asgi import FrontDoor
    from .service import Service

__all__ = ["STATUS", "status_payload"]

#: The HTTP status for each ``error`` code of docs/protocol.md.
STATUS: dict[str, int] = {
    "bad_json": 400,
    "bad_message": 400,
    "invalid_field": 400,
    "unknown_type": 400,
    "bad_params": 422,
    "limit_exceeded": 422,
    "duplicate_id": 409,
    "already_attached": 409,
    "too_many_requests": 429,
    "not_found": 404,
    "busy": 503,
    "shutting_down": 503,
    "engine_unavailable": 503,
}

#: Who a ``cancelled`` request's ``reason`` names, for ``/output``'s message.
_CANCELLED_BY = {
    "client": "by a client (a cancel message or DELETE)",
    "disconnect": "because the connection that started it closed (it was not detached)",
    "shutdown": "because the server shut down",
    "engine": "by the engine",
}

#: The body's keys: the websocket's ``generate`` fields (``detach`` is implied).
_BODY_KEYS = frozenset({"id", "params", "preview", "output", "priority"})


def _status_name(record: RequestRecord, positions: dict[str, int]) -> str:
    if record.outcome == "done":
        return "done"
    if record.outcome == "cancelled":
        return "cancelled"
    if record.outcome is not None:
        return "failed"
    return "queued" if record.id in positions else "running"


def status_payload(
    record: RequestRecord, positions: dict[str, int], *, with_id: bool = True
) -> dict[str, Any]:
    """``GET /v1/generations/{id}``'s body for ``record``."""
    status = _status_name(record, positions)
    out: dict[str, Any] = {
        "id": record.id if with_id else None,
        "status": status,
        "step": record.latest_step,
        "total": record.total,
        "eta_s": record.latest_eta_s if status in ("queued", "running") else None,
        "queue_position": positions.get(record.id),
        "priority": record.priority,
        "error": None,
    }
    terminal = record.terminal_message()
    if terminal is not None and status in ("failed", "cancelled"):
        out["error"] = {k: terminal[k] for k in ("code", "message", "reason") if k in terminal}
    return out


class HttpApi:
    """The ``/v1/generations`` handlers over one :class:`FrontDoor`."""

    def __init__(self, door: FrontDoor) -> None:
        self._door = door

    @property
    def _service(self) -> Service:
        return self._door.service

    # -- helpers -----------------------------------------------------------------

    def _urls(self, request: Request, request_id: str) -> dict[str, str]:
        # root_path: a mounted app's URLs carry the mount prefix.
        base = f"{request.scope.get('root_path', '')}/v1/generations/{request_id}"
        return {
            "self": base, "events": base + "/events", "output": base + "/output", "preview": base + "/preview"
        }

    def _error(self, exc: protocol.MessageError, *, request_id: str | None) -> Response:
        reply = self._service.error_reply(exc, request_id=request_id)
        body = {"error": exc.code, "message": reply["message"]}
        for key in ("field", "retry_after_s"):
            if key in reply:
                body[key] = reply[key]
        if request_id is not None:
            body["id"] = request_id
        extra = {}
        if "retry_after_s" in reply:
            extra["Retry-After"] = str(max(1, math.ceil(float(reply["retry_after_s"]))))
        return responses.json_response(STATUS.get(exc.code, 400), body, extra=extra)

    def _lookup(self, request: Request) -> RequestRecord:
        request_id = request.path_params["request_id"]
        # Ids over HTTP are capabilities: any caller holding one may see it.
        return self._service.lookup(
            f"http:{uuid.uuid4().hex}", request_id, authenticated=self._door.authenticated(request)
        )

    def _positions(self) -> dict[str, int]:
        return self._service.queue_positions()

    # -- routes ------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        """``POST /v1/generations``: 202 and the URLs; or the events (SSE); or, with ``?wait``, the result."""
        limit = self._service.limits.max_message_bytes
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return responses.error_response(
                    413,
                    "limit_exceeded",
                    f"the body is over {limit} bytes (max_message_bytes, OMNI_STREAM_MAX_MESSAGE_BYTES)",
                )
        try:
            msg = self._parse(body)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=None)
        # Its own owner: a caller over HTTP has no connection to hold its work.
        owner = f"http:{uuid.uuid4().hex}"
        try:
            record = self._service.generate(owner, None, msg)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=msg.id)
        if request.query_params.get("wait", "").lower() in ("1", "true", "yes"):
            return await self._wait_result(request, record)
        if "text/event-stream" in request.headers.get("accept", ""):
            return self._events(record, after_step=None)
        urls = self._urls(request, record.id)
        payload = status_payload(record, self._positions())
        payload["urls"] = urls
        return responses.json_response(202, payload, extra={"Location": urls["self"]})

    def _parse(self, body: bytes) -> protocol.Generate:
        obj = protocol.decode_json(body)
        if not isinstance(obj, dict):
            raise protocol.MessageError(
                "bad_message", "the body must be a JSON object: {\"params\": {...}, \"preview\": {...}}"
            )
        unknown = sorted(set(obj) - _BODY_KEYS)
        if unknown:
            name = protocol.clip(str(unknown[0]))
            raise protocol.MessageError(
                "invalid_field",
                f"unknown field {name!r} in the body; allowed: {', '.join(sorted(_BODY_KEYS))}",
                field=name,
            )
        message = protocol.parse_client_object({**obj, "type": "generate", "detach": True})
        assert isinstance(message, protocol.Generate)  # "type" is "generate": it parses as one
        return message

    async def _wait_result(self, request: Request, record: RequestRecord) -> Response:
        # The caller waits for the outcome; a disconnect does not cancel it
        # (it is a detached request: fetch it later from its output URL).
        await record.wait_ended()
        return self._output_response(request, record)

    def _events(self, record: RequestRecord, *, after_step: int | None) -> Response:
        service = self._service
        conn_id = service.connect()
        limits = service.limits
        outbox = Outbox(
            max_pending=limits.max_pending,
            max_pending_bytes=limits.max_pending_bytes,
            budget=service.memory,
            on_replaced=lambda kind: service.metrics.messages_dropped.labels(kind).inc(),
        )
        record.watch(conn_id, outbox, attached=after_step is not None)
        return EventStream(  # type: ignore[return-value]
            outbox,
            send_timeout_s=limits.send_timeout_s,
            after_step=after_step,
            on_close=lambda: service.disconnect(conn_id),
        )

    async def status(self, request: Request) -> Response:
        """``GET /v1/generations/{id}``."""
        try:
            record = self._lookup(request)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        payload = status_payload(record, self._positions())
        payload["urls"] = self._urls(request, record.id)
        return responses.json_response(200, payload)

    async def events(self, request: Request) -> Response:
        """``GET /v1/generations/{id}/events``: SSE, resumed after ``Last-Event-ID``."""
        try:
            record = self._lookup(request)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        refusal = self._service.connection_refusal()
        if refusal is not None:
            status, code, message = refusal
            return responses.error_response(status, code, message)
        after = parse_last_event_id(
            request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        )
        return self._events(record, after_step=after)

    async def output(self, request: Request) -> Response:
        """``GET /v1/generations/{id}/output``: the result; 409 with the status until it is done."""
        try:
            record = self._lookup(request)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        return self._output_response(request, record)

    def _output_response(self, request: Request, record: RequestRecord) -> Response:
        result = record.result()
        if result is None:
            payload = status_payload(record, self._positions())
            terminal = record.terminal_message()
            if record.ended and terminal is not None and terminal.get("type") == "error":
                code = str(terminal.get("code"))
                body = {"error": code, "message": terminal.get("message"), "id": record.id, "status": payload}
                return responses.json_response(500 if code == "internal" else 409, body)
            if record.ended and terminal is not None and terminal.get("type") == "cancelled":
                # Not "not ready": it never will be.
                reason = str(terminal.get("reason") or "engine")
                return responses.json_response(
                    409,
                    {
                        "error": "cancelled",
                        "message": f"request {record.id} was cancelled {_CANCELLED_BY.get(reason, reason)}: "
                        "it has no output",
                        "reason": reason,
                        "id": record.id,
                        "status": payload,
                    },
                )
            return responses.json_response(
                409,
                {
                    "error": "not_ready",
                    "message": (
                        f"request {record.id} is {payload['status']}: its output exists once it is done"
                    ),
                    "id": record.id,
                    "status": payload,
                },
            )
        header, image = result
        ext = {"jpeg": "jpg"}.get(header.format, header.format)
        return responses.respond(
            200,
            bytes(image),
            header.mime,
            extra={
                "Content-Disposition": f'inline; filename="{record.id}.{ext}"',
                "X-Omni-Stream-Width": str(header.width),
                "X-Omni-Stream-Height": str(header.height),
            },
        )

    async def preview(self, request: Request) -> Response:
        """``GET /v1/generations/{id}/preview``: the newest preview image; 404 before the first."""
        try:
            record = self._lookup(request)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        latest = record.latest_preview()
        if latest is None:
            return responses.error_response(
                404, "not_found", f"request {record.id} has no preview yet", id=record.id
            )
        header, image = latest
        return responses.respond(
            200, bytes(image), header.mime, extra={"X-Omni-Stream-Step": str(header.step)}
        )

    async def cancel(self, request: Request) -> Response:
        """``DELETE /v1/generations/{id}``: cancel; 200 with the status once it ended."""
        request_id = request.path_params["request_id"]
        try:
            record = self._service.cancel(
                f"http:{uuid.uuid4().hex}", request_id, authenticated=self._door.authenticated(request)
            )
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request_id)
        # A cancelled request ends within a step (plus a preview render).
        with anyio.move_on_after(self._service.limits.close_timeout_s):
            await record.wait_ended()
        return responses.json_response(200, status_payload(record, self._positions()))

    async def listing(self, request: Request) -> Response:
        """``GET /v1/generations``: the queue, running first, then queued in order, then ended."""
        positions = self._positions()
        authenticated = self._door.authenticated(request)
        records = list(self._service.registry)
        order = {"running": 0, "queued": 1, "done": 2, "failed": 2, "cancelled": 2}

        def key(record: RequestRecord) -> tuple[int, int, float]:
            status = _status_name(record, positions)
            return (order[status], positions.get(record.id, 0), record.created_at)

        # Without a token an id is the capability to a request: a caller
        # sees the queue's shape, not the ids of other people's requests.
        items = [status_payload(r, positions, with_id=authenticated) for r in sorted(records, key=key)]
        return responses.json_response(
            200,
            {
                "generations": items,
                "running": sum(1 for i in items if i["status"] == "running"),
                "queued": len(positions),
                "time": time.time(),
            },
        )
