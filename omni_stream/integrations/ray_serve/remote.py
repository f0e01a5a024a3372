"""RemoteEngine: a Serve application of EngineReplicas, used as one EngineLike.

::

    RemoteEngine.stream(params) ──handle.options(stream=True).stream.remote()──▶ a replica (Serve routes)
      RemoteStream.__anext__ ◀── Header, WireFrame|WireBatch, ... (Ray stream) ◀── EngineReplica.stream
             │ ack(seq) a batch, fire and forget                                   │ wait_acked
             └──────────────────────────────▶ ReplicaBoard (a deployment actor) ◀───┘
      poller (every poll_s) ◀── snapshot(): each replica's ReplicaReport ◀── report(), every report_s

The front door never loads the model: ``model`` is the replicas' ModelCard.
It checks params against the card at once (``stream`` raises ParamsError
then); the replica checks them again with the real model.

Several models (``deploy({name: source, ...})``): ``models`` holds each
one's card by name, the default first, as ModelRouter's ``models`` does, and
``stream(model=NAME)`` checks against that card and names the model in the
request. When the replicas load models on demand (``max_models_per_replica``)
the request goes out with ``handle.options(multiplexed_model_id=NAME)``:
Serve then prefers a replica that holds the model (its ``@serve.multiplexed``
cache says so, replica.py), else one holding the fewest. A request's
``loading`` is a guess made at the front door from the replicas' reports
(no live replica has its model on the device), until the replica's Header
says; the server reads it once, to send ``loading``.

Cancellation: only ``DeploymentResponseGenerator.cancel()`` stops a
request on its replica (dropping the generator or cancelling the task that
reads it lets the replica run every remaining step), so every way a stream
can end early calls it: ``cancel(id)``, ``aclose()``, leaving ``async
with``, a ``break`` (the dropped stream's ``__del__``), the reader's own
cancellation or timeout, and any error while reading. Each also acknowledges
``CANCELLED_SEQ`` through the board: a cancel that lands while Serve is
still assigning the request (just after a submit or a hand-over) is best
effort in Serve, and the replica then ends the request itself.

A lost replica's requests are handed over (handover.py): each replica
sends its requests' checkpoints, ``checkpoints`` keeps the newest of each,
and a RemoteStream that Ray tells its replica died submits its request
again (``_submit``) from it, on another replica, reading on without a gap
or a repeated frame.

``health()``, ``statistics()`` and ``max_batch_size`` are synchronous and
read the replicas' latest reports, which a background task fetches every
``poll_s`` (report.py judges them). Enter and leave a RemoteEngine from
one task; the Serve application outlives it (``undeploy`` deletes it).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ...checkpoint import Checkpoint
from ...engine.facade import RoutingFacade
from ...engine.group import GroupStatistics
from ...engine.intake import already_running, check_request, check_request_id
from ...engine.options import RemoteOptions, RequestOptions, pick, stream_keywords
from ...engine.stats import Health
from ...errors import EngineClosedError, EngineDeadError, ParamsError
from ...params import positive_int
from ...preview.remote import RenderRequest
from .card import ModelCard
from .handover import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_MAX_BYTES,
    DEFAULT_MAX_HANDOVERS,
    CheckpointKeeper,
    HandoverSettings,
    KeptCheckpoint,
)
from .report import ReplicaReport, ReplicaView, sum_statistics, summarize, view
from .stream import RemoteStream, cancel_response
from .wire import Description, Item, Submit

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

    from .replica import EngineReplica

__all__ = ["DEFAULT_WINDOW", "RemoteEngine", "connect_ray"]

logger = logging.getLogger("omni_stream.ray_serve")

#: Frames a replica may have in transit to one reader (sent, not yet taken).
DEFAULT_WINDOW = 2
#: The window for a request rendered on the replica (a server in front): its
#: frames are encoded previews of a few KiB, so a wider window costs little
#: memory and hides the ack's round trip (at 10 ms steps, 2 left the server
#: with 0.54-0.60x a local engine's frame rate, 8 with 0.82x; docs/performance.md).
RENDERED_WINDOW = 8
_BOARD_TIMEOUT_S = 5.0


def connect_ray(address: str | None = None) -> None:
    """``ray.init(address)`` unless this process is connected already.

    ``address``: "auto", "ray://host:10001", "host:6379"; None starts a
    local Ray instance unless ``RAY_ADDRESS`` names one.
    """
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)


class RemoteEngine(RoutingFacade):
    """The Serve application ``name`` of EngineReplicas, as one EngineLike.

    ``address``: the Ray cluster to connect to (see :func:`connect_ray`);
    ``window``: frames a replica may have in transit to one reader (raw
    frames; a request rendered on the replica gets at least RENDERED_WINDOW);
    ``poll_s``: how often replica reports are read; a replica silent for
    ``stale_after_s`` counts as lost; a deployment unreachable for
    ``dead_after_s`` makes ``health()`` dead; ``renders_frames``: a server
    in front asks the replicas for encoded previews and results instead of
    raw frames (``RendersFrames``; True by default, False for raw frames).
    ``checkpoint_every``, ``max_handovers``, ``checkpoint_max_bytes``: a
    request whose replica dies goes on on another from its newest
    checkpoint, which its replica sends every ``checkpoint_every`` steps
    and this front door keeps (at most ``checkpoint_max_bytes`` of them),
    at most ``max_handovers`` times (0: it fails with EngineDeadError);
    see handover.py and :class:`HandoverSettings`.

    Connect with :meth:`connect` (blocking) or by entering it (``async
    with``), which also starts the reports' poller; ``model`` and
    ``models`` are available once connected. Satisfies EngineLike; enter
    and leave it from one task.
    """

    #: ``stream(resume=...)`` sends the checkpoint on as its bytes (``engine.like.resumes_from_bytes``):
    #: a server keeps the bytes it read one from, and none is encoded again on its loop.
    resume_as_bytes = True

    _noun = "RemoteEngine"
    #: Closing it stops this front door; the Serve application keeps running.
    _closed_as = "closed"

    def __init__(
        self,
        name: str = "omni_stream",
        *,
        address: str | None = None,
        window: int = DEFAULT_WINDOW,
        poll_s: float = 0.25,
        stale_after_s: float = 3.0,
        dead_after_s: float = 30.0,
        renders_frames: bool = True,
        checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
        max_handovers: int = DEFAULT_MAX_HANDOVERS,
        checkpoint_max_bytes: int = DEFAULT_CHECKPOINT_MAX_BYTES,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ParamsError(f"window must be a positive int, got {window!r}", field="window")
        super().__init__()
        self.handover = HandoverSettings(
            checkpoint_every=checkpoint_every,
            max_handovers=max_handovers,
            checkpoint_max_bytes=checkpoint_max_bytes,
        )
        #: Each request's newest checkpoint from its replica, for a hand-over (handover.py).
        self.checkpoints = CheckpointKeeper(checkpoint_max_bytes)
        self._name = name
        self._address = address
        self._window = window
        self.renders_frames = bool(renders_frames)
        self._poll_s = float(poll_s)
        self._stale_after_s = float(stale_after_s)
        self._dead_after_s = float(dead_after_s)
        self._handle: DeploymentHandle[EngineReplica] | None = None
        self._stream_handle: DeploymentHandle[EngineReplica] | None = None
        self._card: ModelCard | None = None
        self._cards: dict[str, ModelCard] = {}
        # By model name, when the replicas load models on demand: each sends
        # its requests with multiplexed_model_id set (Serve routes by it).
        self._model_handles: dict[str, DeploymentHandle[EngineReplica]] = {}
        # The ReplicaBoard's ActorHandle (from describe()). Any, not
        # ActorHandle[ReplicaBoard]: Ray types an actor's methods only where
        # they carry @ray.method (ActorHandle.__getattr__ returns Never), and
        # board.py stays a plain class, pickled by value into its actor.
        self._board: Any = None
        # Re-entrant: a stream's __del__ (any thread, any time) takes it too.
        self._lock = threading.RLock()
        # request id -> its open stream, weakly: a dropped stream must be
        # collected (its __del__ cancels the replica's request).
        self._streams: dict[str, weakref.ref[RemoteStream]] = {}
        self._reports: dict[str, tuple[float, ReplicaReport]] = {}
        self._lost: set[str] = set()  # replicas a stream saw die, until their reports age out
        self._polled_at = time.monotonic()
        self._unreachable_since: float | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    # -- what it is ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The Serve application's name."""
        return self._name

    @property
    def model(self) -> ModelCard:
        """The replicas' model card (name, params, ...); raises EngineClosedError before connecting."""
        if self._card is None:
            raise EngineClosedError(
                f"RemoteEngine {self._name!r} is not connected yet; call connect() or enter it"
            )
        return self._card

    @property
    def models(self) -> Mapping[str, ModelCard]:
        """Every served model's card by name, the default first (one model: under its own name);
        raises EngineClosedError before connecting."""
        self.model  # noqa: B018 - raises before connecting
        return MappingProxyType(self._cards)

    @property
    def loaded(self) -> tuple[str, ...] | None:
        """The models on some live replica's device now, when the replicas load them on demand;
        None when every replica holds every model (or there is one)."""
        if not self._model_handles:
            return None
        held: set[str] = set()
        for v in self.replicas():
            if not v.lost and v.report.loaded:
                held.update(v.report.loaded)
        return tuple(name for name in self._cards if name in held)

    @property
    def max_batch_size(self) -> int:
        """The live replicas' batch sizes summed (the card's until a replica has reported)."""
        live = [v.report.max_batch_size for v in self.replicas() if not v.lost]
        if live:
            return sum(live)
        return self._card.max_batch_size if self._card is not None else 1

    def __repr__(self) -> str:
        return f"<RemoteEngine {self._state.value} app={self._name!r}>"

    # -- connecting and lifecycle --------------------------------------------------------

    def connect(self) -> RemoteEngine:
        """Connect to Ray and the application, and fetch the model card (blocking); returns self.

        Raises EngineClosedError when no application ``name`` is running.
        Call it outside an event loop (or from a worker thread).
        """
        if self._card is not None:
            return self
        connect_ray(self._address)
        try:
            handle = serve.get_app_handle(self._name)
            described = handle.describe.remote().result(timeout_s=60)
        except (RayError, RayServeException, TimeoutError) as exc:
            raise EngineClosedError(
                f"no omni_stream application {self._name!r} is reachable on this Ray cluster: {exc}"
            ) from exc
        assert isinstance(described, Description), type(described)
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        if described.routed:
            self._model_handles = {
                name: self._stream_handle.options(multiplexed_model_id=name) for name in described.cards
            }
        self._board = described.board
        self._cards = dict(described.cards)
        self._card = next(iter(self._cards.values()))
        return self

    async def _start(self) -> None:
        """Connect (in a worker thread) if need be, read the reports once, start the poller;
        EngineClosedError when the application is not reachable."""
        if self._card is None:
            await anyio.to_thread.run_sync(self.connect)
        await self.refresh()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._poll_forever)

    async def _shutdown(self) -> None:
        """Stop polling; open streams end with EngineClosedError (their replica requests cancelled).

        The Serve application keeps running (``undeploy`` deletes it).
        """
        for stream in self._open_streams():
            stream._cancel(EngineClosedError("the RemoteEngine was closed", request_id=stream.request_id))
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)

    # -- submitting ------------------------------------------------------------------------

    def _check_open(self, request_id: str | None = None) -> None:
        super()._check_open(request_id)
        h = self.health()
        if h.status == "dead":
            raise EngineDeadError(h.reason or "the deployment is unreachable", request_id=request_id)

    @stream_keywords(RemoteOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RemoteOptions[KeptCheckpoint]]
    ) -> RemoteStream:
        """Submit a request to the deployment (Serve picks the replica); returns its frames.

        ``model``: the served model to run it (None: the default; see
        ``models``). Raises at once ParamsError (field ``model`` for a name
        not among ``models``; params its card refuses, bad options or
        request_id, a request_id still streaming through this RemoteEngine;
        engine/intake.py),
        EngineDeadError (the deployment is unreachable) or
        EngineClosedError. Iterating raises what ``Engine.stream`` does,
        the replica's ParamsError for params only its model refuses, and
        EngineDeadError naming the replica when it is lost.

        ``render``: the replica renders each frame as a server would
        (``RendersFrames``): frames arrive with ``encoded`` set and no tensor.

        ``resume``, ``checkpoint_every`` and ``on_checkpoint`` as
        ``Engine.stream`` takes them (a server's state directory passes
        them): the replica resumes the request from ``resume`` (its frames
        go on at ``resume.step + 1``; ``params`` are checked here against
        the card, the replica runs the checkpoint's) and sends a checkpoint
        every ``checkpoint_every`` steps where its model can snapshot the
        request (the hand-over's interval when not given), which
        ``on_checkpoint(request_id, checkpoint)`` gets as it arrives, on
        the reader's task, as its bytes (a ``KeptCheckpoint``: ``step``,
        ``to_bytes()``); it must not block. A replica that refuses
        ``resume`` (another model, another version) fails the request
        with CheckpointError on iteration, unless the stream's
        ``on_resume_refused`` is set: then it starts again from step 0 and
        that callback hears why.
        """
        request_id = options["request_id"] = check_request_id(options["request_id"])
        render, model, resume = options["render"], options["model"], options["resume"]
        checkpoint_every, on_checkpoint = options["checkpoint_every"], options["on_checkpoint"]
        if render is not None and not isinstance(render, RenderRequest):
            raise ParamsError(
                f"render must be a RenderRequest or None, got {type(render).__name__}",
                field="render",
                request_id=request_id,
            )
        if resume is not None and not isinstance(resume, Checkpoint):
            raise ParamsError(
                f"resume must be a Checkpoint or None, got {type(resume).__name__}",
                field="resume",
                request_id=request_id,
            )
        if checkpoint_every is not None:
            positive_int(checkpoint_every, "checkpoint_every", request_id=request_id)
        self._check_open(request_id)
        name, card = self._model_for(model, request_id)
        with self._lock:
            if self._live(request_id) is not None:
                raise already_running(request_id)
        # Against the card, unless checked against it already (a server in front: CheckedParams).
        checked = check_request(card, params, **pick(options, RequestOptions))
        submit = Submit(
            key=uuid.uuid4().hex,
            request_id=request_id,
            policy=checked.policy,
            timeout=checked.timeout,
            preview_every=checked.preview_every,
            priority=checked.priority,
            window=max(self._window, RENDERED_WINDOW) if render is not None else self._window,
            render=render,
            model=name,
            checkpoint_every=self._checkpoint_every(checkpoint_every, on_checkpoint),
            # (A checkpoint read from bytes, as a restarted server's from its folder, gives those
            # back; one made in this process is encoded here, on the loop.)
            resume=None if resume is None else resume.to_bytes(),
        )
        # Whether the request will wait for its model to load: decided now, with
        # the reports at hand (the server asks as soon as stream() returns).
        loading = self._model_handles != {} and name not in (self.loaded or ())
        # The replica's model validates them once more, in its process: the card checks only the
        # declared params, not what the model's own validate adds (a size multiple, Synthetic's
        # cap, an image's contents), so the replica cannot take this check on trust, and the
        # card cannot run the model's code. It gets the params pinned (the caller's, with the
        # seed drawn here: the one stream.params reports), not checked.params, which a model's
        # validate need not take back (LoRAs). A hand-over sends the same.
        sent = dict(checked.pinned)
        response = self._submit(sent, submit)
        if resume is not None and submit.resume is not None and self.handover.sends_checkpoints:
            # Lost before its first checkpoint of this run, it is handed over from this one.
            self.checkpoints.put(request_id, resume.step, submit.resume)
        stream = RemoteStream(
            self,
            response,
            key=submit.key,
            request_id=request_id,
            total=checked.total,
            params=checked.params,
            model=name,
            loading=loading,
            resubmit=(sent, submit),
            resumed_from=0 if resume is None else resume.step,
            on_checkpoint=on_checkpoint,
        )
        with self._lock:
            self._streams[request_id] = weakref.ref(stream)
        return stream

    def _checkpoint_every(
        self, every: int | None, on_checkpoint: Callable[[str, KeptCheckpoint], None] | None
    ) -> int | None:
        """The steps between two checkpoints the replica is asked to send: the caller's (for its
        ``on_checkpoint``, or for hand-overs), else the hand-over's; None: none are wanted."""
        wanted = on_checkpoint is not None or self.handover.sends_checkpoints
        if not wanted:
            return None
        return every if every is not None else self.handover.checkpoint_every or DEFAULT_CHECKPOINT_EVERY

    def _submit(self, params: Mapping[str, Any] | None, submit: Submit) -> DeploymentResponseGenerator[Item]:
        """``submit`` sent to a replica (Serve picks it; routed by model where replicas load on demand)."""
        handle = self._model_handles.get(submit.model or "", self._stream_handle)
        assert handle is not None  # connected: _check_open passed
        response = handle.stream.remote(params, submit)
        # options(stream=True): Serve returns a generator (typed as either).
        assert isinstance(response, DeploymentResponseGenerator), type(response)
        return response

    def _model_for(self, name: str | None, request_id: str) -> tuple[str, ModelCard]:
        """The served model a request naming ``name`` runs on (None: the default), with its card;
        raises ParamsError (field ``model``) naming the models."""
        cards = self.models
        if name is None:
            return self.default, cards[self.default]
        card = cards.get(name) if isinstance(name, str) else None
        if card is None:
            # ModelRouter's words (a server over either says the same).
            raise ParamsError(
                f"model {str(name)[:64]!r} is not served here; the models are {', '.join(cards)}",
                field="model",
                request_id=request_id,
            )
        return name, card

    def cancel(self, request_id: str) -> bool:
        """Cancel a request on its replica; True if it was still streaming. Safe from any thread.

        Its reader gets RequestCancelledError.
        """
        with self._lock:
            stream = self._live(request_id)
        if stream is None or stream._done:
            return False
        scheduled = self._call_soon_threadsafe(stream._cancel)
        return stream._cancel() if scheduled is None else scheduled

    def _live(self, request_id: str) -> RemoteStream | None:
        ref = self._streams.get(request_id)
        return None if ref is None else ref()

    def _open_streams(self) -> list[RemoteStream]:
        with self._lock:
            streams = [ref() for ref in self._streams.values()]
        return [s for s in streams if s is not None]

    def _forget(self, stream: RemoteStream) -> None:
        with self._lock:
            ref = self._streams.get(stream.request_id)
            if ref is not None and ref() in (stream, None):
                del self._streams[stream.request_id]
                self.checkpoints.discard(stream.request_id)

    def _ack(self, key: str, seq: int) -> None:
        self._board.ack.remote(key, seq)  # fire and forget

    def _cancel_threadsafe(self, response: DeploymentResponseGenerator[Item]) -> None:
        # From a stream's __del__, wherever the collector runs it: here when there is no loop to
        # call onto (on it already, or it has finished).
        if not self._call_soon_threadsafe(cancel_response, response):
            cancel_response(response)

    # -- reports: health and statistics ------------------------------------------------------

    async def refresh(self) -> None:
        """Read every replica's report now (the poller does so every ``poll_s``)."""
        try:
            with anyio.fail_after(_BOARD_TIMEOUT_S):
                snapshot = await self._board.snapshot.remote()
        except (RayError, TimeoutError) as exc:
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
                logger.warning("RemoteEngine %s: the board did not answer: %r", self._name, exc)
            await self._rediscover()
            return
        self._unreachable_since = None
        self._polled_at = time.monotonic()
        reports: dict[str, tuple[float, ReplicaReport]] = {}
        for replica, (age, blob) in snapshot.items():
            try:
                reports[replica] = (age, pickle.loads(blob))
            except Exception:  # noqa: BLE001 - a replica of another version; skip it
                logger.warning("RemoteEngine %s: unreadable report from replica %s", self._name, replica)
        self._reports = reports
        self._lost &= set(reports)
        now = time.monotonic()
        for stream in self._open_streams():
            stream._reack_if_waiting(now)

    async def _rediscover(self) -> None:
        # The board died and Serve made a new one: ask a replica for its handle.
        if self._handle is None:
            return
        try:
            with anyio.fail_after(_BOARD_TIMEOUT_S):
                described = await self._handle.describe.remote()
        except (RayError, TimeoutError):
            return
        self._board = described.board

    async def _poll_forever(self) -> None:
        # A child of the RemoteEngine's task group: raising would cancel the
        # task that entered it (the server's, say). Ray's failures are
        # handled in refresh(); anything else is logged, and polling goes on.
        while True:
            await anyio.sleep(self._poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - see above
                logger.exception("RemoteEngine %s: reading the replicas' reports failed", self._name)

    def replicas(self) -> list[ReplicaView]:
        """Each replica's latest report, its age and whether it counts as lost, by name."""
        since = time.monotonic() - self._polled_at
        aged = {r: (age + since, report) for r, (age, report) in self._reports.items()}
        return view(aged, stale_after_s=self._stale_after_s, known_lost=self._lost)

    def _mark_lost(self, replica: str) -> None:
        # Ray told a reader the replica died: health says so now, not once
        # its report is stale_after_s old.
        self._lost.add(replica)

    def statistics(self) -> GroupStatistics:
        """The live replicas' counters summed, each replica's in ``members`` (as of the last poll)."""
        return sum_statistics([v.report.health.statistics for v in self.replicas() if not v.lost])

    def health(self) -> Health:
        """ok while any replica is ok; stalled when none is (Serve replaces them); dead when the
        deployment has not answered for ``dead_after_s``; closed outside ``async with``."""
        unreachable = None if self._unreachable_since is None else time.monotonic() - self._unreachable_since
        return summarize(
            self.replicas(),
            name=self._name,
            state=self._state.value,
            unreachable_s=unreachable,
            dead_after_s=self._dead_after_s,
        )
