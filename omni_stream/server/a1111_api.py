"""The AUTOMATIC1111 door: ``/sdapi/v1/...`` on the server's one core.

Thin, like every door (docs/design.md, "The server"): a call's body is read
within the server's bounds (bodies.py), translated by ``omni_stream.a1111``
into the ``generate`` the core admits (the same principals, limits, fair
share, admission, memory and metrics as every other door: each call is a
client of the core, ``asgi.py``'s ``call``), and the request's record is
read back into A1111's answer. Every refusal is A1111's error shape
(``omni_stream/a1111/errors.py``), the front door's (401, 421, 403) too.

- ``txt2img`` / ``img2img`` wait for the end, as A1111's do: one request
  for each image (``n_iter`` x ``batch_size``, each image's seed A1111's),
  one after the other, their results read through the call's outbox (a
  caller that hangs up cancels them); an img2img with a mask prepared
  first as A1111 prepares it (``a1111/inpaint_area.py``: the mask blurred,
  "Only masked", the fill), and its pictures given back the init image's
  pixels outside the mask (A1111's overlay);
- ``progress``, ``interrupt``, ``skip`` act on the caller's principal's
  latest call (``a1111/jobs.py``), or else on its latest request from any
  door: ``interrupt`` stops the request and the call's later images,
  ``skip`` the request and the rest of its iteration (the call goes on
  with its next); the stopped image is answered with its latest preview
  (``a1111/unfinished.py``), as A1111 answers its half-done image;
- ``options`` keeps the model each principal chose (``a1111/options.py``);
- the lists (``sd-models``, ``samplers``, ``schedulers``, ``loras``,
  ``scripts``) and ``png-info`` read the served models and the PNG's text.

An A1111 client's basic auth is read as the bearer token (``a1111/auth.py``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import protocol
from ..a1111 import answers, infotext, inpaint_area, names
from ..a1111.auth import bearer_of_basic
from ..a1111.errors import error_body, status_of
from ..a1111.generation import FIELDS, Generation, model_params, parse_generation
from ..a1111.jobs import Job, JobBook, idle_progress, progress_payload
from ..a1111.options import (
    PREVIEW_EVERY,
    PREVIEW_FORMAT,
    ModelChoices,
    checked_options,
    options_payload,
    resolve_model,
)
from ..a1111.unfinished import unfinished_png
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

logger = logging.getLogger("omni_stream.server")

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
        # Masked img2imgs prepared at once (a1111/inpaint_area.py: up to seconds each at the
        # largest sizes).
        self._inpainting = anyio.CapacityLimiter(1)

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
            batch_size=job.batch_size if job is not None else 1,
            index=job.index if job is not None else 0,
            skipped=job is not None and job.skipped,
            interrupted=job is not None and job.interrupted,
        )
        return responses.json_response(200, payload)

    def _elapsed(self, job: Job | None, record: RequestRecord | None) -> float:
        if job is not None:
            return time.monotonic() - job.started
        return self._service.rules.clock() - record.created_at if record is not None else 0.0

    async def interrupt(self, request: Request, client: Client) -> Response:
        """Stop the caller's principal's request, and its call's later images."""
        self._stop(client, skip=False)
        return responses.json_response(200, {})

    async def skip(self, request: Request, client: Client) -> Response:
        """Stop the caller's principal's request and the rest of its iteration; its call goes on
        with its next iteration."""
        self._stop(client, skip=True)
        return responses.json_response(200, None)

    def _stop(self, client: Client, *, skip: bool) -> None:
        job, record = self._current(client)
        stopping = [record] if record is not None else []
        if job is not None:
            job.skipped, job.interrupted = skip, job.interrupted or not skip
            stopping = list(job.records)  # the iteration's images run together: all of them
        for each in stopping:
            if not each.ended:
                self._service.rules.stop(each, "client")

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
            pending, size = self._images(gen, model)
            params = model_params(gen, model.params, model=name, image_size=size)
            if gen.seed != -1 and not any(p.name == "seed" for p in model.params):
                raise MessageError("unsupported", f"seed: model {name} takes no seed", field="seed")
            urls, area = await self._prepared(client, gen, name, model, params, pending)
        except REFUSALS as exc:
            return refusal(exc)
        plan = _Plan(name, model, {**params, **urls}, size)
        if area is not None:
            plan = dataclasses.replace(plan, overlay=area.overlay, extra=area.extra)
        return await self._run(request, client, gen, plan)

    def _images(
        self, gen: Generation, model: Any
    ) -> tuple[dict[str, inputs.PendingImage], tuple[int, int] | None]:
        """An img2img's images for the params the model has, each checked from its header by
        the core (``core/inputs.py``); and the init image's (width, height)."""
        declared = {p.name for p in model.params}
        pending: dict[str, inputs.PendingImage] = {}
        limits = self._service.limits
        for param, field, value in (
            ("image", "init_images", gen.init_image),
            ("mask_image", "mask", gen.mask),
        ):
            if value is None or param not in declared:
                continue  # model_params says what the model lacks
            pending[param] = inputs.check_encoded(
                param, _decoded(value, field), limits, request_id=None, field=field
            )
        init = pending.get("image")
        return pending, (init.header.width, init.header.height) if init is not None else None

    async def _prepared(
        self,
        client: Client,
        gen: Generation,
        name: str,
        model: Any,
        params: dict[str, Any],
        pending: dict[str, inputs.PendingImage],
    ) -> tuple[dict[str, str], inpaint_area.Inpainting | None]:
        """The checked images as ``data:`` URLs; an img2img with a mask first prepared as A1111
        prepares it (``a1111/inpaint_area.py``: the mask's alpha and blur, "Only masked", the
        fill), in a worker thread, with the overlay of its pictures (None without a mask).
        Raises MessageError as ``Rules.precheck`` does, or naming ``init_images`` or ``mask``
        for bytes that do not decode."""
        mask, init = pending.get("mask_image"), pending.get("image")
        if mask is None or init is None:
            return {param: inputs.data_url(image) for param, image in pending.items()}, None
        # The one decode before Service.prepare's, as the OpenAI door's mask: a request the
        # rules would refuse (busy, over the memory bound with its images at their sizes)
        # costs none, and one masked request is prepared at a time.
        msg = protocol.Generate.build(f"a1111-{uuid.uuid4().hex}", params, model=name)
        self._service.rules.precheck(client, msg, list(pending.values()))
        prepare = functools.partial(
            inpaint_area.inpainting,
            init.data,
            mask.data,
            size=_sides(model, params, (init.header.width, init.header.height)),
            blur_x=gen.mask_blur_x,
            blur_y=gen.mask_blur_y,
            full_res=gen.inpaint_full_res,
            padding=gen.inpaint_full_res_padding,
            fill_mode=gen.inpainting_fill,
        )
        area = await anyio.to_thread.run_sync(prepare, limiter=self._inpainting)
        if area.note is not None:
            logger.info("an A1111 img2img: %s", area.note)  # where A1111 says it: its log
        for param, sent, data in (("image", "init_images", area.image), ("mask_image", "mask", area.mask)):
            if data is not None:
                pending[param] = inputs.check_encoded(
                    param, data, self._service.limits, request_id=None, field=sent
                )
        return {param: inputs.data_url(image) for param, image in pending.items()}, area

    async def _run(self, request: Request, client: Client, gen: Generation, plan: _Plan) -> Response:
        key = client.principal.key
        job = Job(kind=gen.kind, n_iter=gen.n_iter, batch_size=gen.batch_size)
        # The results come through this call's outbox, as to a websocket: a request that is not
        # detached is forgotten, results and all, the moment it ends.
        outbox = self._service.rules.open_outbox(client)
        seeded = any(p.name == "seed" for p in plan.model.params)
        made: dict[int, _Result | _Unfinished] = {}  # by image: the answer keeps A1111's order
        first = gen.seed
        ended: Response | None = None

        async def submit(image: int) -> RequestRecord | None:
            # One request of one image, its seed A1111's for that image; None: the call ends.
            nonlocal first, ended
            seed = {"seed": gen.seed if image == 0 else gen.seed_of(image, first)} if seeded else {}
            try:
                msg = protocol.Generate.build(
                    f"a1111-{uuid.uuid4().hex}",
                    {**plan.params, **seed},
                    {"every": PREVIEW_EVERY, "format": PREVIEW_FORMAT},
                    output={"format": "png"},
                    model=plan.name,
                )
                record = await self._service.submit(client, msg)
            except ParamsError as exc:
                ended = refusal(exc)
                return None
            if image == 0 and record.seed is not None:
                first = record.seed
            job.records.append(record)
            if (job.interrupted or job.skipped) and not record.ended:
                # Said while it was being submitted: it is one they meant.
                self._service.rules.stop(record, "client")
            return record

        def finish(image: int, record: RequestRecord, latest: protocol.Preview | None) -> bool:
            # Its end, as its call answers it; False: the call ends with an error.
            nonlocal ended
            terminal = record.terminal_message()
            if isinstance(terminal, protocol.Done):
                return True
            stopped = isinstance(terminal, protocol.Cancelled) and terminal.reason == "client"
            if stopped and (job.skipped or job.interrupted):
                # A1111's sampler returns the latents it reached, and the call decodes them: here,
                # the latest preview the stream delivered (a1111/unfinished.py).
                shown = _newest(latest, record.latest_preview())
                if shown is not None:
                    used = record.seed if record.seed is not None else -1
                    header = shown.header
                    text = self._text_params(plan, used)
                    made[image] = _Unfinished(bytes(shown.image), used, header.width, header.height, text)
                return True
            ended = _ended_error(record, terminal)
            return False

        async def iteration(i: int) -> bool:
            # An iteration's images run together, each its own request (the engine batches
            # them), as many at once as the principal has places left; a skip ends the
            # iteration, an interrupt the call. False: the call ends.
            job.iteration, job.skipped, job.records = i, False, []
            room = self._service.limits.max_requests_per_principal - self._service.registry.running_of(key)
            waiting = list(range(i * gen.batch_size, (i + 1) * gen.batch_size))
            running: dict[str, tuple[int, RequestRecord]] = {}
            latest: dict[str, protocol.Preview] = {}
            ok = True
            while running or (waiting and ok and not (job.interrupted or job.skipped)):
                while ok and waiting and len(running) < max(1, room) and not (job.interrupted or job.skipped):
                    image = waiting.pop(0)
                    record = await submit(image)
                    if record is None:
                        ok = False
                        for _, other in running.values():  # the call ends: its others with it
                            if not other.ended:
                                self._service.rules.stop(other, "client")
                        break
                    running[record.id] = (image, record)
                if not running:
                    break
                message = (await outbox.get()).message
                rid = (
                    message.header.id
                    if isinstance(message, protocol.Preview)
                    else getattr(message, "id", None)
                )
                if rid not in running:
                    continue
                image, record = running[rid]
                if isinstance(message, protocol.Preview):
                    if message.final:
                        used = record.seed if record.seed is not None else -1
                        header = message.header
                        made[image] = _Result(bytes(message.image), used, header.width, header.height)
                    else:
                        latest[rid] = message
                    continue
                if message.kind not in _TERMINAL:
                    continue
                del running[rid]
                if image in made and isinstance(made[image], _Result):
                    continue  # its result came before any stop did
                if not finish(image, record, latest.get(rid)) and ok:
                    ok = False
                    for _, other in running.values():
                        if not other.ended:
                            self._service.rules.stop(other, "client")
            return ok

        async def iterations() -> None:
            for i in range(gen.n_iter):
                if job.interrupted or not await iteration(i):
                    return

        self._jobs.add(key, job)
        try:
            if not await responses.until_or_gone(request, iterations):
                return Response(status_code=499)  # nobody reads it; the call's end cancelled its request
        finally:
            self._jobs.remove(key, job)
        if ended is not None:
            return ended
        # An image stopped half-way has the size of the call's finished ones (else its params').
        size = next(
            ((m.width, m.height) for m in made.values() if isinstance(m, _Result)), None
        ) or _image_size(plan)
        in_order = [made[image] for image in sorted(made)]
        pictures = await anyio.to_thread.run_sync(_pictures, in_order, size, plan.overlay)
        images = [m for m in pictures if m is not None]
        declared = {p.name: p.default for p in plan.model.params}
        params = plan.params
        sampler, schedule = names.display(
            str(params.get("sampler", declared.get("sampler", samplers.DEFAULT)))
        )
        info = answers.info_text(
            gen,
            images,
            model=plan.name,
            sampler=sampler,
            schedule=schedule,
            seed=first,
            timestamp=job.timestamp,
            steps=params.get("steps", declared.get("steps")),
            cfg_scale=next(
                (params.get(g, declared.get(g)) for g in ("guidance_scale", "guidance") if g in declared),
                None,
            ),
            extra_params=plan.extra,
        )
        return responses.json_response(200, answers.generation_answer(gen, images, info))

    def _text_params(self, plan: _Plan, seed: int) -> dict[str, Any]:
        """What the PNG of an image stopped half-way says of how it was made: what its result's
        would have said (``Service._result_params``: the model's checked params, the served
        model, the weights' hashes), as far as the door can tell without its input images."""
        sent = {k: v for k, v in plan.params.items() if k not in inputs.IMAGE_PARAM_NAMES}
        if seed != -1:
            sent["seed"] = seed
        try:
            checked = plan.model.validate(sent)
        except (ParamsError, ValueError, TypeError, KeyError):
            # (An img2img model's validate wants its image: its declared defaults instead.)
            checked = {**{p.name: p.default for p in plan.model.params}, **sent}
        out = {"model": plan.name, **checked}
        hashes = getattr(plan.model, "weight_hashes", None)
        if callable(hashes):
            try:
                found = hashes(checked)
            except (ValueError, TypeError, KeyError):
                found = None
            if found:
                out["hashes"] = found
        return {k: v for k, v in out.items() if k not in inputs.IMAGE_PARAM_NAMES}

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


