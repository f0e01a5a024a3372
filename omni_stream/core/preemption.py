"""A request paused in the engine: by the gate for a shorter one, or by its client, and back.

:class:`Preemption`, a part of :class:`~omni_stream.core.rules.Rules`,
holds the two ways a running request stops between two steps without
ending. Under the engine's ``preemptive`` policy, a request that arrives
to a full engine may take the place of the running one with the most
steps left, once that one has run its quantum (:meth:`Preemption._preempt_for`,
tried again at each of its steps past the quantum, :meth:`Preemption._stepped`):
the victim is paused to the host and waits in the gate, ranked by the
steps it has left, as a :class:`Preempted` payload. A client's ``pause``
(:meth:`Preemption.pause`) gives its place to the next request in the gate
too; its ``resume``, or ``max_pause_s`` paused in all
(:meth:`Preemption.expire_pauses`, called by the shell's timer), brings it
back through the gate like any waiting request.

It asks the engine to pause and resume and tells the request's watchers
(``paused``, ``resumed``); letting requests in is the rules' (rules.py,
``Rules.let_in``), the timer the shell's. Its own module so that the two
paths that take a place from a running request read together.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import protocol
from .limits import ServerLimits

if TYPE_CHECKING:
    from ..engine.like import EngineLike
    from .clients import Client
    from .effects import Shell
    from .gate import Gate
    from .records import RequestRecord
    from .registry import RequestRegistry
    from .rules import Admitted

__all__ = ["Preempted", "Preemption"]

logger = logging.getLogger("omni_stream.server")


@dataclasses.dataclass(frozen=True, slots=True)
class Preempted:
    """A gate payload: a request paused in the engine, to resume when let in: one the gate paused
    to make room (``reason`` ``preempted``), or one its client paused, resumed since (``client``,
    ``max_pause``), that waits for a place like any other."""

    record: RequestRecord
    reason: str = "preempted"


class Preemption:
    """Requests paused and resumed: a part of :class:`~omni_stream.core.rules.Rules` (see the
    module docstring), whose ``__init__`` sets these attributes."""

    engine: EngineLike
    limits: ServerLimits
    clock: Callable[[], float]
    gate: Gate
    registry: RequestRegistry
    #: Requests their clients paused, by id: in the engine, holding no place in the gate's
    #: count (they come back through the gate when resumed), each for max_pause_s at most.
    paused: dict[str, RequestRecord]
    shell: Shell | None

    if TYPE_CHECKING:

        def let_in(self) -> None: ...

        def _let(self, admitted: Admitted) -> None: ...

        def lookup(self, client: Client, request_id: str) -> RequestRecord: ...

    # -- the gate's preemption ----------------------------------------------------------

    def _preempts(self) -> bool:
        """Whether the gate may pause a running request for a waiting one (the preemptive policy)."""
        return getattr(self.engine, "scheduling", None) == "preemptive" and hasattr(self.engine, "pause")

    def _quantum(self) -> int:
        return int(getattr(self.engine, "quantum", 1))

    def _victim(self) -> RequestRecord | None:
        """The running request with the most steps left among those past their quantum since they
        (re)entered the engine, or its principal's lowest-priority one past its quantum (a
        principal's priority says whom of its own to preempt last); None when none is."""
        quantum = self._quantum()
        running = [r for r in self._in_engine() if r.latest_step - r.entered_step >= quantum]
        if not running:
            return None
        longest = max(running, key=_left)
        own = [r for r in running if r.principal == longest.principal]
        return min(own, key=lambda r: (r.priority, -_left(r)))

    def _in_engine(self) -> list[RequestRecord]:
        """The requests in the engine and not paused: those holding a place."""
        return [r for r in self.registry.running() if r.id not in self.gate and not r.paused]

    def _preempt_for(self, waiting: RequestRecord) -> None:
        """Give ``waiting`` (just come to a full engine) a running request's place, if one should.

        First by priority, under every policy: a request of the same principal
        with a lower ``priority`` gives its place (:meth:`_outranked`). Then,
        under the ``preemptive`` policy, the running request with the most
        steps left, if it has more left than ``waiting`` has in all and has run
        its quantum since it (re)entered. The one paused goes back to the gate
        as a request to resume (its state to the host meanwhile), and comes
        back in the gate's order as places free.
        """
        if not hasattr(self.engine, "pause"):
            return
        victim = self._outranked(waiting)
        if victim is not None:
            self._preempt(victim, waiting)
            return
        if not self._preempts():
            return
        victim = self._victim()
        if victim is not None and _left(victim) > waiting.total:
            self._preempt(victim, waiting)

    def _outranked(self, waiting: RequestRecord) -> RequestRecord | None:
        """The request of ``waiting``'s principal in the engine with the lowest ``priority``, if
        lower than ``waiting``'s: one not started yet first (pausing it loses nothing), then the
        one with the most steps left. None when there is none.

        A principal's ``priority`` orders its own requests only (gate.py, rule 5),
        so one principal's request never takes another's place by it, and there
        is no quantum: within a principal the order is strict, nothing thrashes.
        Without this a request of priority 10 that came to a full engine waited
        for one of its own priority-0 requests to end (issue #38).
        """
        own = [
            r for r in self._in_engine() if r.principal == waiting.principal and r.priority < waiting.priority
        ]
        if not own:
            return None
        return min(own, key=lambda r: (r.priority, r.latest_step > 0, -_left(r)))

    def _stepped(self, record: RequestRecord) -> None:
        """``record`` took a step (``RequestRecord.on_step``): try the preemption again.

        An arriving request tries once, when it comes (:meth:`generate`).
        One that came while every running request was within its quantum
        would then wait for a place to free, however long that took: so each
        step of a request past its quantum looks again, for the first fresh
        request in the gate's order shorter than what that request has left.
        (Most steps find no waiter, or none short enough: the checks go
        cheapest first.)
        """
        gate = self.gate
        if not gate.waiting or record.paused or record.id in gate:
            return
        left = record.total - record.latest_step
        if record.latest_step - record.entered_step < self._quantum():
            return
        fresh = [w for w in gate.items() if not isinstance(w.payload, Preempted)]
        if not fresh or min(w.payload.record.total for w in fresh) >= left:
            return
        victim = self._victim()
        if victim is None:
            return
        left = victim.total - victim.latest_step
        for request_id in gate.order():
            item = gate.get(request_id)
            if item is None or isinstance(item.payload, Preempted):
                continue
            if item.payload.record.total < left:
                self._preempt(victim, item.payload.record)
                return

    def _readmit(self, item: Preempted) -> None:
        """Let a request the gate or its client paused run again: its place in the engine back."""
        record = item.record
        self.gate.entered(record.principal, record.total - record.latest_step)
        record.entered_step = record.latest_step
        record.rate.start(self.clock(), record.latest_step)
        resume = getattr(self.engine, "resume", None)
        if resume is not None and resume(record.id):
            record.publish_resumed(item.reason)

    def _preempt(self, victim: RequestRecord, waiting: RequestRecord) -> None:
        """Pause ``victim`` (to the host) and give its place to ``waiting``, which waits in the gate."""
        pause = getattr(self.engine, "pause", None)
        if pause is None or not pause(victim.id, to_host=True):
            return
        victim.publish_paused("preempted")
        self.gate.left(victim.principal)
        # The place is the newcomer's: let in by the gate's order, the victim
        # (its principal now with one fewer inside) could take it straight back.
        item = self.gate.remove(waiting.id)
        self.gate.wait(
            victim.id,
            victim.principal,
            victim.priority,
            Preempted(victim),
            cost=victim.total - victim.latest_step,
            cross=victim.cross_priority,
        )
        if item is not None:
            self._let(item.payload)

    # -- a client's pause -------------------------------------------------------------

    def pause(self, client: Client, request_id: str, *, to_host: bool = False) -> RequestRecord:
        """Pause a request ``client`` may see, between two steps (``Engine.pause``); its watchers
        get ``paused``. It gives its place in the engine to the next request in the gate, comes
        back through the gate when resumed, and resumes by itself once paused ``max_pause_s`` in
        all (:meth:`expire_pauses`). Raises MessageError: ``not_found``, or ``bad_message`` for a
        request that is not running in the engine (ended, waiting for a place, paused already),
        one paused ``max_pause_s`` already, one whose model cannot stop it between two steps (the
        engine's ``pause_refusal`` says why), or an engine that cannot pause."""
        record = self.lookup(client, request_id)
        pause = getattr(self.engine, "pause", None)
        if pause is None:
            raise protocol.MessageError(
                "bad_message", "this server's engine cannot pause requests", request_id=request_id
            )
        bound = self.limits.max_pause_s
        if not record.ended and record.paused_for_s >= bound:
            raise protocol.MessageError(
                "bad_message",
                f"request {record.id} was paused {record.paused_for_s:.1f} s in all, this server's "
                f"max_pause_s={bound:g} ({ServerLimits.env_name('max_pause_s')}): it runs to its end",
                request_id=request_id,
            )
        if (
            record.ended
            or record.id in self.gate
            or record.id in self.paused
            or not pause(record.id, to_host=to_host)
        ):
            # Its model may refuse it whatever its progress (Engine.pause_refusal): say so, not
            # that it is not running.
            refusal = getattr(self.engine, "pause_refusal", None)
            why = refusal(record.id) if callable(refusal) and not record.ended else None
            raise protocol.MessageError(
                "bad_message",
                why
                or f"request {record.id} is not running (ended, not started yet, or paused "
                "already): nothing to pause",
                request_id=request_id,
            )
        record.publish_paused("client")
        record.paused_at = self.clock()
        self.paused[record.id] = record
        # Its place is the next request's: four requests paused for good once held every place
        # of a CPU server, and another tenant's request waited with no end (issue #39, attack 1).
        self.gate.left(record.principal)
        if self.shell is not None:
            self.shell.timers_changed()
        self.let_in()
        return record

    def resume(self, client: Client, request_id: str) -> RequestRecord:
        """Resume a paused request ``client`` may see: it runs again when the gate has a place for
        it (at once if it has one), and its watchers get ``resumed`` then. Raises MessageError:
        ``not_found``, or ``bad_message`` for one that is not paused."""
        record = self.lookup(client, request_id)
        if record.id in self.paused and not record.ended:
            self._unpause(record, "client")
            return record
        resume = getattr(self.engine, "resume", None)
        # (Not a request the gate paused: that one runs again when the gate lets it in.)
        if resume is None or record.ended or record.id in self.gate or not resume(record.id):
            raise protocol.MessageError(
                "bad_message", f"request {record.id} is not paused: nothing to resume", request_id=request_id
            )
        record.publish_resumed("client")
        return record

    def _unpause(self, record: RequestRecord, reason: str) -> None:
        """End a client's pause of ``record`` (``reason``: ``client`` or ``max_pause``): back into
        the engine now if the gate has room, else it waits there for a place, ranked as any
        request with its steps left."""
        del self.paused[record.id]
        now = self.clock()
        if record.paused_at is not None:
            record.paused_for_s += max(0.0, now - record.paused_at)
            record.paused_at = None
        item = Preempted(record, reason)
        self.gate.wait(
            record.id,
            record.principal,
            record.priority,
            item,
            cost=max(1, record.total - record.latest_step),
            cross=record.cross_priority,
        )
        self.let_in()

    def expire_pauses(self) -> float | None:
        """Resume every request its clients paused ``max_pause_s`` in all (its watchers get
        ``resumed`` with ``reason: max_pause`` as it runs again); seconds until the next one is
        due, None when none is paused. The shell calls it when that time comes, and again
        whenever its shell hears that a pause began (``Shell.timers_changed``)."""
        now = self.clock()
        bound = self.limits.max_pause_s
        due: float | None = None
        for record in list(self.paused.values()):
            started = record.paused_at if record.paused_at is not None else now
            left = started + bound - record.paused_for_s - now
            if left <= 0 or record.ended:
                if not record.ended:
                    logger.info(
                        "request %s: paused %.1f s in all, max_pause_s=%g: it resumes",
                        record.id,
                        record.paused_for_s + now - started,
                        bound,
                    )
                    self._unpause(record, "max_pause")
            else:
                due = left if due is None else min(due, left)
        return due


def _left(record: RequestRecord) -> int:
    """The steps ``record`` has left."""
    return record.total - record.latest_step
