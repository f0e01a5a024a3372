"""The server's record of each request: owner, watchers, latest state, retention (pure, no I/O).

A :class:`RequestRecord` is created when a ``generate`` is accepted. Its
consumer (one task per request, in ``app.py``) publishes into it; the record
fans every message out to the outboxes of the connections watching it and
keeps the latest ``progress``, the latest encoded preview and the terminal
message, which is what ``attach`` replays. The :class:`RequestRegistry`
holds the records, answers who may see which, and forgets ended requests:
at once for a request that was not detached, after ``retention_s`` for one
that was, or earlier when ``max_retained`` is reached or the server's
:class:`~omni_stream.core.memory.MemoryBudget` needs the bytes: then the
oldest ended result of the principal holding the most goes first, so a
principal's flood evicts its own results, never another's that holds less
(issue #39, attack 4: 300 cheap results of one tenant made another's
finished results 404 two seconds after they ended). What a record keeps for
replay counts against that budget until the record is forgotten.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from .. import protocol
from ..ids import is_valid_id
from .memory import MemoryBudget
from .outbox import Outbox

if TYPE_CHECKING:
    from .webhooks import WebhookState

__all__ = ["UNREAD_AFTER_S", "RequestRecord", "RequestRegistry"]

#: How long a watcher may hold a request's previous progress or preview
#: unsent before it counts as not reading (its writer has had time to run;
#: a reader's burst clears in milliseconds). Then previews nobody would
#: receive are not rendered, and the consumer paces itself.
UNREAD_AFTER_S = 0.05


class RequestRecord:
    """One request as the server sees it (see the module docstring).

    ``owner`` is the id of the client (connection) that created it: a
    request that is not detached ends when its owner goes. ``principal`` is
    the key of who that client is (principal.py): what per-principal rules
    count it against. ``cancel_reason`` is set by whoever cancels it through
    the engine, so the consumer can say why in ``cancelled``.
    """

    def __init__(
        self,
        request_id: str,
        *,
        owner: str,
        detach: bool,
        total: int,
        preview: Mapping[str, Any],
        created_at: float,
        output: Mapping[str, Any] | None = None,
        priority: int = 0,
        principal: str | None = None,
        cross_priority: int = 0,
        seed: int | None = None,
        model: str | None = None,
    ) -> None:
        self.id = request_id
        self.owner = owner
        self.principal = principal if principal is not None else f"connection:{owner}"
        self.detach = detach
        self.total = total
        self.preview = dict(preview)
        self.output = dict(output) if output is not None else None
        self.created_at = created_at
        self.priority = priority
        #: The part of ``priority`` that ranks against other principals' requests.
        self.cross_priority = cross_priority
        #: The seed it runs with (drawn at admission when it named none), None without one.
        self.seed = seed
        #: The model that runs it, on a server of several (None on a server of one).
        self.model = model
        #: It waits for its model to load (no frame yet).
        self.loading = False
        #: Paused (Rules.pause): no step runs until it is resumed.
        self.paused = False
        #: Seconds its clients' pauses held it, the one running now excluded (max_pause_s bounds it).
        self.paused_for_s = 0.0
        #: When its clients' pause running now began (Rules.clock), None while none is.
        self.paused_at: float | None = None
        #: The ``restarted`` message (serialized) when the server brought it back after a restart
        #: (server/state.py): kept for every later ``attach``, whatever progress comes after it.
        self.restarted: str | None = None
        # Why and when the last restart was said, until its first frame (restart_settled).
        self._restart_pending: tuple[str, float] | None = None
        #: Its step when it (re)entered the engine: a preemption waits for a quantum past it.
        self.entered_step = 0
        #: Called after each published step while it runs (the rules' preemption retry), or None.
        self.on_step: Callable[[RequestRecord], None] | None = None
        #: Callers waiting for its end without watching its steps (HTTP ``?wait=true``).
        self.waiters = 0
        self.cancel_reason: str | None = None
        self.ended_at: float | None = None
        self.outcome: str | None = None  # "done" | "cancelled" | "error" once ended
        self.latest_step = 0
        #: Frames the server took from the engine (one progress each), and
        #: previews it published: the per-request log line reports them.
        self.frames_taken = 0
        self.previews_sent = 0
        #: A preview of a non-finite frame was skipped (warned once; consumer.py).
        self.warned_non_finite = False
        #: The latest progress's estimate of the time left, None before the first.
        self.latest_eta_s: float | None = None
        #: Its webhook (core/webhooks.py), set at admission when it asked for one: told of
        #: each progress and of the end, it decides what is delivered.
        self.webhook: WebhookState | None = None
        self._ended_event: anyio.Event | None = None
        self._latest_progress: str | None = None
        self._latest_preview: bytes | None = None  # the newest intermediate preview
        self._results: list[bytes] = []  # the final frames: one per image, in order
        self._terminal: tuple[str, str] | None = None  # (serialized message, kind)
        self._watchers: dict[str, Outbox] = {}
        # (watcher, kind) -> the held_since its outbox had when last looked at.
        self._held_seen: dict[tuple[str, str], float | None] = {}
        self._budget: MemoryBudget | None = None
        self._counted = 0  # retained_bytes() as last told to the budget

    @property
    def ended(self) -> bool:
        return self._terminal is not None

    @property
    def watchers(self) -> tuple[str, ...]:
        """Ids of the connections watching."""
        return tuple(self._watchers)

    def is_watched_by(self, conn_id: str) -> bool:
        return conn_id in self._watchers

    def accepted_message(self, *, attached: bool) -> str:
        return protocol.dumps(
            protocol.accepted(
                self.id,
                total=self.total,
                detach=self.detach,
                attached=attached,
                preview=self.preview,
                output=self.output,
                seed=self.seed,
                model=self.model,
            )
        )

    def watch(self, conn_id: str, outbox: Outbox, *, attached: bool) -> None:
        """Start sending this request to ``outbox``: ``accepted``, then the replay.

        The replay (latest ``progress``, latest preview, terminal message) is
        queued synchronously, before any later publish can run, so nothing
        is lost or sent twice between the replay and the live messages.
        """
        outbox.put(self.accepted_message(attached=attached), "accepted")
        if self.restarted is not None:
            outbox.put(self.restarted, "restarted")
        if self._latest_progress is not None:
            outbox.put(self._latest_progress, "progress", latest_key=(self.id, "progress"))
        pin = (self.id, "progress")
        if self._results:
            for result in self._results:
                outbox.put(result, "preview", pin_key=pin)
        elif self._latest_preview is not None:
            outbox.put(self._latest_preview, "preview", latest_key=(self.id, "preview"), pin_key=pin)
        if self._terminal is not None:
            text, kind = self._terminal
            outbox.put(text, kind)
        else:
            self._watchers[conn_id] = outbox

    def unwatch(self, conn_id: str) -> None:
        self._watchers.pop(conn_id, None)
        for kind in ("progress", "preview"):
            self._held_seen.pop((conn_id, kind), None)

    def publish_loading(self, model: str) -> None:
        """Say the request waits for ``model`` to load: a ``loading`` to every watcher, in the
        place of its progress (the first ``progress`` replaces it)."""
        self.loading = True
        text = protocol.dumps(protocol.loading(self.id, model=model))
        self._latest_progress = text
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(text, "loading", latest_key=(self.id, "progress"))

    def publish_paused(self, reason: str | None = None) -> None:
        """Say the request is paused (after its latest step), for ``reason`` (protocol.PAUSE_REASONS):
        ``paused`` to every watcher, in the place of its progress (kept for a replay until it
        resumes). Raises ValueError for another reason."""
        text = protocol.dumps(protocol.paused(self.id, step=self.latest_step, reason=reason))
        self.paused = True
        self._publish_state(text, "paused")

    def publish_resumed(self, reason: str | None = None) -> None:
        """Say the request runs again, for ``reason`` (protocol.RESUME_REASONS): ``resumed`` to
        every watcher; its next progress replaces it. Raises ValueError for another reason."""
        text = protocol.dumps(protocol.resumed(self.id, step=self.latest_step, reason=reason))
        self.paused = False
        self._publish_state(text, "resumed")

    def restart_settled(self) -> tuple[str, float] | None:
        """``(reason, seconds)`` from the restart said last to now, once: the consumer asks at each
        frame, and the first frame after a restart gets it (``/metrics``' time to first frame)."""
        pending, self._restart_pending = self._restart_pending, None
        if pending is None:
            return None
        return pending[0], time.monotonic() - pending[1]

    def restart_view(self) -> dict[str, Any] | None:
        """The restart last said (``{"from_step", "reason"}``), None if it did not restart: what
        the HTTP status and an OpenAI video job show of it."""
        if self.restarted is None:
            return None
        message = json.loads(self.restarted)
        return {"from_step": message["from_step"], "reason": message["reason"]}

    def publish_restarted(self, from_step: int, reason: str, *, rewind: bool = True) -> bool:
        """Say the server restarted and runs the request again from ``from_step`` (protocol.RESTART_REASONS
        says why there): ``restarted`` to every watcher, kept for every later ``attach``; its progress
        goes on from that step. Said again only when it changed (a checkpoint the model refused
        once the request was let in). ``rewind=False``: the steps it makes again are not sent
        again (a Ray hand-over drops them), so its step stays where its watchers are. Returns
        whether it was said (False: the same as last time). Raises ValueError for an unknown
        reason."""
        text = protocol.dumps(protocol.restarted(self.id, from_step=from_step, reason=reason))
        if text == self.restarted:
            return False
        self.restarted = text
        self._restart_pending = (reason, time.monotonic())
        if rewind:
            self.latest_step = from_step
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(text, "restarted")
        return True

    def _publish_state(self, text: str, kind: str) -> None:
        self._latest_progress = text
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(text, kind, latest_key=(self.id, "progress"))

    def publish_progress(self, step: int, message: Mapping[str, Any]) -> None:
        """Send a ``progress`` to every watcher, latest wins."""
        self.loading = False
        text = protocol.dumps(message)
        self.latest_step = step
        self.frames_taken += 1
        eta = message.get("eta_s")
        self.latest_eta_s = float(eta) if isinstance(eta, (int, float)) else None
        self._latest_progress = text
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(text, "progress", latest_key=(self.id, "progress"))
        if self.webhook is not None:
            self.webhook.progressed(step, self.total, self.latest_eta_s)
        if self.on_step is not None:
            self.on_step(self)

    def wants_preview(self) -> bool:
        """Whether a new intermediate preview would reach anyone.

        False when every watcher has held this request's previous preview
        unsent since the last look and for UNREAD_AFTER_S (a client that
        does not read): a new one would only replace it there, so rendering
        it is wasted work (a flood of never-reading clients otherwise keeps
        the preview threads busy for nobody). True with no watchers: the
        latest preview is kept for ``attach`` and ``GET .../preview``.
        """
        return not self._watchers or self._someone_takes((self.id, "preview"))

    def has_reader(self) -> bool:
        """Whether a new ``progress`` would reach anyone now.

        False when nobody watches, or every watcher has held this request's
        previous ``progress`` unsent since the last look and for
        UNREAD_AFTER_S (its client is not reading): then the consumer paces
        itself instead of taking every step the engine makes (consumer.py).
        True while a caller waits for its end (``waiters``: ``?wait=true``):
        pacing would hold its result back by up to a pace.
        """
        return self.waiters > 0 or self._someone_takes((self.id, "progress"))

    def _someone_takes(self, key: tuple[str, str]) -> bool:
        # A watcher takes messages unless it has held this kind unsent since
        # the last time we looked (its writer had a turn on the loop since,
        # and did not take it) and for UNREAD_AFTER_S at least. Both: under
        # a saturated loop a reader's writer may wait longer than that for
        # its turn, and a burst may leave one unsent over one turn.
        now = time.monotonic()
        takes = False
        for conn_id, outbox in self._watchers.items():
            since = outbox.held_since(key)
            seen = (conn_id, key[1])
            before = self._held_seen.get(seen)
            self._held_seen[seen] = since
            if since is None or since != before or now - since < UNREAD_AFTER_S:
                takes = True
        return takes

    def publish_preview(self, frame: bytes, *, final: bool) -> None:
        """Send a packed preview frame to every watcher; a final one (a result: one per
        image of the request) is must-deliver, and kept for replay in order."""
        if final:
            self._results.append(frame)
            self._latest_preview = None  # stale next to the result
        else:
            self._latest_preview = frame
        self.previews_sent += 1
        self._recount()
        # The pin keeps this step's progress (if still unsent) ahead of it.
        pin = (self.id, "progress")
        for outbox in self._watchers.values():
            if final:
                # An older preview still unsent is stale next to the result.
                outbox.discard((self.id, "preview"))
                outbox.put(frame, "preview", pin_key=pin)
            else:
                outbox.put(frame, "preview", latest_key=(self.id, "preview"), pin_key=pin)

    def finish(self, message: Mapping[str, Any], *, now: float) -> None:
        """Send the terminal message (``done`` / ``cancelled`` / ``error``) to every watcher.

        Idempotent: a second call is ignored (the first outcome stands).
        """
        if self._terminal is not None:
            return
        kind = str(message["type"])
        text = protocol.dumps(message)
        self._terminal = (text, kind)
        self.outcome = kind
        self.ended_at = now
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(text, kind)
        self._watchers.clear()
        if self._ended_event is not None:
            self._ended_event.set()
        if self.webhook is not None:
            # Whichever path ended it (its consumer, the gate, shutdown): one terminal delivery.
            self.webhook.ended(self, message)

    async def wait_ended(self) -> None:
        """Return once the request has ended (at once if it has)."""
        if self._terminal is not None:
            return
        if self._ended_event is None:
            self._ended_event = anyio.Event()
        await self._ended_event.wait()

    def terminal_message(self) -> dict[str, Any] | None:
        """The terminal message (``done`` / ``cancelled`` / ``error``) as a dict; None while running."""
        return None if self._terminal is None else json.loads(self._terminal[0])

    def latest_preview(self) -> tuple[protocol.PreviewHeader, memoryview] | None:
        """The newest preview sent (the first result, once there is one), split; None before the first."""
        latest = self._results[0] if self._results else self._latest_preview
        if latest is None:
            return None
        return protocol.unpack_preview(latest)

    @property
    def result_count(self) -> int:
        """How many results the request has (one per image) once done, else 0."""
        return len(self._results) if self.outcome == "done" else 0

    def result(self, index: int = 0) -> tuple[protocol.PreviewHeader, memoryview] | None:
        """Result ``index`` (a final frame in its output format; one per image) once the request
        is done, else None (None too for an index it does not have)."""
        if not 0 <= index < self.result_count:
            return None
        return protocol.unpack_preview(self._results[index])

    def retained_bytes(self) -> int:
        """Bytes this record holds for replay."""
        return (
            len(self._latest_preview or b"")
            + sum(len(r) for r in self._results)
            + len(self._latest_progress or "")
            + len(self.restarted or "")
            + len(self._terminal[0] if self._terminal else "")
        )

    def use_budget(self, budget: MemoryBudget | None) -> None:
        """Count what this record holds for replay against ``budget`` from now on."""
        self._release()
        self._budget = budget
        self._recount()

    def forget(self) -> None:
        """The registry let go of this ended record: free its replay state and its budget share."""
        self._release()
        self._budget = None
        self._latest_progress = None
        self._latest_preview = None
        self._results = []

    def _recount(self) -> None:
        if self._budget is None:
            return
        held = self.retained_bytes()
        # Set before telling the budget: adding may shed, and evict this very record.
        delta, self._counted = held - self._counted, held
        if delta >= 0:
            self._budget.add(delta)
        else:
            self._budget.release(-delta)

    def _release(self) -> None:
        if self._budget is not None:
            self._budget.release(self._counted)
        self._counted = 0

    @classmethod
    def restored(
        cls,
        accepted: Mapping[str, Any],
        *,
        owner: str,
        principal: str,
        created_at: float,
        ended_at: float,
        terminal: Mapping[str, Any],
        results: list[bytes],
        priority: int = 0,
        restarted: tuple[int, str] | None = None,
    ) -> RequestRecord:
        """An ended, detached record rebuilt from the state directory (server/state.py).

        ``accepted``: the ``accepted`` message the request got (its id, total,
        preview, output, seed, model); ``terminal``: the message it ended
        with; ``results``: its packed final frames, in order (none unless it
        is done). ``attach`` replays ``accepted``, the results and the
        terminal message, as for a request that ended in this process.
        ``restarted``: (from_step, reason) when it had been restarted before
        it ended (its ``restarted`` message is replayed and shown again).
        Raises KeyError or ValueError for an ``accepted`` without id or total,
        ValueError for an unknown restart reason.
        """
        output = accepted.get("output")
        record = cls(
            str(accepted["id"]),
            owner=owner,
            detach=True,  # its client is gone: the id is how anyone gets it back
            total=int(accepted["total"]),
            preview=accepted.get("preview") or {},
            output=output if isinstance(output, Mapping) else None,
            created_at=created_at,
            priority=priority,
            principal=principal,
            seed=accepted.get("seed"),
            model=accepted.get("model"),
        )
        kind = str(terminal["type"])
        if kind == "done":
            record._results = list(results)
            record.latest_step = record.total
        if restarted is not None:
            step, reason = restarted
            record.restarted = protocol.dumps(protocol.restarted(record.id, from_step=step, reason=reason))
        record._terminal = (protocol.dumps(dict(terminal)), kind)
        record.outcome = kind
        record.ended_at = ended_at
        return record

    def __repr__(self) -> str:
        state = self.outcome or "running"
        return (
            f"RequestRecord({self.id!r}, {state}, step {self.latest_step}/{self.total}, "
            f"owner={self.owner!r}, detach={self.detach}, watchers={len(self._watchers)})"
        )


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

    def lookup(self, request_id: str, conn_id: str, *, principal: str | None = None) -> RequestRecord:
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
        if record is None or not self.visible(record, conn_id, principal=principal):
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
    def visible(record: RequestRecord, conn_id: str, *, principal: str | None) -> bool:
        """Whether client ``conn_id`` (of the proved ``principal``, if any) may see ``record``."""
        if record.owner == conn_id:
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
            r
            for r in self._records.values()
            if r.ended and r.ended_at is not None and r.ended_at <= deadline
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
    key = max(
        oldest, key=lambda p: (held[p], p == newcomer, -(oldest[p].ended_at or 0.0))
    )
    return oldest[key]
