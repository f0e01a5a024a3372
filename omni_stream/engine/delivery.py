"""Per-request hand-over of frames to one reader: "all" and "latest".

Loop-only: every method runs on the event loop, so nothing here locks.

* ``all``: a FIFO. Its depth is bounded by the producer, which stops
  advancing a request whose reader is ``queue_size`` frames behind, so a
  slow reader slows only its own request.
* ``latest``: a single slot. A newer frame replaces an unread older one
  (which is returned to the caller so it can be counted); the final frame is
  the newest there is, so it is never replaced.

An ending error either lets queued frames drain first (the model failed at
step n: frames before n are real and were paid for) or drops them (the
request was cancelled, timed out, or the engine went away: nobody wants
stale frames then).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

from .._wakeup import Wakeup
from ..frame import Frame

__all__ = ["Delivery", "POLICIES"]

POLICIES = ("all", "latest")


class Delivery:
    """One request's frames on their way to its reader."""

    __slots__ = ("_latest", "_frames", "_error", "_drain", "_ended", "_wakeup", "wait")

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._latest = policy == "latest"
        self._frames: deque[Frame] = deque()
        self._error: BaseException | None = None
        self._drain = True
        self._ended = False
        self._wakeup = Wakeup()
        #: ``wait(timeout)``: what to await until a frame is put or the delivery ends,
        #: ``timeout`` seconds at most. Returns either way, and early when another
        #: reader took what came: call :meth:`get_nowait` after. The bound is a
        #: timer, not a cancel scope (``Wakeup.wait``): the reader waits once a
        #: frame. The Wakeup's own method, not a method of ours around it: one
        #: Python call fewer on the loop for every frame delivered.
        self.wait: Callable[[float], Awaitable[object]] = self._wakeup.wait

    def put(self, frame: Frame) -> Frame | None:
        """Queue ``frame``; returns the frame it replaced ("latest"), else None.

        Frames put after the end are ignored (and returned, to be counted).
        """
        if self._ended:
            return frame
        replaced = None
        if self._latest and self._frames:
            replaced = self._frames.popleft()
        self._frames.append(frame)
        if frame.step == frame.total:  # frame.final, without a property call a frame
            self._ended = True
            self._wakeup.disarm()  # the reader has what it waits for, and will not wait again
        self._wakeup.wake()
        return replaced

    def end(self, error: BaseException | None = None, *, drain: bool = True) -> None:
        """No more frames will come; the reader gets ``error`` after (or instead of) the queue."""
        if self._ended:
            # Already ended, or the final frame is queued: a request whose
            # final frame exists has finished, and that frame is kept.
            return
        self._ended = True
        if error is not None:
            self._error = error
            self._drain = drain
            if not drain:
                self._frames.clear()
        self._wakeup.disarm()
        self._wakeup.wake()

    def get_nowait(self) -> Frame | None:
        """The next frame, None if none is ready; raises the ending error or StopAsyncIteration."""
        if self._frames and (self._error is None or self._drain):
            return self._frames.popleft()
        if self._error is not None:
            raise self._error
        if self._ended:
            raise StopAsyncIteration
        return None

    async def get(self) -> Frame:
        """Wait for the next frame; raises the ending error or StopAsyncIteration."""
        while True:
            frame = self.get_nowait()
            if frame is not None:
                return frame
            await self._wakeup.wait()
