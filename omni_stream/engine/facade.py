"""EngineFacade: what Engine, EngineGroup, ModelRouter and RemoteEngine share, written once.

Each is used as ``async with facade: facade.stream(params)`` and differs
only in what stands behind it (one device; one engine per device; one
engine per model; a Ray Serve application). The base is an explicit
EngineLike (like.py: the members, their signatures, ``generate``) and
holds the one lifecycle (a :class:`~omni_stream.lifecycle.Lifetime`), the
refusals of a facade that is not running, ``check_health`` and the hop of
a call from another thread onto the loop. A facade writes only what is
its own::

    start()   ──▶ NEW → RUNNING, then _start()        a failure closes it (aclose) and propagates
    aclose()  ──▶ RUNNING → CLOSING, _shutdown(), CLOSED    idempotent; NEW goes straight to CLOSED
    stream()      its keywords (options.py) and where a request goes
    health()      its Health; check_health() raises what it says, _death_cause() as the cause
    model, max_batch_size, cancel(), statistics()

A facade of several models (ModelRouter, RemoteEngine) is a
:class:`RoutingFacade`: a request names its model (``model=``), and
``generate`` takes the name too.

Enter and leave a facade from one task: ``_start`` may enter a task group
that ``_shutdown`` leaves.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

from .._backend import ThreadsafeLoop, running_loop
from ..errors import EngineClosedError, EngineDeadError, EngineStalledError
from ..frame import Frame
from ..lifecycle import Lifecycle, Lifetime
from ..model import StepModel
from .like import EngineLike, FrameStreamLike, final_frame
from .options import ModelOptions, stream_keywords
from .stats import EngineStatistics, Health

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack  # typing's from Python 3.11

__all__ = ["EngineFacade", "RoutingFacade", "first_dead"]

logger = logging.getLogger("omni_stream.engine")


class EngineFacade(EngineLike):
    """The base of every engine facade (see the module docstring)."""

    #: What its errors and health call it: "the engine group is shut down".
    _noun: ClassVar[str]
    #: How it is said to be once closed (a RemoteEngine's deployment is not shut down).
    _closed_as: ClassVar[str] = "shut down"

    def __init__(self) -> None:
        name = type(self).__name__
        self._lifetime = Lifetime(f"{'an' if name[0] in 'AEIOU' else 'a'} {name}", error=EngineClosedError)
        # The loop and its thread, from start(): what _call_soon_threadsafe calls onto.
        self._loop: ThreadsafeLoop | None = None
        self._loop_thread: int | None = None

    @property
    def _state(self) -> Lifecycle:
        return self._lifetime.state

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Self:
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
        """Start it (each facade's ``_start`` says what that is). Runs under anyio's asyncio
        (uvloop included) and trio backends.

        Raises EngineClosedError if started before, UnsupportedBackendError
        elsewhere, and what its start raised, having closed what it started.
        """
        self._lifetime.start()
        try:
            # Once, here: every thread-to-loop call goes through this object.
            self._loop = running_loop()
            self._loop_thread = threading.get_ident()
            await self._start()
        except BaseException:
            # Cancelled, or it failed: leave nothing running (task groups are left by this task).
            try:
                await self.aclose()
            except Exception:  # noqa: BLE001 - what start raised is the error to report
                logger.exception("closing the %s after its start failed raised", self._noun)
            raise

    @abc.abstractmethod
    async def _start(self) -> None:
        """Start what it stands for (it is RUNNING already)."""

    async def aclose(self) -> None:
        """Shut it down (each facade's ``_shutdown`` says what that is); idempotent."""
        if not self._lifetime.close():
            return
        try:
            await self._shutdown()
        finally:
            self._lifetime.closed()

    @abc.abstractmethod
    async def _shutdown(self) -> None:
        """End what ``_start`` started, or the part of it that started (it is CLOSING)."""

    def _check_open(self, request_id: str | None = None) -> None:
        """Raise EngineClosedError (carrying ``request_id``) unless it is running."""
        if self._state is Lifecycle.RUNNING:
            return
        what = self._closed_as
        if self._state is Lifecycle.NEW:
            what = f"not started (use `async with {type(self).__name__}(...)`)"
        raise EngineClosedError(f"the {self._noun} is {what}", request_id=request_id)

    def _call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> bool | None:
        """From a thread other than the loop's: ``callback(*args)`` scheduled on the loop, and True,
        or False when the loop has finished. None on the loop's thread (or before start): the
        caller calls it itself."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            return None
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has finished (trio: RunFinishedError)
            return False
        return True

    # -- health ----------------------------------------------------------------------

    def _lifecycle_health(self, statistics: EngineStatistics, device: str) -> Health | None:
        """Its Health while it is not running (closed, saying why), else None."""
        if self._state is Lifecycle.NEW:
            return Health("closed", f"the {self._noun} was not started", statistics, device)
        if self._state.ending:
            return Health("closed", f"the {self._noun} was {self._closed_as}", statistics, device)
        return None

    def check_health(self) -> None:
        """Return when healthy; raise EngineDeadError (what killed it as the cause),
        EngineStalledError or EngineClosedError, with the reason ``health()`` gives."""
        h = self.health()
        if h.ok:
            return
        reason = h.reason or f"the {self._noun} is {h.status}"
        if h.status == "dead":
            raise EngineDeadError(reason) from self._death_cause()
        if h.status == "stalled":
            raise EngineStalledError(reason)
        raise EngineClosedError(reason)

    def _death_cause(self) -> BaseException | None:
        """What killed it, for ``check_health``'s EngineDeadError (None: nothing to attach)."""
        return None


class RoutingFacade(EngineFacade):
    """A facade of several models: a request names the one to run (``model=``; None: the default)."""

    @property
    @abc.abstractmethod
    def models(self) -> Mapping[str, StepModel]:
        """The models by name, the default first."""

    @property
    def default(self) -> str:
        """The name of the model a request that names none runs on: the first."""
        return next(iter(self.models))

    @abc.abstractmethod
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[ModelOptions]
    ) -> FrameStreamLike:
        """Submit a request to its ``model``; returns its frames."""

    @stream_keywords(ModelOptions, policy="latest")
    async def generate(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[ModelOptions]
    ) -> Frame:
        """Run a request to its end on ``model``; returns the final Frame. Raises as ``stream`` does."""
        return await final_frame(self.stream(params, **options))


def first_dead(engines: Iterable[EngineLike]) -> BaseException | None:
    """What killed the first of ``engines`` that is dead (its EngineDeadError's cause), or None."""
    for engine in engines:
        if engine.health().status == "dead":
            try:
                engine.check_health()
            except EngineDeadError as exc:
                return exc.__cause__ or exc
    return None