@dataclass(frozen=True, slots=True)
class _Plan:
    """What each request of a call runs: the model (its name), the params (without the seed),
    and the init image's (width, height), None without one; for an img2img with a mask, the
    overlay its pictures get and the ``extra_generation_params`` it adds
    (``a1111/inpaint_area.py``)."""

    name: str
    model: Any
    params: dict[str, Any]
    init_size: tuple[int, int] | None
    overlay: inpaint_area.Overlay | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Result:
    """A finished image: its result PNG, as the request made it."""

    png: bytes
    seed: int
    width: int
    height: int

    def made(self, size: tuple[int, int] | None) -> answers.Made:
        text = infotext.png_text(self.png).get("parameters", "")
        return answers.Made(self.png, self.seed, self.width, self.height, text)


@dataclass(frozen=True, slots=True)
class _Unfinished:
    """An image ``/interrupt`` or ``/skip`` stopped: its latest preview (``width`` x ``height``),
    and the params its PNG says."""

    preview: bytes
    seed: int
    width: int
    height: int
    params: dict[str, Any]

    def made(self, size: tuple[int, int] | None) -> answers.Made | None:
        """Its picture; None when its preview does not decode (then it has none, as a request
        stopped before its first preview)."""
        width, height = size or (self.width, self.height)
        try:
            png = unfinished_png(self.preview, (width, height), self.params)
        except (OSError, ValueError, ParamsError):
            logger.warning("an interrupted image's preview did not decode: it is left out", exc_info=True)
            return None
        return answers.Made(png, self.seed, width, height, infotext.png_text(png).get("parameters", ""))


