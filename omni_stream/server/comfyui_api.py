"""The ComfyUI API door: ``/prompt``, ``/history``, ``/view``, ``/queue``, ``/interrupt``, ...

Thin, like every door (docs/design.md, "The server"): a workflow posted to
``/prompt`` is read and mapped by ``omni_stream.comfyui`` (pure) onto one
``generate``, submitted as every door submits (``Service.submit``: the same
principals, admission, limits, memory bound, metrics and retention), and
detached: it runs whoever listens, as a ComfyUI prompt does, its results
kept ``retention_s``. The websocket side is comfyui_ws.py.

Each route answers its caller's prompts only (the caller's *owner* key:
its token's name, else its address; comfyui/book.py): ``/history``,
``/view``, ``/queue`` and ``/interrupt`` never show or touch another
principal's. Every refusal, the front door's too (401 token, 421 host,
403 origin, 413 body), is ComfyUI's error body (:func:`comfy_shaped`); a
refused workflow names the node and the input (comfyui/errors.py).

``POST /upload/image`` keeps an image for ``LoadImage`` in memory, per
principal, bounded (comfyui/uploads.py), checked from its header as every
door's input images are (core/inputs.py).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import __version__, protocol
from ..comfyui import (
    NODES,
    Choices,
    ModelCard,
    Plan,
    Prompt,
    PromptBook,
    UploadStore,
    WorkflowError,
    comfy_samplers,
    error_body,
    object_info,
    plan_workflow,
    read_workflow,
)
from ..core import inputs
from ..core.rules import Client
from ..errors import BodyRefused, MessageError, ServerBusyError
from ..ids import is_valid_id
from . import responses
from .bodies import read_body
from .comfyui_ws import MAX_CLIENT_ID, ComfySockets
from .http_api import STATUS

if TYPE_CHECKING:
    from .front_door import FrontDoor
    from .service import Service

__all__ = ["MAX_HISTORY", "ComfyUIApi", "comfy_shaped", "system_stats"]

#: The most prompts one ``GET /history`` lists (the newest).
MAX_HISTORY = 64
#: Our codes ComfyUI's clients read as a refused workflow (its 400).
_AS_INVALID = frozenset(
    {"bad_json", "bad_message", "invalid_field", "bad_params", "limit_exceeded", "duplicate_id"}
)


def comfy_shaped(response: Response) -> Response:
    """``response``, when it is our error answer (the front door's refusals on a ComfyUI route),
    rebuilt in ComfyUI's error shape, status and headers kept; any other answer as it is."""
    if not isinstance(response, responses.ErrorResponse):
        return response
    shaped = responses.json_response(response.status_code, error_body(response.message, type=response.code))
    for key, value in response.headers.items():
        if key.lower() not in ("content-length", "content-type"):
            shaped.headers[key] = value
    return shaped


def _answer(error: WorkflowError, plan: Plan | None = None) -> Response:
    extra = {}
    if error.retry_after_s is not None:
        extra["Retry-After"] = str(max(1, round(error.retry_after_s)))
    outputs = [] if plan is None else plan.output_ids
    return responses.json_response(error.status, error.body(outputs), extra=extra)


class ComfyUIApi:
    """The ComfyUI handlers over one FrontDoor; each gets the call's Client, whose principal
    key owns what it posts and uploads."""

    def __init__(self, door: FrontDoor) -> None:
        self._door = door
        service = door.service
        self.book = PromptBook(lambda p: service.registry.get(p.id) is p.record, budget=service.memory)
        self.uploads = UploadStore(budget=service.memory)
        self.sockets = ComfySockets()

    @property
    def _service(self) -> Service:
        return self._door.service

    def _cards(self) -> dict[str, ModelCard]:
        return {name: ModelCard.of(name, model) for name, model in self._service.rules.models.items()}

    # -- /prompt -------------------------------------------------------------------------

    async def post_prompt(self, request: Request, client: Client) -> Response:
        """``POST /prompt``: ``{"prompt", "client_id"?, "extra_data"?, "prompt_id"?}`` ->
        ``{"prompt_id", "number", "node_errors": {}}``, or ComfyUI's 400 naming the nodes."""
        service, owner = self._service, client.principal.key
        plan: Plan | None = None
        try:
            body = await read_body(request, service)
            obj = protocol.decode_json(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), dict):
                raise WorkflowError(
                    'the body must be {"prompt": {...the workflow in API format...}, "client_id": "..."}',
                    type="invalid_prompt",
                )
            client_id, extra = obj.get("client_id"), obj.get("extra_data", {})
            if client_id is not None and (not isinstance(client_id, str) or len(client_id) > MAX_CLIENT_ID):
                raise WorkflowError(
                    f"client_id must be a string of at most {MAX_CLIENT_ID} characters", type="invalid_prompt"
                )
            prompt_id = obj.get("prompt_id") or str(uuid.uuid4())
            if not is_valid_id(prompt_id):
                raise WorkflowError(f"prompt_id {str(prompt_id)[:64]!r} is not an id", type="invalid_prompt")
            plan = plan_workflow(read_workflow(obj["prompt"]), self._cards(), self.uploads.names(owner))
            msg = plan.to_generate(prompt_id, self._image(owner, plan, prompt_id))
            record = await service.submit(client, msg)
        except WorkflowError as exc:
            service.rules.refused(MessageError("bad_params", exc.message))
            return _answer(exc, plan)
        except MessageError as exc:
            return _answer(self._refusal(exc, plan), plan)
        except BodyRefused as exc:
            return responses.json_response(exc.status, error_body(str(exc), type=exc.code))
        except ClientDisconnect:
            return responses.json_response(400, error_body("the client went away", type="bad_message"))
        number = self.book.next_number()
        prompt = Prompt(
            prompt_id,
            number,
            owner,
            client_id,
            plan,
            record,
            obj["prompt"],
            extra if isinstance(extra, dict) else {},
            size=len(body),
            created_ms=int(time.time() * 1000),
        )
        self.book.add(prompt)
        for conn in self.sockets.of(owner, client_id):
            record.watch(conn.id, conn.outbox, attached=False)
        return responses.json_response(200, {"prompt_id": prompt_id, "number": number, "node_errors": {}})

    def _image(self, owner: str, plan: Plan, prompt_id: str) -> str | None:
        """The upload ``plan``'s LoadImage names, as the ``data:`` URL the core decodes; raises
        MessageError for one the core would refuse (its header is checked again: limits change)."""
        if plan.upload is None:
            return None
        upload = self.uploads.get(owner, plan.upload)
        assert upload is not None  # plan_workflow checked the name among the owner's
        pending = inputs.check_encoded("image", upload.data, self._service.limits, request_id=prompt_id)
        return inputs.data_url(pending)

    def _refusal(self, exc: MessageError, plan: Plan | None) -> WorkflowError:
        """The core's refusal as ComfyUI's: the node input the param came from, the status."""
        code = exc.code
        status = 400 if code in _AS_INVALID else STATUS.get(code, 400)
        fault = None if plan is None else plan.node_error(exc.field, exc.message)
        retry = exc.retry_after_s if isinstance(exc, ServerBusyError) else None
        return WorkflowError(
            exc.message, type=code, nodes=[fault] if fault else [], status=status, retry_after_s=retry
        )

    async def get_prompt(self, request: Request, client: Client) -> Response:
        """``GET /prompt``: ``{"exec_info": {"queue_remaining": N}}`` (the caller's prompts)."""
        remaining = self.book.remaining(client.principal.key)
        return responses.json_response(200, {"exec_info": {"queue_remaining": remaining}})

    # -- /history, /view -----------------------------------------------------------------

    async def history(self, request: Request, client: Client) -> Response:
        """``GET /history[?max_items=N]``: the caller's ended prompts, by id, the newest last; at
        most :data:`MAX_HISTORY` (each holds its workflow: the answer is encoded on the loop)."""
        ended = [p for p in self.book.of(client.principal.key) if p.record.ended]
        limit = request.query_params.get("max_items", "")
        count = min(int(limit), MAX_HISTORY) if limit.isdigit() else MAX_HISTORY
        return responses.json_response(200, {p.id: p.history() for p in ended[len(ended) - count :]})

    async def history_of(self, request: Request, client: Client) -> Response:
        """``GET /history/{prompt_id}``: ``{id: entry}`` once it ended; ``{}`` before, or for
        another's (as ComfyUI answers a prompt not in its history)."""
        prompt = self.book.get(request.path_params["prompt_id"], client.principal.key)
        if prompt is None or not prompt.record.ended:
            return responses.json_response(200, {})
        return responses.json_response(200, {prompt.id: prompt.history()})

    async def view(self, request: Request, client: Client) -> Response:
        """``GET /view?filename=&type=&subfolder=``: one of the caller's images (a result:
        ``output`` / ``temp``; an upload: ``input``)."""
        query = request.query_params
        filename, kind, subfolder = (
            query.get("filename", ""),
            query.get("type", "output"),
            query.get("subfolder", ""),
        )
        owner = client.principal.key
        if kind == "input":
            upload = self.uploads.get(owner, f"{subfolder}/{filename}" if subfolder else filename)
            if upload is not None:
                return responses.BufferResponse(
                    memoryview(upload.data),
                    status_code=200,
                    media_type=upload.mime,
                    budget=self._service.memory,
                )
        elif not subfolder and (found := self.book.find_file(owner, filename, kind)) is not None:
            prompt, index = found
            result = prompt.record.result(index)
            if result is not None:
                return responses.BufferResponse(
                    result.image,
                    status_code=200,
                    media_type=result.header.mime,
                    headers={"Content-Disposition": f'filename="{filename}"'},
                    budget=self._service.memory,
                )
        return responses.json_response(
            404,
            error_body(
                f"no {kind} image {protocol.clip(filename)!r} of yours here (unknown, forgotten after "
                "retention_s, or another's)",
                type="not_found",
            ),
        )

    # -- /queue, /interrupt ----------------------------------------------------------------

    async def get_queue(self, request: Request, client: Client) -> Response:
        """``GET /queue``: the caller's prompts, running (in the engine) and pending (waiting for
        a place in it: the core's gate)."""
        gate = self._service.rules.gate
        running: list[list[Any]] = []
        pending: list[list[Any]] = []
        for prompt in self.book.running(client.principal.key):
            (pending if prompt.id in gate else running).append(prompt.queue_item())
        return responses.json_response(200, {"queue_running": running, "queue_pending": pending})

    async def post_queue(self, request: Request, client: Client) -> Response:
        """``POST /queue``: ``{"delete": [ids]}`` or ``{"clear": true}`` cancels the caller's
        pending prompts (those named, or all)."""
        obj = await self._json(request)
        gate = self._service.rules.gate
        named = obj.get("delete") if isinstance(obj.get("delete"), list) else None
        for prompt in self.book.running(client.principal.key):
            if prompt.id in gate and (obj.get("clear") is True or (named and prompt.id in named)):
                self._service.rules.stop(prompt.record, "client")
        return Response(status_code=200)

    async def interrupt(self, request: Request, client: Client) -> Response:
        """``POST /interrupt`` (``{"prompt_id"}`` optional): cancels the caller's running prompts
        (that one only, when named); its socket hears ``execution_interrupted``."""
        obj = await self._json(request)
        named = obj.get("prompt_id")
        gate = self._service.rules.gate
        for prompt in self.book.running(client.principal.key):
            if prompt.id not in gate and named in (None, prompt.id):
                self._service.rules.stop(prompt.record, "client")
        return Response(status_code=200)

    async def _json(self, request: Request) -> dict[str, Any]:
        """A small JSON body, or {} for none (ComfyUI's clients post /interrupt without one)."""
        try:
            body = await read_body(request, self._service)
            obj = protocol.decode_json(body) if body.strip() else {}
        except (BodyRefused, MessageError, ClientDisconnect):
            return {}
        return obj if isinstance(obj, dict) else {}

    # -- /object_info, /system_stats, /embeddings ---------------------------------------------

    def _choices(self, owner: str) -> Choices:
        cards = self._cards().values()
        ours = {name for card in cards for name in card.samplers}
        loras = dict.fromkeys(name for card in cards for name in card.loras)
        return Choices(
            checkpoints=tuple(self._service.rules.models),
            samplers=comfy_samplers(ours),
            loras=tuple(loras),
            uploads=self.uploads.names(owner),
        )

    async def object_info(self, request: Request, client: Client) -> Response:
        """``GET /object_info``: exactly the nodes we run, in ComfyUI's shape."""
        return responses.json_response(200, object_info(self._choices(client.principal.key)))

    async def object_info_of(self, request: Request, client: Client) -> Response:
        """``GET /object_info/{node_class}``: that node's, ``{}`` for one we do not run."""
        name = request.path_params["node_class"]
        only = [name] if name in NODES else []
        return responses.json_response(200, object_info(self._choices(client.principal.key), only))

    async def system_stats(self, request: Request, client: Client) -> Response:
        """``GET /system_stats``: the system and the engine's devices, in ComfyUI's shape."""
        return responses.json_response(200, system_stats(self._service))

    async def embeddings(self, request: Request, client: Client) -> Response:
        """``GET /embeddings``: none (textual inversions are not loaded here)."""
        return responses.json_response(200, [])

    # -- /upload/image -----------------------------------------------------------------------

    async def upload_image(self, request: Request, client: Client) -> Response:
        """``POST /upload/image`` (multipart: ``image``, ``subfolder``, ``type``, ``overwrite``)
        -> ``{"name", "subfolder", "type": "input"}``."""
        service = self._service
        try:
            body = await read_body(request, service)
            fields, filename, data = await _read_upload(request, body, service.limits.max_message_bytes)
            if fields.get("type", "input") != "input":
                raise WorkflowError(
                    "uploads are LoadImage's inputs here: type must be input", type="invalid_field"
                )
            image = inputs.check_encoded("image", data, service.limits, request_id=None)
        except WorkflowError as exc:
            return _answer(exc)
        except MessageError as exc:  # not an image the core takes; a server out of memory
            return _answer(self._refusal(exc, None))
        except BodyRefused as exc:
            return responses.json_response(exc.status, error_body(str(exc), type=exc.code))
        except ClientDisconnect:
            return responses.json_response(400, error_body("the client went away", type="bad_message"))
        upload = self.uploads.put(
            client.principal.key,
            filename,
            data,
            mime=f"image/{image.header.kind.lower()}",
            subfolder=fields.get("subfolder", ""),
            overwrite=fields.get("overwrite", "").lower() in ("true", "1"),
        )
        return responses.json_response(
            200, {"name": upload.name, "subfolder": upload.subfolder, "type": "input"}
        )


