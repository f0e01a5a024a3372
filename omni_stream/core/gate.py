"""The gate between admission and the engine: at most ``max_active`` requests in it, the rest wait here.

An engine steps every request it holds in turn, so each request it holds
beyond what fits in its batches slows every other one: with 144 requests
held and batches of 8, each request advances once every 18 model calls.
So the server gives the engine at most ``max_active`` requests (two
batches by default on an accelerator, four requests on the host CPU:
limits.py) and keeps the other admitted ones (up to
``max_queued``) here, unstarted: they cost nobody a step, hold no model
state, and a client watching one sees it ``queued`` with its position.

When a request leaves the engine, the next one goes in. Owners are
principals (principal.py: a token's tenant, a websocket connection, an
HTTP client's address), so the same rules hold whatever door a client
uses and however many connections it opens:

1. one that has waited :data:`OVERDUE_LET_INS` let-ins or more, oldest
   first: whatever the rules below prefer, nobody waits longer than that
   (plus the overdue ones before it);
2. the highest *effective cross priority*: the part of a request's
   ``priority`` its principal may use against others (``cross``: 0
   unless its token is granted more, tokens.py), plus one point for every
   ``AGE_ROUNDS`` requests let in since the oldest waiting request of that
   level arrived, so a low level is delayed, never starved (the engine's
   own rule, scheduler.py, where all requests of one level age alike too:
   ageing each request from its own arrival would make every level first
   come, first served). A principal's own ``priority`` does not rank it
   against anyone else (a priority-10 flood once kept a priority-0 client
   waiting 9-12 s for its first step);
3. the principal with the fewest requests in the engine;
4. the principal that has had the fewest steps let in while it kept
   requests here or in the engine (its requests' ``cost``, their step
   counts): a client with one short request at a time goes in before a
   flood of long ones that arrived earlier, rather than after a round of
   every flooding principal; a principal with nothing here or inside is
   forgotten;
5. of that principal's requests: its own highest ``priority`` first,
   then arrival.

Pure bookkeeping: no I/O, no engine; the service submits what
:meth:`Gate.pop` returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from ..engine.scheduler import AGE_ROUNDS, PRIORITY_MAX, PRIORITY_MIN, effective_priority

__all__ = ["OVERDUE_LET_INS", "Gate", "Waiting"]

#: Let-ins after which a waiting request goes before any rule's choice:
#: the wait the widest priority gap costs through ageing (160).
OVERDUE_LET_INS: Final = (PRIORITY_MAX - PRIORITY_MIN) * AGE_ROUNDS


@dataclass(slots=True)
class Waiting:
    """An admitted request not yet in the engine; ``payload`` is the service's (what to submit)."""

    request_id: str
    owner: str
    priority: int
    payload: Any = field(repr=False)
    #: The part of ``priority`` that ranks against other owners (rule 2).
    cross: int = 0
    #: Its share of the engine, for fairness between connections: its steps.
    cost: int = 1
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
        self._queued: Counter[str] = Counter()  # owner -> requests waiting here
        #: owner -> cost let in while it had requests here or inside (rule 4).
        self._served: Counter[str] = Counter()
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

    def items(self) -> list[Waiting]:
        """The waiting requests, in no particular order (:meth:`order` ranks them)."""
        return list(self._waiting.values())

    def get(self, request_id: str) -> Waiting | None:
        """The waiting request ``request_id``; None if it is not waiting."""
        return self._waiting.get(request_id)

    # -- moving requests ------------------------------------------------------------

    def entered(self, owner: str, cost: int = 1) -> None:
        """A request of ``owner`` (``cost``: its steps) went into the engine."""
        self._in_engine += 1
        self._inside[owner] += 1
        self._served[owner] += max(1, cost)
        self._let_in += 1

    def left(self, owner: str) -> None:
        """A request of ``owner`` left the engine (ended, however)."""
        self._in_engine -= 1
        self._inside[owner] -= 1
        if self._inside[owner] <= 0:
            del self._inside[owner]
        self._forget_if_gone(owner)

    def wait(
        self, request_id: str, owner: str, priority: int, payload: Any, cost: int = 1, *, cross: int = 0
    ) -> Waiting:
        """Hold an admitted request (``cost``: its steps; ``cross``: rule 2) until :meth:`pop` lets it in."""
        self._seq += 1
        item = Waiting(
            request_id, owner, priority, payload, cross=cross, cost=cost, arrived=self._let_in, seq=self._seq
        )
        self._waiting[request_id] = item
        self._queued[owner] += 1
        return item

    def remove(self, request_id: str) -> Waiting | None:
        """Take a waiting request out (cancelled, its client gone); None if it is not waiting."""
        item = self._waiting.pop(request_id, None)
        if item is not None:
            self._unqueue(item.owner)
            self._forget_if_gone(item.owner)
        return item

    def _unqueue(self, owner: str) -> None:
        self._queued[owner] -= 1
        if self._queued[owner] <= 0:
            del self._queued[owner]

    def _forget_if_gone(self, owner: str) -> None:
        # Nothing here, nothing inside: its history of use ends (rule 4), and
        # the bookkeeping stays bounded by the requests held.
        if owner not in self._inside and owner not in self._queued:
            self._served.pop(owner, None)

    def pop(self) -> Waiting | None:
        """The next request to let in, if the engine has room and one waits; the caller submits it.

        Call :meth:`entered` once it is in the engine (or nothing, if
        submitting it failed: it is no longer waiting either way).
        """
        if not self._waiting or self._in_engine >= self._bound():
            return None
        item = self._next()
        del self._waiting[item.request_id]
        self._unqueue(item.owner)
        # If submitting it fails, nothing else may ever mention this owner.
        self._forget_if_gone(item.owner)
        return item

    def order(self) -> list[str]:
        """The waiting requests' ids, next first: an estimate of the order :meth:`pop` takes them.

        Owners in the order the rules rank them now, taking turns one
        request at a time (as letting one in moves its owner down rules 3
        and 4), each owner's own requests in its order (rule 5); overdue
        ones first.
        """
        now = self._let_in
        overdue = sorted((w for w in self._waiting.values() if now - w.arrived >= OVERDUE_LET_INS), key=_seq)
        rest = [w for w in self._waiting.values() if now - w.arrived < OVERDUE_LET_INS]
        level = self._levels()
        queues: dict[str, list[Waiting]] = {}
        for w in sorted(rest, key=lambda w: (-level(w), -w.priority, w.seq)):
            queues.setdefault(w.owner, []).append(w)
        owners = sorted(queues, key=lambda o: self._owner_rank(queues[o][0], level))
        out = [w.request_id for w in overdue]
        depth = 0
        while len(out) < len(self._waiting):
            out.extend(queues[o][depth].request_id for o in owners if depth < len(queues[o]))
            depth += 1
        return out

    def _next(self) -> Waiting:
        """The request rules 1-5 pick now (one pass: O(waiting))."""
        now = self._let_in
        overdue = [w for w in self._waiting.values() if now - w.arrived >= OVERDUE_LET_INS]
        if overdue:
            return min(overdue, key=_seq)
        level = self._levels()
        # Each owner's own first request (rules 2 and 5), then the owners ranked.
        best: dict[str, Waiting] = {}
        for w in self._waiting.values():
            mine = best.get(w.owner)
            if mine is None or (-level(w), -w.priority, w.seq) < (-level(mine), -mine.priority, mine.seq):
                best[w.owner] = w
        return min(best.values(), key=lambda w: self._owner_rank(w, level))

    def _owner_rank(self, first: Waiting, level: Callable[[Waiting], int]) -> tuple[int, ...]:
        # Rules 2-4 for the owner whose first request is ``first``, then arrival.
        return (-level(first), self._inside[first.owner], self._served[first.owner], first.seq)

    def _levels(self) -> Callable[[Waiting], int]:
        """Each waiting request's effective cross priority now (rule 2)."""
        now = self._let_in
        oldest: dict[int, int] = {}  # cross level -> the longest wait at that level
        for w in self._waiting.values():
            oldest[w.cross] = max(oldest.get(w.cross, 0), now - w.arrived)

        def level(w: Waiting) -> int:
            return effective_priority(w.cross, oldest[w.cross], age_rounds=AGE_ROUNDS)

        return level

    def __repr__(self) -> str:
        return f"Gate(in_engine={self._in_engine}, waiting={len(self._waiting)}, bound={self._bound()})"

    def owners_known(self) -> int:
        """Principals the gate keeps a history of use for (bounded by the requests held)."""
        return len(self._served)


def _seq(w: Waiting) -> int:
    return w.seq
