"""The OpenAI-compatible doors: ``/v1/images/generations``, ``/v1/images/edits``, ``/v1/models``.

Thin, like every door (docs/design.md, "The server"): a call's body is read
within the server's bounds (bodies.py), translated by ``omni_stream.openai``
into the ``generate`` the core admits (the same principals, limits,
admission, memory, metrics and retention as the websocket and
``/v1/generations``), and the request's record is read back into OpenAI's
answer:

- without ``stream``: the call waits for the request's end and answers
  ``ImagesResponse`` (every image base64, or its URL on our output route);
  a caller that hangs up cancels the request (``b64_json``: nobody could
  fetch it), unless it asked for URLs (then the request is detached and its
  results kept ``retention_s``);
- with ``stream``: ``text/event-stream`` of ``image_generation.partial_image``
  events (the request's previews at full size in the output format; for
  ``n`` > 1 the preview grid is cut into its images in a worker thread),
  then one ``image_generation.completed`` per image, or an ``error`` event;
  a caller that hangs up cancels the request.

An edit's files go into the core as every door's input images do
(``core/inputs.py``): each is read as far as its header (PNG, JPEG or
WebP) and refused over ``max_image_size`` before anything reads a pixel,
then carried as a ``data:`` URL of its own bytes into ``Service.prepare``,
which checks the request's memory with the images at their header's sizes
and decodes them in a worker thread, as for the websocket and
``/v1/generations``. The one decode of this door's own, an OpenAI mask's
alpha channel turned into diffusers' white-where-to-paint, runs after
those checks (issue #39: this door decoded any of Pillow's 43 formats in
full first, and a 0.47 MiB PNG declaring 13000x13000 cost +1.29 GB).

Every refusal is OpenAI's error shape (``omni_stream/openai/errors.py``),
the front door's (401 token, 421 host, 403 origin) too: :func:`openai_shaped`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import protocol
from ..core import inputs, retries
from ..core.outbox import OutboxItem
from ..core.records import RequestRecord, Terminal
from ..core.rules import Client
from ..errors import MessageError, ParamsError, ServerBusyError
from ..openai import images as oi
from ..openai.errors import OpenAIError, error_body, from_ours
from ..openai.models import model_object, models_list
from ..params import MAX_IMAGES
from . import responses
from .bodies import BodyRefused, read_body
from .events import EventStream
from .forms import read_form

if TYPE_CHECKING:
    from .asgi import FrontDoor
    from .service import Service

__all__ = [
    "REFUSALS",
    "OpenAIApi",
    "as_sent",
    "checked_uploads",
    "error_answer",
    "model_for",
    "openai_shaped",
    "read_form",
    "refusal",
]

logger = logging.getLogger("omni_stream.server")

#: A form's fields at most (OpenAI's and the model's own).
#: The messages that end a request.
_TERMINAL = frozenset({"done", "cancelled", "error"})
#: Our image params an edit's files become.
_FILE_PARAMS = {"image": "image", "mask": "mask_image"}


def error_answer(error: OpenAIError) -> Response:
    extra = {}
    if error.retry_after_s is not None:
        extra["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return responses.json_response(error.status, error.body(), extra=extra)


def _from_message_error(exc: MessageError) -> OpenAIError:
    retry = exc.retry_after_s if isinstance(exc, ServerBusyError) else None
    return from_ours(exc.code, exc.message, field=exc.field, retry_after_s=retry)


#: What a call of an OpenAI door may be refused with before its request runs.
REFUSALS = (OpenAIError, MessageError, BodyRefused, ClientDisconnect)


def refusal(exc: Exception) -> Response:
    """One of REFUSALS as OpenAI's error answer: the core's codes mapped, a refused body's
    status kept, a caller gone before its body arrived a 400."""
    if isinstance(exc, OpenAIError):
        return error_answer(exc)
    if isinstance(exc, MessageError):
        return error_answer(_from_message_error(exc))
    if isinstance(exc, BodyRefused):
        return error_answer(OpenAIError(exc.status, str(exc), exc.code))
    return error_answer(OpenAIError(400, "the client went away before its body arrived", "bad_message"))


def openai_shaped(response: Response) -> Response:
    """``response``, when it is our error answer (responses.ErrorResponse: the front door's
    refusals on an OpenAI route), rebuilt in OpenAI's shape from what it says, status and
    headers kept; any other answer as it is (a streamed or an OpenAI one: ours already)."""
    if not isinstance(response, responses.ErrorResponse):
        return response
    error = from_ours(response.code, response.message, field=response.fields.get("field"))
    shaped = responses.json_response(
        response.status_code,
        error_body(error.message, type=error.type, param=error.param, code=error.code),
    )
    for key, value in response.headers.items():
        if key.lower() not in ("content-length", "content-type"):
            shaped.headers[key] = value
    return shaped


class OpenAIApi:
    """The OpenAI-compatible handlers over one FrontDoor; each gets the call's Client."""

    def __init__(self, door: FrontDoor) -> None:
        self._door = door
        self._started = int(time.time())
        # One mask turned at a time, as Service.prepare decodes one image at a time: what
        # the decodes hold at once stays bounded (a 2048x2048 RGBA mask is ~40 MB in flight).
        self._masks = anyio.CapacityLimiter(1)

    @property
    def _service(self) -> Service:
        return self._door.service

    # -- routes ------------------------------------------------------------------------

    async def models(self, request: Request, client: Client) -> Response:
        """``GET /v1/models``: the served models, OpenAI's list shape."""
        return responses.json_response(200, models_list(self._service.rules.models, created=self._started))

    async def model(self, request: Request, client: Client) -> Response:
        """``GET /v1/models/{model}``: one served model (``models.retrieve``); 404 ``model_not_found``
        naming the served ones for another name (not counted: nothing was submitted)."""
        name = request.path_params["model"]
        if name not in self._service.rules.models:
            served = ", ".join(self._service.rules.models)
            return error_answer(
                OpenAIError(
                    404,
                    f"model {protocol.clip(name)!r} is not served here; the models are {served}",
                    "model_not_found",
                    param="model",
                )
            )
        return responses.json_response(200, model_object(name, created=self._started))

    async def image_generations(self, request: Request, client: Client) -> Response:
        """``POST /v1/images/generations`` (JSON)."""
        try:
            body = await read_body(request, self._service)
            obj = protocol.decode_json(body)
            if not isinstance(obj, dict):
                raise OpenAIError(400, "the body must be a JSON object", "bad_message")
            req = oi.parse_images_request(obj, max_images=MAX_IMAGES)
            name, model = self._model(req)
            msg = from_headers(
                request, client, req.to_generate(model, served_name=name, detach=_detached(req))
            )
            return await self._images(request, client, req, msg, model, kind="image_generation")
        except REFUSALS as exc:
            return refusal(exc)

    async def image_edits(self, request: Request, client: Client) -> Response:
        """``POST /v1/images/edits`` (a multipart form: ``image``, ``mask``, the fields)."""
        try:
            body = await read_body(request, self._service)
            fields, files = await read_form(
                request, body, files=_FILE_PARAMS, max_part_size=self._service.limits.max_message_bytes
            )
            req = oi.parse_images_request(fields, form=True, max_images=MAX_IMAGES)
            name, model = self._model(req, edit=True)
            if "image" not in files:
                raise OpenAIError(
                    400, "an edit needs its image: a file field 'image'", "invalid_field", param="image"
                )
            route = name if name.endswith(EDIT_SUFFIX) and req.model != name else None
            msg = req.to_generate(model, served_name=name, detach=_detached(req), route=route)
            msg = from_headers(request, client, msg)
            sent = {f: p for f, p in _FILE_PARAMS.items() if f in files}
            try:
                msg = await checked_uploads(
                    self._service, client, msg, files, sent, model=(name, model), limiter=self._masks
                )
                return await self._images(request, client, req, msg, model, kind="image_edit")
            except MessageError as exc:
                raise as_sent(exc, sent) from None
        except REFUSALS as exc:
            return refusal(exc)

    # -- one images request --------------------------------------------------------------

    def _model(self, req: oi.ImagesRequest, *, edit: bool = False) -> tuple[str, Any]:
        return model_for(self._service, req.model, edit=edit)

    async def _images(
        self,
        request: Request,
        client: Client,
        req: oi.ImagesRequest,
        msg: protocol.Generate,
        model: Any,
        *,
        kind: str,
    ) -> Response:
        record = await self._service.submit(client, msg)
        created = int(time.time())
        if req.stream:
            return self._stream(client, record, req, kind=kind, created=created, size=_image_size(req, model))
        if req.response_format == "url":
            # Detached: its results stay on the record (retention_s) for the URLs.
            if not await responses.until_or_gone(request, record.wait_ended):
                return Response(status_code=499)  # nobody reads it; the request goes on
            if record.outcome != "done":
                return error_answer(_ended_error(record, record.terminal_message()))
            base = str(request.base_url).rstrip("/") + str(request.scope.get("root_path", ""))
            output = f"{base}/v1/generations/{record.id}/output"
            urls: list[bytes | str] = [f"{output}?index={i}" for i in range(record.result_count)]
            return responses.json_response(200, oi.images_response(req, urls, created=created))
        # Attached: the results come through this call's outbox, as to a websocket
        # (the record lets go of them when the request ends).
        outbox = self._service.rules.open_outbox(client)
        record.watch(client.id, outbox, attached=False)
        images: list[bytes | str] = []

        async def collect() -> None:
            while True:
                message = (await outbox.get()).message
                if isinstance(message, protocol.Preview):
                    if message.final:
                        images.append(bytes(message.image))
                elif message.kind in _TERMINAL:
                    return

        if not await responses.until_or_gone(request, collect):
            # The caller hung up: its request ends with its call (the door's
            # disconnect), as a websocket's does; nobody reads this answer.
            return Response(status_code=499)
        if record.outcome != "done":
            return error_answer(_ended_error(record, record.terminal_message()))
        return responses.json_response(200, oi.images_response(req, images, created=created))

    def _stream(
        self,
        client: Client,
        record: RequestRecord,
        req: oi.ImagesRequest,
        *,
        kind: str,
        created: int,
        size: tuple[int, int] | None,
    ) -> Response:
        limits = self._service.limits
        outbox = self._service.rules.open_outbox(client)
        record.watch(client.id, outbox, attached=False)
        events = _ImageEvents(req, kind=kind, created=created, record=record, size=size)
        return EventStream(outbox, send_timeout_s=limits.send_timeout_s, encode=events)  # type: ignore[return-value]


