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
the least recently used one, once the requests it runs have ended (the
model's ``unload()`` hook moves its weights off the device; a diffusers
pipeline goes back to the CPU). ComfyUI and AUTOMATIC1111 keep checkpoints
the same way; vLLM-Omni loads one model per server.

Who waits on whom: a request whose model is not loaded waits in its
stream's first ``__anext__`` (its :attr:`RoutedStream.loading` is True
meanwhile: the server says ``loading``); loads run one at a time in the
router's own tasks, never in a reader's, so a reader that leaves does not
abort a load that others wait for. A model chosen for unloading takes no
new requests (they wait for it to load again), so a busy model cannot keep
another out forever. A model that fails to load fails the requests waiting
for it (EngineDeadError) and the next request tries again; the router's
health stays ok while the loaded engines are.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from ..checkpoint import Checkpoint
from ..errors import EngineClosedError, EngineDeadError, ParamsError, RequestCancelledError
from ..frame import Frame
from ..ids import model_name_problem
from ..lifecycle import Lifecycle
from ..model import StepModel
from ..params import positive_int
from .engine import Engine, pause_refusal
from .group import _sum_statistics
from .intake import CheckedRequest, already_running, check_checkpointed, check_request_id
from .like import FrameStreamLike, final_frame
from .stats import EngineStatistics, Health

__all__ = ["ModelRouter", "RoutedStream", "check_model_name"]

logger = logging.getLogger("omni_stream.engine")

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

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining


