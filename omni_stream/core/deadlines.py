"""A request's deadline: ended at ``deadline_s`` after its admission, whatever it is doing.

:class:`Deadlines`, a part of :class:`~omni_stream.core.rules.Rules`,
keeps the requests that named a ``deadline_s`` (a ``generate`` field;
HTTP's and the OpenAI doors' ``Cancel-After`` header, Replicate's) and
ends each one that is still going when its time comes: a request that has
not started yet ends ``cancelled`` with reason ``expired`` without a step
run (Replicate's "aborted"), one that runs (or is paused) is cancelled
with reason ``deadline`` (Replicate's "canceled"). Its watchers, its
status, its webhook and ``/metrics`` (``omni_stream_deadlines_total``) say
which. Nothing here waits: the shell calls :meth:`Deadlines.expire_deadlines`
when the next deadline is due (server/service.py keeps the time), and
again whenever one is set (``Shell.timers_changed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gate import Gate
from .preemption import Preempted

if TYPE_CHECKING:
    from collections.abc import Callable

    from .effects import Shell
    from .metrics import ServerMetrics
    from .records import RequestRecord

__all__ = ["Deadlines"]


class Deadlines:
    """Requests ended at their deadline: a part of :class:`~omni_stream.core.rules.Rules` (see
    the module docstring), whose ``__init__`` sets these attributes."""

    gate: Gate
    metrics: ServerMetrics
    shell: Shell | None
    clock: Callable[[], float]
    #: Requests with a deadline that have not ended, by id.
    deadlines: dict[str, RequestRecord]

    if TYPE_CHECKING:

        def stop(self, record: RequestRecord, reason: str) -> None: ...

    def keep_deadline(self, record: RequestRecord, deadline_s: float | None) -> None:
        """Hold ``record`` to ``deadline_s`` from its admission (None: no deadline)."""
        if deadline_s is None:
            return
        record.deadline_at = record.created_at + deadline_s
        self.deadlines[record.id] = record
        if self.shell is not None:
            self.shell.timers_changed()

    def expire_deadlines(self) -> float | None:
        """End every request whose deadline has come (see the module docstring); seconds until
        the next one is due, None when no request has a deadline."""
        now = self.clock()
        due: float | None = None
        for record in list(self.deadlines.values()):
            if record.ended:
                del self.deadlines[record.id]
                continue
            assert record.deadline_at is not None  # (keep_deadline set it)
            left = record.deadline_at - now
            if left > 0:
                due = left if due is None else min(due, left)
                continue
            del self.deadlines[record.id]
            reason = "expired" if self._unstarted(record) else "deadline"
            self.metrics.deadlines.labels(reason, self.metrics.model(record.model)).inc()
            self.stop(record, reason)
        return due

    def _unstarted(self, record: RequestRecord) -> bool:
        # Waiting in the gate, never let in (one paused there by preemption, or its client, has run).
        item = self.gate.get(record.id)
        return item is not None and not isinstance(item.payload, Preempted) and record.frames_taken == 0
