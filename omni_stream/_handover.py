"""Handover: items from threads to one callback on the loop, one wake-up per batch.

The producer thread hands every step's frames to the event loop. A wake-up
of the loop from a thread is the dear part of that: ``call_soon_threadsafe``
writes to the loop's self-pipe (a system call that drops the GIL, which
the loop thread then takes), and each wake-up is a pass of the loop. A
Handover pays it once for everything posted while the loop had not yet
come round: :meth:`post` appends under a lock and schedules the drain only
if none is scheduled already; the drain, on the loop, takes every item
posted so far and hands them to ``receive`` in one call.

Promises:

* **Order.** Items reach ``receive`` in the order they were posted (one
  list, appended under the lock, taken whole), and batches in the order
  they were taken.
* **Nothing stranded.** The flag that says "a drain is scheduled" is
  cleared under the same lock that the drain takes the items under, so an
  item posted after a drain took its batch always schedules another.
  A drain that finds nothing (the items were taken by :meth:`take`) does
  nothing.
* **A finished loop.** :meth:`post` raises the loop's RuntimeError (asyncio's
  closed loop, trio's RunFinishedError) as ``call_soon_threadsafe`` does; the
  items stay queued for :meth:`take`, and the next post tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ._backend import ThreadsafeLoop

__all__ = ["Handover"]

T = TypeVar("T")


class Handover(Generic[T]):
    """See the module docstring. ``post`` from any thread; ``take`` and ``receive`` on the loop."""

    __slots__ = ("loop", "_receive", "_lock", "_items", "_scheduled", "wakeups")

    def __init__(self, receive: Callable[[list[T]], object], loop: ThreadsafeLoop | None = None) -> None:
        #: The loop drains run on; must be set before the first ``post``.
        self.loop = loop
        self._receive = receive
        self._lock = threading.Lock()
        self._items: list[T] = []
        # A drain is scheduled on the loop and has not yet taken the items.
        self._scheduled = False
        #: How many times ``post`` woke the loop (a drain scheduled): for tests and benchmarks.
        self.wakeups = 0

    def post(self, items: Iterable[T]) -> None:
        """Queue ``items`` for ``receive`` on the loop; never blocks on the loop, never waits.

        Raises RuntimeError if the loop has finished (the items stay queued).
        """
        with self._lock:
            self._items.extend(items)
            if self._scheduled:
                # The scheduled drain has not run yet: it will take these too.
                return
            self._scheduled = True
            self.wakeups += 1
        loop = self.loop
        assert loop is not None, "Handover.post before its loop was set"
        try:
            loop.call_soon_threadsafe(self._drain)
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def take(self) -> list[T]:
        """Every item posted and not yet received, oldest first (loop-side; for shutdown)."""
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        return items

    def _drain(self) -> None:
        # On the loop: ``take`` written out (this runs once a wake-up). Swapping
        # the list (not copying it) keeps the lock held for a few bytecodes:
        # the producer may be waiting on it to post.
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        if items:
            self._receive(items)