async def _read_upload(
    request: Request, body: bytes, max_part_size: int
) -> tuple[dict[str, str], str, bytes]:
    """An upload form's text fields, its ``image`` file's name and bytes; raises WorkflowError."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise WorkflowError(
            f"the body must be multipart/form-data, got {content_type[:60]!r}", type="invalid_field"
        )

    async def replay() -> Any:
        yield body

    parser = MultiPartParser(
        Headers(headers={"content-type": content_type}),
        replay(),
        max_files=1,
        max_fields=8,
        max_part_size=max_part_size,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise WorkflowError(f"the form does not parse: {exc.message}", type="invalid_field") from None
    try:
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        image = form.get("image")
        if image is None or isinstance(image, str):
            raise WorkflowError("the form needs a file field 'image'", type="invalid_field")
        return fields, image.filename or "image.png", await image.read()
    finally:
        await form.close()


def system_stats(service: Service) -> dict[str, Any]:
    """``/system_stats``: ComfyUI's ``{"system", "devices"}`` for this process and its engine."""
    import torch

    ram_total, ram_free = _ram()
    devices = []
    for index, name in enumerate(str(service.engine.health().device).split(",")):
        name = name.strip()
        total, free = ram_total, ram_free
        if name.startswith("cuda") and torch.cuda.is_available():
            device = torch.device(name)
            free, total = torch.cuda.mem_get_info(device)
        devices.append(
            {
                "name": name,
                "type": name.split(":")[0],
                "index": index,
                "vram_total": total,
                "vram_free": free,
                "torch_vram_total": total,
                "torch_vram_free": free,
            }
        )
    return {
        "system": {
            "os": os.name,
            "ram_total": ram_total,
            "ram_free": ram_free,
            "comfyui_version": f"omni_stream {__version__}",
            "python_version": sys.version,
            "pytorch_version": torch.__version__,
            "embedded_python": False,
            "argv": [],
        },
        "devices": devices,
    }


def _ram() -> tuple[int, int]:
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 0, 0