def _detached(req: oi.ImagesRequest) -> bool:
    # URLs outlive the call: such a request is detached and its results kept.
    return req.response_format == "url" and not req.stream


async def checked_uploads(
    service: Service,
    client: Client,
    msg: protocol.Generate,
    files: Mapping[str, bytes],
    params: Mapping[str, str],
    *,
    model: tuple[str, Any],
    limiter: anyio.CapacityLimiter | None = None,
) -> protocol.Generate:
    """``msg`` with the uploaded ``files`` (form field -> bytes) as its image params (``params``:
    form field -> the param it becomes), each read by the core as far as its header first.

    A file is refused from its header (not a PNG, JPEG or WebP; a side over
    ``max_image_size``) before anything reads a pixel (core/inputs.py), and
    goes on as a ``data:`` URL of its own bytes, which ``Service.prepare``
    checks and decodes as it does every door's. An OpenAI ``mask`` with an
    alpha channel (transparent where to paint) is made diffusers' mask (white
    where to paint) here, in a worker thread (``limiter``'s), once the core's
    checks of the request (its memory with the images at their header's
    sizes, the load, the principal's count: ``Rules.precheck``) let it in.
    Raises OpenAIError (a file for a param ``model`` does not take),
    MessageError (``bad_params``, ``limit_exceeded``, what ``Rules.precheck``
    raises) naming the form field.
    """
    served_name, served = model
    declared = {p.name for p in served.params}
    pending: dict[str, inputs.PendingImage] = {}
    for field_name, data in files.items():
        param = params[field_name]
        if param not in declared:
            raise OpenAIError(
                400,
                f"model {served_name} takes no {field_name} (its pipeline has no {param} input); "
                "/v1/models and /models list the models",
                "unsupported",
                param=field_name,
            )
        pending[field_name] = inputs.check_encoded(
            param, data, service.limits, request_id=msg.id, field=field_name
        )
    masks = [f for f, image in pending.items() if f == "mask" and image.header.alpha]
    if masks:
        # The one decode before Service.prepare's: a request the rules would refuse
        # (busy, over the memory bound with its images at their sizes) costs no decode.
        service.rules.precheck(client, msg, list(pending.values()))
        for field_name in masks:
            image = pending[field_name]
            try:
                painted = await anyio.to_thread.run_sync(
                    oi.mask_to_paint, image.data, field_name, limiter=limiter
                )
            except ParamsError as exc:
                raise MessageError("bad_params", exc.message, field=field_name, request_id=msg.id) from None
            pending[field_name] = inputs.check_encoded(
                image.name, painted, service.limits, request_id=msg.id, field=field_name
            )
    urls = {image.name: inputs.data_url(image) for image in pending.values()}
    return dataclasses.replace(msg, params={**msg.params, **urls})


