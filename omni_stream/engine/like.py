"""EngineLike: what the server and users call on an engine, as a typing Protocol.

``Engine`` (one device), ``EngineGroup`` (one engine per device) and remote
engines satisfy it, so code written against one runs on the others. Both
protocols are ``runtime_checkable``: ``isinstance`` checks that the members
exist, not their signatures (a type checker does that).

A server needs less than all of EngineLike (:data:`SERVER_NEEDS`), and
passes ``stream`` only the keywords it takes (:func:`server_stream_keywords`,
read once from its signature when the server is built), so an engine of
one's own written to the minimal ``stream(params, *, request_id=None, ...)``
runs behind it.

The protocols' ``stream`` and ``generate`` take the keywords of
options.RequestOptions (``request_id``, ``policy``, ``timeout``,
``preview_every``, ``priority``); an engine may spell them out or take
them as ``**options: Unpack[RequestOptions]``, as the facades do.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from ..frame import Frame
from ..model import StepModel
from .options import RenderOptions, RequestOptions, stream_keywords
from .stats import EngineStatistics, Health

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack  # typing's from Python 3.11

__all__ = [
    "OPTIONAL_STREAM_KEYWORDS",
    "SERVER_NEEDS",
    "EngineLike",
    "FrameStreamLike",
    "RendersFrames",
    "final_frame",
    "looks_like_engine",
    "missing_stream_members",
    "resumes_from_bytes",
    "server_stream_keywords",
]

#: What a server reads or calls on an engine; the rest of EngineLike
#: (``generate``, ``check_health``, ``statistics``) is for one's own code.
#: ``health()`` must return a :class:`~omni_stream.engine.stats.Health`.
SERVER_NEEDS: Final = ("model", "max_batch_size", "stream", "cancel", "health")

#: The keywords of ``stream`` besides ``request_id`` that a server passes
#: where the engine takes them (docs/configuration.md says what it loses
#: without each).
OPTIONAL_STREAM_KEYWORDS: Final = (
    "policy",
    "preview_every",
    "priority",
    "render",
    "model",
    "resume",
    "checkpoint_every",
    "on_checkpoint",
    "group",
    "rank",
)

_METHODS: Final = frozenset({"stream", "cancel", "health"})
_ABSENT: Final = object()
#: FrameStreamLike's members (what a server's consumer uses of a request's frames).
_STREAM_MEMBERS: Final = (
    "request_id",
    "total",
    "params",
    "poll",
    "aclose",
    "__aiter__",
    "__anext__",
    "__aenter__",
    "__aexit__",
)


@runtime_checkable
class FrameStreamLike(Protocol):
    """One request's frames: an async iterator and an async context manager.

    Iterating raises what ``EngineLike.stream`` documents; leaving the
    ``async with`` (or ``aclose()``) before the final frame cancels the request.
    An explicit subclass (GroupStream, RoutedStream) inherits ``__aiter__``,
    ``__aenter__`` and ``__aexit__`` (which calls ``aclose``) from here.
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

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame: ...

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None; never waits, never raises."""
        ...

    async def aclose(self) -> None:
        """Stop the request if it has not finished; idempotent."""
        ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@runtime_checkable
class EngineLike(Protocol):
    """Something that streams frames: ``async with engine: engine.stream(params)``.

    Enter and leave it from the same task. ``stream`` raises ParamsError (bad
    params or options, a ``request_id`` outside omni_stream/ids.py's rule or
    one still running; engine/intake.py has the checks), EngineDeadError or
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

    @stream_keywords(RequestOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RequestOptions]
    ) -> FrameStreamLike:
        """Submit a request; returns its frames."""
        ...

    @stream_keywords(RequestOptions, policy="latest")
    async def generate(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RequestOptions]
    ) -> Frame:
        """Run a request to its end; returns the final Frame. Raises as ``stream`` does.

        An explicit subclass (every facade: engine/facade.py) inherits this body.
        """
        return await final_frame(self.stream(params, **options))

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


