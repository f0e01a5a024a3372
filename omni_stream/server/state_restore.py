"""A restart: what the state directory holds comes back into the server.

:class:`Restorer` is the part of the server's
:class:`~omni_stream.server.state.StateKeeper` that runs once, as it
starts: every request that ended in retention comes back as an ended
record that serves its results (with the ``restarted`` it said, if any),
and every unfinished one is admitted again through the rules
(``Rules.generate``), detached, under its id, as a client of the door
``restart``, with the cross-principal priority it had (never more than
its token grants now), from its last checkpoint (else step 0); what a
door kept of each is held for it (``StateKeeper.take_restored``). A
request that cannot be served or resumed again is logged and, when
unfinished, marked failed in the folder; the others go on.

It only reads back and re-admits: what a request says about its restart
to its watchers, and every write, are the keeper's (``state.py``) and its
lanes' (``state_lanes.py``); the forms read back are ``state_forms.py``'s.
Kept apart so that the start's one-off path reads on its own.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import protocol
from ..core.records import RequestRecord
from ..core.repeats import restored_key
from ..core.rules import Client
from ..engine.like import resumes_from_bytes
from ..store import RequestEntry
from .state_forms import NOTES, REPEAT_SCOPE, pack_result, principal_of, restart_notice, stored_terminal
from .state_lanes import Lane, StateLanes

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..core.rules import Rules

__all__ = ["RESTART_DOOR", "Restorer"]

logger = logging.getLogger("omni_stream.server")

#: The door of a request re-admitted after a restart (its client is gone).
RESTART_DOOR = "restart"


class Restorer(StateLanes):
    """What the folder holds, brought back as the server starts (see the module docstring).

    A base of :class:`~omni_stream.server.state.StateKeeper`, which sets
    these attributes as it is built and calls :meth:`_restore_finished`
    then :meth:`_resume_unfinished` from its ``start``.
    """

    rules: Rules
    # Restored requests (already recorded), the checkpoints they resume from, and
    # why they start where they do until they go into the engine (state.py).
    _restoring: set[str]
    _resume: dict[str, Checkpoint]
    _restarts: dict[str, str]
    #: What doors wrote with the requests brought back, by request id (take_restored).
    _restored_notes: dict[str, dict[str, Any]]

    async def _restore_finished(self) -> int:
        store = self._open_store()
        wall = time.time()
        entries = await self._run(lambda: store.finished(wall))
        count = 0
        for entry in entries:  # the longest ended first: the registry's bounds drop those first
            accepted = entry.message.get("accepted")
            if not isinstance(accepted, Mapping) or entry.ended_at is None:
                continue
            frames: list[protocol.Preview] = []
            if entry.status == "done" and entry.result_count:
                stored = await self._run(functools.partial(store.load_results, entry.request_id))
                frames = [pack_result(entry, r) for r in stored or ()]
            terminal = stored_terminal(entry)
            # The registry's clock (monotonic), as far back as the wall clock says it ended.
            now = self.rules.clock()
            try:
                record = RequestRecord.restored(
                    accepted,
                    owner=f"{RESTART_DOOR}:{entry.request_id}",
                    principal=entry.principal,
                    created_at=now - max(0.0, wall - entry.created_at),
                    ended_at=now - max(0.0, wall - entry.ended_at),
                    terminal=terminal,
                    results=frames,
                    priority=int(entry.message.get("generate", {}).get("priority") or 0),
                    restarted=restart_notice(entry.message.get("restarted")),
                )
            except (KeyError, ValueError) as exc:
                logger.warning("request %s: not served again after the restart: %r", entry.request_id, exc)
                continue
            try:
                self.rules.registry.add(record)
            except protocol.MessageError as exc:
                logger.warning(
                    "request %s: not served again after the restart: %s", entry.request_id, exc.message
                )
                continue
            self._keep_notes(entry)
            if frames and entry.status == "done":
                # A repeat of it is answered from these results again (core/repeats.py).
                generate = entry.message.get("generate")
                scope = entry.message.get(REPEAT_SCOPE)
                key = restored_key(
                    scope if isinstance(scope, str) else entry.principal,
                    self.rules.models,
                    generate if isinstance(generate, Mapping) else {},
                    accepted,
                )
                if key is not None:
                    record.repeat_key = key
                    self.rules.repeats.keep(key, record.total, frames)
            count += 1
        return count

    async def _resume_unfinished(self) -> int:
        store = self._open_store()
        keep_bytes = resumes_from_bytes(self.rules.engine)
        count = 0
        for entry in await self._run(store.unfinished):
            rid = entry.request_id
            checkpoint = None
            reason = "no_checkpoint"
            if entry.checkpoint_step is not None:
                # A torn or refused file: None, and the store says so (one WARNING).
                # With its file's bytes only for an engine that sends them on (a Ray
                # front door's): otherwise the tensors alone, half the memory, held
                # until the request goes into the engine.
                checkpoint = await self._run(
                    functools.partial(store.load_checkpoint, rid, keep_bytes=keep_bytes)
                )
                if checkpoint is None:
                    reason = "checkpoint_unusable"
                    logger.info("request %s: resumed from step 0 (its checkpoint could not be read)", rid)
                else:
                    reason = "checkpoint"
            else:
                logger.warning("request %s: no checkpoint was written: it starts again from step 0", rid)
            if self._readmit(entry, checkpoint, reason):
                self._keep_notes(entry)
                count += 1
        return count

    def _keep_notes(self, entry: RequestEntry) -> None:
        notes = entry.message.get(NOTES)
        if isinstance(notes, Mapping) and notes:
            self._restored_notes[entry.request_id] = dict(notes)

    def _readmit(self, entry: RequestEntry, checkpoint: Checkpoint | None, reason: str) -> bool:
        rid = entry.request_id
        generate = dict(entry.message.get("generate") or {})
        generate["detach"] = True  # its client is gone; the id gets it back (attach, GET)
        if generate.get("webhook") is not None and self.rules.webhooks is None:
            logger.warning("request %s: resumed without its webhook (this server sends none)", rid)
            generate.pop("webhook")
        principal = principal_of(entry.principal, rid, grant=self._grant_of(entry))
        client = Client(f"{RESTART_DOOR}:{rid}", principal, RESTART_DOOR)
        if checkpoint is not None:
            self._resume[rid] = checkpoint
        self._restarts[rid] = reason
        self._restoring.add(rid)
        self._lanes.setdefault(rid, Lane())
        try:
            msg = protocol.parse_client_message(json.dumps(generate))
            if not isinstance(msg, protocol.Generate):
                raise protocol.MessageError("bad_message", "the recorded message is not a generate")
            self.rules.generate(client, msg)
        except protocol.MessageError as exc:
            self._restoring.discard(rid)
            self._resume.pop(rid, None)
            self._restarts.pop(rid, None)
            logger.warning("request %s: could not be resumed after the restart: %s", rid, exc.message)
            terminal = protocol.ErrorMessage.build(
                "engine_error",
                f"the server restarted and could not resume this request: {exc.message}",
                request_id=rid,
            ).to_dict()
            store = self._open_store()
            self._queue(
                rid,
                lambda: store.mark_ended(rid, "failed", time.time(), terminal=terminal),
                "recording the end",
            )
            return False
        if checkpoint is not None:
            self.checkpoint_steps[rid] = checkpoint.step
        return True

    def _grant_of(self, entry: RequestEntry) -> int:
        """The priority grant ``entry``'s request is resumed with: what it carried against other
        principals when it was accepted, never more than its token grants on this server (0 for a
        token no longer configured, and for a principal that is not a token)."""
        kind, _, name = entry.principal.partition(":")
        recorded = entry.message.get("cross_priority")
        if kind != "token" or isinstance(recorded, bool) or not isinstance(recorded, int):
            return 0  # (a folder written before the grant was recorded: none)
        token = self.rules.tokens.named(name)
        return max(0, min(recorded, token.priority if token is not None else 0))
