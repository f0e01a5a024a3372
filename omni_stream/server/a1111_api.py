"""The AUTOMATIC1111 door: ``/sdapi/v1/...`` on the server's one core.

Thin, like every door (docs/design.md, "The server"): a call's body is read
within the server's bounds (bodies.py), translated by ``omni_stream.a1111``
into the ``generate`` the core admits (the same principals, limits, fair
share, admission, memory and metrics as every other door: each call is a
client of the core, ``asgi.py``'s ``call``), and the request's record is
read back into A1111's answer. Every refusal is A1111's error shape
(``omni_stream/a1111/errors.py``), the front door's (401, 421, 403) too.

- ``txt2img`` / ``img2img`` wait for the end, as A1111's do: ``n_iter``
  requests of ``batch_size`` images, one after the other, their results
  read through the call's outbox (a caller that hangs up cancels them);
- ``progress``, ``interrupt``, ``skip`` act on the caller's principal's
  latest call (``a1111/jobs.py``), or else on its latest request from any
  door: ``interrupt`` stops the request and the call's later iterations,
  ``skip`` the request only (the call goes on with its next iteration);
- ``options`` keeps the model each principal chose (``a1111/options.py``);
- the lists (``sd-models``, ``samplers``, ``schedulers``, ``loras``,
  ``scripts``) and ``png-info`` read the served models and the PNG's text.

An A1111 client's basic auth is read as the bearer token (``a1111/auth.py``).
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import protocol
from ..a1111 import answers, infotext, names
from ..a1111.auth import bearer_of_basic
from ..a1111.errors import error_body, status_of
from ..a1111.generation import FIELDS, Generation, model_params, parse_generation
from ..a1111.jobs import Job, JobBook, idle_progress, progress_payload
from ..a1111.options import PREVIEW_EVERY, ModelChoices, checked_options, options_payload, resolve_model
from ..core import inputs
from ..core.records import RequestRecord, Terminal
from ..core.rules import Client
from ..errors import BodyRefused, MessageError, ParamsError, ServerBusyError
from ..models.diffusers import samplers
from . import responses
from .bodies import read_body

if TYPE_CHECKING:
    from .front_door import FrontDoor
    from .service import Service

__all__ = ["A1111Api", "a1111_shaped", "refusal", "with_basic_as_bearer"]

#: What a call of the A1111 door may be refused with before its request runs.
REFUSALS = (ParamsError, BodyRefused, ClientDisconnect)
#: The messages that end a request.
_TERMINAL = frozenset({"done", "cancelled", "error"})

Handler = Callable[[Request, Client], Awaitable[Response]]


def _answer(
    status: int, code: str, message: str, *, field: str | None = None, retry: float | None = None
) -> Response:
    extra = {"Retry-After": str(max(1, round(retry)))} if retry is not None else None
    return responses.json_response(status, error_body(status, code, message, field=field), extra=extra)


def refusal(exc: Exception) -> Response:
    """One of REFUSALS in A1111's shape: the core's field (ours) named as the client sent it
    (``guidance_scale`` is its ``cfg_scale``), a refused body's status kept."""
    if isinstance(exc, BodyRefused):
        return _answer(exc.status, exc.code, str(exc))
    if isinstance(exc, ClientDisconnect):
        return _answer(422, "bad_message", "the client went away before its body arrived")
    assert isinstance(exc, ParamsError)
    code = exc.code if isinstance(exc, MessageError) else "bad_params"
    retry = exc.retry_after_s if isinstance(exc, ServerBusyError) else None
    message, field = exc.message, exc.field
    sent = FIELDS.get(field) if field is not None else None
    if sent is not None and sent != field:
        message, field = f"{sent} ({field} here): {message}", sent
    return _answer(status_of(code), code, message, field=field, retry=retry)


def a1111_shaped(response: Response) -> Response:
    """``response``, when it is our error answer (the front door's refusals on an A1111 route),
    rebuilt in A1111's shape, status and headers kept; any other answer as it is."""
    if not isinstance(response, responses.ErrorResponse):
        return response
    message = response.message
    if response.code == "unauthorized":
        message += ", or HTTP basic auth with the token as the password"
    field = response.fields.get("field")
    shaped = responses.json_response(
        response.status_code, error_body(response.status_code, response.code, message, field=field)
    )
    for key, value in response.headers.items():
        if key.lower() not in ("content-length", "content-type"):
            shaped.headers[key] = value
    return shaped


