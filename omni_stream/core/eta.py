"""A running request's time left, from its own recent steps (pure: the caller passes the clock).

The estimate was once the time since admission over the steps done,
times the steps left: the wait in the queue, a model's load and any
pause counted as step time, so a request that waited 3 s and then ran
4.5 s was told 15.2 s left at step 7 (issue #38). Now only the time
between two of its steps counts: the mean over the last
:data:`WINDOW` of them (steps run in batches whose size changes as
requests come and go, so an old rate goes stale), and a gap the request
did not spend stepping (it entered the engine, it resumed) starts a new
interval instead of ending one. Before the second step, the first one's
time since the request entered the engine is all there is.
"""

from __future__ import annotations

from collections import deque
from typing import Final

__all__ = ["WINDOW", "StepRate"]

#: Steps whose times make the estimate.
WINDOW: Final = 8


class StepRate:
    """Seconds per step of one request, over its last :data:`WINDOW` steps (module docstring)."""

    __slots__ = ("_entered", "_first", "_last", "_per_step")

    def __init__(self) -> None:
        self._per_step: deque[float] = deque(maxlen=WINDOW)
        #: (time, step) of the step the next interval starts from; None after a gap.
        self._last: tuple[float, int] | None = None
        #: (time, step) when it last entered the engine.
        self._entered: tuple[float, int] | None = None
        #: The seconds a step of the first interval after it entered took: its setup
        #: (text encoding, a state brought back from the host) rides on it, so it
        #: stands in only until a later step is timed.
        self._first: float | None = None

    def start(self, now: float, step: int) -> None:
        """It entered (or re-entered) the engine at ``step``: the next interval starts here."""
        self._entered = self._last = (now, step)

    def gap(self) -> None:
        """It did not step for a while (resumed from a pause): the next step starts an interval."""
        self._last = None

    def observe(self, now: float, step: int) -> None:
        """It reached ``step`` at ``now``."""
        last, self._last = self._last, (now, step)
        if last is None or step <= last[1]:
            return
        per_step = max(0.0, now - last[0]) / (step - last[1])
        if last is self._entered:
            self._first = per_step
        else:
            self._per_step.append(per_step)

    def eta(self, step: int, total: int) -> float | None:
        """Seconds left at ``step`` of ``total``; None before it has a step's time."""
        left = max(0, total - step)
        if self._per_step:
            return sum(self._per_step) / len(self._per_step) * left
        return None if self._first is None else self._first * left