def resumes_from_bytes(engine: object) -> bool:
    """Whether ``engine`` sends a ``resume=`` checkpoint on as its bytes (``Checkpoint.to_bytes``).

    An engine says so with ``resume_as_bytes = True`` (a Ray ``RemoteEngine``
    does: its replica reads the bytes). A server that resumes requests from
    checkpoints it read then keeps the bytes beside them, so none is encoded
    again on its event loop; for any other engine it keeps the tensors alone,
    half the memory.
    """
    return getattr(engine, "resume_as_bytes", False) is True


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

    @stream_keywords(RenderOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RenderOptions]
    ) -> FrameStreamLike: ...


def looks_like_engine(obj: object) -> bool:
    """Whether ``obj`` is meant as an engine rather than a model or a model factory.

    Told without touching it (no property is read: a remote engine may not
    be connected yet): not a StepModel nor a class, and has ``stream``,
    ``health`` or ``cancel``.
    """
    if isinstance(obj, (StepModel, type)):
        return False
    return any(_member(obj, name) is not _ABSENT for name in _METHODS)


def server_stream_keywords(engine: Any) -> frozenset[str]:
    """Which of :data:`OPTIONAL_STREAM_KEYWORDS` ``engine.stream`` takes, read once from its signature.

    Raises TypeError naming what a server needs and ``engine`` lacks: a
    member of :data:`SERVER_NEEDS`, a ``stream`` that can be called as
    ``stream(params, request_id=...)``, or one that returns its frames at
    once (not ``async def``, not an async generator: a server needs a
    :class:`FrameStreamLike`).
    """
    kind = type(engine).__name__
    missing = [
        name
        for name in SERVER_NEEDS
        if (member := _member(engine, name)) is _ABSENT or (name in _METHODS and not _callable(member))
    ]
    if missing:
        raise TypeError(
            f"{kind} cannot serve: it lacks {', '.join(missing)} (a server needs "
            f"{', '.join(SERVER_NEEDS)} of an engine; omni_stream.engine.like.EngineLike)"
        )
    stream = engine.stream
    if inspect.iscoroutinefunction(stream) or inspect.isasyncgenfunction(stream):
        raise TypeError(
            f"{kind}.stream is async def: a server needs stream() to return a FrameStreamLike at once "
            "(an async iterator and context manager with request_id, total, params, poll, aclose)"
        )
    try:
        signature = inspect.signature(stream)
    except (TypeError, ValueError):
        # No signature to read (a C extension, a callable object): pass them all.
        return frozenset(OPTIONAL_STREAM_KEYWORDS)
    try:
        signature.bind({}, request_id="id")
    except TypeError as exc:
        raise TypeError(
            f"{kind}.stream{signature} cannot be called as stream(params, request_id=...), "
            f"which a server does ({exc})"
        ) from None
    parameters = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(OPTIONAL_STREAM_KEYWORDS)
    keywords = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return frozenset(name for name in OPTIONAL_STREAM_KEYWORDS if name in keywords)


def missing_stream_members(frames: object) -> list[str]:
    """The members of :class:`FrameStreamLike` that ``frames`` (what a ``stream`` returned) lacks."""
    return [name for name in _STREAM_MEMBERS if _member(frames, name) is _ABSENT]


def _member(obj: object, name: str) -> object:
    # getattr_static: a property (a remote engine's model) is not run.
    member = inspect.getattr_static(obj, name, _ABSENT)
    if member is _ABSENT and inspect.getattr_static(type(obj), "__getattr__", None) is not None:
        # A proxy that forwards what it does not define: only asking finds out.
        member = getattr(obj, name, _ABSENT)
    return member


def _callable(member: object) -> bool:
    return callable(member) or isinstance(member, (staticmethod, classmethod))


async def final_frame(frames: FrameStreamLike) -> Frame:
    """Read ``frames`` to its end (closing it) and return the final frame: every ``generate``."""
    final: Frame | None = None
    async with frames:
        async for frame in frames:
            final = frame
    assert final is not None and final.final
    return final
