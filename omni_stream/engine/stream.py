"""FrameStream: one request's frames as an async iterator.

Each ``__anext__`` waits a bounded time for the next step's output: the
bound is the request's ``timeout=`` or ``omni_stream.timeout()`` read at
that moment. Time the reader spends elsewhere does not count; time the step
spends queued, computing or copying does, except queued behind another
request's whole run (a ``runs_whole_requests`` model): there the bound
starts when the producer hands this request the device, a moment the
producer stamps on the request (``OutputProcessor.step_deadline``,
read through ``time_left``).

Cleanup is deterministic with ``async with``; a plain ``async for`` that
breaks out drops the last reference to the stream, and ``__del__`` then
cancels the request (thread-safe, it only schedules the cancel on the
loop), so the producer stops within one step.

The stream holds the engine's OutputProcessor, not the engine: it tells it
what the reader took (the producer's backpressure), gave up, or timed out on.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..frame import Frame
from .request import Request

if TYPE_CHECKING:
    from .output_processor import OutputProcessor

__all__ = ["FrameStream"]


class FrameStream:
    """Async iterator (and async context manager) over one request's frames."""

    def __init__(self, output: OutputProcessor, request: Request) -> None:
        self._output = output
        self._request = request
        self._done = False

    @property
    def request_id(self) -> str:
        return self._request.id

    @property
    def total(self) -> int:
        return self._request.total

    @property
    def params(self) -> Mapping[str, Any]:
        """The request's params as the model checked them, defaults filled in."""
        return self._request.params

    def __aiter__(self) -> FrameStream:
        return self

    async def __anext__(self) -> Frame:
        if self._done:
            raise StopAsyncIteration
        request = self._request
        delivery = request.delivery
        try:
            frame = delivery.get_nowait()
            if frame is None:
                output = self._output
                bound = output.step_timeout(request)
                since = output.clock()
                # The first wait is for the whole bound: the deadline is never
                # earlier than since + bound (a pause, a resume or a queue
                # behind a whole run only moves it later), so there is
                # nothing to look up yet. This runs once a frame.
                await delivery.wait(bound)
                frame = delivery.get_nowait()
                while frame is None:
                    # Decided on the producer's clock, from what it stamped:
                    # the timer below only says when to look again.
                    left = output.time_left(request, since, bound)
                    if left <= 0:
                        raise output.time_out(request, bound)
                    # Returns on a put, the end, or after ``left``: a timer,
                    # not a cancel scope (the reader waits once a frame).
                    await delivery.wait(left)
                    frame = delivery.get_nowait()
        except BaseException:
            # The request ended (its error is raised), or the reader itself was
            # cancelled: then nobody will read this request, so abort it.
            # Either way the exception propagates unchanged.
            self._done = True
            self._output.abandon(request)
            raise
        # What ``_took`` does, written out (once a frame).
        self._output.consumed(request)
        if frame.step == frame.total:
            self._done = True
        return frame

    def _took(self, frame: Frame) -> Frame:
        """Count ``frame`` as read (the producer's backpressure) and note the end."""
        self._output.consumed(self._request)
        if frame.step == frame.total:  # frame.final, without its property call
            self._done = True
        return frame

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None; never waits, never raises.

        With ``policy="latest"`` that is the newest step computed since the
        last frame was taken: a reader that was busy (rendering a preview,
        say) calls it to skip ahead to the freshest frame. An ending error or
        the end itself is left for the next ``__anext__`` to report.
        """
        if self._done:
            return None
        try:
            frame = self._request.delivery.get_nowait()
        except (Exception, StopAsyncIteration):
            return None  # the ending: __anext__ raises it
        if frame is None:
            return None
        return self._took(frame)

    async def aclose(self) -> None:
        """Stop the request if it has not finished; idempotent."""
        if not self._done:
            self._done = True
            self._output.abandon(self._request)

    async def __aenter__(self) -> FrameStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._done:
            self._output.abandon_threadsafe(self._request)
