"""The server's record of each request: owner, watchers, latest state, retention (pure, no I/O).

A :class:`RequestRecord` is created when a ``generate`` is accepted. Its
consumer (one task per request, server/consumer.py) publishes into it, as
message objects (``protocol``'s classes and ``protocol.Preview``: the
server's one currency, encoded once where a websocket sends it); the record
fans every message out to the outboxes of the connections watching it and
keeps the latest ``progress``, the latest preview, the results and the
terminal message, which is what ``attach`` replays. What a record keeps for replay
counts against the server's :class:`~omni_stream.core.memory.MemoryBudget`
until the record is forgotten. The :class:`RequestRegistry` that holds the
records, answers who may see which and forgets ended ones (retention,
eviction per principal) is registry.py's, importable from here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from .. import protocol
from .eta import StepRate
from .memory import MemoryBudget
from .outbox import Outbox
from .registry import RequestRegistry

if TYPE_CHECKING:
    from .webhooks import WebhookState

__all__ = ["UNREAD_AFTER_S", "RequestRecord", "RequestRegistry", "Terminal", "error_view"]

#: The message a request ends with.
Terminal = protocol.Done | protocol.Cancelled | protocol.ErrorMessage


def error_view(terminal: Terminal | None) -> dict[str, Any] | None:
    """Why a request did not succeed, as its status and webhooks show it: ``{"code", "message"}``
    for an error, ``{"reason"}`` for a cancel; None for ``done`` or while it runs."""
    if isinstance(terminal, protocol.ErrorMessage):
        return {"code": terminal.code, "message": terminal.message}
    if isinstance(terminal, protocol.Cancelled):
        return {"reason": terminal.reason}
    return None


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
        #: Its key among finished results an exact repeat may reuse (repeats.py), or None.
        self.repeat_key: str | None = None
        #: Its recent steps' time, for the time it has left (eta.py).
        self.rate = StepRate()
        #: The browser session that started it (Client.session), None without one.
        self.session: str | None = None
        #: Whose repeats its result answers (repeats.repeat_scope); None: its principal's.
        self.repeat_scope: str | None = None
        #: It waits for its model to load (no frame yet).
        self.loading = False
        #: Paused (Rules.pause): no step runs until it is resumed.
        self.paused = False
        #: Seconds its clients' pauses held it, the one running now excluded (max_pause_s bounds it).
        self.paused_for_s = 0.0
        #: When its clients' pause running now began (Rules.clock), None while none is.
        self.paused_at: float | None = None
        #: The ``restarted`` message when the server brought it back after a restart
        #: (server/state.py): kept for every later ``attach``, whatever progress comes after it.
        self.restarted: protocol.Restarted | None = None
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
        #: When (the registry's clock) its deadline_s ends it, None without one (deadlines.py).
        self.deadline_at: float | None = None
        #: The digest of the message it was submitted with (core/retries.py), None when it came
        #: another way (a restart): a retry with the same id and message is this request again.
        self.fingerprint: str | None = None
        #: Its webhook (core/webhooks.py), set at admission when it asked for one: told of
        #: each progress and of the end, it decides what is delivered.
        self.webhook: WebhookState | None = None
        self._ended_event: anyio.Event | None = None
        # What a replay sends: the latest progress (or loading/paused/resumed in its place),
        # the newest intermediate preview, the results (one per image, in order), the end.
        self._latest_progress: protocol.ServerMessage | None = None
        self._latest_preview: protocol.Preview | None = None
        self._results: list[protocol.Preview] = []
        self._terminal: Terminal | None = None
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

    def accepted_message(self, *, attached: bool) -> protocol.Accepted:
        return protocol.Accepted.build(
            self.id,
            total=self.total,
            detach=self.detach,
            attached=attached,
            preview=self.preview,
            output=self.output,
            seed=self.seed,
            model=self.model,
        )

    def watch(self, conn_id: str, outbox: Outbox, *, attached: bool, position: int | None = None) -> None:
        """Start sending this request to ``outbox``: ``accepted``, then the replay.

        The replay (latest ``progress``, or ``queued`` at ``position`` for a
        request that has neither started nor ended; latest preview; terminal
        message) is queued synchronously, before any later publish can run, so
        nothing is lost or sent twice between the replay and the live messages:
        a stream opens with where the request stands.
        """
        outbox.put(self.accepted_message(attached=attached))
        if self.restarted is not None:
            outbox.put(self.restarted)
        if self._latest_progress is not None:
            outbox.put(self._latest_progress, latest_key=(self.id, "progress"))
        elif position is not None and self._terminal is None:
            outbox.put(protocol.Queued.build(self.id, position=position), latest_key=(self.id, "progress"))
        pin = (self.id, "progress")
        if self._results:
            for result in self._results:
                outbox.put(result, pin_key=pin)
        elif self._latest_preview is not None:
            outbox.put(self._latest_preview, latest_key=(self.id, "preview"), pin_key=pin)
        if self._terminal is not None:
            outbox.put(self._terminal)
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
        self._publish_state(protocol.Loading.build(self.id, model=model))

    def publish_queued(self, position: int) -> None:
        """Say the request waits unstarted, ``position`` requests before it: a ``queued`` to every
        watcher, in the place of its progress. Not kept for a replay: the position moves, and
        :meth:`watch` is told the one of its time."""
        message = protocol.Queued.build(self.id, position=position)
        for outbox in self._watchers.values():
            outbox.put(message, latest_key=(self.id, "progress"))

    def publish_paused(self, reason: str | None = None) -> None:
        """Say the request is paused (after its latest step), for ``reason`` (protocol.PAUSE_REASONS):
        ``paused`` to every watcher, in the place of its progress (kept for a replay until it
        resumes). Raises ValueError for another reason."""
        message = protocol.Paused.build(self.id, step=self.latest_step, reason=reason)
        self.paused = True
        self._publish_state(message)

    def publish_resumed(self, reason: str | None = None) -> None:
        """Say the request runs again, for ``reason`` (protocol.RESUME_REASONS): ``resumed`` to
        every watcher; its next progress replaces it. Raises ValueError for another reason."""
        message = protocol.Resumed.build(self.id, step=self.latest_step, reason=reason)
        self.paused = False
        self.rate.gap()  # the pause was no step's time
        self._publish_state(message)

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
        return {"from_step": self.restarted.from_step, "reason": self.restarted.reason}

    def publish_restarted(self, from_step: int, reason: str, *, rewind: bool = True) -> bool:
        """Say the server restarted and runs the request again from ``from_step`` (protocol.RESTART_REASONS
        says why there): ``restarted`` to every watcher, kept for every later ``attach``; its progress
        goes on from that step. Said again only when it changed (a checkpoint the model refused
        once the request was let in). ``rewind=False``: the steps it makes again are not sent
        again (a Ray hand-over drops them), so its step stays where its watchers are. Returns
        whether it was said (False: the same as last time). Raises ValueError for an unknown
        reason."""
        message = protocol.Restarted.build(self.id, from_step=from_step, reason=reason)
        if message == self.restarted:
            return False
        self.restarted = message
        self._restart_pending = (reason, time.monotonic())
        if rewind:
            self.latest_step = from_step
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(message)
        return True

    def _publish_state(self, message: protocol.ServerMessage) -> None:
        # In the place of its progress: latest wins, and a replay sends the latest of them.
        self._latest_progress = message
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(message, latest_key=(self.id, "progress"))

    def publish_progress(self, message: protocol.Progress) -> None:
        """Send a ``progress`` to every watcher, latest wins."""
        self.loading = False
        step = message.step
        self.latest_step = step
        self.frames_taken += 1
        self.latest_eta_s = message.eta_s
        self._publish_state(message)
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

    def publish_preview(self, frame: protocol.Preview) -> None:
        """Send a preview to every watcher; a final one (a result: one per image of the
        request) is must-deliver, and kept for replay in order."""
        final = frame.final
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
                outbox.put(frame, pin_key=pin)
            else:
                outbox.put(frame, latest_key=(self.id, "preview"), pin_key=pin)

    def finish(self, message: Terminal, *, now: float) -> None:
        """Send the terminal message (``done`` / ``cancelled`` / ``error``) to every watcher.

        Idempotent: a second call is ignored (the first outcome stands).
        """
        if self._terminal is not None:
            return
        self._terminal = message
        self.outcome = message.kind
        self.ended_at = now
        self._recount()
        for outbox in self._watchers.values():
            outbox.put(message)
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

    def terminal_message(self) -> Terminal | None:
        """The terminal message (``done`` / ``cancelled`` / ``error``); None while running."""
        return self._terminal

    def latest_preview(self) -> protocol.Preview | None:
        """The newest preview sent (the first result, once there is one); None before the first."""
        return self._results[0] if self._results else self._latest_preview

    @property
    def result_count(self) -> int:
        """How many results the request has (one per image) once done, else 0."""
        return len(self._results) if self.outcome == "done" else 0

    def result(self, index: int = 0) -> protocol.Preview | None:
        """Result ``index`` (a final frame in its output format; one per image) once the request
        is done, else None (None too for an index it does not have)."""
        if not 0 <= index < self.result_count:
            return None
        return self._results[index]

    def retained_bytes(self) -> int:
        """Bytes this record holds for replay (the wire forms: what an attach sends)."""
        held = sum(len(r.wire) for r in self._results)
        if self._latest_preview is not None:
            held += len(self._latest_preview.wire)
        for message in (self._latest_progress, self.restarted, self._terminal):
            if message is not None:
                held += len(message.wire)
        return held

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
        terminal: Terminal,
        results: list[protocol.Preview],
        priority: int = 0,
        restarted: tuple[int, str] | None = None,
    ) -> RequestRecord:
        """An ended, detached record rebuilt from the state directory (server/state.py).

        ``accepted``: the ``accepted`` message the request got (its id, total,
        preview, output, seed, model); ``terminal``: the message it ended
        with; ``results``: its final previews, in order (none unless it is
        done). ``attach`` replays ``accepted``, the results and the
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
        kind = terminal.kind
        if kind == "done":
            record._results = list(results)
            record.latest_step = record.total
        if restarted is not None:
            step, reason = restarted
            record.restarted = protocol.Restarted.build(record.id, from_step=step, reason=reason)
        record._terminal = terminal
        record.outcome = kind
        record.ended_at = ended_at
        return record

    def __repr__(self) -> str:
        state = self.outcome or "running"
        return (
            f"RequestRecord({self.id!r}, {state}, step {self.latest_step}/{self.total}, "
            f"owner={self.owner!r}, detach={self.detach}, watchers={len(self._watchers)})"
        )
