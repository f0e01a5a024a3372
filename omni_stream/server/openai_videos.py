"""OpenAI's video jobs: ``POST/GET /v1/videos``, ``GET/DELETE /v1/videos/{id}``, ``.../content``.

A job is a detached request on the core (the same admission, principals,
limits and retention as ``/v1/generations``): ``POST`` admits it and answers
at once (``queued``); ``GET`` reads its record (status, progress from its
steps); ``content`` is its result (the MP4; ``variant=thumbnail`` its first
frame as a WebP, made in a worker thread); ``DELETE`` cancels it if it runs,
then forgets it and its result. Only its principal sees it (a token's
tenant, or the address that made it), in ``GET /v1/videos`` too.

The door keeps, per job, what OpenAI's object says that the record does
not (its prompt, seconds, size, the wall-clock time it was made): a few
hundred bytes, dropped with the record (retention, eviction, DELETE). With
``--state-dir`` they are written down with the request, in the same write
(``StateKeeper.written_with``), and a restart gives them back with the
requests it brings back (``take_restored``): a job done before a ``kill -9``
is served with its video, one that ran is resumed and followed, on this door
as on ``/v1/generations`` (issue #39: both answered 404 here after a restart).
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from .. import protocol
from ..core.records import RequestRecord
from ..core.rules import Client
from ..errors import MessageError
from ..openai import videos as ov
from ..openai.errors import OpenAIError, from_ours
from . import responses
from .bodies import read_body
from .openai_api import (
    REFUSALS,
    as_sent,
    checked_uploads,
    error_answer,
    from_headers,
    model_for,
    read_form,
    refusal,
)

if TYPE_CHECKING:
    from .asgi import FrontDoor
    from .service import Service

__all__ = ["OpenAIVideos"]

_FILES = {"input_reference": "image"}
#: The key a job's fields are written under with its request (the state directory).
_NOTE = "openai_video"


@dataclass(frozen=True, slots=True)
class _Job:
    """What the Video object says that the record does not."""

    principal: str
    model: str
    prompt: str
    seconds: str
    size: str
    created_at: int  # wall clock, seconds

    @classmethod
    def from_note(cls, note: Any) -> _Job | None:
        """The job a state directory wrote down (``asdict``); None for what is not one."""
        if not isinstance(note, Mapping):
            return None
        kinds = {"created_at": int}
        values: dict[str, Any] = {f.name: note.get(f.name) for f in fields(cls)}
        if not all(isinstance(v, kinds.get(k, str)) for k, v in values.items()):
            return None
        return cls(**values)


class OpenAIVideos:
    """The ``/v1/videos`` handlers over one FrontDoor."""

    def __init__(self, door: FrontDoor) -> None:
        self._door = door
        self._jobs: dict[str, _Job] = {}
        # The core's clock is monotonic; OpenAI's times are wall-clock seconds.
        self._wall_offset = time.time() - door.service.rules.clock()

    @property
    def _service(self) -> Service:
        return self._door.service

    # -- routes ------------------------------------------------------------------------

    async def create(self, request: Request, client: Client) -> Response:
        """``POST /v1/videos`` (a multipart form, as the SDK sends it, or JSON)."""
        try:
            body = await read_body(request, self._service)
            files: dict[str, bytes] = {}
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                fields, files = await read_form(
                    request, body, files=_FILES, max_part_size=self._service.limits.max_message_bytes
                )
                req = ov.parse_video_request(fields, form=True)
            else:
                obj = protocol.decode_json(body)
                if not isinstance(obj, dict):
                    raise OpenAIError(400, "the body must be a JSON object", "bad_message")
                req = ov.parse_video_request(obj)
            name, model = model_for(self._service, req.model)
            msg = from_headers(request, client, req.to_generate(model, served_name=name))
            try:
                # The reference image is checked by the core from its header, then
                # decoded by Service.submit, as every door's input image is.
                msg = await checked_uploads(self._service, client, msg, files, _FILES, model=(name, model))
                size = f"{req.size[0]}x{req.size[1]}" if req.size is not None else _size_of(msg.params, model)
                job = _Job(
                    principal=client.principal.key,
                    model=name,
                    prompt=req.prompt,
                    seconds=_seconds(msg.params, model),
                    size=size,
                    created_at=int(time.time()),
                )
                # The job is written down with the request, in one write (a restart keeps both or neither).
                record = await self._service.submit(client, msg, note=(_NOTE, asdict(job)))
            except MessageError as exc:
                raise as_sent(exc, _FILES) from None
        except REFUSALS as exc:
            return refusal(exc)
        self._prune()
        self._jobs[record.id] = job
        return responses.json_response(200, self._object(record))

    async def retrieve(self, request: Request, client: Client) -> Response:
        """``GET /v1/videos/{id}``."""
        found = self._find(request, client)
        if isinstance(found, Response):
            return found
        return responses.json_response(200, self._object(found))

    async def content(self, request: Request, client: Client) -> Response:
        """``GET /v1/videos/{id}/content``: the video (``variant=video``), or its first frame
        (``thumbnail``)."""
        found = self._find(request, client)
        if isinstance(found, Response):
            return found
        variant = request.query_params.get("variant", "video")
        if variant not in ("video", "thumbnail"):
            return error_answer(
                OpenAIError(
                    400,
                    f"variant {variant[:20]!r} is not served here: video or thumbnail",
                    "unsupported",
                    param="variant",
                )
            )
        result = found.result(0)
        if result is None:
            status = self._status(found)
            return error_answer(
                OpenAIError(
                    409, f"video {found.id} is {status}: its content exists once it is completed", "not_ready"
                )
            )
        header, data = result.header, result.image
        if variant == "video":
            return responses.BufferResponse(
                data,
                status_code=200,
                media_type=header.mime,
                headers={"Content-Disposition": f'inline; filename="{found.id}.{header.format}"'},
                budget=self._service.memory,
            )
        try:
            still = await anyio.to_thread.run_sync(_thumbnail, bytes(data), header.format)
        except ValueError as exc:
            return error_answer(OpenAIError(400, str(exc), "unsupported", param="variant"))
        return Response(still, media_type="image/webp")

    async def listing(self, request: Request, client: Client) -> Response:
        """``GET /v1/videos``: the caller's own jobs, paginated (``after``, ``limit``, ``order``)."""
        self._adopt()
        self._prune()
        registry = self._service.registry
        mine = []
        for job_id, job in self._jobs.items():
            record = registry.get(job_id)
            if record is not None and job.principal == client.principal.key:
                mine.append(self._object(record))
        try:
            limit_text = request.query_params.get("limit", "20")
            if not limit_text.isdigit():
                raise OpenAIError(
                    400, f"limit must be a number, got {limit_text[:20]!r}", "invalid_field", param="limit"
                )
            page = ov.list_page(
                mine,
                after=request.query_params.get("after"),
                limit=int(limit_text),
                order=request.query_params.get("order", "desc"),
            )
        except OpenAIError as exc:
            return error_answer(exc)
        return responses.json_response(200, page)

    async def delete(self, request: Request, client: Client) -> Response:
        """``DELETE /v1/videos/{id}``: cancel it if it runs, then forget it and its result."""
        found = self._find(request, client)
        if isinstance(found, Response):
            return found
        if not found.ended:
            self._service.rules.stop(found, "client")
            with anyio.move_on_after(self._service.limits.close_timeout_s):
                await found.wait_ended()
        self._service.registry.discard(found)
        self._jobs.pop(found.id, None)
        return responses.json_response(200, {"id": found.id, "object": "video.deleted", "deleted": True})

    # -- inside ------------------------------------------------------------------------

    def _find(self, request: Request, client: Client) -> RequestRecord | Response:
        """The job the path names, if the caller may see it; else OpenAI's 404."""
        self._adopt()
        video_id = request.path_params["video_id"]
        job = self._jobs.get(video_id)
        record: RequestRecord | None = self._service.registry.get(video_id) if job is not None else None
        if job is None or record is None or job.principal != client.principal.key:
            return error_answer(
                OpenAIError(
                    404,
                    f"no video {protocol.clip(video_id)!r} (unknown, expired, deleted or not yours)",
                    "not_found",
                    param="video_id",
                )
            )
        return record

    def _status(self, record: RequestRecord) -> str:
        if record.outcome == "done":
            return "completed"
        if record.outcome is not None:
            return "failed"
        if record.paused:
            # Ours, as /v1/generations says it: not queued, and not going on (issue #39).
            return "paused"
        started = record.latest_step > 0 and not record.loading
        return "in_progress" if started else "queued"

    def _object(self, record: RequestRecord) -> dict[str, Any]:
        job = self._jobs[record.id]
        status = self._status(record)
        error = None
        if status == "failed":
            terminal = record.terminal_message()
            if isinstance(terminal, protocol.ErrorMessage):
                error = {"code": terminal.code, "message": terminal.message}
            else:
                reason = terminal.reason if isinstance(terminal, protocol.Cancelled) else "engine"
                failure = from_ours("cancelled", f"cancelled ({reason})")
                error = {"code": failure.code, "message": failure.message}
        ended = None if record.ended_at is None else int(record.ended_at + self._wall_offset)
        retention = self._service.limits.retention_s
        return ov.video_object(
            video_id=record.id,
            status=status,
            progress=100 if status == "completed" else int(100 * record.latest_step / max(1, record.total)),
            created_at=job.created_at,
            completed_at=ended if status == "completed" else None,
            expires_at=None if ended is None else int(ended + retention),
            model=job.model,
            prompt=job.prompt,
            seconds=job.seconds,
            size=job.size,
            error=error,
            restarted=record.restart_view(),
        )

    def _adopt(self) -> None:
        """Take up the jobs a restart brought back from the state directory (once each)."""
        state = self._service.state
        if state is None:
            return
        for video_id, note in state.take_restored(_NOTE).items():
            job = _Job.from_note(note)
            if job is not None:
                self._jobs.setdefault(video_id, job)

    def _prune(self) -> None:
        """Drop the jobs whose records are gone (retention over, evicted)."""
        registry = self._service.registry
        for job_id in [j for j in self._jobs if registry.get(j) is None]:
            del self._jobs[job_id]


