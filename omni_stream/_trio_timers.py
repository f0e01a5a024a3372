"""``call_at`` for a trio run: one system task sleeps until the earliest timer.

trio bounds a wait with a cancel scope, entered and left around each wait:
for a reader that waits once a frame with a bound minutes long, that is a
scope built, registered in the run's deadlines and removed again every
frame (about half of a trio wait's cost, measured). asyncio has timers
(``loop.call_at``), and a ``Wakeup`` arms one and keeps it across waits,
because a reader's next deadline is later than its last. This gives trio
the same: :func:`timers` returns the run's :class:`Timers`, whose
``call_at`` pushes onto a heap and, when the new timer is the earliest,
moves the deadline of the scope its task sleeps in. The task runs the
callbacks whose time has come, in deadline order, and sleeps again.

Loop-only: ``call_at`` and ``TimerHandle.cancel`` run in the trio run's
thread. A cancelled timer stays in the heap until it would have fired or
until cancelled timers are more than half of it (then the heap is rebuilt
without them), as asyncio does: an ended request's disarmed timer, minutes
away, does not stay in memory for minutes on a busy server. The task is a
system task, cancelled when the run's main task ends. Callbacks must not
raise (``Wakeup._expire`` does not); one that does is logged and the
others still run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["TimerHandle", "Timers", "timers"]

logger = logging.getLogger("omni_stream")

# Below this many timers the heap is never rebuilt: cancelled entries cost nothing to keep.
_COMPACT_MIN = 64


class TimerHandle:
    """One timer: ``cancel()`` it, or it calls its callback at ``when`` (trio's clock)."""

    __slots__ = ("when", "callback", "_done", "_timers")

    def __init__(self, when: float, callback: Callable[[], object], timers: Timers) -> None:
        self.when = when
        self.callback = callback
        # Cancelled, or already fired: either way it will not call again.
        self._done = False
        self._timers = timers

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._timers._cancelled_one(self)

    def cancelled(self) -> bool:
        """Cancelled or fired (asyncio's TimerHandle has the same method)."""
        return self._done


class Timers:
    """The timers of one trio run; see the module docstring."""

    def __init__(self, trio: Any) -> None:
        self._trio = trio
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._cancelled = 0
        # The scope the task sleeps in (its deadline: the earliest timer), None while it runs callbacks.
        self._scope: Any = None

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        """Call ``callback()`` at ``when`` (``trio.current_time()``'s clock), on this run."""
        handle = TimerHandle(when, callback, self)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        scope = self._scope
        if scope is not None and when < scope.deadline:
            scope.deadline = when
        return handle

    def __len__(self) -> int:
        """Timers in the heap, cancelled ones not yet dropped included (for tests)."""
        return len(self._heap)

    def _cancelled_one(self, handle: TimerHandle) -> None:
        self._cancelled += 1
        heap = self._heap
        if heap and heap[0][2] is handle:
            # The earliest: drop it (and any cancelled ones under it), and let the task sleep
            # until the next timer rather than wake for nothing (a disarmed 600 s bound would
            # otherwise wake it in 600 s, and jump a test's autojumping clock that far).
            while heap and heap[0][2]._done:
                heapq.heappop(heap)
                self._cancelled -= 1
            scope = self._scope
            if scope is not None:
                scope.deadline = heap[0][0] if heap else math.inf
        elif len(heap) >= _COMPACT_MIN and self._cancelled * 2 > len(heap):
            heap[:] = [entry for entry in heap if not entry[2]._done]
            heapq.heapify(heap)
            self._cancelled = 0

    async def run(self) -> None:
        """The system task: fire what is due, sleep until the next, forever (until the run ends)."""
        trio = self._trio
        heap = self._heap
        try:
            await self._serve(trio, heap)
        finally:
            # The run ends (its system tasks are cancelled): no timer here will fire, so none
            # may look armed to a Wakeup waited on in a later run (whose clock is another).
            for _, _, handle in heap:
                handle._done = True
            heap.clear()
            self._cancelled = 0

    async def _serve(self, trio: Any, heap: list[tuple[float, int, TimerHandle]]) -> None:
        while True:
            now = trio.current_time()
            while heap and (heap[0][2]._done or heap[0][0] <= now):
                _, _, handle = heapq.heappop(heap)
                if handle._done:
                    self._cancelled -= 1
                    continue
                handle._done = True  # fired: a cancel() from here on is a no-op
                try:
                    handle.callback()
                except Exception:
                    logger.exception("a timer's callback raised; the other timers still run")
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None


# Made at import, once (this module is imported only under a trio run, or by its tests).
_run_var: Any = trio.lowlevel.RunVar("omni_stream.timers")


def timers() -> Timers:
    """The running trio run's timers, started at the first call (in the run's thread)."""
    try:
        found: Timers = _run_var.get()
        return found
    except LookupError:
        pass
    made = Timers(trio)
    # Spawned first: a run that cannot take a system task any more (it is ending) gets none.
    trio.lowlevel.spawn_system_task(made.run, name="omni_stream timers")
    _run_var.set(made)
    return made
