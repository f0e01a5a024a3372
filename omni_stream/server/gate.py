"""The gate between admission and the engine: at most ``max_active`` requests in it, the rest wait here.

An engine steps every request it holds in turn, so each request it holds
beyond what fits in its batches slows every other one: with 144 requests
held and batches of 8, each request advances once every 18 model calls.
So the server gives the engine at most ``max_active`` requests (two
batches by default) and keeps the other admitted ones (up to
``max_queued``) here, unstarted: they cost nobody a step, hold no model
state, and a client watching one sees it ``queued`` with its position.

When a request leaves the engine, the next one goes in: the highest
*effective* priority first (its ``priority`` plus one point for every
``AGE_ROUNDS`` requests let in while it waited, so a low priority is
delayed, never starved: the engine's own rule, scheduler.py), then the
connection with the fewest requests in the engine (one connection that
queued a hundred requests does not keep another's one waiting behind all
of them), then arrival. Pure bookkeeping: no I/O, no engine; the service
submits what :meth:`Gate.pop` returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.scheduler import AGE_ROUNDS, effective_priority

__all__ = ["Gate", "Waiting"]


@dataclass(slots=True)
class Waiting:
    """An admitted request not yet in the engine; ``payload`` is the service's (what to submit)."""

    request_id: str
    owner: str
    priority: int
    payload: Any = field(repr=False)
    #: The gate's count of requests let in when this one arrived.
    arrived: int = 0
    #: Arrival order among the waiting, for ties.
    seq: int = 0


class Gate:
    """Who is in the engine, who waits, and who goes in next (see the module docstring).

    ``bound()`` is the most requests in the engine (read on every call, so
    it may follow the engine's batch size).
    """

    def __init__(self, bound: Callable[[], int]) -> None:
        self._bound = bound
        self._inside: Counter[str] = Counter()  # owner -> requests in the engine
        self._in_engine = 0
        self._waiting: dict[str, Waiting] = {}
        self._let_in = 0  # requests let in so far: the waiting's clock for ageing
        self._seq = 0

    # -- counts -------------------------------------------------------------------

    @property
    def in_engine(self) -> int:
        """Requests given to the engine and not yet finished."""
        return self._in_engine

    @property
    def waiting(self) -> int:
        """Requests admitted and waiting here."""
        return len(self._waiting)

    def has_room(self) -> bool:
        """True when a request may go into the engine now (nobody waits, and it is under its bound)."""
        return not self._waiting and self._in_engine < self._bound()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    # -- moving requests ------------------------------------------------------------

    def entered(self, owner: str) -> None:
        """A request of ``owner`` went into the engine."""
        self._in_engine += 1
        self._inside[owner] += 1
        self._let_in += 1

    def left(self, owner: str) -> None:
        """A request of ``owner`` left the engine (ended, however)."""
        self._in_engine -= 1
        self._inside[owner] -= 1
        if self._inside[owner] <= 0:
            del self._inside[owner]

    def wait(self, request_id: str, owner: str, priority: int, payload: Any) -> Waiting:
        """Hold an admitted request until :meth:`pop` lets it in."""
        self._seq += 1
        item = Waiting(request_id, owner, priority, payload, arrived=self._let_in, seq=self._seq)
        self._waiting[request_id] = item
        return item

    def remove(self, request_id: str) -> Waiting | None:
        """Take a waiting request out (cancelled, its client gone); None if it is not waiting."""
        return self._waiting.pop(request_id, None)

    def pop(self) -> Waiting | None:
        """The next request to let in, if the engine has room and one waits; the caller submits it.

        Call :meth:`entered` once it is in the engine (or nothing, if
        submitting it failed: it is no longer waiting either way).
        """
        if not self._waiting or self._in_engine >= self._bound():
            return None
        item = min(self._waiting.values(), key=self._rank)
        del self._waiting[item.request_id]
        return item

    def order(self) -> list[str]:
        """The waiting requests' ids, next first (as :meth:`pop` would take them now)."""
        return [w.request_id for w in sorted(self._waiting.values(), key=self._rank)]

    def _rank(self, w: Waiting) -> tuple[int, int, int]:
        rank = effective_priority(w.priority, self._let_in - w.arrived, age_rounds=AGE_ROUNDS)
        return (-rank, self._inside[w.owner], w.seq)

    def __repr__(self) -> str:
        return f"Gate(in_engine={self._in_engine}, waiting={len(self._waiting)}, bound={self._bound()})"