#: A served model named ``NAME`` + this takes OpenAI's edits for ``NAME`` (docs/openai.md):
#: one served name, a text-to-image pipeline for generations and an img2img or inpaint one for
#: edits, as OpenAI's own samples use ``gpt-image-1`` for both.
EDIT_SUFFIX = ".edit"


def model_for(service: Service, name: str | None, *, edit: bool = False) -> tuple[str, Any]:
    """The served model an OpenAI request names, and its name; for an ``edit``, ``NAME.edit``
    where one is served. An unknown one is OpenAI's 404 ``model_not_found``, counted as the
    refusal it is (the core's ``bad_params`` on ``model``, as every door counts it)."""
    rules = service.rules
    if edit:
        base = name if name is not None else next(iter(rules.models))
        if not base.endswith(EDIT_SUFFIX) and base + EDIT_SUFFIX in rules.models:
            return rules.model_for(base + EDIT_SUFFIX)
    try:
        return rules.model_for(name)
    except MessageError as exc:
        rules.refused(exc, name)
        raise OpenAIError(404, exc.message, "model_not_found", param="model") from None


def from_headers(request: Request, client: Client, msg: protocol.Generate) -> protocol.Generate:
    """``msg`` as its headers say: under the id its ``Idempotency-Key`` names for the caller
    (core/retries.py: sent again, it is the same job), with the deadline its ``Cancel-After``
    gives (``30s``, ``5m``: Replicate's). Raises MessageError naming a bad header."""
    key = request.headers.get(retries.IDEMPOTENCY_HEADER)
    if key is not None:
        msg = dataclasses.replace(msg, id=retries.id_for_key(client.principal.key, key))
    after = request.headers.get("cancel-after")
    if after is not None and msg.deadline_s is None:
        msg = dataclasses.replace(msg, deadline_s=protocol.parse_duration(after))
    return msg