def with_basic_as_bearer(request: Request) -> None:
    """Read an A1111 client's basic auth as the bearer token (``a1111/auth.py``), before the
    front door reads the headers."""
    headers = request.scope["headers"]
    for i, (name, value) in enumerate(headers):
        if name == b"authorization":
            bearer = bearer_of_basic(value.decode("latin-1"))
            if bearer is not None:
                request.scope["headers"] = [*headers[:i], (name, bearer.encode("latin-1")), *headers[i + 1 :]]
                request.__dict__.pop("_headers", None)
            return


class A1111Api:
    """The A1111 handlers over one FrontDoor; each gets the call's Client."""

    def __init__(self, door: FrontDoor) -> None:
        self._door = door
        self._choices = ModelChoices()
        self._jobs = JobBook()

    @property
    def _service(self) -> Service:
        return self._door.service

    def routes(self) -> dict[str, dict[str, Handler]]:
        """Path -> method -> handler, for ``asgi.py`` to wrap and route."""
        table: dict[str, dict[str, Handler]] = {
            "txt2img": {"POST": self.txt2img},
            "img2img": {"POST": self.img2img},
            "progress": {"GET": self.progress},
            "interrupt": {"POST": self.interrupt},
            "skip": {"POST": self.skip},
            "options": {"GET": self.get_options, "POST": self.set_options},
            "sd-models": {"GET": self.sd_models},
            "samplers": {"GET": self.samplers},
            "schedulers": {"GET": self.schedulers},
            "loras": {"GET": self.loras},
            "scripts": {"GET": self.scripts},
            "png-info": {"POST": self.png_info},
        }
        return {f"/sdapi/v1/{path}": handlers for path, handlers in table.items()}

    # -- the model a caller's requests run on ---------------------------------------------

    def _model_names(self) -> list[str]:
        return list(self._service.rules.models)

    def _chosen(self, client: Client) -> str:
        """The model ``client``'s principal chose (``/options``), else the server's first."""
        return self._choices.get(client.principal.key) or self._model_names()[0]

    def _model(self, client: Client) -> Any:
        return self._service.rules.model_for(self._chosen(client))[1]

    # -- the lists and the options ---------------------------------------------------------

    async def sd_models(self, request: Request, client: Client) -> Response:
        return responses.json_response(200, answers.model_list(self._model_names()))

    async def samplers(self, request: Request, client: Client) -> Response:
        """The samplers of the caller's model, each with every spelling a request may use."""
        param = next((p for p in self._model(client).params if p.name == "sampler"), None)
        choices = param.choices if param is not None and param.choices else ()
        return responses.json_response(200, names.sampler_list(choices))

    async def schedulers(self, request: Request, client: Client) -> Response:
        return responses.json_response(200, names.scheduler_list())

    async def loras(self, request: Request, client: Client) -> Response:
        """The LoRAs of the caller's model (``serve --lora``)."""
        return responses.json_response(200, answers.lora_list(getattr(self._model(client), "lora_names", ())))

    async def scripts(self, request: Request, client: Client) -> Response:
        return responses.json_response(200, answers.scripts())

    async def get_options(self, request: Request, client: Client) -> Response:
        return responses.json_response(200, options_payload(self._chosen(client)))

    async def set_options(self, request: Request, client: Client) -> Response:
        """``sd_model_checkpoint``: the model of the caller's principal's later requests."""
        try:
            posted = await self._object(request)
            chosen = checked_options(posted, current=self._chosen(client), models=self._model_names())
        except REFUSALS as exc:
            return refusal(exc)
        if chosen is not None:
            self._choices.choose(client.principal.key, chosen)
        return responses.json_response(200, None)

    # -- progress, interrupt, skip ---------------------------------------------------------

    def _current(self, client: Client) -> tuple[Job | None, RequestRecord | None]:
        """The caller's principal's latest call and its request, else its latest request."""
        key = client.principal.key
        job = self._jobs.latest(key)
        if job is not None:
            return job, job.record
        running = [r for r in self._service.registry.running() if r.principal == key]
        return None, max(running, key=lambda r: r.created_at, default=None)

    async def progress(self, request: Request, client: Client) -> Response:
        job, record = self._current(client)
        if record is None and job is None:
            return responses.json_response(200, idle_progress())
        image = None
        preview = record.latest_preview() if record is not None else None
        if preview is not None and request.query_params.get("skip_current_image", "").lower() not in (
            "true",
            "1",
        ):
            image = base64.b64encode(bytes(preview.image)).decode("ascii")
        payload = progress_payload(
            kind=job.kind if job is not None else "generate",
            count=job.n_iter if job is not None else 1,
            number=job.iteration if job is not None else 0,
            step=record.latest_step if record is not None else 0,
            steps=record.total if record is not None else 0,
            elapsed_s=self._elapsed(job, record),
            eta_s=record.latest_eta_s if record is not None else None,
            timestamp=job.timestamp if job is not None else "0",
            image=image,
            skipped=job is not None and job.skipped,
            interrupted=job is not None and job.interrupted,
        )
        return responses.json_response(200, payload)

    def _elapsed(self, job: Job | None, record: RequestRecord | None) -> float:
        if job is not None:
            return time.monotonic() - job.started
        return self._service.rules.clock() - record.created_at if record is not None else 0.0

    async def interrupt(self, request: Request, client: Client) -> Response:
        """Stop the caller's principal's request, and its call's later iterations."""
        self._stop(client, skip=False)
        return responses.json_response(200, {})

    async def skip(self, request: Request, client: Client) -> Response:
        """Stop the caller's principal's request; its call goes on with its next iteration."""
        self._stop(client, skip=True)
        return responses.json_response(200, None)

    def _stop(self, client: Client, *, skip: bool) -> None:
        job, record = self._current(client)
        if job is not None:
            job.skipped, job.interrupted = skip, job.interrupted or not skip
        if record is not None and not record.ended:
            self._service.rules.stop(record, "client")

    # -- png-info -----------------------------------------------------------------------

    async def png_info(self, request: Request, client: Client) -> Response:
        """The PNG's infotext, parsed, and the ``txt2img`` body that makes it again (``request``)."""
        try:
            posted = await self._object(request)
            data = _decoded(posted.get("image"), "image")
        except REFUSALS as exc:
            return refusal(exc)
        chunks = await anyio.to_thread.run_sync(infotext.png_text, data)
        text = chunks.pop("parameters", "")
        fields = infotext.a1111_fields(text) if text else {}
        made = infotext.request_of(fields, chunks) if text else {}
        return responses.json_response(
            200, {"info": text, "items": chunks, "parameters": fields, "request": made}
        )

    # -- txt2img, img2img ---------------------------------------------------------------

    async def txt2img(self, request: Request, client: Client) -> Response:
        return await self._generation(request, client, "txt2img")

    async def img2img(self, request: Request, client: Client) -> Response:
        return await self._generation(request, client, "img2img")

    async def _generation(self, request: Request, client: Client, kind: str) -> Response:
        try:
            gen = parse_generation(await self._object(request), kind=kind)
            current = self._chosen(client)
            models = self._model_names()
            checked_options(gen.overrides, current=current, models=models, prefix="override_settings.")
            field = "override_settings.sd_model_checkpoint"
            name = resolve_model(gen.model, models, field=field) if gen.model else current
            model = self._service.rules.model_for(name)[1]
            images, size = self._images(gen, model)
            params = {**model_params(gen, model.params, model=name, image_size=size), **images}
            if gen.seed != -1 and not any(p.name == "seed" for p in model.params):
                raise MessageError("unsupported", f"seed: model {name} takes no seed", field="seed")
        except REFUSALS as exc:
            return refusal(exc)
        return await self._run(request, client, gen, name, model, params)

    def _images(self, gen: Generation, model: Any) -> tuple[dict[str, str], tuple[int, int] | None]:
        """An img2img's images as ``data:`` URLs for the params the model has, each checked from
        its header by the core (``core/inputs.py``); and the init image's (width, height)."""
        declared = {p.name for p in model.params}
        urls: dict[str, str] = {}
        size = None
        limits = self._service.limits
        for param, field, value in (
            ("image", "init_images", gen.init_image),
            ("mask_image", "mask", gen.mask),
        ):
            if value is None or param not in declared:
                continue  # model_params says what the model lacks
            image = inputs.check_encoded(param, _decoded(value, field), limits, request_id=None, field=field)
            urls[param] = inputs.data_url(image)
            if param == "image":
                size = (image.header.width, image.header.height)
        return urls, size

    async def _run(
        self, request: Request, client: Client, gen: Generation, name: str, model: Any, params: dict[str, Any]
    ) -> Response:
        key = client.principal.key
        job = Job(kind=gen.kind, n_iter=gen.n_iter)
        # The results come through this call's outbox, as to a websocket: a request that is not
        # detached is forgotten, results and all, the moment it ends.
        outbox = self._service.rules.open_outbox(client)
        seeded = any(p.name == "seed" for p in model.params)
        made: list[tuple[bytes, int, int, int]] = []  # png, seed, width, height
        first = gen.seed
        ended: Response | None = None

        async def iterations() -> None:
            # One request after another, as A1111 runs its batches: a call holds one of its
            # principal's places at a time, and a skip ends one iteration, not the call.
            nonlocal first, ended
            for i in range(gen.n_iter):
                if job.interrupted:
                    return
                job.iteration, job.skipped, job.record = i, False, None
                seed = {"seed": gen.seed if i == 0 else gen.seed_of(i, first)} if seeded else {}
                try:
                    msg = protocol.Generate.build(
                        f"a1111-{uuid.uuid4().hex}",
                        {**params, **seed},
                        {"every": PREVIEW_EVERY},
                        output={"format": "png"},
                        model=name,
                    )
                    record = await self._service.submit(client, msg)
                except ParamsError as exc:
                    ended = refusal(exc)
                    return
                if i == 0 and record.seed is not None:
                    first = record.seed
                job.record = record
                if (job.interrupted or job.skipped) and not record.ended:
                    # Said while it was being submitted: it is the one they meant.
                    self._service.rules.stop(record, "client")
                while (message := (await outbox.get()).message).kind not in _TERMINAL:
                    if isinstance(message, protocol.Preview) and message.final:
                        header = message.header
                        seed_used = record.seed if record.seed is not None else -1
                        made.append((bytes(message.image), seed_used, header.width, header.height))
                terminal = record.terminal_message()
                stopped = isinstance(terminal, protocol.Cancelled) and terminal.reason == "client"
                if isinstance(terminal, protocol.Done) or (stopped and (job.skipped or job.interrupted)):
                    continue
                ended = _ended_error(record, terminal)
                return

        self._jobs.add(key, job)
        try:
            if not await responses.until_or_gone(request, iterations):
                return Response(status_code=499)  # nobody reads it; the call's end cancelled its request
        finally:
            self._jobs.remove(key, job)
        if ended is not None:
            return ended
        texts = await anyio.to_thread.run_sync(
            lambda: [infotext.png_text(png).get("parameters", "") for png, *_ in made]
        )
        images = [
            answers.Made(png, seed, w, h, text) for (png, seed, w, h), text in zip(made, texts, strict=True)
        ]
        declared = {p.name: p.default for p in model.params}
        sampler, schedule = names.display(
            str(params.get("sampler", declared.get("sampler", samplers.DEFAULT)))
        )
        info = answers.info_text(
            gen,
            images,
            model=name,
            sampler=sampler,
            schedule=schedule,
            seed=first,
            timestamp=job.timestamp,
            steps=params.get("steps", declared.get("steps")),
            cfg_scale=next(
                (params.get(g, declared.get(g)) for g in ("guidance_scale", "guidance") if g in declared),
                None,
            ),
        )
        return responses.json_response(200, answers.generation_answer(gen, images, info))

    async def _object(self, request: Request) -> dict[str, Any]:
        obj = protocol.decode_json(await read_body(request, self._service))
        if not isinstance(obj, dict):
            raise MessageError("bad_json", f"the body must be a JSON object, got {type(obj).__name__}")
        return obj


def _decoded(value: Any, field: str) -> bytes:
    """A base64 image (bare, or a ``data:`` URL's) as bytes; MessageError naming ``field``."""
    if not isinstance(value, str) or not value:
        raise MessageError("bad_params", f"{field}: must be a base64 image", field=field)
    text = value.partition(",")[2] if value.startswith("data:") else value
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MessageError("bad_params", f"{field}: is not base64", field=field) from None


def _ended_error(record: RequestRecord, terminal: Terminal | None) -> Response:
    if isinstance(terminal, protocol.ErrorMessage):
        sent = FIELDS.get(terminal.field) if terminal.field is not None else None
        return _answer(
            status_of(terminal.code), terminal.code, terminal.message, field=sent or terminal.field
        )
    reason = terminal.reason if isinstance(terminal, protocol.Cancelled) else "engine"
    if reason == "shutdown":
        return _answer(
            503, "shutting_down", f"request {record.id} was cancelled: the server is shutting down"
        )
    return _answer(409, "cancelled", f"request {record.id} was cancelled ({reason}): it has no images")
