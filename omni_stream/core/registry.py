"""The server's registry of request records: who may see which, and how long ended ones are kept.

The :class:`RequestRegistry` holds every
:class:`~omni_stream.core.records.RequestRecord` by its id (ids are global
to the server), answers who may see which (:meth:`RequestRegistry.lookup`:
a client's own requests, its proved principal's, and on a server without
tokens the detached ones of principals that proved nobody), and forgets
ended requests: at once for a request that was not detached, after
``retention_s`` for one that was, or earlier when ``max_retained`` is
reached or the server's :class:`~omni_stream.core.memory.MemoryBudget`
needs the bytes: then the oldest ended result of the principal holding the
most goes first, so a principal's flood evicts its own results, never
another's that holds less (issue #39, attack 4: 300 cheap results of one
tenant made another's finished results 404 two seconds after they ended).

Pure, no I/O: it never publishes into a record or cancels one (records.py
fans out, the rules cancel); it tells ``on_forget`` of each record it
forgets (the state directory deletes it too). Apart from the record
because retention and eviction are rules about the whole set, the record
is one request's fan-out and replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .. import protocol
from ..ids import is_valid_id

if TYPE_CHECKING:
    from .memory import MemoryBudget
    from .records import RequestRecord

__all__ = ["RequestRegistry"]


class RequestRegistry:
    """Every request the server knows, by id (see the module docstring)."""

    def __init__(
        self,
        *,
        retention_s: float,
        max_retained: int,
        clock: Callable[[], float] = time.monotonic,
        budget: MemoryBudget | None = None,
    ) -> None:
        self._retention_s = retention_s
        self._max_retained = max_retained
        self._clock = clock
        self._records: dict[str, RequestRecord] = {}
        self._budget = budget
        #: Told of every record forgotten (retention over, evicted, discarded, a
        #: request not detached that ended): the state directory deletes it too.
        self.on_forget: Callable[[RequestRecord], None] | None = None
        if budget is not None:
            budget.set_retained(self)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def running(self) -> list[RequestRecord]:
        return [r for r in self._records.values() if not r.ended]

    def retained(self) -> list[RequestRecord]:
        """Detached records, running or ended."""
        return [r for r in self._records.values() if r.detach]

    def running_owned_by(self, conn_id: str) -> int:
        return sum(1 for r in self._records.values() if r.owner == conn_id and not r.ended)

    def running_of(self, principal: str) -> int:
        """Requests of ``principal`` (its key) that have not ended."""
        return sum(1 for r in self._records.values() if r.principal == principal and not r.ended)

    def check_new(self, request_id: str, *, detach: bool) -> None:
        """Raise MessageError unless a request ``request_id`` may be added now.

        ``duplicate_id`` when the id is taken; for a detached request,
        ``too_many_requests`` when ``max_retained`` detached requests are
        held and none has ended (ended ones are forgotten, oldest first, by
        :meth:`add`).
        """
        self.prune()
        if request_id in self._records:
            raise protocol.MessageError(
                "duplicate_id",
                f"a request with id {request_id!r} already exists; ids are global to the server",
                field="id",
                request_id=request_id,
            )
        retained = self.retained() if detach else []
        if len(retained) >= self._max_retained and not any(r.ended for r in retained):
            raise protocol.MessageError(
                "too_many_requests",
                f"the server already holds {self._max_retained} detached requests "
                "(max_retained, OMNI_STREAM_MAX_RETAINED)",
                request_id=request_id,
            )

    def add(self, record: RequestRecord) -> None:
        """Register ``record``; raises MessageError as :meth:`check_new` does."""
        self.check_new(record.id, detach=record.detach)
        if record.detach:
            retained = self.retained()
            for _ in range(len(retained) - self._max_retained + 1):
                victim = _next_victim(retained, newcomer=record.principal, weight=_one)
                if victim is None:
                    break
                retained.remove(victim)
                self._forget(victim)
        self._records[record.id] = record
        record.use_budget(self._budget)

    def lookup(
        self, request_id: str, conn_id: str, *, principal: str | None = None, session: str | None = None
    ) -> RequestRecord:
        """The record client ``conn_id`` may cancel or attach; raises MessageError ``not_found`` otherwise.

        Visible: the client's own requests; every request of its
        ``principal`` when it proved it (a token's: pass its key, None
        otherwise, since an address or a connection proves nothing more
        than the client itself); and, to a client that proved nobody, the
        detached requests of principals that proved nobody either (on a
        server without tokens the id is the capability: a websocket's
        principal is its connection, which a reconnect does not keep).
        """
        self.prune()
        record = self._records.get(request_id)
        if record is None or not self.visible(record, conn_id, principal=principal, session=session):
            # (Over HTTP the id is whatever a path held: echoed clipped, carried only if it is one.)
            raise protocol.MessageError(
                "not_found",
                f"no request with id {protocol.clip(request_id)!r} visible to this connection "
                "(unknown, ended and not retained, or not yours)",
                field="id",
                request_id=request_id if is_valid_id(request_id) else None,
            )
        return record

    @staticmethod
    def visible(
        record: RequestRecord, conn_id: str, *, principal: str | None, session: str | None = None
    ) -> bool:
        """Whether client ``conn_id`` (of the proved ``principal``, if any; in browser ``session``,
        if any: server/sessions.py) may see ``record``."""
        if record.owner == conn_id or (session is not None and record.session == session):
            return True
        if principal is not None:
            return record.principal == principal
        # A tenant's request is its tenant's alone, on every route, whoever knows the id
        # (issue #39, attack 9: tenant B read, paused and deleted A's job by its id).
        return record.detach and not record.principal.startswith(_PROVED)

    def ended(self, record: RequestRecord) -> None:
        """Call once ``record`` has finished: a request that was not detached is forgotten now."""
        if not record.detach and self._records.get(record.id) is record:
            self._forget(record)

    def discard(self, record: RequestRecord) -> bool:
        """Forget an ended ``record`` now, its results with it (a deleted video job); False
        while it runs or once it is gone."""
        if not record.ended or self._records.get(record.id) is not record:
            return False
        self._forget(record)
        return True

    def disconnect(self, conn_id: str) -> list[RequestRecord]:
        """Stop sending anything to ``conn_id``; return its running, non-detached requests.

        The caller cancels those through the engine.
        """
        to_cancel = []
        for record in list(self._records.values()):
            record.unwatch(conn_id)
            if record.owner == conn_id and not record.detach and not record.ended:
                to_cancel.append(record)
        return to_cancel

    def prune(self) -> list[RequestRecord]:
        """Forget detached requests that ended more than ``retention_s`` ago; return them."""
        deadline = self._clock() - self._retention_s
        expired = [
            r for r in self._records.values() if r.ended and r.ended_at is not None and r.ended_at <= deadline
        ]
        for r in expired:
            self._forget(r)
        return expired

    def evict_oldest_retained(self) -> bool:
        """Forget one ended request, if any (the memory budget's call): the oldest of the
        principal whose retained records hold the most bytes, so that one principal's large
        results make room from its own first. Returns whether one was forgotten.
        """
        victim = _next_victim(list(self._records.values()), newcomer=None, weight=_bytes)
        if victim is None:
            return False
        self._forget(victim)
        return True

    def _forget(self, record: RequestRecord) -> None:
        del self._records[record.id]
        record.forget()
        if self.on_forget is not None:
            self.on_forget(record)


#: The principal kind whose key proves who it is (principal.py: a token's name).
_PROVED = "token:"


def _one(record: RequestRecord) -> int:
    return 1


def _bytes(record: RequestRecord) -> int:
    return record.retained_bytes()


def _next_victim(
    records: list[RequestRecord], *, newcomer: str | None, weight: Callable[[RequestRecord], int]
) -> RequestRecord | None:
    """The ended record to forget first among ``records``: the oldest ended one of the principal
    holding the most (by ``weight``, running records included; ties: ``newcomer``'s own, then
    the one whose oldest ended first). None when none has ended.

    Retention is one pool shared by every principal: forgetting the oldest result overall let
    a principal's burst of cheap results evict everyone else's (issue #39, attack 4). Taken
    from the largest holder, a burst evicts its own results, and another principal's go only
    once it holds as much.
    """
    held: dict[str, int] = {}
    oldest: dict[str, RequestRecord] = {}
    for r in records:
        held[r.principal] = held.get(r.principal, 0) + weight(r)
        if r.ended:
            mine = oldest.get(r.principal)
            if mine is None or (r.ended_at or 0.0) < (mine.ended_at or 0.0):
                oldest[r.principal] = r
    if not oldest:
        return None
    key = max(oldest, key=lambda p: (held[p], p == newcomer, -(oldest[p].ended_at or 0.0)))
    return oldest[key]
