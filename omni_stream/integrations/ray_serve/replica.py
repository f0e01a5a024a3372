"""EngineReplica: one Engine in one Serve replica, streaming to RemoteStreams.

Lifecycle. Serve runs a replica's ``async __init__``, its requests, its
``check_health`` and its ``__del__`` on one event loop but in different
tasks, while an Engine (its anyio task group) must be entered and left in
one task. So ``__init__`` starts one long-lived *owner* task that enters
the engine, publishes reports while it runs, and leaves it when
``__del__`` asks; ``__init__`` returns once the engine is running (or
raises what stopped it, and Serve retries the constructor).

A request (``stream``) is one async generator on that loop: it submits to
the engine (``policy`` as the reader asked: "latest" coalesces on the
engine's single slot, "all" pauses the request), yields a Header, then
frames (rendered here into the preview and result bytes when the reader
sent a RenderRequest: a server in front), and ends with the final frame or
a WireError. It takes a frame from the engine only once fewer than
``window`` frames are unacknowledged (the board relays the
acknowledgements), and with it whatever else the engine has ready
(``take_ready``: up to the window's room for "all"; for "latest" only the
newest and the final), sent as one item (a WireBatch): Serve's streaming
path costs about the same per item whatever it carries, so frames that
are ready together should share one. So the engine never waits on the
network, the frames in transit (counted in frames, not items) stay within
``window`` per request, and the final frame is never dropped. Serve's
cancellation (``DeploymentResponseGenerator.cancel()``) arrives as
CancelledError at the generator's current await (taking a batch never
waits, rendering one awaits per frame); leaving ``async with frames`` then
cancels the engine request, which stops within one step.

Checkpoints (handover.py). A Submit with ``checkpoint_every`` asks for
the request's checkpoints: the engine snapshots it every N steps on its
producer thread and ``on_checkpoint`` hands each to this loop (never
waiting there), where the newest waits in the request's flow; it goes out
as a WireCheckpoint (its bytes made in a worker thread) right after a frame
of its step or later has been yielded, so the front door never holds a
checkpoint ahead of its reader. A model that cannot snapshot the request
runs it without (the Header says so). A Submit with ``resume`` (a
hand-over) goes on from that checkpoint: its frames start after its step.

Several models. Given ``{name: source}``, a replica serves them with a
:class:`~omni_stream.engine.router.ModelRouter` (one Engine per model,
each entered and left by its own task, as the owner task does here) and a
request names its model in its Submit. With ``max_models`` set, the
router loads a model on the first request for it and keeps at most
``max_models`` on the device, unloading the least recently used; and the
replica tells Serve which models it holds through ``@serve.multiplexed``,
so that Serve routes a request (sent with ``multiplexed_model_id``) to a
replica holding its model. Serve's multiplexing only *routes* here: its
"models" are tokens, because it unloads by calling ``__del__`` at once,
while an engine must drain its requests and be closed by the task that
entered it. The two caches see the same requests with the same bound and
both evict the least recently used, so they agree but for a request or
two around an unload; a request routed to a replica that no longer holds
its model is still served, after a load.

Health. ``check_health`` (Serve calls it every ``health_check_period_s``)
raises what ``engine.check_health()`` raises, so Serve replaces a replica
whose engine is dead or stalled. A replica that Serve will replace (its
third failed check in a row, Serve's threshold) first ends its in-flight
requests with EngineDeadError naming it, rather than leaving their readers
to wait out Serve's graceful shutdown (20 s by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import ray
from ray import serve
from ray.exceptions import RayActorError

from ...checkpoint import Checkpoint
from ...engine import Engine, FrameStreamLike
from ...engine.options import RequestOptions, keywords_of
from ...engine.router import ModelRouter
from ...errors import (
    CheckpointError,
    EngineDeadError,
    EngineError,
    OmniStreamError,
    ParamsError,
    RenderFailedError,
    RequestCancelledError,
)
from ...frame import Frame
from ...model import StepModel
from ...preview import Previewer, PreviewSpec, RenderRequest, render_frame
from .card import ModelCard
from .report import ReplicaReport
from .wire import (
    CANCELLED_SEQ,
    Description,
    Header,
    Item,
    Submit,
    WireBatch,
    WireCheckpoint,
    WireError,
    WireFrame,
)

__all__ = ["BOARD", "EngineReplica", "ModelSource", "ModelSources", "ReplicaSettings", "take_ready"]

logger = logging.getLogger("omni_stream.ray_serve")

#: The name of the deployment actor that relays acknowledgements and reports.
BOARD = "omni_stream_board"

#: What a replica builds its model from: a registry spec ("synthetic",
#: "diffusers:ID", "module:attr"), a StepModel (pickled to each replica), or
#: a callable returning one (called once per replica).
ModelSource = str | StepModel | Callable[[], StepModel]
#: One model, or several by name (the first is the default).
ModelSources = ModelSource | Mapping[str, ModelSource]

#: Serve's REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD: failed checks in a row
#: before it stops a replica.
_CHECKS_BEFORE_REPLACEMENT = 3
#: How long one wait on the board for an acknowledgement lasts before the
#: replica looks again (it also looks at once when one arrives).
_ACK_WAIT_S = 2.0
#: A board call that takes longer than this counts as failed.
_BOARD_TIMEOUT_S = 5.0
#: The most frames a ``latest`` batch looks through: the engine's slot
#: refills as fast as the model steps, and the loop must yield to a cancel.
_LATEST_POLLS = 64


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """How a replica behaves.

    ``report_s``: how often it publishes its report. ``shutdown_s``: how
    long ``__del__`` waits for the engine to close. ``max_window``: the
    most frames in transit per request, whatever a reader asks.
    ``reader_timeout_s``: a request whose reader has acknowledged nothing
    for this long, while frames wait for it, is cancelled (its front door
    died without cancelling it, or stopped reading for good).
    """

    report_s: float = 0.25
    shutdown_s: float = 15.0
    max_window: int = 16
    reader_timeout_s: float = 120.0


@dataclass(slots=True)
class _Flow:
    """One request's flow control, on the replica's loop."""

    key: str
    request_id: str
    window: int
    sent: int = 0
    acked: int = 0
    #: Set when the replica ends the request itself (it is being replaced).
    failure: OmniStreamError | None = None
    #: The newest checkpoint not sent yet (the engine's on_checkpoint; handover.py).
    checkpoint: Checkpoint | None = None


def take_ready(frames: FrameStreamLike, first: Frame, *, room: int, latest: bool) -> list[Frame]:
    """``first`` and what ``frames`` has ready now (``poll()``: never waits), as one batch.

    ``room``: the frames the window still allows in transit (at least 1:
    ``first`` was taken with credit). ``latest=False`` (policy ``"all"``):
    up to ``room`` frames in step order, none skipped. ``latest=True``: the
    newest non-final frame and the final one if it came, as a latest
    reader would keep them (only the final when ``room`` is 1); the frames
    in between never cross, and the newest carries the progress.
    """
    room = max(1, room)
    if not latest:
        batch = [first]
        while len(batch) < room and not batch[-1].final and (more := frames.poll()) is not None:
            batch.append(more)
        return batch
    newest, before = first, None
    for _ in range(_LATEST_POLLS):
        if newest.final or (more := frames.poll()) is None:
            break
        newest, before = more, newest
    if newest.final and before is not None and room >= 2:
        return [before, newest]
    return [newest]


def _build_model(source: ModelSource) -> StepModel:
    if isinstance(source, StepModel):
        return source
    if isinstance(source, str):
        from ...models.registry import load_model

        return load_model(source)
    model = source()
    if not isinstance(model, StepModel):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an omni_stream.StepModel")
    return model


def _build_models(sources: Mapping[str, ModelSource]) -> dict[str, StepModel]:
    # Every model is built (host memory), as a ModelRouter wants them: their
    # params are known and checked before any is on the device.
    return {name: _build_model(source) for name, source in sources.items()}


class EngineReplica:
    """The deployment's class: one Engine per replica, or a ModelRouter of several (module docstring)."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async __init__
        self,
        model: ModelSources,
        engine_kwargs: Mapping[str, Any] | None = None,
        settings: ReplicaSettings | None = None,
        max_models: int | None = None,
    ) -> None:
        self._settings = settings or ReplicaSettings()
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._node = ray.get_runtime_context().get_node_id()
        # A copy: Serve pickles the init arguments again after __init__, and
        # a Device instance among them holds threads once its engine runs.
        options = copy.deepcopy(dict(engine_kwargs or {}))
        self._engine: Engine | ModelRouter
        #: Tells Serve's router this replica holds a model (see the module docstring).
        self._hold: Callable[[str], Awaitable[object]] | None = None
        if isinstance(model, Mapping):
            models = await anyio.to_thread.run_sync(_build_models, model)
            self._cards = {name: ModelCard.of(m) for name, m in models.items()}
            self._engine = ModelRouter(models, max_loaded=max_models, **options)
            if max_models is not None:
                self._hold = _routing_cache(max_models)
            where = str(options.get("device", "auto"))
        else:
            built = await anyio.to_thread.run_sync(_build_model, model)
            card = ModelCard.of(built)
            self._cards = {card.name: card}
            self._engine = Engine(built, **options)
            where = self._engine.device.name
        self._default = next(iter(self._cards))
        self._board = serve.get_deployment_actor(BOARD)
        # Renders for readers that send a RenderRequest: one thread, as a
        # server's own default (the producer needs the other core).
        self._previewer = Previewer(threads=1)
        self._flows: dict[str, _Flow] = {}
        self._failed_checks = 0
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._closed = asyncio.Event()
        self._failure: BaseException | None = None
        # The one task that enters and leaves the engine. A root task, like
        # anyio.run's: nothing above it on this loop belongs to us.
        self._owner = asyncio.get_running_loop().create_task(
            self._own(), name=f"omni-stream-replica-{self._replica}"
        )
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure
        logger.info(
            "replica %s: %s on %s, max_batch_size %d",
            self._replica,
            ", ".join(self._cards),
            where,
            self._engine.max_batch_size,
        )

    async def _own(self) -> None:
        try:
            async with self._engine:
                self._ready.set()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._report_forever)
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
        except BaseException as exc:  # noqa: BLE001 - kept for __init__ and check_health
            self._failure = exc
            if not isinstance(exc, asyncio.CancelledError):
                logger.exception("replica %s: the engine's owner task failed", self._replica)
        finally:
            self._ready.set()
            self._closed.set()

    async def __del__(self) -> None:
        # Serve's graceful shutdown, after in-flight requests drained (or its
        # graceful_shutdown_timeout_s passed). Requests still open end with
        # EngineClosedError as the engine closes.
        if not hasattr(self, "_owner"):
            # Serve calls this also on a replica whose __init__ raised before its
            # engine started (a model that failed to build): nothing to stop or leave.
            return
        self._stop.set()
        with anyio.move_on_after(self._settings.shutdown_s):
            await self._closed.wait()
        try:
            with anyio.fail_after(1.0):
                await self._board.leave.remote(self._replica)
        except Exception:  # noqa: BLE001 - the board ages the report out anyway
            pass

    # -- what front doors call ------------------------------------------------------

    async def describe(self) -> Description:
        """The models' cards, the board's handle, this replica's name, whether to route by model."""
        return Description(dict(self._cards), self._board, self._replica, routed=self._hold is not None)

    async def stream(self, params: Mapping[str, Any] | None, submit: Submit) -> AsyncIterator[Item]:
        """One request's items: Header, WireFrames, WireCheckpoints, or a WireError (module docstring)."""
        flow = _Flow(submit.key, submit.request_id, min(max(1, submit.window), self._settings.max_window))
        try:
            self._check_owner()
            name = self._model_name(submit)
            resume = None
            if submit.resume is not None:
                # Checked (sha256) and read off the loop: a few MiB for a large model.
                resume = await anyio.to_thread.run_sync(Checkpoint.from_bytes, submit.resume)
            frames, checkpoints = self._open(params, submit, name, resume, flow)
            spec = submit.render.spec() if submit.render is not None else None
        except OmniStreamError as exc:
            if exc.request_id is None:  # Checkpoint.from_bytes knows no request
                exc.request_id = submit.request_id
            yield WireError.of(exc)
            return
        self._flows[flow.key] = flow
        try:
            async with frames:
                loading = bool(getattr(frames, "loading", False))
                if self._hold is not None:
                    await self._hold(name)
                yield Header(
                    self._replica,
                    frames.request_id,
                    frames.total,
                    loading=loading,
                    window=flow.window,
                    checkpoints=checkpoints,
                    step=0 if resume is None else resume.step,
                )
                latest = submit.policy == "latest"
                while True:
                    await self._credit(flow)
                    if flow.failure is not None:
                        yield WireError.of(flow.failure)
                        return
                    try:
                        first = await frames.__anext__()
                    except StopAsyncIteration:
                        return
                    except OmniStreamError as exc:
                        yield WireError.of(flow.failure or exc)
                        return
                    # What else is ready crosses with it: one item's cost for all.
                    room = flow.window - (flow.sent - flow.acked)
                    batch = take_ready(frames, first, room=room, latest=latest)
                    if spec is not None:
                        assert submit.render is not None
                        try:
                            # Only what crosses is rendered (a latest reader's skipped steps are not).
                            # Each render is an await: a cancel lands between the batch's frames.
                            batch = [
                                await self._render(f, submit.render, spec, name, frames.params) for f in batch
                            ]
                        except RenderFailedError as exc:
                            yield WireError.of(exc)
                            return
                    wired = tuple(WireFrame.of(f, flow.sent + i) for i, f in enumerate(batch, 1))
                    flow.sent += len(wired)
                    yield wired[0] if len(wired) == 1 else WireBatch(wired)
                    if batch[-1].final:
                        return
                    ready = flow.checkpoint
                    # Only behind the frame of its step: a front door resuming from it
                    # has every frame before it (handover.py).
                    if ready is not None and ready.step <= batch[-1].step:
                        flow.checkpoint = None
                        # The bytes (torch.save, sha256) off the loop: the other requests' frames go on.
                        data = await anyio.to_thread.run_sync(ready.to_bytes)
                        yield WireCheckpoint(ready.step, data)
        finally:
            del self._flows[flow.key]
            self._board.forget.remote(flow.key)  # fire and forget

    def _model_name(self, submit: Submit) -> str:
        """The served model ``submit`` names (else the one Serve's request names, else the default);
        raises ParamsError (field ``model``) for a name not served here."""
        # get_multiplexed_model_id(): a caller of the handle of its own may
        # name the model only in .options(multiplexed_model_id=...).
        name = submit.model or serve.get_multiplexed_model_id() or self._default
        if name not in self._cards:
            raise ParamsError(
                f"model {name[:64]!r} is not served here; the models are {', '.join(self._cards)}",
                field="model",
                request_id=submit.request_id,
            )
        return name

    def _open(
        self,
        params: Mapping[str, Any] | None,
        submit: Submit,
        name: str,
        resume: Checkpoint | None,
        flow: _Flow,
    ) -> tuple[FrameStreamLike, bool]:
        """The request submitted to the engine, and whether it sends checkpoints (it was asked to
        and its model can snapshot it). Raises what ``Engine.stream`` raises (CheckpointError for
        a ``resume`` the model refuses)."""
        # A Submit carries stream()'s request keywords under their own names.
        options: dict[str, Any] = {name: getattr(submit, name) for name in keywords_of(RequestOptions)}
        options["resume"] = resume
        if submit.checkpoint_every is not None:
            try:
                frames = self._submit(
                    params,
                    name,
                    {
                        **options,
                        "checkpoint_every": submit.checkpoint_every,
                        "on_checkpoint": self._checkpointer(flow),
                    },
                )
                return frames, True
            except CheckpointError:
                if resume is not None:
                    raise  # the checkpoint itself is refused: the front door's to handle
                # Its model cannot snapshot this request (checked before anything was
                # submitted): it runs without checkpoints, and a hand-over restarts it from 0.
        return self._submit(params, name, options), False

    def _submit(
        self, params: Mapping[str, Any] | None, name: str, options: dict[str, Any]
    ) -> FrameStreamLike:
        # The engine validates ``params`` with the model: the request's one check in this process.
        # The front door's was against the card, which checks less than the model (card.py), so
        # it is not trusted here; its drawn seed is in ``params`` (RemoteEngine.stream), not drawn again.
        if isinstance(self._engine, ModelRouter):
            return self._engine.stream(params, model=name, **options)
        return self._engine.stream(params, **options)

    def _checkpointer(self, flow: _Flow) -> Callable[[str, Checkpoint], None]:
        """The engine's ``on_checkpoint`` for ``flow``'s request."""
        loop = asyncio.get_running_loop()

        def keep(checkpoint: Checkpoint) -> None:
            # (The loop.) The newest wins: only one waits for the next frame to go out.
            if flow.checkpoint is None or checkpoint.step > flow.checkpoint.step:
                flow.checkpoint = checkpoint

        def on_checkpoint(request_id: str, checkpoint: Checkpoint) -> None:
            # The producer thread: hand it to the loop and return (engine.py's contract).
            # RuntimeError: the loop is closed; the replica is going, and the checkpoint with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(keep, checkpoint)

        return on_checkpoint

    async def _render(
        self, frame: Frame, request: RenderRequest, spec: PreviewSpec, model: str, params: Mapping[str, Any]
    ) -> Frame:
        """``frame`` rendered as its reader asked; raises RenderFailedError saying why not."""
        try:
            return await render_frame(
                frame,
                request,
                spec=spec,
                previewer=self._previewer,
                # The result's metadata, as a server writes it for a local engine.
                params={"model": model, **params},
            )
        except Exception as exc:  # noqa: BLE001 - any encoder failure ends the request, said
            what = "the result" if frame.final else f"the preview of step {frame.step}"
            error = RenderFailedError(
                f"replica {self._replica}: could not render {what}: {exc}",
                request_id=frame.request_id,
                step=frame.step,
            )
            raise error from exc

    async def _credit(self, flow: _Flow) -> None:
        """Return once fewer than ``flow.window`` frames are unacknowledged.

        Sets ``flow.failure`` (RequestCancelledError) when the reader has
        acknowledged nothing for ``reader_timeout_s``, or acknowledged
        ``CANCELLED_SEQ`` (it cancelled the stream).
        """
        progress = time.monotonic()
        while flow.sent - flow.acked >= flow.window and flow.failure is None:
            if time.monotonic() - progress > self._settings.reader_timeout_s:
                flow.failure = RequestCancelledError(
                    f"replica {self._replica}: the reader took no frame for "
                    f"{self._settings.reader_timeout_s:.0f} s",
                    request_id=flow.request_id,
                )
                return
            try:
                with anyio.fail_after(_ACK_WAIT_S + _BOARD_TIMEOUT_S):
                    acked = await self._board.wait_acked.remote(
                        flow.key, flow.sent - flow.window + 1, _ACK_WAIT_S
                    )
            except (RayActorError, TimeoutError):
                # The board is being replaced: its state (acks) is lost, and
                # the reader re-sends its latest ack while it waits.
                await self._refresh_board()
                continue
            if acked >= CANCELLED_SEQ:
                flow.failure = RequestCancelledError(
                    f"replica {self._replica}: its reader cancelled it", request_id=flow.request_id
                )
                return
            if acked > flow.acked:
                flow.acked = int(acked)
                progress = time.monotonic()

    # -- health ------------------------------------------------------------------------

    def _check_owner(self) -> None:
        if self._closed.is_set() and not self._stop.is_set():
            error = EngineDeadError(
                f"replica {self._replica}: the engine's owner task ended: {self._failure!r}"
            )
            error.__cause__ = self._failure
            raise error

    async def check_health(self) -> None:
        """Raise EngineDeadError, EngineStalledError or EngineClosedError when the engine is not ok.

        Serve calls it every ``health_check_period_s`` and replaces the
        replica after three failures in a row; before the third raises,
        the requests still open end with EngineDeadError naming this replica.
        """
        try:
            self._check_owner()
            self._engine.check_health()
        except EngineError as exc:
            self._failed_checks += 1
            if self._failed_checks >= _CHECKS_BEFORE_REPLACEMENT:
                self._fail_in_flight(exc)
            raise
        self._failed_checks = 0

    def _fail_in_flight(self, why: EngineError) -> None:
        for flow in list(self._flows.values()):
            if flow.failure is None:
                flow.failure = EngineDeadError(
                    f"replica {self._replica} is being replaced: {why.message}", request_id=flow.request_id
                )
                flow.failure.__cause__ = why
                self._engine.cancel(flow.request_id)

    def report(self) -> ReplicaReport:
        """This replica's report, as published to the board."""
        return ReplicaReport(
            replica=self._replica,
            health=self._engine.health(),
            max_batch_size=self._engine.max_batch_size,
            streams=len(self._flows),
            in_transit=sum(f.sent - f.acked for f in self._flows.values()),
            pid=os.getpid(),
            node=self._node,
            loaded=self._engine.loaded if isinstance(self._engine, ModelRouter) and self._hold else None,
        )

    async def _report_forever(self) -> None:
        while True:
            blob = pickle.dumps(self.report())
            try:
                with anyio.fail_after(_BOARD_TIMEOUT_S):
                    await self._board.report.remote(self._replica, blob)
            except (RayActorError, TimeoutError):
                await self._refresh_board()
            await anyio.sleep(self._settings.report_s)

    async def _refresh_board(self) -> None:
        # Serve recreates a deployment actor that died; until then the name
        # does not resolve (ValueError). Back off a little either way.
        await anyio.sleep(0.2)
        try:
            self._board = serve.get_deployment_actor(BOARD)
        except ValueError:
            logger.warning("replica %s: the board is not back yet", self._replica)


def _routing_cache(max_models: int) -> Callable[[str], Awaitable[object]]:
    """A ``@serve.multiplexed`` function of its own for one replica (the bound is per deployment).

    Calling it with a model's name records the name in Serve's per-replica
    cache, which Serve reports to its routers so that requests with that
    ``multiplexed_model_id`` come here. It returns the name: a token that
    needs no unloading (the ModelRouter unloads the model itself).
    """

    async def hold(model_id: str) -> str:
        return model_id

    cache: Callable[[str], Awaitable[object]] = serve.multiplexed(max_num_models_per_replica=max_models)(hold)
    return cache