class RoutedStream:
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
        self._cancelled = False
        self._released = False
        self._closed = False

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
    def loading(self) -> bool:
        """True while the request waits for its model to load (no frame can come before)."""
        return self._inner is None and not self._closed and not self._slot.ready

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        if self._inner is None:
            if self._closed:
                raise StopAsyncIteration
            self._inner = await self._router._open(self)
        try:
            frame = await self._inner.__anext__()
        except BaseException:
            self._release()
            raise
        if frame.final:
            self._release()
        return frame

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None (always None while loading)."""
        if self._inner is None:
            return None
        frame = self._inner.poll()
        if frame is not None and frame.final:
            self._release()
        return frame

    async def aclose(self) -> None:
        """Stop the request (or its wait for the model); idempotent."""
        self._closed = True
        self._router._forget(self)
        try:
            if self._inner is not None:
                await self._inner.aclose()
        finally:
            self._release()

    async def __aenter__(self) -> RoutedStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _cancel(self) -> None:
        self._cancelled = True
        self._router._notify()

    def __del__(self) -> None:
        # The inner stream's own __del__ cancels the request; this lets its model unload.
        if not getattr(self, "_released", True) and getattr(self, "_inner", None) is not None:
            self._released = True
            self._slot.active -= 1
            # Waiters see it at the next change (a finalizer may run where no event loop does).

    def _release(self) -> None:
        if not self._released and self._inner is not None:
            self._released = True
            self._router._release(self._slot)
        self._router._forget(self)


class ModelRouter:
    """Several models behind one engine interface (see the module docstring).

    ``ModelRouter({"sd": sd_model, "mix": mixture}, max_loaded=None,
    **engine_options)``: the first model is the default; ``max_loaded``
    (None: all, loaded at start) bounds the models loaded at once;
    ``engine_options`` go to each model's :class:`Engine` (``device``,
    ``max_batch_size``, ...). Enter it with ``async with``. Raises
    ParamsError for no models, a bad name or a bad ``max_loaded``.
    """

    def __init__(
        self,
        models: Mapping[str, StepModel],
        *,
        max_loaded: int | None = None,
        **engine_options: Any,
    ) -> None:
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
        self._default = next(iter(self._slots))
        self._max_loaded = max_loaded
        self._engine_options = dict(engine_options)
        self._state = Lifecycle.NEW
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
    def default(self) -> str:
        """The name of the model a request that names none runs on: the first."""
        return self._default

    @property
    def model(self) -> StepModel:
        """The default model."""
        return self._slots[self._default].model

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

    def load_times(self) -> dict[str, tuple[float, float]]:
        """``{name: (seconds its last load took, seconds its last unload took)}``."""
        return {name: (slot.load_s, slot.unload_s) for name, slot in self._slots.items()}

    def __repr__(self) -> str:
        return f"ModelRouter({', '.join(self._slots)}; loaded {', '.join(self.loaded) or 'none'})"

    # -- life --------------------------------------------------------------------------

    async def __aenter__(self) -> ModelRouter:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start; with ``max_loaded=None`` load every model, in order. Raises EngineClosedError
        if started before, EngineDeadError (and closes) when a model fails to load at start."""
        if self._state is not Lifecycle.NEW:
            raise EngineClosedError("a ModelRouter can be started once; create a new one")
        self._state = Lifecycle.RUNNING
        self._changed = anyio.Event()
        self._load_lock = anyio.Lock()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._max_loaded is None:
            try:
                for slot in self._slots.values():
                    slot.attempt += 1
                    await self._load(slot)
                    if slot.error is not None:
                        error = slot.error
                        raise EngineDeadError(f"model {slot.name!r} failed to load: {error}") from error
            except BaseException:
                await self.aclose()
                raise

    async def aclose(self) -> None:
        """Close every loaded engine (their streams end with EngineClosedError); idempotent."""
        if self._state.ending or self._state is Lifecycle.NEW:
            self._state = Lifecycle.CLOSED
            return
        self._state = Lifecycle.CLOSING
        self._notify()  # waiting streams see the state and end
        for slot in self._slots.values():
            if slot.stop is not None:
                slot.stop.set()
        tg, self._tg = self._tg, None
        try:
            if tg is not None:
                await tg.__aexit__(None, None, None)
        finally:
            self._state = Lifecycle.CLOSED

    # -- requests ----------------------------------------------------------------------

    def stream(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        policy: str = "all",
        timeout: float | None = None,
        preview_every: int | None = None,
        priority: int = 0,
        resume: Checkpoint | None = None,
        checkpoint_every: int | None = None,
        on_checkpoint: Callable[[str, Checkpoint], None] | None = None,
    ) -> RoutedStream:
        """Submit a request to ``model`` (the default when None); returns its frames. ``resume``,
        ``checkpoint_every`` and ``on_checkpoint`` as ``Engine.stream``'s.

        Checked at once against that model (engine/intake.py), whether it is
        loaded or not. Raises ParamsError (field ``model`` for a name that is
        not one of the models, listing them; else as ``Engine.stream``),
        EngineClosedError; iterating raises as ``Engine.stream``'s frames do,
        and EngineDeadError when the model fails to load.
        """
        request_id = check_request_id(request_id)
        self._check_open(request_id)
        slot = self._slot(model, request_id)
        if request_id in self._streams:
            raise already_running(request_id)
        checked = check_checkpointed(
            slot.model, params, resume=resume, checkpoint_every=checkpoint_every, request_id=request_id,
            policy=policy, timeout=timeout, preview_every=preview_every, priority=priority,
        )
        stream = RoutedStream(
            self, slot, checked,
            submit={"resume": resume, "checkpoint_every": checkpoint_every, "on_checkpoint": on_checkpoint},
        )
        self._streams[request_id] = stream
        return stream

    async def generate(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        policy: str = "latest",
        timeout: float | None = None,
        preview_every: int | None = None,
        priority: int = 0,
    ) -> Frame:
        """Run a request to its end on ``model``; returns the final Frame. Raises as ``stream`` does."""
        return await final_frame(
            self.stream(
                params, request_id=request_id, model=model, policy=policy, timeout=timeout,
                preview_every=preview_every, priority=priority,
            )
        )

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
        """``Engine.pause`` on the engine running the request; False while it waits for its model,
        and for one its model cannot stop between two steps (:meth:`pause_refusal`)."""
        stream = self._streams.get(request_id)
        engine = None if stream is None or stream._inner is None else stream._slot.engine
        return engine is not None and engine.pause(request_id, to_host=to_host)

    def pause_refusal(self, request_id: str) -> str | None:
        """Why :meth:`pause` refuses ``request_id`` whatever its progress (its model cannot stop it
        between two steps: ``engine.pause_refusal``), or None. Known while it waits for its model."""
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        return pause_refusal(stream._slot.model, stream.params, request_id)

    def resume(self, request_id: str) -> bool:
        """``Engine.resume`` on the engine running the request."""
        stream = self._streams.get(request_id)
        engine = None if stream is None or stream._inner is None else stream._slot.engine
        return engine is not None and engine.resume(request_id)

    def model_of(self, name: str | None) -> StepModel:
        """The model a request naming ``name`` runs on; ParamsError (field ``model``) listing the names."""
        return self._slot(name, None).model

    # -- health ------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """The loaded engines' counters, plus those of engines unloaded since start."""
        live = [slot.engine.statistics() for slot in self._slots.values() if slot.engine is not None]
        members = live + self._retired
        if not members:
            return EngineStatistics(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        total = _sum_statistics(members)
        queued = sum(1 for s in self._streams.values() if s._inner is None)
        return EngineStatistics(**{
            **{f: getattr(total, f) for f in EngineStatistics.__dataclass_fields__},
            "queued": total.queued + queued,
        })

    def health(self) -> Health:
        """ok while every loaded engine is (none loaded: ok, the models load on demand);
        else the first one's status that is not, naming its model."""
        stats = self.statistics()
        device = str(self._engine_options.get("device", "auto"))
        if self._state is Lifecycle.NEW:
            return Health("closed", "the model router was not started", stats, device)
        if self._state.ending:
            return Health("closed", "the model router was shut down", stats, device)
        for name, slot in self._slots.items():
            if slot.engine is None:
                continue
            health = slot.engine.health()
            if not health.ok:
                return Health(health.status, f"model {name!r}: {health.reason}", stats, health.device)
        failed = [f"model {s.name!r} failed to load: {s.error}" for s in self._slots.values() if s.error]
        return Health("ok", "; ".join(failed) or None, stats, device)

    def check_health(self) -> None:
        """Return when healthy; raise EngineDeadError, EngineStalledError or EngineClosedError."""
        for slot in self._slots.values():
            if slot.engine is not None:
                slot.engine.check_health()
        if self._state is not Lifecycle.RUNNING:
            raise EngineClosedError(self.health().reason or "the model router is closed")

    # -- inside ------------------------------------------------------------------------

    def _check_open(self, request_id: str | None) -> None:
        if self._state is not Lifecycle.RUNNING:
            what = "shut down"
            if self._state is Lifecycle.NEW:
                what = "not started (use `async with ModelRouter(...)`)"
            raise EngineClosedError(f"the model router is {what}", request_id=request_id)

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
        while True:
            self._check_open(request_id)
            if stream._cancelled:
                raise RequestCancelledError("request cancelled while its model loaded", request_id=request_id)
            if slot.ready:
                assert slot.engine is not None
                inner = slot.engine.submit(stream._request, **stream._submit)
                slot.active += 1
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
        """Load ``slot``'s model (a router task), unloading the least recently used first when
        ``max_loaded`` are; a failure is kept in ``slot.error`` for the requests waiting."""
        slot.loading = True
        assert self._load_lock is not None
        try:
            async with self._load_lock:
                while self._max_loaded is not None and len(self.loaded) >= self._max_loaded:
                    victim = self._victim(slot)
                    if victim is None:
                        await self._wait_change()
                        continue
                    await self._unload(victim)
                started = time.monotonic()
                assert self._tg is not None
                await self._tg.start(self._own, slot)
                slot.load_s = time.monotonic() - started
                slot.loads += 1
                logger.info("model %s loaded in %.2f s", slot.name, slot.load_s)
        except Exception as exc:  # noqa: BLE001 - any failure of a model's load is its requests' error
            slot.error = exc
            slot.failed_attempt = slot.attempt
            logger.error("model %s failed to load: %s", slot.name, exc, exc_info=exc)
        finally:
            slot.loading = False
            self._notify()

    def _victim(self, wanted: _Slot) -> _Slot | None:
        """The least recently used loaded model other than ``wanted``."""
        loaded = [s for s in self._slots.values() if s.engine is not None and s is not wanted]
        return min(loaded, key=lambda s: s.last_used) if loaded else None

    async def _unload(self, slot: _Slot) -> None:
        """Drain ``slot`` (no new requests; its running ones end), close its engine, move its model off."""
        slot.draining = True
        try:
            while slot.active:
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
