"""The HTTP door: ``/v1/generations`` (docs/http.md), beside the websocket, on one core.

Each call is a client of the core while it is open (asgi.py opens and
closes it), its principal its token's name or its address: the same rules
as a websocket's, counted against the same principal (core/rules.py). A
generation started over HTTP is a websocket ``generate`` with ``detach:
true``: it runs whether or not anyone watches, its id is the capability to
see it (and its principal's token, when one is used), and its result is
kept ``retention_s`` after it ends (at most ``max_retained`` of them). Every
refusal has the websocket's error code, here with an HTTP status
(:data:`STATUS`); ``busy`` also sets ``Retry-After``.

A body is read within ``body_timeout_s`` and ``max_message_bytes`` (the
wire's own bounds are http11.py's), held as one buffer counted in
``max_memory_bytes`` until it is parsed; its input images are decoded off
the event loop (Service.prepare). A result is sent from the record's own
buffer, never copied per call (responses.BufferResponse).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import protocol
from ..core import retries
from ..core.records import RequestRecord, error_view
from ..core.rules import Client
from ..ids import is_valid_id
from . import responses
from .bodies import BodyRefused, read_body
from .events import EventStream, parse_last_event_id

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
    "expired": "at its deadline_s (Cancel-After) before it started",
    "deadline": "at its deadline_s (Cancel-After) while it ran",
}

#: The body's keys: the websocket's ``generate`` fields (``detach`` is implied).
_BODY_KEYS = frozenset({"id", "params", "preview", "output", "priority", "model", "webhook", "deadline_s"})


#: The request's body is refused (server/bodies.py).
_BodyRefused = BodyRefused


def _status_name(record: RequestRecord, positions: dict[str, int]) -> str:
    if record.outcome == "done":
        return "done"
    if record.outcome == "cancelled":
        # Replicate's "aborted": its deadline came before it started; it never ran.
        return "expired" if record.cancel_reason == "expired" else "cancelled"
    if record.outcome is not None:
        return "failed"
    if record.paused:
        return "paused"  # (paused while it waited for its model too: it wants none until resumed)
    if record.loading:
        return "loading"  # its model is being loaded onto the device
    return "queued" if record.id in positions else "running"


def status_payload(
    record: RequestRecord, positions: dict[str, int], *, with_id: bool = True
) -> dict[str, Any]:
    """``GET /v1/generations/{id}``'s body for ``record``; ``with_id=False`` (another principal's
    request in the listing): only its place in the queue, no id and nothing of what it asked."""
    status = _status_name(record, positions)
    if not with_id:
        # Ids are scoped to their principal (issue #39, attack 9), and so is what a request is:
        # its seed, model, priority and errors are its principal's to see.
        return {
            "id": None,
            "status": status,
            "step": record.latest_step,
            "total": record.total,
            "queue_position": positions.get(record.id),
        }
    out: dict[str, Any] = {
        "id": record.id,
        "status": status,
        "step": record.latest_step,
        "total": record.total,
        "eta_s": record.latest_eta_s if status in ("queued", "running") else None,
        "queue_position": positions.get(record.id),
        "priority": record.priority,
        "seed": record.seed,
        "model": record.model,
        # Results once done: one per image (num_images), each at output?index=i.
        "images": record.result_count,
        # The server restarted and runs it again: {"from_step", "reason"} (docs/protocol.md).
        "restarted": record.restart_view(),
        "error": None,
    }
    if status in ("failed", "cancelled", "expired"):
        out["error"] = error_view(record.terminal_message())
    if record.webhook is not None:
        # Its URL and how each delivery went (docs/webhooks.md); only to who may see the id.
        out["webhook"] = record.webhook.view()
    return out


class HttpApi:
    """The ``/v1/generations`` handlers over one :class:`FrontDoor`; each gets the call's :class:`Client`."""

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
            "self": base,
            "events": base + "/events",
            "output": base + "/output",
            "preview": base + "/preview",
        }

    def _error(self, exc: protocol.MessageError, *, request_id: str | None) -> Response:
        reply = self._service.rules.error_reply(exc, request_id=request_id)
        fields: dict[str, Any] = {}
        if reply.field is not None:
            fields["field"] = reply.field
        if reply.retry_after_s is not None:
            fields["retry_after_s"] = reply.retry_after_s
        if request_id is not None:
            # A path's id is anything a client typed: echoed only as far as the protocol echoes.
            fields["id"] = request_id if is_valid_id(request_id) else protocol.clip(request_id)
        extra = {}
        if reply.retry_after_s is not None:
            extra["Retry-After"] = str(max(1, math.ceil(reply.retry_after_s)))
        status = STATUS.get(exc.code, 400)
        return responses.error_response(status, exc.code, reply.message, extra=extra, **fields)

    def _lookup(self, request: Request, client: Client) -> RequestRecord:
        return self._service.rules.lookup(client, request.path_params["request_id"])

    def _positions(self) -> dict[str, int]:
        return self._service.rules.queue_positions()

    # -- routes ------------------------------------------------------------------

    async def create(self, request: Request, client: Client) -> Response:
        """``POST /v1/generations``: 202 and the URLs; or the events (SSE); or, with ``?wait``, the result."""
        try:
            body = await self._read_body(request)
            msg = self._parse(body)
            key = request.headers.get(retries.IDEMPOTENCY_HEADER)
            if key is not None and msg.id is None:
                # The caller names its job by a key: sent again, it is the same job (core/retries.py).
                msg = dataclasses.replace(msg, id=retries.id_for_key(client.principal.key, key))
            after = request.headers.get("cancel-after")
            if after is not None and msg.deadline_s is None:
                # Replicate's header: the request's deadline_s (core/deadlines.py).
                msg = dataclasses.replace(msg, deadline_s=protocol.parse_duration(after))
        except protocol.MessageError as exc:
            unknown = exc.code in ("bad_json", "bad_message")
            return self._error(exc, request_id=None if unknown else exc.request_id)
        except _BodyRefused as exc:
            return responses.error_response(exc.status, exc.code, str(exc), extra={"Connection": "close"})
        except ClientDisconnect:
            return responses.error_response(
                400, "bad_message", "the client went away before its body arrived"
            )
        try:
            record = await self._service.submit(client, msg)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=msg.id)
        if request.query_params.get("wait", "").lower() in ("1", "true", "yes"):
            return await self._wait_result(request, record)
        if "text/event-stream" in request.headers.get("accept", ""):
            return self._events(client, record, after_step=None)
        urls = self._urls(request, record.id)
        payload = status_payload(record, self._positions())
        payload["urls"] = urls
        return responses.json_response(202, payload, extra={"Location": urls["self"]})

    async def _read_body(self, request: Request) -> bytes:
        """The body, bounded (server/bodies.py); raises _BodyRefused, ServerBusyError."""
        return await read_body(request, self._service)

    def _parse(self, body: bytes) -> protocol.Generate:
        obj = protocol.decode_json(body)
        if not isinstance(obj, dict):
            raise protocol.MessageError(
                "bad_message", 'the body must be a JSON object: {"params": {...}, "preview": {...}}'
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
        # (it is a detached request: fetch it later from its output URL). It
        # reads the result as soon as there is one: not paced as unread.
        record.waiters += 1
        try:
            await record.wait_ended()
        finally:
            record.waiters -= 1
        return self._output_response(request, record)

    def _events(self, client: Client, record: RequestRecord, *, after_step: int | None) -> Response:
        rules = self._service.rules
        outbox = rules.open_outbox(client)
        record.watch(client.id, outbox, attached=after_step is not None, position=rules.position_of(record))
        # The call's client stays open while the stream is (asgi.py closes it after).
        return EventStream(  # type: ignore[return-value]
            outbox, send_timeout_s=self._service.limits.send_timeout_s, after_step=after_step
        )

    async def status(self, request: Request, client: Client) -> Response:
        """``GET /v1/generations/{id}``."""
        try:
            record = self._lookup(request, client)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        payload = status_payload(record, self._positions())
        payload["urls"] = self._urls(request, record.id)
        return responses.json_response(200, payload)

    async def events(self, request: Request, client: Client) -> Response:
        """``GET /v1/generations/{id}/events``: SSE, resumed after ``Last-Event-ID``."""
        try:
            record = self._lookup(request, client)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        after = parse_last_event_id(
            request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        )
        return self._events(client, record, after_step=after)

    async def output(self, request: Request, client: Client) -> Response:
        """``GET /v1/generations/{id}/output``: the result; 409 with the status until it is done."""
        try:
            record = self._lookup(request, client)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        return self._output_response(request, record)

    def _output_response(self, request: Request, record: RequestRecord) -> Response:
        raw_index = request.query_params.get("index")
        index = 0
        if raw_index is not None:
            if not raw_index.isdigit() or len(raw_index) > 4:
                return responses.error_response(
                    400,
                    "invalid_field",
                    f"index must be an image's number, 0 or more; got {protocol.clip(raw_index)!r}",
                    field="index",
                    id=record.id,
                )
            index = int(raw_index)
        count = record.result_count
        if count > 1 and raw_index is None:
            return self._results_listing(request, record)
        if count and index >= count:
            return responses.error_response(
                404,
                "not_found",
                f"request {record.id} has {count} image(s): index {index} is not one of them",
                field="index",
                id=record.id,
            )
        result = record.result(index)
        if result is None:
            payload = status_payload(record, self._positions())
            terminal = record.terminal_message()
            if isinstance(terminal, protocol.ErrorMessage):
                code = terminal.code
                body = {"error": code, "message": terminal.message, "id": record.id, "status": payload}
                return responses.json_response(500 if code == "internal" else 409, body)
            if isinstance(terminal, protocol.Cancelled):
                # Not "not ready": it never will be.
                reason = terminal.reason or "engine"
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
        header, image = result.header, result.image
        ext = {"jpeg": "jpg"}.get(header.format, header.format)
        name = record.id if count == 1 else f"{record.id}-{index}"
        return responses.BufferResponse(
            image,
            status_code=200,
            media_type=header.mime,
            headers={
                "Content-Disposition": f'inline; filename="{name}.{ext}"',
                "X-Omni-Stream-Width": str(header.width),
                "X-Omni-Stream-Height": str(header.height),
                "X-Omni-Stream-Images": str(count),
            },
            budget=self._service.memory,
        )

    def _results_listing(self, request: Request, record: RequestRecord) -> Response:
        """A request of several images: its results as a JSON array, each one's URL and size."""
        output = self._urls(request, record.id)["output"]
        items = []
        for index in range(record.result_count):
            found = record.result(index)
            assert found is not None  # index < result_count
            header, image = found.header, found.image
            items.append(
                {
                    "index": index,
                    "url": f"{output}?index={index}",
                    "format": header.format,
                    "mime": header.mime,
                    "width": header.width,
                    "height": header.height,
                    "bytes": len(image),
                }
            )
        return responses.json_response(200, {"id": record.id, "seed": record.seed, "images": items})

    async def preview(self, request: Request, client: Client) -> Response:
        """``GET /v1/generations/{id}/preview``: the newest preview image; 404 before the first."""
        try:
            record = self._lookup(request, client)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request.path_params["request_id"])
        latest = record.latest_preview()
        if latest is None:
            return responses.error_response(
                404, "not_found", f"request {record.id} has no preview yet", id=record.id
            )
        header, image = latest.header, latest.image
        return responses.BufferResponse(
            image,
            status_code=200,
            media_type=header.mime,
            headers={"X-Omni-Stream-Step": str(header.step)},
            budget=self._service.memory,
        )

    async def pause(self, request: Request, client: Client) -> Response:
        """``POST /v1/generations/{id}/pause`` (``?to_host=true``): 200 with the status once paused."""
        to_host = request.query_params.get("to_host", "").lower() in ("1", "true", "yes")
        return self._act(request, lambda rid: self._service.rules.pause(client, rid, to_host=to_host))

    async def resume(self, request: Request, client: Client) -> Response:
        """``POST /v1/generations/{id}/resume``: 200 with the status."""
        return self._act(request, lambda rid: self._service.rules.resume(client, rid))

    def _act(self, request: Request, act: Callable[[str], RequestRecord]) -> Response:
        """``act`` on the request the path names: 200 with its status, or the refusal."""
        request_id = request.path_params["request_id"]
        try:
            record = act(request_id)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request_id)
        return responses.json_response(200, status_payload(record, self._positions()))

    async def cancel(self, request: Request, client: Client) -> Response:
        """``DELETE /v1/generations/{id}``: cancel; 200 with the status once it ended."""
        request_id = request.path_params["request_id"]
        try:
            record = self._service.rules.cancel(client, request_id)
        except protocol.MessageError as exc:
            return self._error(exc, request_id=request_id)
        # A cancelled request ends within a step (plus a preview render).
        with anyio.move_on_after(self._service.limits.close_timeout_s):
            await record.wait_ended()
        return responses.json_response(200, status_payload(record, self._positions()))

    async def listing(self, request: Request, client: Client) -> Response:
        """``GET /v1/generations``: the queue, running first, then queued in order, then ended."""
        positions = self._positions()
        principal = client.principal
        records = list(self._service.registry)
        order = {
            "running": 0,
            "paused": 0,
            "loading": 1,
            "queued": 1,
            "done": 2,
            "failed": 2,
            "cancelled": 2,
            "expired": 2,
        }

        def key(record: RequestRecord) -> tuple[int, int, float]:
            status = _status_name(record, positions)
            return (order[status], positions.get(record.id, 0), record.created_at)

        # An id is the capability to a request: a caller sees the queue's
        # shape, and the ids of its own principal's requests only when it
        # proved who it is (a token), or of its browser session's (sessions.py).
        session = client.session

        def own(record: RequestRecord) -> bool:
            if session is not None and record.session == session:
                return True
            return principal.authenticated and record.principal == principal.key

        items = [status_payload(r, positions, with_id=own(r)) for r in sorted(records, key=key)]
        return responses.json_response(
            200,
            {
                "generations": items,
                "running": sum(1 for i in items if i["status"] == "running"),
                "queued": len(positions),
                "time": time.time(),
            },
        )