def _seconds(params: dict[str, Any], model: Any) -> str:
    """The clip's length at the model's frame rate, from its frame count ("" where it has none)."""
    frames = params.get("num_frames", {p.name: p.default for p in model.params}.get("num_frames"))
    if not isinstance(frames, int):
        return ""
    fps = getattr(model, "fps", None) or ov.DEFAULT_FPS
    return f"{max(frames - 1, 1) / fps:g}"


def _size_of(params: dict[str, Any], model: Any) -> str:
    declared = {p.name: p.default for p in model.params}
    width = params.get("width", declared.get("width"))
    height = params.get("height", declared.get("height"))
    return f"{width}x{height}" if isinstance(width, int) and isinstance(height, int) else ""


def _thumbnail(data: bytes, fmt: str) -> bytes:
    """A video's first frame as a WebP (worker thread). ValueError when it cannot be read."""
    from PIL import Image

    if fmt == "mp4":
        try:
            import av
        except ImportError as exc:
            raise ValueError("thumbnails of MP4 videos need PyAV (the video extra)") from exc
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0))
            image = frame.to_image()
    else:
        with Image.open(io.BytesIO(data)) as animation:
            animation.seek(0)
            image = animation.convert("RGB")
    out = io.BytesIO()
    image.save(out, "WEBP")
    return out.getvalue()
