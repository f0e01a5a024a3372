"""ModelRouter: several models behind one engine, each loaded on demand.

``serve --model sd=diffusers:DIR --model mix=mixture`` serves two models
from one process. Each model gets an :class:`~omni_stream.engine.Engine` of
its own (its producer thread, its batches: requests on different models
never share a model call), and a request names its model (``model=`` on
:meth:`ModelRouter.stream`, the ``model`` field on the wire; the first
model when it names none).

Every model is built when the router is made (its weights in host memory,
its params known, so requests are checked before anything loads). *Loaded*
means on the device in a running engine. With ``max_loaded=None`` every
model loads at start; with ``max_loaded=N`` models load when a request
needs them, and at most ``N`` are loaded at once: loading another unloads
one (the model's ``unload()`` hook moves its weights off the device; a
diffusers pipeline goes back to the CPU). ComfyUI and AUTOMATIC1111 keep
checkpoints the same way; vLLM-Omni loads one model per server.

Residency: which loaded model makes room, and when (a quantum,
``min_residency_s``, then the scheduling policy; at most
``max_swaps_per_min`` switches a minute), is engine/residency.py's rules.
The router hands a model's running requests over to the host when it
gives way (``Engine.offload``, ``Engine.hand_over``), and they go on where
they stopped when it loads again. A request its client paused holds no
model: handed over to the host with the rest, it asks for its model again
only when resumed.

Who waits on whom: a request whose model is not loaded waits in its
stream's ``__anext__`` (its :attr:`RoutedStream.loading` is True
meanwhile: the server says ``loading``); loads run one at a time in the
router's own tasks, never in a reader's, so a reader that leaves does not
abort a load that others wait for. A model chosen for unloading takes no
new requests (they wait for it to load again). A model that fails to load
fails the requests waiting for it (EngineDeadError) and the next request
tries again; the router's health stays ok while the loaded engines are.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from ..checkpoint import Checkpoint
from ..device import Device, resolve_device
from ..errors import CheckpointError, EngineDeadError, ParamsError, RequestCancelledError
from ..frame import Frame
from ..ids import model_name_problem
from ..lifecycle import Lifecycle
from ..model import StepModel
from ..params import positive_int
from .engine import Engine, HandedOver, pause_refusal
from .facade import RoutingFacade, first_dead
from .group import _sum_statistics
from .intake import CheckedRequest, already_running, check_checkpointed, check_request_id
from .like import FrameStreamLike
from .options import Checkpointing, Ordering, RequestOptions, RoutedOptions, pick, stream_keywords
from .residency import MAX_SWAPS_PER_MIN_ENV, MIN_RESIDENCY_ENV, Residency, Resident
from .stats import EngineStatistics, Health

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = [
    "MAX_SWAPS_PER_MIN_ENV",
    "MIN_RESIDENCY_ENV",
    "ModelRouter",
    "RoutedStream",
    "check_model_name",
]

logger = logging.getLogger("omni_stream.engine")

#: The producer says nothing when it has moved a paused state to the host: an unload looks
#: again this often (it takes the step in progress, at most).
_HAND_OVER_POLL_S = 0.005


def check_model_name(name: object) -> str:
    """``name`` if it is a model name (omni_stream/ids.py's rule); raises ParamsError (field ``model``)."""
    problem = model_name_problem(name, name="model name")
    if problem is not None:
        raise ParamsError(problem, field="model")
    assert isinstance(name, str)
    return name


@dataclass(eq=False)
class _Slot:
    """One model and, while it is loaded, its engine."""

    name: str
    model: StepModel
    engine: Engine | None = None
    loading: bool = False
    #: Chosen for unloading: takes no new requests until it loads again.
    draining: bool = False
    active: int = 0  # streams holding this engine
    last_used: float = 0.0
    stop: anyio.Event | None = None  # set to close its engine (made when it loads)
    error: BaseException | None = None  # why its last load failed
    attempt: int = 0  # loads begun
    failed_attempt: int = -1  # the last load that failed
    loads: int = 0
    load_s: float = 0.0  # how long its last load took
    unload_s: float = 0.0
    loaded_at: float = 0.0  # when its engine was last ready: its residency counts from here

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining


class RoutedStream(FrameStreamLike):
    """One request's frames from its model's engine, once that model is loaded."""

    def __init__(
        self,
        router: ModelRouter,
        slot: _Slot,
        request: CheckedRequest,
        *,
        submit: dict[str, Any] | None = None,
    ) -> None:
        self._router = router
        self._slot = slot
        self._request = request
        self._submit = submit or {}  # Engine.submit's checkpoint keywords
        self._inner: FrameStreamLike | None = None
        #: Its frames from the engine it was handed over from, still to read (then it goes on).
        self._old: FrameStreamLike | None = None
        self._holds = False  # it counts in its slot's ``active`` (it holds the engine)
        #: Its client paused it (ModelRouter.pause): in an engine or not, it keeps no model loaded.
        self._paused = False
        self._leaving = False  # an unload is handing it over
        self._step = 0  # the last step its reader took (or its checkpoint's): what it has left
        self._waiting_since = time.monotonic()  # when it last began to wait for its model
        self._cancelled = False
        self._closed = False
        #: Called when it is handed over and waits for its model again (the server says ``loading``).
        self.on_loading: Callable[[], None] | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def total(self) -> int:
        return self._request.total

    @property
    def params(self) -> Mapping[str, Any]:
        """The request's params as its model checked them, defaults filled in."""
        return self._request.params

    @property
    def model(self) -> str:
        """The name of the model that runs the request."""
        return self._slot.name

    @property
    def remaining(self) -> int:
        """Steps it has left, as far as its reader has seen (the router's policy ranks by it)."""
        return self._request.total - self._step

    @property
    def loading(self) -> bool:
        """True while the request waits for its model to load (no frame can come before)."""
        return self._inner is None and not self._closed and not self._slot.ready

    async def __anext__(self) -> Frame:
        while True:
            old = self._old
            if old is not None:
                # Handed over: the frames its last engine made come first, then its end there.
                try:
                    return await old.__anext__()
                except RequestCancelledError:
                    if self._old is old:
                        self._old = None
                    continue
                except BaseException:
                    self._release()
                    raise
            if self._inner is None:
                if self._closed:
                    raise StopAsyncIteration
                self._inner = await self._router._open(self)
            inner = self._inner
            try:
                frame = await inner.__anext__()
            except RequestCancelledError:
                if self._old is inner:
                    # Handed over while this reader waited (its frames are all read): go on.
                    self._old = None
                    continue
                self._release()
                raise
            except BaseException:
                self._release()
                raise
            self._step = frame.step
            if frame.final:
                self._release()
            return frame

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None (always None while loading)."""
        if self._inner is None:
            return None
        frame = self._inner.poll()
        if frame is not None:
            self._step = frame.step
            if frame.final:
                self._release()
        return frame

    async def aclose(self) -> None:
        """Stop the request (or its wait for the model); idempotent."""
        self._closed = True
        self._router._forget(self)
        try:
            for inner in (self._old, self._inner):
                if inner is not None:
                    await inner.aclose()
        finally:
            self._release()

    def _cancel(self) -> None:
        self._cancelled = True
        self._router._notify()

    def __del__(self) -> None:
        # The inner stream's own __del__ cancels the request; this lets its model unload.
        if getattr(self, "_holds", False):
            self._holds = False
            self._slot.active -= 1
            # Waiters see it at the next change (a finalizer may run where no event loop does).

    def _release(self) -> None:
        """It ended: it holds its engine no more, and the router forgets it."""
        self._leave()
        self._router._forget(self)

    def _leave(self) -> None:
        if self._holds:
            self._holds = False
            self._router._release(self._slot)

    def _hand_over(self, handed: HandedOver) -> None:
        """Its engine gave it up (an unload): the next ``__anext__`` reads what that engine made,
        then waits for its model and goes on from ``handed.checkpoint`` there."""
        self._old, self._inner = self._inner, None
        self._submit["resume"] = handed.checkpoint
        self._step = handed.step
        self._leaving = False
        self._leave()
        if self.on_loading is not None and not self._paused:
            self.on_loading()


class ModelRouter(RoutingFacade):
    """Several models behind one engine interface (see the module docstring).

    ``ModelRouter({"sd": sd_model, "mix": mixture}, max_loaded=None,
    **engine_options)``: the first model is the default; ``max_loaded``
    (None: all, loaded at start) bounds the models loaded at once;
    ``min_residency_s`` and ``max_swaps_per_min`` (None: their environment
    variables, else the defaults) bound how often they change
    (engine/residency.py); ``engine_options`` go to each model's :class:`Engine`
    (``device``, ``max_batch_size``, ``scheduling``, ...). Enter it with
    ``async with``. Raises ParamsError for no models, a bad name, a bad
    ``max_loaded``, ``min_residency_s`` or ``max_swaps_per_min``.
    """

    _noun = "model router"

    def __init__(
        self,
        models: Mapping[str, StepModel],
        *,
        max_loaded: int | None = None,
        min_residency_s: float | None = None,
        max_swaps_per_min: int | None = None,
        **engine_options: Any,
    ) -> None:
        self._residency = Residency(
            min_residency_s=min_residency_s,
            max_swaps_per_min=max_swaps_per_min,
            scheduling=str(engine_options.get("scheduling", "preemptive")),
        )
        if not models:
            raise ParamsError("a ModelRouter needs at least one model", field="models")
        for name, model in models.items():
            check_model_name(name)
            if not isinstance(model, StepModel):
                raise ParamsError(
                    f"model {name!r} is a {type(model).__name__}, not an omni_stream.StepModel",
                    field="models",
                )
        if max_loaded is not None:
            positive_int(max_loaded, "max_loaded")
        self._slots = {name: _Slot(name, model) for name, model in models.items()}
        self._device: Device | None = None  # resolved from the options on first ask
        self._default = next(iter(self._slots))
        self._max_loaded = max_loaded
        self._engine_options = dict(engine_options)
        super().__init__()
        self._tg: anyio.abc.TaskGroup | None = None
        # Made in start(): anyio's primitives need the running backend.
        self._changed: anyio.Event | None = None
        # One load at a time: a model's weights arrive while no other is moving.
        self._load_lock: anyio.Lock | None = None
        # By request id, until they end; weak: a dropped stream's __del__ releases its engine.
        self._streams: weakref.WeakValueDictionary[str, RoutedStream] = weakref.WeakValueDictionary()
        self._retired: list[EngineStatistics] = []  # the counters of engines unloaded

    # -- what a server reads -----------------------------------------------------------

    @property
    def models(self) -> Mapping[str, StepModel]:
        """The models by name, the default first."""
        return MappingProxyType({name: slot.model for name, slot in self._slots.items()})

    @property
    def model(self) -> StepModel:
        """The default model."""
        return self._slots[self._default].model

    @property
    def device(self) -> Device:
        """The device its engines compute on (one for all: they share its options): a loaded
        engine's, else the one its ``device`` option names. What a server reads to size
        ``max_active`` (the host's CPU takes 4 requests an engine, an accelerator two batches),
        so a server of several models sizes as a server of one."""
        for slot in self._slots.values():
            if slot.engine is not None:
                return slot.engine.device
        if self._device is None:
            self._device = resolve_device(self._engine_options.get("device", "auto"))
        return self._device

    @property
    def loaded(self) -> tuple[str, ...]:
        """The names of the models loaded now."""
        return tuple(name for name, slot in self._slots.items() if slot.engine is not None)

    @property
    def max_loaded(self) -> int | None:
        return self._max_loaded

    @property
    def max_batch_size(self) -> int:
        """The most requests one model call advances, over the models (each its own engine)."""
        option = int(self._engine_options.get("max_batch_size", 8))
        return max(min(option, slot.model.max_batch_size) for slot in self._slots.values())

    @property
    def min_residency_s(self) -> float:
        """Seconds a model in use stays loaded before another may take its place."""
        return self._residency.min_residency_s

    @property
    def max_swaps_per_min(self) -> int:
        """The most model switches (an unload to load another) in any minute."""
        return self._residency.max_swaps_per_min

    @property
    def swaps(self) -> int:
        """Swaps (an unload to load another) since start."""
        return self._residency.swaps

    def loads(self) -> dict[str, int]:
        """``{name: times it was loaded}`` since start."""
        return {name: slot.loads for name, slot in self._slots.items()}

    def load_times(self) -> dict[str, tuple[float, float]]:
        """``{name: (seconds its last load took, seconds its last unload took)}``."""
        return {name: (slot.load_s, slot.unload_s) for name, slot in self._slots.items()}

    def __repr__(self) -> str:
        return f"ModelRouter({', '.join(self._slots)}; loaded {', '.join(self.loaded) or 'none'})"

    # -- life --------------------------------------------------------------------------

    async def _start(self) -> None:
        """With ``max_loaded=None`` load every model, in order; raises EngineDeadError when one
        fails to load (start() then closes the router)."""
        self._changed = anyio.Event()
        self._load_lock = anyio.Lock()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        if self._max_loaded is None:
            for slot in self._slots.values():
                slot.attempt += 1
                await self._load(slot)
                if slot.error is not None:
                    error = slot.error
                    raise EngineDeadError(f"model {slot.name!r} failed to load: {error}") from error

    async def _shutdown(self) -> None:
        """Close every loaded engine (their streams end with EngineClosedError)."""
        self._notify()  # waiting streams see the state and end
        for slot in self._slots.values():
            if slot.stop is not None:
                slot.stop.set()
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)

    # -- requests ----------------------------------------------------------------------

    @stream_keywords(RoutedOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RoutedOptions[Checkpoint]]
    ) -> RoutedStream:
        """Submit a request to ``model`` (the default when None); returns its frames. ``resume``,
        ``checkpoint_every`` and ``on_checkpoint`` as ``Engine.stream``'s.

        Checked at once against that model (engine/intake.py), whether it is
        loaded or not. Raises ParamsError (field ``model`` for a name that is
        not one of the models, listing them; else as ``Engine.stream``),
        EngineClosedError; iterating raises as ``Engine.stream``'s frames do,
        and EngineDeadError when the model fails to load.
        """
        request_id = options["request_id"] = check_request_id(options["request_id"])
        self._check_open(request_id)
        slot = self._slot(options["model"], request_id)
        if request_id in self._streams:
            raise already_running(request_id)
        checked = check_checkpointed(
            slot.model,
            params,
            resume=options["resume"],
            checkpoint_every=options["checkpoint_every"],
            **pick(options, RequestOptions),
        )
        submit = {**pick(options, Checkpointing), **pick(options, Ordering)}
        stream = RoutedStream(self, slot, checked, submit=submit)
        self._streams[request_id] = stream
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a request, loaded or waiting for its model; True if it was still running."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        engine = stream._slot.engine
        if stream._inner is not None and engine is not None:
            return engine.cancel(request_id)
        stream._cancel()
        return True

    def pause(self, request_id: str, *, to_host: bool = False) -> bool:
        """Pause a request: ``Engine.pause`` on the engine running it, or, while it waits for its
        model (loading, or handed over by an unload), it stays out of every engine until
        :meth:`resume`. Either way it keeps no model loaded: an unload hands it over to the host.
        False for one paused already, one not here, and one its model cannot stop between two
        steps (:meth:`pause_refusal`)."""
        stream = self._streams.get(request_id)
        if stream is None or stream._paused or stream._closed or self.pause_refusal(request_id):
            return False
        engine = stream._slot.engine
        in_engine = stream._inner is not None and not stream._leaving
        if in_engine and (engine is None or not engine.pause(request_id, to_host=to_host)):
            return False
        stream._paused = True
        self._notify()  # its model may be free to unload now
        return True

    def pause_refusal(self, request_id: str) -> str | None:
        """Why :meth:`pause` refuses ``request_id`` whatever its progress (its model cannot stop it
        between two steps: ``engine.pause_refusal``), or None. Known while it waits for its model."""
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        return pause_refusal(stream._slot.model, stream.params, request_id)

    def resume(self, request_id: str) -> bool:
        """Resume a request :meth:`pause` paused: ``Engine.resume`` in its engine, or, out of
        every engine, it asks for its model again. False for one that is not paused."""
        stream = self._streams.get(request_id)
        if stream is None or not stream._paused:
            return False
        if stream._inner is not None and not stream._leaving:
            engine = stream._slot.engine
            if engine is None or not engine.resume(request_id):
                return False
        stream._paused = False
        stream._waiting_since = time.monotonic()  # its wait for its model starts now
        if stream._inner is None and stream.loading and stream.on_loading is not None:
            stream.on_loading()  # out of every engine, its model unloaded meanwhile
        self._notify()  # a reader waiting out of every engine goes on
        return True

    # -- health ------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """The loaded engines' counters, plus those of engines unloaded since start."""
        live = [slot.engine.statistics() for slot in self._slots.values() if slot.engine is not None]
        members = live + self._retired
        if not members:
            return EngineStatistics(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        total = _sum_statistics(members)
        queued = sum(1 for s in self._streams.values() if s._inner is None)
        return EngineStatistics(
            **{
                **{f: getattr(total, f) for f in EngineStatistics.__dataclass_fields__},
                "queued": total.queued + queued,
            }
        )

    def health(self) -> Health:
        """ok while every loaded engine is (none loaded: ok, the models load on demand);
        else the first one's status that is not, naming its model."""
        stats = self.statistics()
        device = str(self._engine_options.get("device", "auto"))
        closed = self._lifecycle_health(stats, device)
        if closed is not None:
            return closed
        for name, slot in self._slots.items():
            if slot.engine is None:
                continue
            health = slot.engine.health()
            if health.status == "closed" and slot.draining:
                continue  # unloading: closed on purpose, not a router that cannot serve
            if not health.ok:
                return Health(health.status, f"model {name!r}: {health.reason}", stats, health.device)
        failed = [f"model {s.name!r} failed to load: {s.error}" for s in self._slots.values() if s.error]
        return Health("ok", "; ".join(failed) or None, stats, device)

    def _death_cause(self) -> BaseException | None:
        return first_dead(slot.engine for slot in self._slots.values() if slot.engine is not None)

    # -- inside ------------------------------------------------------------------------

    def _slot(self, name: str | None, request_id: str | None) -> _Slot:
        slot = self._slots.get(self._default if name is None else name)
        if slot is None:
            raise ParamsError(
                f"model {str(name)[:64]!r} is not served here; the models are {', '.join(self._slots)}",
                field="model",
                request_id=request_id,
            )
        return slot

    def _notify(self) -> None:
        """Wake every task waiting for a change (a load, an unload, a stream's end)."""
        changed = self._changed
        if changed is not None:
            self._changed = anyio.Event()
            changed.set()

    async def _wait_change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    async def _open(self, stream: RoutedStream) -> FrameStreamLike:
        """The request's frames from its model's engine, loading the model first if need be."""
        slot = stream._slot
        request_id = stream.request_id
        waited = -2  # the load attempt this request waits for (none yet)
        stream._waiting_since = time.monotonic()
        if not slot.ready:
            self._notify()  # one more waiter: a load waiting to make room decides again
        while True:
            self._check_open(request_id)
            if stream._cancelled:
                raise RequestCancelledError("request cancelled while its model loaded", request_id=request_id)
            if stream._paused:
                # Paused out of every engine (its state on the host): it wants no model until
                # it is resumed.
                await self._wait_change()
                continue
            if slot.ready:
                assert slot.engine is not None
                inner = slot.engine.submit(stream._request, **stream._submit)
                slot.active += 1
                stream._holds = True
                slot.last_used = time.monotonic()
                return inner
            if slot.loading:
                waited = slot.attempt
            elif slot.engine is None:
                if waited == slot.failed_attempt:
                    # The load this request waited for failed: it fails with it
                    # (a later request tries again).
                    raise EngineDeadError(
                        f"model {slot.name!r} failed to load: {slot.error}", request_id=request_id
                    ) from slot.error
                slot.loading = True
                slot.attempt += 1
                waited = slot.attempt
                assert self._tg is not None
                self._tg.start_soon(self._load, slot)
            await self._wait_change()

    async def _load(self, slot: _Slot) -> None:
        """Load ``slot``'s model (a router task), first making room when ``max_loaded`` are (the
        module docstring: whose, when); a failure is kept in ``slot.error`` for the requests
        waiting. Gives up when nobody waits for it any more."""
        slot.loading = True
        assert self._load_lock is not None
        try:
            async with self._load_lock:
                while self._max_loaded is not None and len(self.loaded) >= self._max_loaded:
                    if self._state is not Lifecycle.RUNNING or not self._wanted(slot):
                        return  # closing, or its requests left while it waited: no switch for nobody
                    victim, wait = self._victim(slot)
                    if victim is not None:
                        budget = self._residency.swap_wait(time.monotonic())
                        if budget <= 0:
                            await self._unload(victim)
                            continue
                        wait = min(wait, budget)
                    with anyio.move_on_after(wait):
                        await self._wait_change()
                if self._state is not Lifecycle.RUNNING:
                    return
                started = time.monotonic()
                assert self._tg is not None
                await self._tg.start(self._own, slot)
                slot.loaded_at = time.monotonic()
                slot.load_s = slot.loaded_at - started
                slot.loads += 1
                logger.info("model %s loaded in %.2f s", slot.name, slot.load_s)
        except Exception as exc:  # noqa: BLE001 - any failure of a model's load is its requests' error
            slot.error = exc
            slot.failed_attempt = slot.attempt
            logger.error("model %s failed to load: %s", slot.name, exc, exc_info=exc)
        finally:
            slot.loading = False
            self._notify()

    def _streams_of(self, slot: _Slot) -> list[RoutedStream]:
        return [s for s in list(self._streams.values()) if s._slot is slot and not s._closed]

    def _wanted(self, slot: _Slot) -> bool:
        """Whether a request waits for ``slot``'s model (not paused, not cancelled)."""
        return any(s._inner is None and not s._paused and not s._cancelled for s in self._streams_of(slot))

    def _in_use(self, slot: _Slot) -> bool:
        """Whether a request runs in ``slot``'s engine (one its client paused does not count) or
        waits for it."""
        return any(not s._paused and not s._cancelled for s in self._streams_of(slot))

    def _victim(self, wanted: _Slot) -> tuple[_Slot | None, float]:
        """The loaded model to make room for ``wanted`` now, or None and the seconds until one
        may (engine/residency.py's rules, told what the router sees)."""
        residents = {
            slot: Resident(slot.loaded_at, slot.last_used, self._in_use(slot), self._running(slot))
            for slot in self._slots.values()
            if slot.engine is not None and slot is not wanted
        }
        waiting = [
            (s.remaining, s._waiting_since)
            for s in self._streams_of(wanted)
            if s._inner is None and not s._paused
        ]
        return self._residency.victim(residents, waiting, time.monotonic())

    def _running(self, slot: _Slot) -> tuple[int, ...]:
        """The steps left of each request running in ``slot``'s engine, not paused by its client."""
        return tuple(s.remaining for s in self._streams_of(slot) if s._inner is not None and not s._paused)

    async def _unload(self, slot: _Slot) -> None:
        """Make ``slot`` give up the device: no new requests; its running ones handed over to the
        host (``Residency.preempts``; those its client paused always) or run to their end; then its
        engine closes and its model moves off."""
        slot.draining = True
        self._residency.swapped(time.monotonic())
        moving: list[RoutedStream] = []
        try:
            engine = slot.engine
            if engine is not None:
                for stream in self._streams_of(slot):
                    if stream._inner is None or not (stream._paused or self._residency.preempts):
                        continue
                    if engine.offload(stream.request_id):
                        stream._leaving = True
                        moving.append(stream)
            while slot.active:
                for stream in list(moving):
                    if self._handed_over(engine, stream):
                        moving.remove(stream)
                if not slot.active:
                    break
                # The producer says nothing when it has moved a state to the host: look again
                # after a moment, or at the next change (a request's end).
                with anyio.move_on_after(_HAND_OVER_POLL_S if moving else math.inf):
                    await self._wait_change()
            started = time.monotonic()
            engine = slot.engine
            if slot.stop is not None:
                slot.stop.set()
            while slot.engine is not None:
                await self._wait_change()
            if engine is not None:
                self._retired.append(engine.statistics())
            unload = getattr(slot.model, "unload", None)
            if callable(unload):
                # Moving weights off the device takes a while: not on the event loop.
                await anyio.to_thread.run_sync(unload)
            slot.unload_s = time.monotonic() - started
            logger.info("model %s unloaded in %.2f s", slot.name, slot.unload_s)
        finally:
            slot.draining = False
            for stream in moving:
                stream._leaving = False

    def _handed_over(self, engine: Engine | None, stream: RoutedStream) -> bool:
        """Take ``stream``'s request out of ``engine`` if it is ready (its state on the host);
        whether it is done with (handed over, ended, or it must run to its end here)."""
        if engine is None or stream._inner is None:
            return True
        request_id = stream.request_id
        try:
            handed = engine.hand_over(request_id)
        except RequestCancelledError:
            stream._leaving = False
            return True  # it ended meanwhile: its reader releases the engine
        except CheckpointError as exc:
            logger.warning(
                "request %s stays on model %s until it ends: %s", request_id, stream._slot.name, exc
            )
            stream._leaving = False
            if not stream._paused:
                engine.resume(request_id)
            return True
        if handed is None:
            return False
        stream._hand_over(handed)
        logger.debug(
            "request %s handed over at step %d (model %s unloads)", request_id, handed.step, stream._slot.name
        )
        return True

    async def _own(self, slot: _Slot, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run ``slot``'s engine from start to close in one task (an Engine is entered and left
        by the same task); started once its model is on the device."""
        engine = Engine(slot.model, **self._engine_options)
        slot.stop = anyio.Event()
        try:
            async with engine:
                await engine.wait_loaded()
                slot.engine = engine
                task_status.started()
                await slot.stop.wait()
        finally:
            slot.engine = None
            self._notify()

    def _release(self, slot: _Slot) -> None:
        slot.active -= 1
        slot.last_used = time.monotonic()
        self._notify()

    def _forget(self, stream: RoutedStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
