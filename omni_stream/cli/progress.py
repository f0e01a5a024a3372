"""``ProgressBar``: a request's step/total, steps/s and ETA on one line of stderr."""

from __future__ import annotations

import math
import time
from typing import Any, TextIO

__all__ = ["ProgressBar"]


def _clock(seconds: float) -> str:
    # Rounded up: an ETA of 0:00 while work remains reads as a hang.
    seconds = math.ceil(seconds)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressBar:
    """A one-line progress bar redrawn with ``\\r``: step/total, steps/s, ETA.

    The rate counts from the first frame, so model loading does not skew it.
    Redraws at most every ``interval`` seconds (and always on the last
    step): this runs once per step and must stay cheap. With ``live``
    False (stderr is not a terminal) only :meth:`finish` writes.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        live: bool,
        width: int = 24,
        interval: float = 0.1,
        clock: Any = time.monotonic,
    ) -> None:
        self._out = out
        self._live = live
        self._width = width
        self._interval = interval
        self._clock = clock
        self._start = clock()
        self._first: tuple[int, float] | None = None
        self._drawn_at = -float("inf")
        self._step = 0
        self._total = 0

    def rate(self, step: int, now: float) -> float | None:
        """Steps per second since the first frame, or None before two frames."""
        if self._first is None or step <= self._first[0] or now <= self._first[1]:
            return None
        return (step - self._first[0]) / (now - self._first[1])

    def line(self, step: int, total: int, now: float) -> str:
        filled = self._width * step // max(total, 1)
        bar = "#" * filled + "." * (self._width - filled)
        rate = self.rate(step, now)
        speed = f"{rate:.1f} steps/s" if rate else "-- steps/s"
        eta = _clock((total - step) / rate) if rate else "--:--"
        digits = len(str(total))
        return f"{step:>{digits}}/{total} [{bar}] {speed} ETA {eta}"

    def update(self, step: int, total: int) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        self._step, self._total = step, total
        if not self._live or (step < total and now - self._drawn_at < self._interval):
            return
        self._drawn_at = now
        self._out.write("\r" + self.line(step, total, now))
        self._out.flush()

    def abort(self) -> None:
        """End a half-drawn bar's line, so an error message starts on its own."""
        if self._live and self._drawn_at > -float("inf"):
            self._out.write("\n")
            self._out.flush()

    def finish(self, note: str = "") -> None:
        """End the bar's line and write a summary: steps, time, rate."""
        now = self._clock()
        elapsed = now - self._start
        rate = self.rate(self._step, now)
        summary = f"{self._step}/{self._total} steps in {elapsed:.1f}s"
        if rate:
            summary += f" ({rate:.1f} steps/s)"
        if note:
            summary += f" {note}"
        self._out.write(("\r\x1b[2K" if self._live else "") + summary + "\n")
        self._out.flush()
