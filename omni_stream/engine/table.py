"""The live-request table the producer thread and the event loop share.

One lock guards it, with a ``threading.Condition`` on that lock for the
producer's waits: ``with table.lock`` where nothing waits or notifies (the
hot path: the lock's own C ``__enter__``, not the condition's Python one),
``with table.cond`` around a ``wait``/``notify``. The loop holds it only for counter
updates (microseconds); the producer holds it to pick a batch and never
while a model or device call runs, so neither side can stall the other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .request import Request

__all__ = ["RequestTable", "Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_run_ahead: int
    queue_size: int
    #: The scheduling policy and the preemptive one's quantum (scheduler.py).
    scheduling: str = "preemptive"
    quantum: int = 1


@dataclass(eq=False)
class RequestTable:
    limits: Limits
    #: Re-entrant, as a Condition's default lock is: the loop's ``end`` may run under it.
    lock: threading.RLock = field(default_factory=threading.RLock)
    cond: threading.Condition = field(init=False)
    live: dict[int, Request] = field(default_factory=dict)  # by arrival
    #: Set (under cond) to make the producer return.
    stopping: bool = False
    #: True while the producer waits on ``cond`` for work.
    producer_waiting: bool = False
    arrivals: int = 0
    #: The one clock a step's bound is measured on: the producer stamps
    #: ``Request.handed_at`` with it, the reader's wait reads it. Replaceable
    #: (tests drive it by hand); it must be monotonic.
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def wake_producer(self) -> None:
        """Call with ``cond`` held after a change that may make a request runnable."""
        if self.producer_waiting:
            self.cond.notify()
