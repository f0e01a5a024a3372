"""The rules every door shares, keyed on principals: one sans-I/O state machine.

:class:`Rules` is what docs/protocol.md and docs/http.md say the server
does with a client's messages: admission (load, params, memory),
ownership, attach, cancel, retention, and every per-client bound (requests
held, connections open, messages a second, the fair share of a crowded
server), counted per :class:`~omni_stream.core.principal.Principal`. Every
door calls it the same way: the websocket (one :class:`Client` per
connection), the HTTP API (one per call, so an open POST or event stream
counts as a connection) and its event streams. Nothing here waits, reads a
socket or needs an event loop: a door turns bytes into calls, the replies
go into the client's :class:`~omni_stream.core.outbox.Outbox`, as typed
messages (protocol's classes: only the websocket encodes them), and what
the core asks of the world goes through the interfaces it was given:

- ``engine.stream(...)`` (submitting a request; synchronous) and
  ``engine.cancel(id)``, ``engine.health()``;
- its :class:`~omni_stream.core.effects.Shell` (:meth:`Rules.bind`: the
  server's service runs consumers, sends webhooks, hears of idleness) and
  its :class:`~omni_stream.core.effects.Journal` (:meth:`Rules.keep_journal`:
  the state directory, with one).

So the rules are tested with no socket and no loop (tests/core/test_rules.py).

:class:`Rules` is the one class the doors use; its parts, a module each,
are the bases it is made of: the clients coming and going (clients.py,
with :class:`Client` and :class:`Refusal`), their messages read and acted
on (dispatch.py), requests paused by the gate or their client
(preemption.py) and the load read (load_report.py). Here are admission,
the gate's letting in, cancel, attach and lookup, and the end of a
request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from .. import protocol
from ..engine.like import RendersFrames, missing_stream_members, server_stream_keywords
from ..errors import CheckpointError, EngineError, OmniStreamError, ParamsError
from ..model import StepModel
from ..preview import PreviewSpec, RenderRequest
from . import admission, inputs
from .clients import Client, Clients, Refusal, who
from .deadlines import Deadlines
from .dispatch import Dispatch
from .effects import Journal, Shell
from .gate import Gate
from .limits import ServerLimits
from .load_report import LoadReport
from .memory import MemoryBudget, MemoryReservation
from .metrics import ServerMetrics
from .preemption import Preempted, Preemption
from .rates import RateBook
from .records import RequestRecord, Terminal
from .registry import RequestRegistry
from .repeats import Kept, RepeatBook, repeat_key, repeat_scope
from .retries import retry_of
from .tokens import Tokens
from .webhooks import WebhookBook, WebhookConfig, WebhookState, check_webhook

if TYPE_CHECKING:
    from ..engine.like import EngineLike, FrameStreamLike

__all__ = ["NOT_STARTED", "Admitted", "Client", "Refusal", "Rules"]

logger = logging.getLogger("omni_stream.server")

#: Why a server that was never started serves nothing (what ``/health`` and a generate say).
NOT_STARTED: Final = (
    "the server is not started: a mounted app needs its lifespan run by the host app "
    "(Starlette(lifespan=omni.lifespan), FastAPI(lifespan=omni.lifespan), or "
    "`async with omni.lifespan(app)` in the host's own; docs/http.md, Mounting)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    """What an admitted request needs to go into the engine, now or when the gate lets it in."""

    record: RequestRecord
    params: Any
    spec: PreviewSpec
    output: admission.OutputSpec
    #: The served model that runs it (one of Rules.models).
    model: str
    memory: MemoryReservation
    #: The priority it carries against other principals' requests (its own,
    #: capped by its principal's grant: Principal.cross_priority).
    cross_priority: int
    #: Its params as the model checked them (what ``can_snapshot`` is asked about).
    checked: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _seed_of(checked: Mapping[str, Any]) -> int | None:
    """The seed a request runs with, where its model has an int one."""
    seed = checked.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


class Rules(Clients, Dispatch, Preemption, Deadlines, LoadReport):
    """The server's rules for every door (see the module docstring).

    ``engine``: what serves the requests (its ``stream`` given only the
    keywords it takes). ``tokens``: the configured tokens (none: an open
    server). ``clock``: seconds, for rates and retention (tests pass their
    own). Raises TypeError naming what ``engine`` lacks.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        limits: ServerLimits,
        tokens: Tokens | None = None,
        clock: Callable[[], float] = time.monotonic,
        webhooks: WebhookConfig | None = None,
    ) -> None:
        #: The keywords besides request_id that engine.stream takes, read once here.
        self.stream_keywords = server_stream_keywords(engine)
        self.engine = engine
        #: The models served, by name, the default first: a router's (engine/router.py),
        #: else the engine's one model under its own name.
        served = getattr(engine, "models", None)
        self.models: dict[str, StepModel] = (
            dict(served) if isinstance(served, Mapping) and served else {engine.model.name: engine.model}
        )
        #: The default model (a request that names none runs on it).
        self.model: StepModel = next(iter(self.models.values()))
        self.limits = limits
        self.tokens = tokens if tokens is not None else Tokens()
        self.clock = clock
        # Each model's default preview decoder and settings, worked out once.
        self._decoders = {name: admission.default_decoder(m) for name, m in self.models.items()}
        self._previews = {
            name: admission.cap_preview(PreviewSpec(decoder=decoder), limits)
            for name, decoder in self._decoders.items()
        }
        self.default_decoder = next(iter(self._decoders.values()))
        self.default_preview = next(iter(self._previews.values()))
        # Bytes held for clients, queued and retained, reserved by running
        # requests and held by the models' caches: max_memory_bytes (memory.py).
        self.memory = MemoryBudget(limits.max_memory_bytes)
        for model in self.models.values():
            self.memory.watch_model(model)
        #: Finished results an exact repeat gets instead of a run (repeats.py).
        self.repeats = RepeatBook(limits.repeat_cache_bytes)
        self.registry = RequestRegistry(
            retention_s=limits.retention_s,
            max_retained=limits.max_retained,
            budget=self.memory,
            clock=clock,
        )
        self.metrics = ServerMetrics(
            engine, running=lambda: len(self.registry.running()), models=tuple(self.models)
        )
        self.metrics.watch_memory(self.memory)
        self.metrics.watch_models(self.models)
        #: Engines computing on this host's CPU (max_active's default depends on it).
        self.host_engines = admission.host_engines(engine)
        #: At most max_active requests in the engine; the other admitted ones wait here.
        self.gate = Gate(
            lambda: self.limits.active_bound(self.engine.max_batch_size, host_engines=self.host_engines)
        )
        #: Requests their clients paused, by id: in the engine, holding no place in the gate's
        #: count (they come back through the gate when resumed), each for max_pause_s at most.
        self.paused: dict[str, RequestRecord] = {}
        #: Requests with a deadline_s that have not ended (deadlines.py).
        self.deadlines: dict[str, RequestRecord] = {}
        #: Called when a client's pause starts: the shell's timer looks at :meth:`expire_pauses` again.
        #: Open clients (websockets, HTTP calls, event streams), by id.
        self.clients: dict[str, Client] = {}
        #: Open clients per principal key.
        self.open_by_principal: Counter[str] = Counter()
        self.rates = RateBook(limits.max_messages_per_s)
        #: Its effects (effects.py): the shell's (bind), the state directory's (keep_journal).
        self.shell: Shell | None = None
        self.journal: Journal | None = None
        #: Webhooks (core/webhooks.py): the settings (None: every webhook is refused) and the
        #: requests holding one; the shell sends the deliveries.
        self.webhooks = webhooks
        self.webhook_book = WebhookBook(webhooks.max_held if webhooks is not None else 0)
        #: Set by the shell: started (consumers can run), closing (refuse new
        #: work), letting_in (queued requests may still start: the graceful
        #: part of a shutdown), fatal (why the server cannot go on).
        self.started = False
        self.closing = False
        self.letting_in = True
        self.fatal: OmniStreamError | None = None

    def bind(self, shell: Shell) -> None:
        """Act through ``shell`` from now on (the server's service, once, as it is built)."""
        self.shell = shell

    def keep_journal(self, journal: Journal) -> None:
        """Write down what a restart needs through ``journal`` (the state directory, with one)."""
        self.journal = journal

    # -- generate ----------------------------------------------------------------

    def retried(self, client: Client, msg: protocol.Generate, fingerprint: str) -> RequestRecord | None:
        """The request ``msg`` submits again, if it is a retry (core/retries.py), ``client``'s outbox
        then watching it; None otherwise (a new request, or a ``duplicate_id`` for :meth:`generate`)."""
        record = retry_of(self.registry, client.principal.key, msg, fingerprint)
        if record is not None and client.outbox is not None:
            record.watch(client.id, client.outbox, attached=True, position=self.position_of(record))
        return record

    def generate(self, client: Client, msg: protocol.Generate) -> RequestRecord:
        """Admit ``msg`` for ``client`` (its outbox, if any, watches it); it goes into the engine
        now, or waits in the gate.

        Raises MessageError (ServerBusyError for ``busy``) with the code to
        answer; every refusal is counted by its code.
        """
        try:
            admitted = self._admit(client, msg)
            kept = self.repeats.find(admitted.record.repeat_key)  # an exact repeat: no step runs
            stream = self._open_stream(admitted) if kept is None and self.gate.has_room() else None
        except protocol.MessageError as exc:
            self.refused(exc, msg.model)
            raise
        record = admitted.record
        self.registry.add(record)
        self.keep_deadline(record, msg.deadline_s)
        if self.journal is not None:
            self.journal.admitted(admitted, msg)
        if record.webhook is not None:
            record.webhook.hold()  # until its terminal delivery settles
        client.owns_attached = client.owns_attached or not record.detach
        if client.outbox is not None:
            record.watch(client.id, client.outbox, attached=False)
        if kept is not None:
            self._repeat(admitted, kept)
        elif stream is None:
            # The engine holds max_active requests already: this one waits,
            # unstarted, in the gate (gate.py), and goes in when one leaves.
            self.gate.wait(
                record.id,
                record.principal,
                msg.priority,
                admitted,
                cost=record.total,
                cross=admitted.cross_priority,
            )
            # Under the preemptive policy a long request in the engine may
            # give its place to this shorter one (it waits here, paused).
            self._preempt_for(record)
            self.let_in()  # in case the bound grew (a remote engine's replicas came up)
            if record.id in self.gate:  # its stream opens with where it stands
                record.publish_queued(self.queue_positions()[record.id])
        else:
            self._start(admitted, stream)
        return record

    @property
    def preview_defaults(self) -> Mapping[str, PreviewSpec]:
        """Each model's default preview settings, by model name."""
        return self._previews

    def model_for(self, name: str | None, *, request_id: str | None = None) -> tuple[str, StepModel]:
        """The served model a request naming ``name`` runs on (None: the first), and its name.

        Raises MessageError ``bad_params`` (field ``model``) naming the models.
        """
        if name is None:
            return next(iter(self.models.items()))
        model = self.models.get(name)
        if model is None:
            raise protocol.MessageError(
                "bad_params",
                f"model {protocol.clip(name)!r} is not served here; the models are {', '.join(self.models)}",
                field="model",
                request_id=request_id,
            )
        return name, model

    def precheck(
        self, client: Client, msg: protocol.ClientMessage, images: Sequence[inputs.PendingImage] = ()
    ) -> None:
        """The admission rules that cost nothing to check: the server's state, the engine's
        health, the id, the principal's count, the load, and the memory the request would
        hold with ``images`` at the sizes their headers say.

        A door calls it before work it would do for a ``generate`` (decoding
        its images): refusing an overloaded server's work must cost less than
        the work. Raises MessageError as :meth:`generate` would.
        """
        if not isinstance(msg, protocol.Generate):
            return
        request_id = msg.id or uuid.uuid4().hex
        load = self._admit_cheap(client, msg, request_id)
        _, model = self.model_for(msg.model, request_id=request_id)
        if images and isinstance(msg.params, Mapping):
            sized = {image.name: inputs.Sized((image.header.width, image.header.height)) for image in images}
            admission.check_memory(
                self.memory,
                model,
                {**msg.params, **sized},
                engine=self.engine,
                request_id=request_id,
                retry_after_s=lambda: self.retry_after(load),
            )

    def _admit_cheap(self, client: Client, msg: protocol.Generate, request_id: str) -> admission.Load:
        """:meth:`precheck`'s rules; the load they measured."""
        principal = client.principal
        if not self.started or self.shell is None:
            raise protocol.MessageError("engine_unavailable", NOT_STARTED, request_id=request_id)
        if self.closing:
            raise protocol.MessageError("shutting_down", "the server is shutting down", request_id=request_id)
        if self.fatal is not None:
            # Kept up by stay_dead after a fatal error: it serves no new work.
            raise protocol.MessageError(
                "engine_unavailable", f"the server failed: {self.fatal}", request_id=request_id
            )
        health = self.engine.health()
        if not health.ok:
            raise protocol.MessageError(
                "engine_unavailable", f"the engine is {health.status}: {health.reason}", request_id=request_id
            )
        self.registry.check_new(request_id, detach=msg.detach)
        limit = self.limits.max_requests_per_principal
        own = self.registry.running_of(principal.key)
        if own >= limit:
            raise protocol.MessageError(
                "too_many_requests",
                f"{who(principal)} already runs {limit} requests "
                "(max_requests_per_principal, OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL)",
                request_id=request_id,
            )
        # Before the params are read: refusing an overloaded server's work
        # must cost less than the work (a data: URL image is up to 1 MiB).
        load = self.load(health)
        admission.check_load(
            load,
            own=own,
            principals=self.principals(),
            retry_after_s=lambda: self.retry_after(load),
            request_id=request_id,
        )
        self._check_webhook(msg, request_id, principal.key)
        return load

    def _check_webhook(self, msg: protocol.Generate, request_id: str, principal: str) -> None:
        # Refused unless this server may call it and has room (core/webhooks.py).
        if msg.webhook is not None:
            check_webhook(
                self.webhooks if self.shell is not None else None,
                self.webhook_book,
                msg.webhook,
                request_id=request_id,
                principal=principal,
            )

    def _admit(self, client: Client, msg: protocol.Generate) -> Admitted:
        """Apply every admission rule to ``msg`` (load, params, memory); raises MessageError."""
        request_id = msg.id or uuid.uuid4().hex
        principal = client.principal
        load = self._admit_cheap(client, msg, request_id)
        name, model = self.model_for(msg.model, request_id=request_id)
        spec = admission.preview_spec(
            msg.preview,
            default=self._previews[name],
            decoder=self._decoders[name],
            limits=self.limits,
            request_id=request_id,
            model=model,
        )
        output = admission.output_spec(
            msg.output, video=bool(getattr(model, "produces_video", False)), request_id=request_id
        )
        total, params = admission.check_params(model, msg.params, self.limits, request_id=request_id)
        checked = params.checked
        memory = admission.reserve_memory(
            self.memory,
            model,
            checked,
            engine=self.engine,
            request_id=request_id,
            retry_after_s=lambda: self.retry_after(load),
        )
        cross = principal.cross_priority(msg.priority)
        record = RequestRecord(
            request_id,
            owner=client.id,
            principal=principal.key,
            detach=msg.detach,
            total=total,
            preview=admission.preview_wire(spec),
            output=output.wire(),
            created_at=self.clock(),
            priority=msg.priority,
            cross_priority=cross,
            seed=_seed_of(checked),
            model=name if len(self.models) > 1 else None,
        )
        record.session = client.session
        record.repeat_scope = scope = repeat_scope(principal.key, client.repeat_session)
        record.repeat_key = repeat_key(scope, name, model, checked, output.wire())
        if msg.webhook is not None and self.webhooks is not None and self.shell is not None:
            # (_admit_cheap admitted it.) Told of its progress and its end by the record.
            record.webhook = WebhookState(
                request_id,
                msg.webhook,
                config=self.webhooks,
                emit=self.shell.send_webhook,
                book=self.webhook_book,
                principal=principal.key,
                clock=self.clock,
            )
        # Validated once: the engine of `model` takes `params` as checked (engine/intake.py),
        # so it runs with the seed drawn here, the one `accepted` reports.
        return Admitted(record, params, spec, output, name, memory, cross, checked=checked)

    def _open_stream(self, admitted: Admitted) -> FrameStreamLike:
        """Submit an admitted request to the engine; its stream.

        Raises MessageError ``bad_params`` (params only the engine refuses)
        or ``engine_unavailable``, having released its memory.
        """
        request_id = admitted.record.id
        spec, output = admitted.spec, admitted.output
        try:
            wanted: dict[str, Any] = {
                "policy": "latest",
                "preview_every": spec.every,
                # Across principals only what its grant allows (the engine's
                # scheduler ranks every request it holds by priority).
                "priority": admitted.cross_priority,
                # Its own priority orders it among its principal's requests only.
                "group": admitted.record.principal,
                "rank": admitted.record.priority,
                "render": self._render_request(spec, output),
                # Only to an engine of several models (engine/router.py).
                "model": admitted.model if len(self.models) > 1 else None,
            }
            if self.journal is not None:
                wanted.update(self.journal.stream_options(admitted))
            # Only what the engine takes (an engine of one's own may take less).
            options = {k: v for k, v in wanted.items() if k in self.stream_keywords and v is not None}
            # CheckedParams (_admit): an engine of the model that checked them does not again;
            # one of another model, or one of one's own, validates them as they read.
            try:
                stream = self.engine.stream(admitted.params, request_id=request_id, **options)
            except CheckpointError as exc:
                if options.pop("resume", None) is None:
                    raise
                # The model refused the checkpoint it was to resume from (another
                # model, another version): the request starts over instead.
                if self.journal is not None:
                    self.journal.resume_refused(admitted.record, exc)
                stream = self.engine.stream(admitted.params, request_id=request_id, **options)
        except ParamsError as exc:
            admitted.memory.release()
            raise protocol.MessageError(
                "bad_params", exc.message, field=exc.field, request_id=request_id
            ) from None
        except (EngineError, CheckpointError) as exc:
            admitted.memory.release()
            raise protocol.MessageError("engine_unavailable", exc.message, request_id=request_id) from None
        missing = missing_stream_members(stream)
        if missing:
            # The engine's own type: nothing a client did. Said once per request
            # here rather than as an `internal` in the middle of its stream.
            admitted.memory.release()
            self.engine.cancel(request_id)
            raise protocol.MessageError(
                "engine_unavailable",
                f"the engine's stream() returned a {type(stream).__name__}, which lacks "
                f"{', '.join(missing)} (omni_stream.engine.like.FrameStreamLike)",
                request_id=request_id,
            )
        return stream

    def _render_request(self, spec: PreviewSpec, output: admission.OutputSpec) -> RenderRequest | None:
        """What to ask an engine that renders where it makes frames (a Ray replica); None to render here."""
        if "render" not in self.stream_keywords or not (
            isinstance(self.engine, RendersFrames) and self.engine.renders_frames
        ):
            return None
        return RenderRequest.of(spec, output.format, output.quality)

    def _start(self, admitted: Admitted, stream: FrameStreamLike) -> None:
        record = admitted.record
        if record.frames_taken == 0 and record.latest_step == 0:  # its first time in (not a resume)
            self.metrics.queue_wait.labels(self.metrics.model(record.model)).observe(
                self.clock() - record.created_at
            )
        record.entered_step = record.latest_step
        record.rate.start(self.clock(), record.latest_step)
        self.gate.entered(record.principal, record.total)
        if self._preempts():
            record.on_step = self._stepped
        assert self.shell is not None  # _admit checked it
        self.shell.start_consumer(admitted, stream)

    # -- letting in from the gate ------------------------------------------------------

    def let_in(self) -> None:
        """Submit waiting requests while the engine has room (a request left it, or the bound grew)."""
        while self.letting_in and (item := self.gate.pop()) is not None:
            if isinstance(item.payload, Preempted):
                self._readmit(item.payload)  # in the engine already, paused
            else:
                self._let(item.payload)

    def _let(self, admitted: Admitted) -> None:
        """Submit an admitted request that waited in the gate; if the engine refuses it now, it ends."""
        try:
            stream = self._open_stream(admitted)
        except protocol.MessageError as exc:
            # Accepted already: it ends, with what the engine said.
            code = "engine_error" if exc.code == "engine_unavailable" else "step_failed"
            self.finish(
                admitted.record,
                protocol.ErrorMessage.build(
                    code, exc.message, request_id=admitted.record.id, field=exc.field
                ),
            )
            return
        self._start(admitted, stream)

    # -- cancel, attach, lookup ----------------------------------------------------

    def stop(self, record: RequestRecord, reason: str) -> None:
        """Cancel a running request (``reason`` for its ``cancelled``), in the engine or in the gate."""
        record.cancel_reason = record.cancel_reason or reason
        item = self.gate.remove(record.id)
        if item is None:
            self.engine.cancel(record.id)
            return
        if isinstance(item.payload, Preempted):
            # Paused in the engine, waiting here to resume: its consumer ends
            # it, and counts its place out of the gate as any in the engine.
            self.gate.entered(record.principal)
            self.engine.cancel(record.id)
            return
        item.payload.memory.release()
        self.finish(record, protocol.Cancelled.build(record.id, reason=record.cancel_reason))

    def cancel(self, client: Client, request_id: str) -> RequestRecord:
        """Cancel a request ``client`` may see; raises MessageError ``not_found``."""
        record = self.lookup(client, request_id)
        if not record.ended:  # else its terminal message was already sent
            self.stop(record, "client")
        return record

    # -- the end of a request ----------------------------------------------------------

    def consumer_done(self, record: RequestRecord, message: Terminal) -> None:
        """A request's consumer ended with ``message``: it left the engine; the next goes in."""
        if self.paused.pop(record.id, None) is None:
            # (One its client paused gave its place back when it paused.)
            self.gate.left(record.principal)
        self.finish(record, message)
        self.let_in()

    def _repeat(self, admitted: Admitted, kept: Kept) -> None:
        """Answer an exact repeat with the results kept (repeats.py): it ends done, no step run."""
        record, total = admitted.record, kept.total
        admitted.memory.release()
        record.publish_progress(
            protocol.Progress.build(record.id, step=total, total=total, eta_s=0, cached=True)
        )
        for preview in kept.previews(record.id):
            record.publish_preview(preview)
        self.finish(record, protocol.Done.build(record.id, total=total, elapsed_s=0.0, repeat=True))

    def finish(self, record: RequestRecord, message: Terminal) -> None:
        """End ``record`` with its terminal ``message``: its watchers, the books.

        The model's caches may have grown while it ran (memory.py counts them).
        """
        try:
            ended_before = record.ended
            record.finish(message, now=self.clock())
            if not ended_before:
                # Before the registry forgets it (and its results with it).
                if self.journal is not None:
                    self.journal.finished(record, message)
                if record.outcome == "done" and record.repeat_key is not None:
                    results = [record.result(i) for i in range(record.result_count)]
                    self.repeats.keep(record.repeat_key, record.total, [r for r in results if r])
            self.registry.ended(record)
            if not ended_before:  # counted once, whoever ended it first
                model = self.metrics.model(record.model)
                self.metrics.requests.labels(record.outcome or "error", model).inc()
                if record.outcome == "done" and record.ended_at is not None:
                    self.metrics.time_to_result.labels(model).observe(record.ended_at - record.created_at)
        finally:
            self.memory.recount_model()
            if not self.registry.running() and self.shell is not None:
                self.shell.requests_idle()