def _pictures(
    made: list[_Result | _Unfinished], size: tuple[int, int] | None, overlay: inpaint_area.Overlay | None
) -> list[answers.Made | None]:
    """Each image's picture (``size``: a finished one's), under ``overlay`` when there is one (the
    init image's pixels outside the mask, A1111's ``apply_overlay``). For a worker thread."""
    out: list[answers.Made | None] = []
    for each in made:
        picture = each.made(size)
        if picture is not None and overlay is not None:
            picture = dataclasses.replace(picture, png=inpaint_area.overlaid(picture.png, overlay))
        out.append(picture)
    return out


def _newest(*previews: protocol.Preview | None) -> protocol.Preview | None:
    """The intermediate preview of the latest step among ``previews`` (a result is none)."""
    shown = [p for p in previews if p is not None and not p.final]
    return max(shown, key=lambda p: p.header.step, default=None)


def _image_size(plan: _Plan) -> tuple[int, int] | None:
    """The (width, height) the requests of ``plan`` make: their sides, else their model's
    defaults, else the init image's; None when nothing says it."""
    return _sides(plan.model, plan.params, plan.init_size)


def _sides(model: Any, params: dict[str, Any], init_size: tuple[int, int] | None) -> tuple[int, int] | None:
    """The (width, height) requests of ``model`` with ``params`` make: their sides, else the
    model's defaults, else ``init_size``."""
    declared = {p.name: p.default for p in model.params}

    def side(name: str) -> int | None:
        value = params.get(name, declared.get(name))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    width, height, size = side("width"), side("height"), side("size")
    if width is not None and height is not None:
        return width, height
    if size is not None:
        return size, size
    return init_size
