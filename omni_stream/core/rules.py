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
go into the client's :class:`~omni_stream.core.outbox.Outbox`, and the two
things the core asks of the world are calls it was given:

- ``engine.stream(...)`` (submitting a request; synchronous) and
  ``engine.cancel(id)``, ``engine.health()``;
- ``on_start(admitted, stream)``: run a consumer for an admitted request
  (the server's shell, ``omni_stream.server.service``, starts a task).

So the rules are tested by calling them with no socket and no loop
(tests/core/test_rules.py), as python-websockets tests its protocol.
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
from ..errors import CheckpointError, EngineError, OmniStreamError, ParamsError, ServerBusyError
from ..model import StepModel
from ..params import pin_drawn
from ..preview import PreviewSpec, RenderRequest
from . import admission, inputs
from .gate import Gate
from .limits import ServerLimits
from .memory import MemoryBudget, MemoryReservation
from .metrics import ServerMetrics
from .outbox import Outbox
from .principal import Principal
from .rates import RateBook, message_cost
from .records import RequestRecord, RequestRegistry
from .tokens import Tokens
from .webhooks import Delivery, WebhookBook, WebhookConfig, WebhookState

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


@dataclasses.dataclass(eq=False)
class Client:
    """One client session at a door: a websocket connection, an HTTP call, an event stream.

    ``id`` is unique to the session (it owns the requests it starts that
    are not detached); ``principal`` is who it is (what the rules count by);
    ``outbox`` is where its replies go (None for an HTTP call, which reads
    its answer from the call's return value).
    """

    id: str
    principal: Principal
    door: str
    outbox: Outbox | None = None
    #: It started a request that is not detached (which ends when it goes).
    owns_attached: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a new client (connection) is refused: the HTTP status, the code, the words."""

    status: int
    code: str
    message: str


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


@dataclasses.dataclass(frozen=True, slots=True)
class _Preempted:
    """A gate payload: a request paused in the engine, to resume when let in: one the gate paused
    to make room (``reason`` ``preempted``), or one its client paused, resumed since (``client``,
    ``max_pause``), that waits for a place like any other."""

    record: RequestRecord
    reason: str = "preempted"


def _seed_of(checked: Mapping[str, Any]) -> int | None:
    """The seed a request runs with, where its model has an int one."""
    seed = checked.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


class Rules:
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
        self.registry = RequestRegistry(
            retention_s=limits.retention_s, max_retained=limits.max_retained, budget=self.memory,
            clock=clock,
        )
        self.metrics = ServerMetrics(engine, running=lambda: len(self.registry.running()))
        self.metrics.watch_memory(self.memory)
        #: Engines computing on this host's CPU (max_active's default depends on it).
        self.host_engines = admission.host_engines(engine)
        #: At most max_active requests in the engine; the other admitted ones wait here.
        self.gate = Gate(
            lambda: self.limits.active_bound(self.engine.max_batch_size, host_engines=self.host_engines)
        )
        #: Requests their clients paused, by id: in the engine, holding no place in the gate's
        #: count (they come back through the gate when resumed), each for max_pause_s at most.
        self.paused: dict[str, RequestRecord] = {}
        #: Called when a client's pause starts: the shell's timer looks at :meth:`expire_pauses` again.
        self.on_paused: Callable[[], None] = lambda: None
        #: Open clients (websockets, HTTP calls, event streams), by id.
        self.clients: dict[str, Client] = {}
        #: Open clients per principal key.
        self.open_by_principal: Counter[str] = Counter()
        self.rates = RateBook(limits.max_messages_per_s)
        #: Run a consumer for an admitted request (the server's shell sets it when it starts).
        self.on_start: Callable[[Admitted, FrameStreamLike], None] | None = None
        #: Webhooks (core/webhooks.py): the settings (None: every webhook is refused), the
        #: requests holding one, and where deliveries go (the shell's sender sets it).
        self.webhooks = webhooks
        self.webhook_book = WebhookBook(webhooks.max_held if webhooks is not None else 0)
        self.on_webhook: Callable[[Delivery], None] | None = None
        #: The state directory's hooks (server/state.py; None without one): a request
        #: admitted (to write it down), the keywords its stream gets besides the
        #: rules' own (checkpoints, a checkpoint to resume from), a checkpoint the
        #: model refused (the request starts from step 0 instead), a request ended.
        self.on_admitted: Callable[[Admitted, protocol.Generate], None] | None = None
        self.stream_options: Callable[[Admitted], Mapping[str, Any]] | None = None
        self.on_resume_refused: Callable[[RequestRecord, CheckpointError], None] | None = None
        #: Told when a request is handed over to another replica (a Ray front door) and its
        #: watchers were told so (``restarted``, ``replica_lost``): ``(record, from_step)``.
        #: The state directory keeps the notice with the request.
        self.on_handed_over: Callable[[RequestRecord, int], None] | None = None
        self.on_finished: Callable[[RequestRecord, dict[str, Any]], None] | None = None
        #: Set by the shell: started (consumers can run), closing (refuse new
        #: work), letting_in (queued requests may still start: the graceful
        #: part of a shutdown), fatal (why the server cannot go on).
        self.started = False
        self.closing = False
        self.letting_in = True
        self.fatal: OmniStreamError | None = None
        #: Called when the last running request ends / the last client leaves.
        self.on_requests_idle: Callable[[], None] = lambda: None
        self.on_clients_idle: Callable[[], None] = lambda: None

    # -- clients -------------------------------------------------------------------

    def principal_of_connection(self, conn_id: str, *, headers: Mapping[str, str], query: str) -> Principal:
        """A websocket's principal: its token's, else the connection (see principal.py)."""
        grant = self.tokens.identify(headers, query) if self.tokens else None
        return Principal.of_token(grant) if grant is not None else Principal.of_connection(conn_id)

    def principal_of_address(self, address: str, *, headers: Mapping[str, str], query: str) -> Principal:
        """An HTTP caller's principal: its token's, else its address (see principal.py)."""
        grant = self.tokens.identify(headers, query) if self.tokens else None
        return Principal.of_token(grant) if grant is not None else Principal.of_address(address)

    def connection_refusal(self, principal: Principal) -> Refusal | None:
        """Why a new client of ``principal`` is refused now; None to accept."""
        if self.closing:
            return Refusal(503, "shutting_down", "the server is shutting down")
        limits = self.limits
        if len(self.clients) >= limits.max_connections:
            return Refusal(
                503,
                "too_many_connections",
                f"the server has {limits.max_connections} connections open "
                "(max_connections, OMNI_STREAM_MAX_CONNECTIONS)",
            )
        if self.open_by_principal[principal.key] >= limits.max_connections_per_principal:
            return Refusal(
                429,
                "too_many_connections",
                f"{_who(principal)} already has {limits.max_connections_per_principal} connections "
                "open, HTTP calls and event streams included (max_connections_per_principal, "
                "OMNI_STREAM_MAX_CONNECTIONS_PER_PRINCIPAL)",
            )
        return None

    def connect(self, principal: Principal, door: str, outbox: Outbox | None = None) -> Client:
        """Register a new client (call :meth:`connection_refusal` first); returns it."""
        client = Client(uuid.uuid4().hex, principal, door, outbox)
        if principal.kind == "connection" and principal.name != client.id:
            # A websocket without a token is its own principal: one name for both.
            client.principal = Principal.of_connection(client.id)
        self.clients[client.id] = client
        self.open_by_principal[client.principal.key] += 1
        self.metrics.connections.inc()
        self.metrics.connections_opened.inc()
        return client

    def disconnect(self, client: Client) -> None:
        """The client is gone: nothing more is sent to it; its own requests that are not detached end."""
        if client.outbox is not None or client.owns_attached:
            # (A client without an outbox watched nothing, and if all it
            # started is detached, nothing ends with it: an HTTP call's close
            # is then no walk over every record.)
            for record in self.registry.disconnect(client.id):
                self.stop(record, "disconnect")
        if self.clients.pop(client.id, None) is not None:
            key = client.principal.key
            self.open_by_principal[key] -= 1
            if self.open_by_principal[key] <= 0:
                del self.open_by_principal[key]
                self.rates.forget(key, self.clock())
            self.metrics.connections.dec()
        if not self.clients:
            self.on_clients_idle()

    def pace(self, client: Client, nbytes: int) -> float:
        """Count one message of ``nbytes`` against its principal's rate; seconds to wait before acting.

        max_messages_per_s per principal, in bursts of as many (rates.py):
        the door reads (or answers) the next one that much later.
        """
        delay = self.rates.take(client.principal.key, message_cost(nbytes), self.clock())
        if delay > 0.0:
            self.metrics.reads_paced.inc()
        return delay

    def principals(self) -> int:
        """Principals with a client open or a request held (the fair share divides among them)."""
        keys = set(self.open_by_principal)
        keys.update(r.principal for r in self.registry.running())
        return max(1, len(keys))

    # -- client messages (every door's, in the websocket's form) ---------------------

    def receive(self, client: Client, data: str | bytes) -> protocol.ClientMessage | None:
        """Parse one message; a malformed one is answered in ``client.outbox`` (None returned)."""
        try:
            return protocol.parse_client_message(data)
        except protocol.MessageError as exc:
            self.reply_error(client, exc, request_id=exc.request_id)
            return None

    def dispatch(self, client: Client, msg: protocol.ClientMessage) -> None:
        """Act on one parsed message; every reply (and error) goes to ``client.outbox``.

        Synchronous on purpose: handling a message never waits, so one
        client is never blocked behind anything.
        """
        try:
            if isinstance(msg, protocol.Generate):
                self.generate(client, msg)
            elif isinstance(msg, protocol.Cancel):
                self.cancel(client, msg.id)
            elif isinstance(msg, protocol.Pause):
                self.pause(client, msg.id, to_host=msg.to_host)
            elif isinstance(msg, protocol.Resume):
                self.resume(client, msg.id)
            else:
                self.attach(client, msg.id)
        except protocol.MessageError as exc:
            request_id = exc.request_id
            if isinstance(msg, protocol.Generate) and msg.id is None:
                request_id = None  # an id the server made up means nothing to the client
            self.reply_error(client, exc, request_id=request_id)
        except Exception as exc:
            # A bug: this message gets ``internal``; the client and the server go on.
            logger.exception("handling a message from client %s failed", client.id)
            if client.outbox is not None:
                reply = protocol.error("internal", f"internal server error: {exc!r}", request_id=msg.id)
                client.outbox.put(protocol.dumps(reply), "error")

    def handle(self, client: Client, data: str | bytes) -> None:
        """:meth:`receive` then :meth:`dispatch`: one message, start to end."""
        msg = self.receive(client, data)
        if msg is not None:
            self.dispatch(client, msg)

    def reply_error(self, client: Client, exc: protocol.MessageError, *, request_id: str | None) -> None:
        if client.outbox is not None:
            client.outbox.put(protocol.dumps(self.error_reply(exc, request_id=request_id)), "error")

    def error_reply(self, exc: protocol.MessageError, *, request_id: str | None) -> dict[str, Any]:
        """The ``error`` message for a refused client message (``busy`` carries ``retry_after_s``)."""
        reply = protocol.error(exc.code, exc.message, request_id=request_id, field=exc.field)
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            reply["retry_after_s"] = retry
        return reply

    # -- generate ----------------------------------------------------------------

    def generate(self, client: Client, msg: protocol.Generate) -> RequestRecord:
        """Admit ``msg`` for ``client`` (its outbox, if any, watches it); it goes into the engine
        now, or waits in the gate.

        Raises MessageError (ServerBusyError for ``busy``) with the code to
        answer; every refusal is counted by its code.
        """
        try:
            admitted = self._admit(client, msg)
            stream = self._open_stream(admitted) if self.gate.has_room() else None
        except protocol.MessageError as exc:
            self.metrics.rejections.labels(exc.code).inc()
            self.metrics.requests.labels("rejected").inc()
            raise
        record = admitted.record
        self.registry.add(record)
        if self.on_admitted is not None:
            self.on_admitted(admitted, msg)
        if record.webhook is not None:
            record.webhook.hold()  # until its terminal delivery settles
        client.owns_attached = client.owns_attached or not record.detach
        if client.outbox is not None:
            record.watch(client.id, client.outbox, attached=False)
        if stream is None:
            # The engine holds max_active requests already: this one waits,
            # unstarted, in the gate (gate.py), and goes in when one leaves.
            self.gate.wait(
                record.id, record.principal, msg.priority, admitted,
                cost=record.total, cross=admitted.cross_priority,
            )
            # Under the preemptive policy a long request in the engine may
            # give its place to this shorter one (it waits here, paused).
            self._preempt_for(record)
            self.let_in()  # in case the bound grew (a remote engine's replicas came up)
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
                self.memory, model, {**msg.params, **sized}, engine=self.engine, request_id=request_id,
                retry_after_s=lambda: self.retry_after(load),
            )

    def _admit_cheap(self, client: Client, msg: protocol.Generate, request_id: str) -> admission.Load:
        """:meth:`precheck`'s rules; the load they measured."""
        principal = client.principal
        if not self.started or self.on_start is None:
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
                f"{_who(principal)} already runs {limit} requests "
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
        """Refuse ``msg``'s webhook unless this server may call it and has room for one more.

        ``bad_params`` (field ``webhook``) without an allow-list or for a URL
        outside it (core/webhooks.py), ``busy`` when ``max_held`` requests
        with a webhook are held, or ``principal``'s share of them (their
        terminal deliveries are never dropped).
        """
        if msg.webhook is None:
            return
        if self.webhooks is None or self.on_webhook is None:
            raise protocol.MessageError(
                "bad_params",
                "this server sends no webhooks: it allows no webhook URL "
                "(webhook_allow, --webhook-allow, OMNI_STREAM_WEBHOOK_ALLOW)",
                field="webhook",
                request_id=request_id,
            )
        self.webhooks.check(msg.webhook, request_id=request_id)
        why = self.webhook_book.refusal(principal)
        if why is not None:
            raise ServerBusyError(
                f"{why}; try again shortly",
                retry_after_s=self.webhooks.max_retry_s,
                request_id=request_id,
            )

    def _admit(self, client: Client, msg: protocol.Generate) -> Admitted:
        """Apply every admission rule to ``msg`` (load, params, memory); raises MessageError."""
        request_id = msg.id or uuid.uuid4().hex
        principal = client.principal
        load = self._admit_cheap(client, msg, request_id)
        name, model = self.model_for(msg.model, request_id=request_id)
        spec = admission.preview_spec(
            msg.preview, default=self._previews[name], decoder=self._decoders[name],
            limits=self.limits, request_id=request_id, model=model,
        )
        output = admission.output_spec(
            msg.output, video=bool(getattr(model, "produces_video", False)), request_id=request_id
        )
        total, checked = admission.check_params(model, msg.params, self.limits, request_id=request_id)
        memory = admission.reserve_memory(
            self.memory, model, checked, engine=self.engine, request_id=request_id,
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
        if msg.webhook is not None and self.webhooks is not None and self.on_webhook is not None:
            # (_admit_cheap admitted it.) Told of its progress and its end by the record.
            record.webhook = WebhookState(
                request_id, msg.webhook, config=self.webhooks, emit=self.on_webhook,
                book=self.webhook_book, principal=principal.key, clock=self.clock,
            )
        # The engine checks the params again: it must run with the seed drawn
        # here (the one `accepted` reports), not draw a second.
        params = pin_drawn(model.params, msg.params, checked)
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
                "render": self._render_request(spec, output),
                # Only to an engine of several models (engine/router.py).
                "model": admitted.model if len(self.models) > 1 else None,
            }
            if self.stream_options is not None:
                wanted.update(self.stream_options(admitted))
            # Only what the engine takes (an engine of one's own may take less).
            options = {k: v for k, v in wanted.items() if k in self.stream_keywords and v is not None}
            # The raw params: the engine validates them itself (the same checks).
            try:
                stream = self.engine.stream(admitted.params, request_id=request_id, **options)
            except CheckpointError as exc:
                if options.pop("resume", None) is None:
                    raise
                # The model refused the checkpoint it was to resume from (another
                # model, another version): the request starts over instead.
                if self.on_resume_refused is not None:
                    self.on_resume_refused(admitted.record, exc)
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
        record.entered_step = record.latest_step
        self.gate.entered(record.principal, record.total)
        if self._preempts():
            record.on_step = self._stepped
        assert self.on_start is not None  # _admit checked it
        self.on_start(admitted, stream)

    def _preempts(self) -> bool:
        """Whether the gate may pause a running request for a waiting one (the preemptive policy)."""
        return getattr(self.engine, "scheduling", None) == "preemptive" and hasattr(self.engine, "pause")

    def _quantum(self) -> int:
        return int(getattr(self.engine, "quantum", 1))

    def _victim(self) -> RequestRecord | None:
        """The running request with the most steps left among those past their quantum since they
        (re)entered the engine; None when none is."""
        quantum = self._quantum()
        running = [
            r for r in self.registry.running()
            if r.id not in self.gate and not r.paused and r.latest_step - r.entered_step >= quantum
        ]
        return max(running, key=lambda r: r.total - r.latest_step) if running else None

    def _preempt_for(self, waiting: RequestRecord) -> None:
        """Pause the running request with the most steps left for ``waiting``, when the engine's
        policy is ``preemptive``, every place is held, and that request has more steps left than
        ``waiting`` has in all and has run its quantum since it (re)entered. It goes back to the
        gate as a request to resume (its state to the host meanwhile): the gate lets it in again
        as places free, by its remaining steps."""
        if not self._preempts():
            return
        victim = self._victim()
        if victim is not None and victim.total - victim.latest_step > waiting.total:
            self._preempt(victim, waiting)

    def _stepped(self, record: RequestRecord) -> None:
        """``record`` took a step (``RequestRecord.on_step``): try the preemption again.

        An arriving request tries once, when it comes (:meth:`generate`).
        One that came while every running request was within its quantum
        would then wait for a place to free, however long that took: so each
        step of a request past its quantum looks again, for the first fresh
        request in the gate's order shorter than what that request has left.
        (Most steps find no waiter, or none short enough: the checks go
        cheapest first.)
        """
        gate = self.gate
        if not gate.waiting or record.paused or record.id in gate:
            return
        left = record.total - record.latest_step
        if record.latest_step - record.entered_step < self._quantum():
            return
        fresh = [w for w in gate.items() if not isinstance(w.payload, _Preempted)]
        if not fresh or min(w.payload.record.total for w in fresh) >= left:
            return
        victim = self._victim()
        if victim is None:
            return
        left = victim.total - victim.latest_step
        for request_id in gate.order():
            item = gate.get(request_id)
            if item is None or isinstance(item.payload, _Preempted):
                continue
            if item.payload.record.total < left:
                self._preempt(victim, item.payload.record)
                return

    def _preempt(self, victim: RequestRecord, waiting: RequestRecord) -> None:
        """Pause ``victim`` (to the host) and give its place to ``waiting``, which waits in the gate."""
        pause = getattr(self.engine, "pause", None)
        if pause is None or not pause(victim.id, to_host=True):
            return
        victim.publish_paused("preempted")
        self.gate.left(victim.principal)
        # The place is the newcomer's: let in by the gate's order, the victim
        # (its principal now with one fewer inside) could take it straight back.
        item = self.gate.remove(waiting.id)
        self.gate.wait(
            victim.id, victim.principal, victim.priority, _Preempted(victim),
            cost=victim.total - victim.latest_step, cross=victim.cross_priority,
        )
        if item is not None:
            self._let(item.payload)

    def let_in(self) -> None:
        """Submit waiting requests while the engine has room (a request left it, or the bound grew)."""
        while self.letting_in and (item := self.gate.pop()) is not None:
            if isinstance(item.payload, _Preempted):
                # A preempted request: it is in the engine already, paused.
                record = item.payload.record
                self.gate.entered(record.principal, record.total - record.latest_step)
                record.entered_step = record.latest_step
                resume = getattr(self.engine, "resume", None)
                if resume is not None and resume(record.id):
                    record.publish_resumed(item.payload.reason)
                continue
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
                protocol.error(code, exc.message, request_id=admitted.record.id, field=exc.field),
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
        if isinstance(item.payload, _Preempted):
            # Paused in the engine, waiting here to resume: its consumer ends
            # it, and counts its place out of the gate as any in the engine.
            self.gate.entered(record.principal)
            self.engine.cancel(record.id)
            return
        item.payload.memory.release()
        self.finish(record, protocol.cancelled(record.id, reason=record.cancel_reason))

    def cancel(self, client: Client, request_id: str) -> RequestRecord:
        """Cancel a request ``client`` may see; raises MessageError ``not_found``."""
        record = self.lookup(client, request_id)
        if not record.ended:  # else its terminal message was already sent
            self.stop(record, "client")
        return record

    def pause(self, client: Client, request_id: str, *, to_host: bool = False) -> RequestRecord:
        """Pause a request ``client`` may see, between two steps (``Engine.pause``); its watchers
        get ``paused``. It gives its place in the engine to the next request in the gate, comes
        back through the gate when resumed, and resumes by itself once paused ``max_pause_s`` in
        all (:meth:`expire_pauses`). Raises MessageError: ``not_found``, or ``bad_message`` for a
        request that is not running in the engine (ended, waiting for a place, paused already),
        one paused ``max_pause_s`` already, one whose model cannot stop it between two steps (the
        engine's ``pause_refusal`` says why), or an engine that cannot pause."""
        record = self.lookup(client, request_id)
        pause = getattr(self.engine, "pause", None)
        if pause is None:
            raise protocol.MessageError(
                "bad_message", "this server's engine cannot pause requests", request_id=request_id
            )
        bound = self.limits.max_pause_s
        if not record.ended and record.paused_for_s >= bound:
            raise protocol.MessageError(
                "bad_message",
                f"request {record.id} was paused {record.paused_for_s:.1f} s in all, this server's "
                f"max_pause_s={bound:g} ({ServerLimits.env_name('max_pause_s')}): it runs to its end",
                request_id=request_id,
            )
        if (
            record.ended
            or record.id in self.gate
            or record.id in self.paused
            or not pause(record.id, to_host=to_host)
        ):
            # Its model may refuse it whatever its progress (Engine.pause_refusal): say so, not
            # that it is not running.
            refusal = getattr(self.engine, "pause_refusal", None)
            why = refusal(record.id) if callable(refusal) and not record.ended else None
            raise protocol.MessageError(
                "bad_message",
                why or f"request {record.id} is not running (ended, not started yet, or paused "
                "already): nothing to pause",
                request_id=request_id,
            )
        record.publish_paused("client")
        record.paused_at = self.clock()
        self.paused[record.id] = record
        # Its place is the next request's: four requests paused for good once held every place
        # of a CPU server, and another tenant's request waited with no end (issue #39, attack 1).
        self.gate.left(record.principal)
        self.on_paused()
        self.let_in()
        return record

    def resume(self, client: Client, request_id: str) -> RequestRecord:
        """Resume a paused request ``client`` may see: it runs again when the gate has a place for
        it (at once if it has one), and its watchers get ``resumed`` then. Raises MessageError:
        ``not_found``, or ``bad_message`` for one that is not paused."""
        record = self.lookup(client, request_id)
        if record.id in self.paused and not record.ended:
            self._unpause(record, "client")
            return record
        resume = getattr(self.engine, "resume", None)
        # (Not a request the gate paused: that one runs again when the gate lets it in.)
        if resume is None or record.ended or record.id in self.gate or not resume(record.id):
            raise protocol.MessageError(
                "bad_message", f"request {record.id} is not paused: nothing to resume", request_id=request_id
            )
        record.publish_resumed("client")
        return record

    def _unpause(self, record: RequestRecord, reason: str) -> None:
        """End a client's pause of ``record`` (``reason``: ``client`` or ``max_pause``): back into
        the engine now if the gate has room, else it waits there for a place, ranked as any
        request with its steps left."""
        del self.paused[record.id]
        now = self.clock()
        if record.paused_at is not None:
            record.paused_for_s += max(0.0, now - record.paused_at)
            record.paused_at = None
        item = _Preempted(record, reason)
        self.gate.wait(
            record.id, record.principal, record.priority, item,
            cost=max(1, record.total - record.latest_step), cross=record.cross_priority,
        )
        self.let_in()

    def expire_pauses(self) -> float | None:
        """Resume every request its clients paused ``max_pause_s`` in all (its watchers get
        ``resumed`` with ``reason: max_pause`` as it runs again); seconds until the next one is
        due, None when none is paused. The shell calls it when that time comes, and again
        whenever ``on_paused`` says a pause began."""
        now = self.clock()
        bound = self.limits.max_pause_s
        due: float | None = None
        for record in list(self.paused.values()):
            started = record.paused_at if record.paused_at is not None else now
            left = started + bound - record.paused_for_s - now
            if left <= 0 or record.ended:
                if not record.ended:
                    logger.info(
                        "request %s: paused %.1f s in all, max_pause_s=%g: it resumes",
                        record.id, record.paused_for_s + now - started, bound,
                    )
                    self._unpause(record, "max_pause")
            else:
                due = left if due is None else min(due, left)
        return due

    def attach(self, client: Client, request_id: str) -> RequestRecord:
        """``client``'s outbox watches the request from now on, after its replay; raises MessageError."""
        record = self.lookup(client, request_id)
        if client.outbox is None:
            raise protocol.MessageError(
                "bad_message", "this door cannot watch a request", request_id=request_id
            )
        if record.is_watched_by(client.id):
            raise protocol.MessageError(
                "already_attached",
                f"this connection already watches request {request_id!r}",
                field="id",
                request_id=request_id,
            )
        record.watch(client.id, client.outbox, attached=True)
        return record

    def lookup(self, client: Client, request_id: str) -> RequestRecord:
        """The record ``client`` may see (records.py's rule); raises MessageError ``not_found``."""
        principal = client.principal
        return self.registry.lookup(
            request_id, client.id, principal=principal.key if principal.authenticated else None
        )

    # -- the end of a request ----------------------------------------------------------

    def consumer_done(self, record: RequestRecord, message: dict[str, Any]) -> None:
        """A request's consumer ended with ``message``: it left the engine; the next goes in."""
        if self.paused.pop(record.id, None) is None:
            # (One its client paused gave its place back when it paused.)
            self.gate.left(record.principal)
        self.finish(record, message)
        self.let_in()

    def finish(self, record: RequestRecord, message: dict[str, Any]) -> None:
        """End ``record`` with its terminal ``message``: its watchers, the books.

        The model's caches may have grown while it ran (memory.py counts them).
        """
        try:
            ended_before = record.ended
            record.finish(message, now=self.clock())
            if self.on_finished is not None and not ended_before:
                # Before the registry forgets it (and its results with it).
                self.on_finished(record, message)
            self.registry.ended(record)
            self.metrics.requests.labels(record.outcome or "error").inc()
        finally:
            self.memory.recount_model()
            if not self.registry.running():
                self.on_requests_idle()

    # -- load and health ------------------------------------------------------------

    def load(self, health: Any | None = None) -> admission.Load:
        stats = (health or self.engine.health()).statistics
        # What the engine holds (its own count, in case others share it) and what waits in the
        # gate; the requests their clients paused hold no place.
        in_engine = max(self.gate.in_engine, stats.active + stats.queued - len(self.paused))
        return admission.Load.of(
            in_engine, self.gate.waiting, self.limits, engine_batch_size=self.engine.max_batch_size,
            host_engines=self.host_engines,
        )

    def retry_after(self, load: admission.Load) -> float:
        return admission.retry_after(
            (r.total - r.latest_step for r in self.registry.running()),
            held=load.held,
            step_s=self.metrics.recent_step_s,
            batch_size=self.metrics.recent_batch_size,
            whole_requests=any(getattr(m, "runs_whole_requests", False) for m in self.models.values()),
        )

    def queue_positions(self) -> dict[str, int]:
        """Position (0 = next) of every request that has not started a step yet.

        Those in the engine first, in the order its scheduler takes them
        (higher priority across principals first, then arrival), then
        those waiting in the gate, in the order it lets them in.
        """
        starting = [
            r for r in self.registry.running()
            if r.latest_step == 0 and r.id not in self.gate and r.id not in self.paused
        ]
        starting.sort(key=lambda r: (-r.cross_priority, r.created_at))
        order = [r.id for r in starting] + self.gate.order()
        return {rid: i for i, rid in enumerate(order)}


def _who(principal: Principal) -> str:
    if principal.kind == "token":
        return f"token {principal.name!r}"
    if principal.kind == "address":
        return f"address {principal.name}"
    return "this connection"
