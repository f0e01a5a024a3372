"""The store's requests: record one, annotate it, end it, read, list, prune and delete them.

A part of :class:`~omni_stream.store.Store` (``base.py`` says what the parts
share). A request's row holds its message (what the server needs to start
it again), its status and, once it ended, the terminal message ``attach``
replays; its checkpoint and results are ``checkpoints.py``'s and
``results.py``'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

from ..errors import StoreError
from ..ids import is_valid_id
from .base import StoreBase, to_json
from .entries import ENDED, RequestEntry, Saved, Status
from .schema import RESULT_COUNT, ROW_BYTES

__all__ = ["RequestsMixin"]

logger = logging.getLogger("omni_stream.store")

_ENTRY_COLUMNS: Final = (
    "request_id, principal, model, message, created_at, total, seed, status, ended_at, terminal, "
    f"checkpoint_step, {RESULT_COUNT}"
)


class RequestsMixin(StoreBase):
    """Store's methods over its requests' rows (see :class:`~omni_stream.store.Store`)."""

    def record_request(self, entry: RequestEntry) -> Saved:
        """Write down an accepted request (``entry.status`` must be ``running``).

        A finished request of the same id (the server forgot it, and the id
        was used again) is replaced, its files deleted. Call it in a worker
        thread, before the request is acknowledged. Returns ``Saved(stored=False)``
        when even evicting every finished request leaves no room for its
        message. Raises ValueError for an entry that is not a new running
        request or a message that is not JSON, StoreError when a request of
        that id is recorded and still running.
        """
        if entry.status != "running" or entry.ended_at is not None or entry.terminal is not None:
            raise ValueError(f"request {entry.request_id!r}: a new request is recorded as running")
        if not is_valid_id(entry.request_id):
            raise ValueError(f"request id {entry.request_id!r:.80} is not a valid request id")
        if isinstance(entry.total, bool) or not isinstance(entry.total, int) or entry.total < 0:
            raise ValueError(f"request {entry.request_id}: total {entry.total!r} is not an int >= 0")
        message = to_json(entry.message, entry.request_id, "message")
        size = len(message.encode())
        rid = entry.request_id
        with self._errors("recording the request", rid), self._locked():
            with self._transaction() as db:
                row = db.execute("SELECT id, status FROM requests WHERE request_id = ?", (rid,)).fetchone()
                replaced: list[Path] = []
                freed = 0
                if row is not None:
                    if row[1] == "running":
                        raise StoreError(
                            f"state directory {self._folder}: the request is already recorded and running",
                            request_id=rid,
                        )
                    replaced, freed = self._delete_row(db, row[0])
                room = self._make_room(db, size - freed, exclude=None)
                if not room.fits:
                    db.execute("ROLLBACK")  # the request it replaces stays: it was not its room that lacked
                    reason = self._no_room(size)
                    logger.warning("request %s: not written down: %s", rid, reason)
                    return Saved(False, reason=reason)
                db.execute(
                    "INSERT INTO requests (request_id, principal, model, message, message_bytes, created_at,"
                    " total, seed, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'running')",
                    (
                        rid,
                        entry.principal,
                        entry.model,
                        message,
                        size,
                        float(entry.created_at),
                        entry.total,
                        entry.seed,
                    ),
                )
            self._usage += size - freed - room.freed
        self._remove_files([*replaced, *room.files])
        return Saved(True, evicted=room.evicted)

    def annotate(self, request_id: str, key: str, value: Any) -> bool:
        """Set ``key`` to ``value`` (JSON) in a recorded request's message: what the server learns
        of it later (why it restarted), kept for its next start. Returns False when the request is
        not recorded. Call it in a worker thread. Raises ValueError for a value that is not JSON.
        """
        with self._errors("annotating the request", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    "SELECT id, message, message_bytes FROM requests WHERE request_id = ?", (request_id,)
                ).fetchone()
                if row is None:
                    return False
                message = json.loads(row[1])
                message[key] = value
                text = to_json(message, request_id, "message")
                size = len(text.encode())
                db.execute(
                    "UPDATE requests SET message = ?, message_bytes = ? WHERE id = ?", (text, size, row[0])
                )
            # A few bytes either way: counted, not made room for (the bound is checked at every write).
            self._usage += size - row[2]
        return True

    def mark_ended(
        self, request_id: str, status: Status, ended_at: float, terminal: dict[str, Any] | None = None
    ) -> bool:
        """Record that a running request ended at wall time ``ended_at``: done, failed or cancelled.

        ``terminal`` is the terminal message the server sent, for ``attach``
        to replay after a restart. Its checkpoint is deleted: nothing will
        resume it. A request that is done with results is recorded by
        :meth:`save_results` instead. Returns False when the request is not
        recorded or had already ended. Call it in a worker thread. Raises
        ValueError for another status.
        """
        if status not in ENDED:
            raise ValueError(f"request {request_id}: {status!r} is not an ended status ({sorted(ENDED)})")
        text = None if terminal is None else to_json(terminal, request_id, "terminal")
        with self._errors("recording the end", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    "SELECT id, checkpoint_file, checkpoint_bytes FROM requests"
                    " WHERE request_id = ? AND status = 'running'",
                    (request_id,),
                ).fetchone()
                if row is None:
                    return False
                db.execute(
                    "UPDATE requests SET status = ?, ended_at = ?, terminal = ?, checkpoint_file = NULL,"
                    " checkpoint_step = NULL, checkpoint_bytes = 0 WHERE id = ?",
                    (status, float(ended_at), text, row[0]),
                )
            self._usage -= row[2]
        if row[1] is not None:
            self._remove_files([self._checkpoints / row[1]])
        return True

    def get(self, request_id: str) -> RequestEntry | None:
        """The request recorded under ``request_id``, or None. Call it in a worker thread."""
        with self._errors("reading a request", request_id), self._locked():
            row = self._db.execute(
                f"SELECT {_ENTRY_COLUMNS} FROM requests WHERE request_id = ?", (request_id,)
            ).fetchone()
        return None if row is None else _entry(row)

    def unfinished(self) -> list[RequestEntry]:
        """Every running request, oldest accepted first: what a restarted server resumes.

        Each one's ``checkpoint_step`` says where :meth:`load_checkpoint`
        would take it up (None: from step 0). Call it in a worker thread.
        """
        with self._errors("listing running requests"), self._locked():
            rows = self._db.execute(
                f"SELECT {_ENTRY_COLUMNS} FROM requests WHERE status = 'running' ORDER BY created_at, id"
            ).fetchall()
        return [_entry(row) for row in rows]

    def finished(self, now: float) -> list[RequestEntry]:
        """Every ended request still in retention at wall time ``now``, the longest ended first.

        Call it in a worker thread.
        """
        with self._errors("listing ended requests"), self._locked():
            rows = self._db.execute(
                f"SELECT {_ENTRY_COLUMNS} FROM requests WHERE status != 'running' AND ended_at > ?"
                " ORDER BY ended_at, id",
                (float(now) - self._retention_s,),
            ).fetchall()
        return [_entry(row) for row in rows]

    def prune(self, now: float) -> list[str]:
        """Delete every ended request whose retention is over at wall time ``now``; their ids.

        Call it in a worker thread (the server: now and then, as it forgets
        its own ended requests).
        """
        with self._errors("pruning"), self._locked():
            with self._transaction() as db:
                rows = db.execute(
                    f"SELECT id, request_id, {ROW_BYTES} FROM requests"
                    " WHERE status != 'running' AND ended_at <= ? ORDER BY ended_at, id",
                    (float(now) - self._retention_s,),
                ).fetchall()
                files: list[Path] = []
                for key, _, _ in rows:
                    files += self._delete_row(db, key)[0]
            self._usage -= sum(row[2] for row in rows)
        self._remove_files(files)
        return [row[1] for row in rows]

    def delete(self, request_id: str) -> bool:
        """Delete a request, its checkpoint and its results; False when it is not recorded.

        For the server forgetting a request it will not serve again (a
        deleted job, an ended request nobody may attach to). Deleting a
        running one means it is not resumed after a restart. Call it in a
        worker thread.
        """
        with self._errors("deleting", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute("SELECT id FROM requests WHERE request_id = ?", (request_id,)).fetchone()
                if row is None:
                    return False
                files, freed = self._delete_row(db, row[0])
            self._usage -= freed
        self._remove_files(files)
        return True


def _entry(row: Any) -> RequestEntry:
    (
        request_id,
        principal,
        model,
        message,
        created_at,
        total,
        seed,
        status,
        ended_at,
        terminal,
        checkpoint_step,
        result_count,
    ) = row
    return RequestEntry(
        request_id=request_id,
        principal=principal,
        model=model,
        message=json.loads(message),
        created_at=created_at,
        total=total,
        seed=seed,
        status=status,
        ended_at=ended_at,
        terminal=None if terminal is None else json.loads(terminal),
        checkpoint_step=checkpoint_step,
        result_count=result_count,
    )
