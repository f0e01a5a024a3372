"""The state directory wired into the server: requests, checkpoints and results that survive it.

:class:`StateKeeper` joins the store (``omni_stream/store/``) to the
rules (``core/rules.py``) through the rules' hooks, and owns nothing else:

- a request admitted is written down (its ``generate`` message with the
  drawn seed pinned, its principal, its ``accepted`` message, and what a
  door keeps of it besides, :meth:`StateKeeper.written_with`: an OpenAI
  video job's fields);
- a model that can snapshot is asked for a checkpoint every
  ``checkpoint_every`` steps (the engine's ``on_checkpoint``, on the
  producer thread), the latest of which is written;
- a request that ends is marked ended with its terminal message, and a
  detached one's results are written with it (a request that is not
  detached is forgotten as it ends, and deleted instead);
- a request the registry forgets (retention over, evicted, a deleted video
  job) is deleted, so the folder stays bounded by the server's own rules;
- on start, every request that ended in retention comes back as an ended
  record that serves its results, and every unfinished one is admitted
  again, detached, under its id, with the cross-principal priority it had,
  from its last checkpoint (else step 0), and says so to whoever watches
  it: ``restarted`` with the step it goes on from and why (for an
  ``attach``, SSE and ``GET /v1/generations/{id}``), not only in the log;
  what a door kept of each is handed back to it (:meth:`StateKeeper.take_restored`),
  so every door serves after a restart what it served before (issue #39:
  ``/v1/videos/{id}`` answered 404 for jobs ``/v1/generations`` still had).

Over Ray (a RemoteEngine) the same holds: the replica snapshots the
request and sends the checkpoint's bytes, the front door's RemoteStream
hands them to ``on_checkpoint`` as they arrive (written as they came, not
read), and a restart resubmits the request with ``resume`` to whichever
replica Serve picks. A replica that refuses the checkpoint is learnt of
only once the request runs: the consumer hears it (``on_resume_refused``)
and the request goes on from step 0, said as ``checkpoint_unusable``.

Who waits on whom: nothing here blocks the event loop or the producer. The
producer hands a checkpoint over in a dict under a lock and one
``call_soon_threadsafe``; every disk write (``Checkpoint.to_bytes()``
included) runs in a worker thread, at most ``_STORE_THREADS`` at once. A
request's writes go through its own lane, in order (recorded, then
checkpoints, then its end, then its deletion), and a lane holds at most one
checkpoint waiting: a newer one replaces it (latest wins), so a slow disk
costs more redone steps after a crash, never memory or the engine's time.

Its parts, a module each: the lanes that run the writes
(``state_lanes.py``), the restart's reading back and re-admitting
(``state_restore.py``), and the forms a request takes in the folder, both
ways (``state_forms.py``, pure); here are the settings, the rules' hooks
and the checkpoints' hand-over from the producer thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.to_thread

from .. import config, protocol
from .._backend import ThreadsafeLoop, running_loop
from ..core.records import RequestRecord, Terminal
from ..core.rules import Admitted
from ..errors import CheckpointError, ParamsError
from ..params import positive_int
from ..store import RequestEntry, Store, StoredResult
from .state_forms import NOTES, REPEAT_SCOPE, wire_message
from .state_lanes import Lane
from .state_restore import Restorer

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint, CheckpointLike
    from ..core.rules import Rules
    from ..store import Status

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_STATE_MAX_BYTES",
    "STATE_OPTIONS",
    "StateKeeper",
    "StateOptions",
]

logger = logging.getLogger("omni_stream.server")

#: Steps between two checkpoints: a crash redoes at most this many steps of a request.
DEFAULT_CHECKPOINT_EVERY: Final = 10
#: What the folder may hold by default: a few hundred results and checkpoints of a large model.
DEFAULT_STATE_MAX_BYTES: Final = 2 << 30
#: The server's keyword arguments that are the state directory's (Server, create_app, serve).
STATE_OPTIONS: Final = ("state_dir", "checkpoint_every", "checkpoint_seconds", "state_max_bytes")
#: Store calls at once: two, so one request's slow checkpoint (a few MiB of
#: conditioning, fsync'ed) does not hold another's result behind it, and
#: the disk is not asked for more than it gives.
_STORE_THREADS = 2
#: The least seconds between two prunes of the store by the retention sweep.
_PRUNE_EVERY_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class StateOptions:
    """The state directory's settings: keyword arguments first, then ``OMNI_STREAM_*`` variables.

    ``path``: the folder (None: nothing is written, nothing survives);
    ``checkpoint_every``: steps between two checkpoints of a request;
    ``checkpoint_seconds``: the least seconds between two checkpoints written
    for one request (None: no floor); ``max_bytes``: what the folder holds.
    """

    path: Path | None = None
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    checkpoint_seconds: float | None = None
    max_bytes: int = DEFAULT_STATE_MAX_BYTES

    @classmethod
    def take(cls, options: dict[str, Any]) -> StateOptions:
        """Remove :data:`STATE_OPTIONS` from ``options`` (a server's keyword arguments); the settings.

        What ``options`` leaves out comes from the environment, else the
        defaults (a malformed variable warns once, naming it, and the default
        applies). Raises ParamsError naming a bad keyword value.
        """
        given = {name: options.pop(name) for name in STATE_OPTIONS if name in options}
        raw_path = given.get("state_dir")
        if raw_path is None:
            raw_path = config.state_dir()
        elif not isinstance(raw_path, (str, Path)) or not str(raw_path).strip():
            raise ParamsError(f"state_dir must be a folder's path, got {raw_path!r}", field="state_dir")
        every = given.get("checkpoint_every")
        if every is None:
            every = config.env_int(config.CHECKPOINT_EVERY_ENV, DEFAULT_CHECKPOINT_EVERY)
        every = positive_int(every, "checkpoint_every", env=config.CHECKPOINT_EVERY_ENV)
        seconds = given.get("checkpoint_seconds")
        if seconds is None and config.env_str(config.CHECKPOINT_SECONDS_ENV) is not None:
            seconds = config.env_float(config.CHECKPOINT_SECONDS_ENV, math.inf)
            seconds = None if math.isinf(seconds) else seconds  # malformed: warned, off
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ParamsError(
                f"checkpoint_seconds ({config.CHECKPOINT_SECONDS_ENV}) must be a finite number > 0, "
                f"got {seconds!r}",
                field="checkpoint_seconds",
            )
        max_bytes = given.get("state_max_bytes")
        if max_bytes is None:
            max_bytes = config.env_int(config.STATE_MAX_BYTES_ENV, DEFAULT_STATE_MAX_BYTES)
        max_bytes = positive_int(max_bytes, "state_max_bytes", env=config.STATE_MAX_BYTES_ENV)
        return cls(
            path=None if raw_path is None else Path(raw_path).expanduser(),
            checkpoint_every=every,
            checkpoint_seconds=None if seconds is None else float(seconds),
            max_bytes=max_bytes,
        )


class StateKeeper(Restorer):
    """The state directory's side of a server (see the module docstring).

    Built with the server's :class:`~omni_stream.core.rules.Rules`, whose
    hooks it sets; :meth:`start` (in the service's task group, once the
    engine runs) opens the folder and brings back what it holds;
    :meth:`flush` waits for the writes queued; :meth:`close` closes it.
    """

    def __init__(self, rules: Rules, options: StateOptions) -> None:
        if options.path is None:
            raise ValueError("a StateKeeper needs a folder (StateOptions.path)")
        self.rules = rules
        self.options = options
        self.path = options.path
        self.store: Store | None = None
        #: The step of each request's latest checkpoint written in this process.
        self.checkpoint_steps: dict[str, int] = {}
        self._limiter = anyio.CapacityLimiter(_STORE_THREADS)
        self._lanes: dict[str, Lane] = {}
        self._busy = 0
        self._idle: anyio.Event | None = None
        self._send, self._ready = anyio.create_memory_object_stream[str](math.inf)
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: ThreadsafeLoop | None = None
        # The producer thread's hand-over: checkpoints not yet taken by the loop,
        # and when the last one of each request was taken (checkpoint_seconds).
        self._lock = threading.Lock()
        self._incoming: dict[str, CheckpointLike] = {}
        self._last_taken: dict[str, float] = {}
        self._closed = False
        # Restored requests (already recorded), the checkpoints they resume from,
        # why they start where they do until they go into the engine (a
        # RESTART_REASONS word: "checkpoint", "no_checkpoint", "checkpoint_unusable"),
        # and the requests a shutdown cancelled, kept running for the next start.
        self._restoring: set[str] = set()
        self._resume: dict[str, Checkpoint] = {}
        self._restarts: dict[str, str] = {}
        self._kept: set[str] = set()
        # What doors keep of a request, by request id: given for the request
        # about to be admitted (written with it), and read back from the folder.
        self._noted: dict[str, dict[str, Any]] = {}
        self._restored_notes: dict[str, dict[str, Any]] = {}
        self._last_prune = -math.inf
        take = {"checkpoint_every", "on_checkpoint"}
        self._takes_checkpoints = take <= rules.stream_keywords
        rules.keep_journal(self)  # the core writes down through this (core/effects.py's Journal)
        rules.registry.on_forget = self._forgotten

    # -- lifecycle -----------------------------------------------------------------

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the folder (repairing it), serve its finished requests again, resume the others.

        Call it once the rules may admit (the engine runs, ``rules.started``).
        Raises StoreError when the folder is in use, damaged, or of a newer
        version (the server does not start: move the folder away).
        """
        self._tg = tg
        self._loop = running_loop()
        options = self.options
        self.store = await self._run(
            functools.partial(
                Store.open, self.path, max_bytes=options.max_bytes, retention_s=self.rules.limits.retention_s
            )
        )
        tg.start_soon(self._dispatch, name="omni_stream state directory")
        if not self._takes_checkpoints:
            logger.warning(
                "state directory %s: the engine's stream() takes no checkpoint options: requests are "
                "written down but not checkpointed, and a restart runs them again from step 0",
                self.path,
            )
        restored = await self._restore_finished()
        resumed = await self._resume_unfinished()
        logger.info(
            "state directory %s: %d finished requests served again, %d unfinished resumed "
            "(checkpoint every %d steps%s, max %d bytes)",
            self.path,
            restored,
            resumed,
            options.checkpoint_every,
            f", at most every {options.checkpoint_seconds:g} s" if options.checkpoint_seconds else "",
            options.max_bytes,
        )

    async def close(self) -> None:
        """Stop taking checkpoints and close the folder; idempotent."""
        with self._lock:
            self._closed = True
        self._send.close()
        store, self.store = self.store, None
        if store is not None:
            await anyio.to_thread.run_sync(store.close)

    @contextlib.contextmanager
    def written_with(self, request_id: str, key: str, value: Mapping[str, Any]) -> Iterator[None]:
        """Within the block, the request admitted under ``request_id`` is written down with
        ``value`` (JSON) under ``key``: what a door keeps of it besides the core's record (an
        OpenAI video job's fields), in the same write as the request, so no crash keeps one
        without the other. After a restart, :meth:`take_restored` gives it back."""
        self._noted.setdefault(request_id, {})[key] = dict(value)
        try:
            yield
        finally:
            self._noted.pop(request_id, None)

    def take_restored(self, key: str) -> dict[str, Any]:
        """What doors wrote under ``key`` with the requests this start brought back (finished and
        resumed), by request id; each is given once (the door keeps it from then on)."""
        out: dict[str, Any] = {}
        for request_id, notes in list(self._restored_notes.items()):
            if key in notes:
                out[request_id] = notes.pop(key)
            if not notes:
                del self._restored_notes[request_id]
        return out

    async def prune(self) -> None:
        """Delete what ended longer than ``retention_s`` ago (at most every few seconds)."""
        now = time.monotonic()
        if self.store is None or now - self._last_prune < _PRUNE_EVERY_S:
            return
        self._last_prune = now
        store = self.store
        for request_id in await self._guarded("pruning", lambda: store.prune(time.time())) or ():
            logger.debug("state directory: request %s deleted (retention over)", request_id)

    # -- the rules' hooks (event loop) -------------------------------------------------

    def admitted(self, admitted: Admitted, msg: protocol.Generate) -> None:
        record = admitted.record
        rid = record.id
        if rid in self._restoring:
            self._restoring.discard(rid)  # recorded in the run before
            if rid in self._restarts:
                # It waits in the gate: say now where it will start (said again,
                # only if that changed, when it goes into the engine).
                resume = self._resume.get(rid)
                self._publish_restart(admitted, resume if self._resumable else None, self._restarts[rid])
            return
        principal = record.principal
        accepted = record.accepted_message(attached=False).to_dict()
        message: dict[str, Any] = {
            "type": "generate",
            "id": rid,
            "params": admitted.params,  # the drawn seed pinned: a restart renders the same picture
            "preview": msg.preview,
            "output": msg.output,
            "priority": msg.priority,
            "detach": msg.detach,
            "model": admitted.model,
            "webhook": msg.webhook,
        }
        created_at = time.time()
        # What its priority counts against other principals' (its token's grant
        # applied): a restart gives it back (state_forms.principal_of), capped by the token then.
        cross = admitted.cross_priority
        notes = self._noted.pop(rid, None)

        # Whose repeats its result answers, where that is not its principal (a browser session's
        # digest): a restart keeps them theirs (core/repeats.py).
        scope = record.repeat_scope or principal

        def write() -> None:
            recorded = {"generate": wire_message(message), "accepted": accepted, "cross_priority": cross}
            if notes:
                recorded[NOTES] = notes
            if scope != principal:
                recorded[REPEAT_SCOPE] = scope
            entry = RequestEntry(
                rid, principal, admitted.model, recorded, created_at, record.total, record.seed
            )
            try:
                saved = self._open_store().record_request(entry)
            except ValueError as exc:  # params a message cannot carry (an object of one's own)
                logger.warning("request %s: not written down, it will not survive a restart: %s", rid, exc)
                return
            self._saved(rid, saved)

        self._queue(rid, write, "recording the request", new=True)

    @property
    def _resumable(self) -> bool:
        """The engine takes a checkpoint to resume from."""
        return "resume" in self.rules.stream_keywords

    def stream_options(self, admitted: Admitted) -> dict[str, Any]:
        rid = admitted.record.id
        options: dict[str, Any] = {}
        resume = self._resume.pop(rid, None)
        if resume is not None:
            if self._resumable:
                options["resume"] = resume
            else:
                logger.warning(
                    "request %s: the engine cannot resume from a checkpoint: it starts again from step 0",
                    rid,
                )
        snapshots = self._snapshots(admitted)
        if snapshots:
            options["checkpoint_every"] = self.options.checkpoint_every
            options["on_checkpoint"] = self._on_checkpoint
        restart = self._restarts.pop(rid, None)
        if restart is not None:
            # It goes into the engine now: where it starts is decided (unless the
            # model refuses the checkpoint: _resume_refused says so again).
            self._publish_restart(admitted, options.get("resume"), restart, snapshots=snapshots)
        return options

    def _snapshots(self, admitted: Admitted) -> bool:
        """Whether ``admitted``'s model can snapshot it and the engine takes checkpoints."""
        model = self.rules.models[admitted.model]
        try:
            return self._takes_checkpoints and bool(model.can_snapshot(admitted.checked))
        except Exception:  # noqa: BLE001 - a model's own hook: no checkpoints rather than no request
            logger.exception(
                "request %s: %s.can_snapshot failed; not checkpointed", admitted.record.id, model.name
            )
            return False

    def _publish_restart(
        self, admitted: Admitted, resume: Checkpoint | None, reason: str, *, snapshots: bool | None = None
    ) -> None:
        """Tell ``admitted``'s watchers (and later ones) the step it goes on from after the restart,
        and why: from ``resume``'s step, else from 0 (``reason`` from the folder, or that its
        model or engine cannot resume it)."""
        if resume is not None:
            self._said_restarted(admitted.record, resume.step, "checkpoint")
            return
        if snapshots is None:
            snapshots = self._snapshots(admitted)
        if reason == "checkpoint" and not self._resumable:
            reason = "cannot_resume"  # a checkpoint the engine cannot take
        elif reason == "no_checkpoint" and not snapshots:
            reason = "cannot_resume"  # none was written because none could be
        self._said_restarted(admitted.record, 0, reason)

    def _said_restarted(self, record: RequestRecord, from_step: int, reason: str) -> None:
        if not record.publish_restarted(from_step, reason):
            return
        self.rules.metrics.restarts.labels(reason).inc()
        self._note_restart(record, from_step, reason)

    def handed_over(self, record: RequestRecord, from_step: int) -> None:
        # A Ray replica died and another goes on with the request (the consumer said and counted
        # it): written down like a restart of ours, so a later start says it too.
        self._note_restart(record, from_step, "replica_lost")

    def _note_restart(self, record: RequestRecord, from_step: int, reason: str) -> None:
        # Kept with it: a later start that serves its result says it too.
        rid, notice = record.id, {"from_step": from_step, "reason": reason}
        self._queue(rid, lambda: self._open_store().annotate(rid, "restarted", notice), "noting the restart")

    def resume_refused(self, record: RequestRecord, exc: CheckpointError) -> None:
        logger.warning(
            "request %s: its model refused its checkpoint (%s): it starts again from step 0", record.id, exc
        )
        self.checkpoint_steps.pop(record.id, None)
        rid = record.id
        self._said_restarted(record, 0, "checkpoint_unusable")
        self._queue(rid, lambda: self._open_store().discard_checkpoint(rid), "dropping a checkpoint")

    def finished(self, record: RequestRecord, ended: Terminal) -> None:
        rid = record.id
        kind = ended.kind
        if isinstance(ended, protocol.Cancelled) and ended.reason == "shutdown" and self.rules.closing:
            # A deploy or a restart, not the client's wish: it stays running in
            # the folder, and the next start resumes it from its checkpoint.
            self._kept.add(rid)
            return
        if not record.detach:
            return  # forgotten now (registry.ended), and deleted then
        lane = self._lanes.get(rid)
        if lane is not None:
            lane.ending = True
            lane.checkpoint = None
        ended_at = time.time()
        # The store keeps the message as the wire's JSON object.
        message = ended.to_dict()
        results = [record.result(i) for i in range(record.result_count)]
        if kind == "done" and results:
            stored = [
                StoredResult(
                    r.header.step,
                    r.header.format,
                    r.header.mime,
                    r.header.width,
                    r.header.height,
                    r.image,
                    index=r.header.index,
                    images=r.header.images,
                )
                for r in results
                if r is not None
            ]
            self._queue(
                rid,
                lambda: self._saved(
                    rid, self._open_store().save_results(rid, stored, ended_at=ended_at, terminal=message)
                ),
                "writing the results",
            )
            return
        status: Status = "done" if kind == "done" else "cancelled" if kind == "cancelled" else "failed"
        self._queue(
            rid,
            lambda: self._open_store().mark_ended(rid, status, ended_at, terminal=message),
            "recording the end",
        )

    def _forgotten(self, record: RequestRecord) -> None:
        rid = record.id
        if rid in self._kept:
            return  # resumed by the next start
        self._restored_notes.pop(rid, None)  # no door took it up: nothing to serve it for now
        self.checkpoint_steps.pop(rid, None)
        self._queue(rid, lambda: self._open_store().delete(rid), "deleting a request")
        lane = self._lanes.get(rid)
        if lane is not None:
            lane.forgotten = True
            lane.checkpoint = None

    # -- checkpoints: the producer thread hands them over --------------------------------

    def _on_checkpoint(self, request_id: str, checkpoint: CheckpointLike) -> None:
        """The engine's ``on_checkpoint`` (its producer thread; a RemoteEngine's: the loop, the
        checkpoint in bytes as its replica sent it): hand it to the loop, never wait."""
        now = time.monotonic()
        seconds = self.options.checkpoint_seconds
        with self._lock:
            if self._closed or self._loop is None:
                return
            last = self._last_taken.get(request_id)
            if seconds is not None and last is not None and now - last < seconds:
                return  # too soon after the last one taken (checkpoint_seconds)
            self._last_taken[request_id] = now
            first = request_id not in self._incoming
            self._incoming[request_id] = checkpoint
        if first:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                self._loop.call_soon_threadsafe(self._take_checkpoint, request_id)

    def _take_checkpoint(self, request_id: str) -> None:
        # (Event loop: a callback.)
        with self._lock:
            checkpoint = self._incoming.pop(request_id, None)
        lane = self._lanes.get(request_id)
        if checkpoint is None or lane is None or lane.ending or lane.forgotten:
            return
        lane.checkpoint = checkpoint
        self._kick(request_id, lane)
