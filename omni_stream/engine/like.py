"""EngineLike: what the server and users call on an engine, as a typing Protocol.

``Engine`` (one device), ``EngineGroup`` (one engine per device) and remote
engines satisfy it, so code written against one runs on the others. Both
protocols are ``runtime_checkable``: ``isinstance`` checks that the members
exist, not their signatures (a type checker does that).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..frame import Frame
from ..model import StepModel
from .stats import EngineStatistics, Health

if TYPE_CHECKING:
    from ..preview.remote import RenderRequest

__all__ = ["EngineLike", "FrameStreamLike", "RendersFrames", "final_frame"]


@runtime_checkable
class FrameStreamLike(Protocol):
    """One request's frames: an async iterator and an async context manager.

    Iterating raises what ``EngineLike.stream`` documents; leaving the
    ``async with`` (or ``aclose()``) before the final frame cancels the request.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def total(self) -> int:
        """The request's step count (frames it will produce)."""
        ...

    @property
    def params(self) -> Mapping[str, Any]:
        """The request's params as the model checked them, defaults filled in."""
        ...

    def __aiter__(self) -> AsyncIterator[Frame]: ...

    async def __anext__(self) -> Frame: ...

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None; never waits, never raises."""
        ...

    async def aclose(self) -> None:
        """Stop the request if it has not finished; idempotent."""
        ...

    async def __aenter__(self) -> FrameStreamLike: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class EngineLike(Protocol):
    """Something that streams frames: ``async with engine: engine.stream(params)``.

    Enter and leave it from the same task. ``stream`` raises ParamsError (bad
    params or options, a duplicate ``request_id``), EngineDeadError or
    EngineClosedError at once; iterating raises StepFailedError,
    StepTimeoutError, RequestCancelledError, EngineDeadError or
    EngineClosedError.
    """

    @property
    def model(self) -> StepModel:
        """The model requests are checked against (its name, its params)."""
        ...

    @property
    def max_batch_size(self) -> int:
        """The most requests advanced together (for a group, across its members)."""
        ...

    def stream(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        policy: str = "all",
        timeout: float | None = None,
        preview_every: int | None = None,
        priority: int = 0,
    ) -> FrameStreamLike:
        """Submit a request; returns its frames."""
        ...

    async def generate(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        policy: str = "latest",
        timeout: float | None = None,
        preview_every: int | None = None,
        priority: int = 0,
    ) -> Frame:
        """Run a request to its end; returns the final Frame."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Cancel a request; True if it was still running. Safe from any thread."""
        ...

    def health(self) -> Health:
        """ok, stalled, dead or closed, with the reason and the statistics."""
        ...

    def check_health(self) -> None:
        """Return when healthy; raise EngineDeadError, EngineStalledError or EngineClosedError."""
        ...

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the counters."""
        ...

    async def __aenter__(self) -> EngineLike: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class RendersFrames(Protocol):
    """An EngineLike that can render frames where it makes them (a Ray ``RemoteEngine``).

    Its ``stream`` also takes ``render=RenderRequest``: then every frame
    arrives with ``encoded`` set (the preview when one is due, the result
    in its output format at the end) and no tensor, so a server in front
    receives the bytes its clients get rather than raw frames
    (omni_stream/preview/remote.py). A server checks ``isinstance(engine,
    RendersFrames)`` and ``renders_frames`` before it asks.
    """

    #: False where rendering remotely is switched off.
    renders_frames: bool

    def stream(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        policy: str = "all",
        timeout: float | None = None,
        preview_every: int | None = None,
        priority: int = 0,
        render: RenderRequest | None = None,
    ) -> FrameStreamLike: ...


async def final_frame(frames: FrameStreamLike) -> Frame:
    """Read ``frames`` to its end (closing it) and return the final frame: every ``generate``."""
    final: Frame | None = None
    async with frames:
        async for frame in frames:
            final = frame
    assert final is not None and final.final
    return final