def as_sent(exc: Exception, params: Mapping[str, str]) -> Exception:
    """``exc`` naming the form field a file was sent in where it names the param the file became
    (``params``: form field -> param; the core names ``mask_image``, the caller sent ``mask``)."""
    if not isinstance(exc, MessageError) or isinstance(exc, ServerBusyError):
        return exc
    sent = {param: field for field, param in params.items()}
    if exc.field not in sent:
        return exc
    return MessageError(exc.code, exc.message, field=sent[exc.field], request_id=exc.request_id)


def _ended_error(record: RequestRecord, terminal: Terminal | None) -> OpenAIError:
    if isinstance(terminal, protocol.ErrorMessage):
        return from_ours(terminal.code, terminal.message, field=terminal.field)
    reason = terminal.reason if isinstance(terminal, protocol.Cancelled) else "engine"
    if reason == "shutdown":
        return from_ours("shutting_down", f"request {record.id} was cancelled: the server is shutting down")
    return from_ours("cancelled", f"request {record.id} was cancelled ({reason}): it has no images")


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class _ImageEvents:
    """One stream's items as OpenAI's image events (the EventStream's ``encode``)."""

    def __init__(
        self,
        req: oi.ImagesRequest,
        *,
        kind: str,
        created: int,
        record: RequestRecord,
        size: tuple[int, int] | None,
    ) -> None:
        self._req = req
        self._size = size
        self._kind = kind
        self._created = created
        self._record = record
        self._partials = 0
        #: The steps whose progress said they reused the step cache (a partial image of one says so).
        self._cached_steps: set[int] = set()

    async def __call__(self, item: OutboxItem) -> bytes | None:
        message = item.message
        if isinstance(message, protocol.Progress):
            if message.cached:
                self._cached_steps.add(message.step)
            return None
        if isinstance(message, protocol.Preview):
            header = message.header
            if header.final:
                payload = oi.completed_event(
                    self._kind,
                    self._req,
                    bytes(message.image),
                    image_index=header.index,
                    created_at=self._created,
                )
                return _sse(payload["type"], payload)
            if self._partials >= self._req.partial_images:
                return None
            index, self._partials = self._partials, self._partials + 1
            parts = [bytes(message.image)]
            if message.cells or (self._size is not None and (header.width, header.height) != self._size):
                # A preview of the n images holds each in its cell (the previewer says where);
                # a preview at the latents' size (the linear decoders) is brought to the image's.
                parts = await anyio.to_thread.run_sync(_partials, message, self._req, self._size)
            return b"".join(
                _sse(
                    f"{self._kind}.partial_image",
                    oi.partial_event(
                        self._kind,
                        self._req,
                        part,
                        index=index,
                        image_index=i,
                        created_at=self._created,
                        cached=header.step in self._cached_steps,
                    ),
                )
                for i, part in enumerate(parts)
            )
        if isinstance(message, (protocol.ErrorMessage, protocol.Cancelled)):
            error = _ended_error(self._record, message)
            return _sse("error", {"type": "error", **error.body()})
        return None  # accepted, loading, done: nothing OpenAI streams


def _partials(preview: protocol.Preview, req: oi.ImagesRequest, size: tuple[int, int] | None) -> list[bytes]:
    """A preview as its partial images at ``size`` in the output format (worker thread): each
    image of several from its cell, each scaled to the image's size where it is not."""
    from PIL import Image

    with Image.open(io.BytesIO(preview.image)) as picture:
        picture.load()
        out = []
        for box in preview.cells or ((0, 0, picture.width, picture.height),):
            part = picture.crop(box).convert("RGB")
            if size is not None and part.size != size:
                part = part.resize(size, Image.Resampling.BILINEAR)
            buf = io.BytesIO()
            options: dict[str, Any] = {}
            if req.output_format in ("jpeg", "webp") and req.output_compression is not None:
                options["quality"] = req.output_compression
            part.save(buf, req.output_format.upper(), **options)
            out.append(buf.getvalue())
    return out


def _image_size(req: oi.ImagesRequest, model: Any) -> tuple[int, int] | None:
    """The (width, height) a request's images come out at, where its params say; else None."""
    if req.size is not None:
        return req.size
    declared = {p.name: p.default for p in model.params}
    width = req.extra.get("width", declared.get("width"))
    height = req.extra.get("height", declared.get("height"))
    if isinstance(width, int) and isinstance(height, int):
        return (width, height)
    return None
