"""``Store``: requests, their latest checkpoints and their results in a state directory.

Every method that touches the disk is synchronous: call it in a worker
thread (``anyio.to_thread.run_sync(store.save_checkpoint, ..., limiter=...)``),
never on the event loop. A Store may be used from several threads at once:
one lock guards the database, and it is held only for the database's part of
a call, so the writes of several requests' checkpoints and results (the
large, slow part: write, fsync, rename) run side by side.

A write goes file first, row second: the file is durable under its final
name before the row that names it commits, and a file a row stops naming is
deleted after that commit. A crash between the two leaves a file no row
names, which the next ``open`` deletes; a file deleted by hand leaves a row
without its file, which ``open`` (or the first read) notices and clears.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..checkpoint import Checkpoint
from ..errors import CheckpointError, LifecycleError, StoreError
from ..ids import is_valid_id
from .entries import ENDED, Reconciliation, RequestEntry, Saved, Status, StoredResult, StoreStatistics
from .files import FolderLock, fsync_folder, is_temporary, new_name, remove, write_atomic
from .schema import connect

__all__ = ["CHECKPOINTS", "DATABASE", "RESULTS", "Store"]

logger = logging.getLogger("omni_stream.store")

#: The layout of a state directory (docs/reliability.md, "The state directory").
DATABASE: Final = "state.db"
CHECKPOINTS: Final = "checkpoints"
RESULTS: Final = "results"
_LOCK: Final = "lock"

_RESULT_COUNT: Final = "(SELECT COUNT(*) FROM results WHERE results.request = requests.id)"
_ENTRY_COLUMNS: Final = (
    "request_id, principal, model, message, created_at, total, seed, status, ended_at, terminal, "
    f"checkpoint_step, {_RESULT_COUNT}"
)
# What a request costs against max_bytes: its message, its checkpoint, its results.
_ROW_BYTES: Final = (
    "message_bytes + checkpoint_bytes"
    " + COALESCE((SELECT SUM(bytes) FROM results WHERE results.request = requests.id), 0)"
)


@dataclass(frozen=True, slots=True)
class _Room:
    """The outcome of making room for a write: whether it fits, who was evicted, their files."""

    fits: bool
    evicted: tuple[str, ...]
    files: tuple[Path, ...]
    freed: int


class Store:
    """A state directory: each accepted request, its latest checkpoint, its results.

    Open one with :meth:`open`; see the module docstring for threads and
    docs/reliability.md for the layout. ``max_bytes`` bounds the checkpoint
    and result files and the recorded messages together: to make room, the
    requests that ended longest ago are deleted whole (record and results),
    never a running one; a write that does not fit even then is not made
    (:class:`Saved` says so). ``retention_s``: how long after it ended a
    request is kept (:meth:`finished`, :meth:`prune`).

    Every method raises StoreError for a failing disk or database (the
    OSError or sqlite3 error is its ``__cause__``) and LifecycleError once
    the store is closed; bad bytes in a checkpoint or a result file are not
    errors (the read returns None and logs one WARNING).
    """

    def __init__(
        self, folder: Path, db: sqlite3.Connection, lock: FolderLock, *, max_bytes: int, retention_s: float
    ) -> None:
        # Use Store.open: this only assembles what it opened.
        self._folder = folder
        self._checkpoints = folder / CHECKPOINTS
        self._results = folder / RESULTS
        self._db = db
        self._folder_lock = lock
        self._lock = threading.Lock()
        self._closed = False
        self._max_bytes = max_bytes
        self._retention_s = retention_s
        self._usage = 0
        self._reserved = 0  # bytes of writes between their room check and their commit
        self.reconciliation = Reconciliation()

    # -- opening and closing ------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, max_bytes: int, retention_s: float) -> Store:
        """Open the state directory ``path``, creating it (and its parents) when missing.

        Repairs what a crash or a hand left behind (:class:`Reconciliation`,
        kept as ``store.reconciliation`` and logged) and evicts down to
        ``max_bytes``. Call it in a worker thread. Raises ValueError for a
        bound that is not positive, StoreError when another process holds
        the folder, its database is damaged or of a newer schema version,
        or the disk fails.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not isinstance(retention_s, (int, float)) or not math.isfinite(retention_s) or retention_s < 0:
            raise ValueError(f"retention_s must be a finite number >= 0, got {retention_s!r}")
        folder = Path(path)
        lock = FolderLock(folder / _LOCK)
        try:
            # Owner only when created here: the folder holds every request's prompt and images.
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            for sub in (folder / CHECKPOINTS, folder / RESULTS):
                sub.mkdir(mode=0o700, exist_ok=True)
            if not lock.acquire():
                raise StoreError(f"state directory {folder} is in use by another process (another server?)")
        except OSError as exc:
            lock.release()
            raise StoreError(f"state directory {folder} cannot be created or locked: {exc}") from exc
        try:
            db = connect(folder / DATABASE, folder)
        except BaseException:
            lock.release()
            raise
        store = cls(folder, db, lock, max_bytes=max_bytes, retention_s=float(retention_s))
        try:
            with store._errors("opening"):
                store.reconciliation = store._reconcile()
        except BaseException:
            store.close()
            raise
        if not store.reconciliation.clean:
            logger.warning("state directory %s: repaired on open: %s", folder, store.reconciliation)
        return store

    def close(self) -> None:
        """Close the database and let the folder go; idempotent. Writes in flight in other threads fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(sqlite3.Error):
                self._db.close()  # the last connection to close folds the WAL back into the database
            self._folder_lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        """The state directory."""
        return self._folder

    @property
    def max_bytes(self) -> int:
        """The bound on :meth:`usage_bytes`."""
        return self._max_bytes

    @property
    def retention_s(self) -> float:
        """How long after it ended a request is kept."""
        return self._retention_s

    # -- requests -----------------------------------------------------------

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
        message = _json(entry.message, entry.request_id, "message")
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
                    (rid, entry.principal, entry.model, message, size, float(entry.created_at),
                     entry.total, entry.seed),
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
                text = _json(message, request_id, "message")
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
        text = None if terminal is None else _json(terminal, request_id, "terminal")
        with self._errors("recording the end", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    "SELECT id, checkpoint_file, checkpoint_bytes FROM requests"
                    " WHERE request_id = ? AND status = 'running'", (request_id,),
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
                " ORDER BY ended_at, id", (float(now) - self._retention_s,),
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
                    f"SELECT id, request_id, {_ROW_BYTES} FROM requests"
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

    # -- checkpoints --------------------------------------------------------

    def save_checkpoint(self, request_id: str, step: int, data: bytes | bytearray | memoryview) -> Saved:
        """Write ``data`` (``Checkpoint.to_bytes()`` after ``step`` steps) as the request's latest checkpoint.

        The previous one is deleted once the new one is on the disk. Not
        stored (``Saved.stored`` False, with the reason) when the request is
        not recorded or not running, a checkpoint of a later step is already
        stored, or it does not fit in ``max_bytes`` even after evicting
        every finished request; the stored one then stays. Call it in a
        worker thread; several requests' checkpoints are written in
        parallel. Raises ValueError for a negative step or no bytes.
        """
        size = memoryview(data).nbytes
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"request {request_id}: checkpoint step {step!r} is not an int >= 0")
        if size == 0:
            raise ValueError(f"request {request_id}: a checkpoint of no bytes")
        with self._errors("saving a checkpoint", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    "SELECT id, status, checkpoint_step, checkpoint_bytes FROM requests WHERE request_id = ?",
                    (request_id,),
                ).fetchone()
                refusal = _checkpoint_refusal(row, step)
                if refusal is not None:
                    return Saved(False, reason=refusal)
                key, old_bytes = row[0], row[3]
                # The old file goes once the new one is written: only the difference needs room.
                reserve = max(0, size - old_bytes)
                room = self._make_room(db, reserve, exclude=key)
                if not room.fits:
                    reason = self._no_room(size)
                    logger.warning("request %s: checkpoint %d not written: %s", request_id, step, reason)
                    return Saved(False, reason=reason)
            self._usage -= room.freed
            self._reserved += reserve
        self._remove_files(room.files)
        name = new_name(f"{key}-s{step}", ".ckpt")
        committed = False
        try:
            with self._errors("writing a checkpoint", request_id):
                write_atomic(self._checkpoints, name, [data])
                fsync_folder(self._checkpoints)
            with self._errors("saving a checkpoint", request_id), self._locked():
                self._reserved -= reserve
                reserve = 0
                with self._transaction() as db:
                    row = db.execute(
                        "SELECT id, status, checkpoint_step, checkpoint_bytes, checkpoint_file FROM requests"
                        " WHERE id = ?", (key,),
                    ).fetchone()
                    # The request may have ended, been deleted or checkpointed again meanwhile.
                    refusal = _checkpoint_refusal(row, step)
                    if refusal is not None:
                        return Saved(False, evicted=room.evicted, reason=refusal)
                    db.execute(
                        "UPDATE requests SET checkpoint_file = ?, checkpoint_step = ?, checkpoint_bytes = ?"
                        " WHERE id = ?", (name, step, size, key),
                    )
                self._usage += size - row[3]
                committed = True
        finally:
            if reserve:
                with self._lock:
                    self._reserved -= reserve
            if not committed:
                self._remove_files([self._checkpoints / name])
        if row[4] is not None:
            self._remove_files([self._checkpoints / row[4]])
        return Saved(True, evicted=room.evicted)

    def load_checkpoint(self, request_id: str, *, keep_bytes: bool = True) -> Checkpoint | None:
        """The request's latest checkpoint, or None when there is none to resume from.

        ``keep_bytes``: as ``Checkpoint.from_bytes`` (keep the file's bytes
        beside the tensors, for a checkpoint sent on as bytes).

        A file that is missing, torn, tampered with or of a format this
        omni_stream does not read (``CheckpointError``) gives None and one
        WARNING, and is deleted: the request starts again from step 0, and
        its next checkpoint is not refused as older. Call it in a worker
        thread (it reads and checks the whole file).
        """
        with self._errors("reading a checkpoint", request_id), self._locked():
            row = self._db.execute(
                "SELECT checkpoint_file, checkpoint_step FROM requests WHERE request_id = ?"
                " AND status = 'running' AND checkpoint_file IS NOT NULL", (request_id,),
            ).fetchone()
        if row is None:
            return None
        name, step = row
        try:
            return Checkpoint.from_bytes((self._checkpoints / name).read_bytes(), keep_bytes=keep_bytes)
        except (OSError, CheckpointError) as exc:
            logger.warning(
                "request %s: its checkpoint of step %d (%s) cannot be used; it starts again from step 0: %s",
                request_id, step, name, exc,
            )
        self._forget_checkpoint(request_id, name)
        return None

    def discard_checkpoint(self, request_id: str) -> bool:
        """Delete the request's checkpoint (the model refused to restore it); False when there was none.

        Call it in a worker thread.
        """
        with self._errors("reading a checkpoint", request_id), self._locked():
            row = self._db.execute(
                "SELECT checkpoint_file FROM requests WHERE request_id = ? AND checkpoint_file IS NOT NULL",
                (request_id,),
            ).fetchone()
        return row is not None and self._forget_checkpoint(request_id, row[0])

    def _forget_checkpoint(self, request_id: str, name: str) -> bool:
        with self._errors("deleting a checkpoint", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    "SELECT id, checkpoint_bytes FROM requests WHERE request_id = ? AND checkpoint_file = ?",
                    (request_id, name),
                ).fetchone()
                if row is None:  # a newer one replaced it meanwhile: that one stays
                    return False
                db.execute(
                    "UPDATE requests SET checkpoint_file = NULL, checkpoint_step = NULL, checkpoint_bytes = 0"
                    " WHERE id = ?", (row[0],),
                )
            self._usage -= row[1]
        self._remove_files([self._checkpoints / name])
        return True

    # -- results ------------------------------------------------------------

    def save_results(
        self,
        request_id: str,
        results: Sequence[StoredResult],
        *,
        ended_at: float,
        terminal: dict[str, Any] | None = None,
    ) -> Saved:
        """Record the request as done at wall time ``ended_at`` with its ``results`` (one per image).

        ``terminal`` is the ``done`` message, as :meth:`mark_ended` takes
        it. The files are written first, then the request is marked done
        with them in one commit, and its checkpoint deleted. When the
        results do not fit in ``max_bytes`` even after evicting every other
        finished request, the request is still marked done, without them
        (``Saved.stored`` False). Not stored either when the request is not
        recorded, or ended otherwise, or has its results already. Call it in
        a worker thread. Raises ValueError when the results are not index 0
        to n-1 of n images; StoreError leaves the request as it was.
        """
        indexes = sorted(r.index for r in results)
        if indexes != list(range(len(results))) or any(r.images != len(results) for r in results):
            raise ValueError(f"request {request_id}: results must be index 0..n-1 of n images, got {indexes}")
        text = None if terminal is None else _json(terminal, request_id, "terminal")
        need = sum(r.nbytes for r in results)
        with self._errors("saving results", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    f"SELECT id, status, {_RESULT_COUNT} FROM requests WHERE request_id = ?", (request_id,),
                ).fetchone()
                refusal = _results_refusal(row)
                if refusal is not None:
                    return Saved(False, reason=refusal)
                key = row[0]
                room = self._make_room(db, need, exclude=key)
                # No room: still done (nothing will resume it), only without its results.
                stale = None if room.fits else self._end(db, key, ended_at, text)
            if room.fits:
                self._usage -= room.freed
                self._reserved += need
            elif stale is not None:
                self._usage -= stale[1]
        if not room.fits:
            reason = self._no_room(need)
            logger.warning("request %s: done, but its results are not written: %s", request_id, reason)
            self._remove_files([] if stale is None else [self._checkpoints / stale[0]])
            return Saved(False, reason=reason)
        self._remove_files(room.files)
        named = [(r, new_name(f"{key}-{r.index}", f".{r.format}")) for r in results]
        committed = False
        try:
            with self._errors("writing results", request_id):
                digests = [_write_result(self._results, name, r) for r, name in named]
                fsync_folder(self._results)
            with self._errors("saving results", request_id), self._locked():
                self._reserved -= need
                need = 0
                with self._transaction() as db:
                    row = db.execute(
                        f"SELECT id, status, {_RESULT_COUNT} FROM requests WHERE id = ?",
                        (key,),
                    ).fetchone()
                    refusal = _results_refusal(row)
                    if refusal is not None:
                        return Saved(False, evicted=room.evicted, reason=refusal)
                    db.executemany(
                        "INSERT INTO results (request, idx, images, step, format, mime, width, height, file,"
                        " bytes, sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [
                            (key, r.index, r.images, r.step, r.format, r.mime, r.width, r.height, name,
                             r.nbytes, digest)
                            for (r, name), digest in zip(named, digests, strict=True)
                        ],
                    )
                    stale = self._end(db, key, ended_at, text)
                self._usage += sum(r.nbytes for r in results) - (0 if stale is None else stale[1])
                committed = True
        finally:
            if need:
                with self._lock:
                    self._reserved -= need
            if not committed:
                self._remove_files([self._results / name for _, name in named])
        if stale is not None:
            self._remove_files([self._checkpoints / stale[0]])
        return Saved(True, evicted=room.evicted)

    def load_results(self, request_id: str) -> list[StoredResult] | None:
        """The request's results in index order, or None when none are stored.

        A file that is missing, or whose size or sha256 is not what was
        written, drops all of the request's results (one WARNING; the record
        stays). Call it in a worker thread (it reads and checks every file).
        """
        with self._errors("reading results", request_id), self._locked():
            rows = self._db.execute(
                "SELECT idx, images, step, format, mime, width, height, file, bytes, sha256, request"
                " FROM results WHERE request = (SELECT id FROM requests WHERE request_id = ?) ORDER BY idx",
                (request_id,),
            ).fetchall()
        if not rows:
            return None
        out: list[StoredResult] = []
        for index, images, step, fmt, mime, width, height, name, size, digest, _ in rows:
            try:
                data = (self._results / name).read_bytes()
            except OSError as exc:
                problem = f"{name} cannot be read: {exc}"
            else:
                if len(data) == size and hashlib.sha256(data).hexdigest() == digest:
                    out.append(StoredResult(step, fmt, mime, width, height, data, index, images))
                    continue
                problem = f"{name} is {len(data)} bytes, or not the bytes written (sha256)"
            logger.warning("request %s: its stored results are dropped: %s", request_id, problem)
            self._drop_results(rows[0][10])
            return None
        return out

    def _drop_results(self, key: int) -> None:
        with self._errors("deleting results"), self._locked():
            with self._transaction() as db:
                rows = db.execute("SELECT file, bytes FROM results WHERE request = ?", (key,)).fetchall()
                db.execute("DELETE FROM results WHERE request = ?", (key,))
            self._usage -= sum(row[1] for row in rows)
        self._remove_files([self._results / row[0] for row in rows])

    # -- the bound ----------------------------------------------------------

    def usage_bytes(self) -> int:
        """Bytes counted against ``max_bytes`` now (files and messages; writes in flight not included).

        Kept in memory: safe to call on the event loop.
        """
        return self._usage

    def statistics(self) -> StoreStatistics:
        """The store's usage and counts. Call it in a worker thread."""
        with self._errors("reading statistics"), self._locked():
            running, finished, checkpoints = self._db.execute(
                "SELECT COALESCE(SUM(status = 'running'), 0), COALESCE(SUM(status != 'running'), 0),"
                " COUNT(checkpoint_file) FROM requests"
            ).fetchone()
            (results,) = self._db.execute("SELECT COUNT(*) FROM results").fetchone()
            return StoreStatistics(
                usage_bytes=self._usage, reserved_bytes=self._reserved, max_bytes=self._max_bytes,
                running=running, finished=finished, checkpoints=checkpoints, results=results,
            )

    def _make_room(
        self, db: sqlite3.Connection, need: int, *, exclude: int | None, all_or_nothing: bool = True
    ) -> _Room:
        """Evict the longest-ended requests until ``need`` more bytes fit; inside a transaction.

        With ``all_or_nothing``, evicts nothing when even all of them would
        not make room: a write refused must not cost the results that were
        kept. Without (on open, over a bound lowered since), gets as close
        as it can.
        """
        over = self._usage + self._reserved + need - self._max_bytes
        if over <= 0:
            return _Room(True, (), (), 0)
        candidates = db.execute(
            f"SELECT id, request_id, {_ROW_BYTES} FROM requests WHERE status != 'running' AND id != ?"
            " ORDER BY ended_at, id", (-1 if exclude is None else exclude,),
        ).fetchall()
        fits = sum(row[2] for row in candidates) >= over
        if not fits and all_or_nothing:
            return _Room(False, (), (), 0)
        evicted: list[str] = []
        files: list[Path] = []
        freed = 0
        for key, request_id, _ in candidates:
            if freed >= over:
                break
            row_files, row_bytes = self._delete_row(db, key)
            files += row_files
            freed += row_bytes
            evicted.append(request_id)
        if evicted:
            logger.info("state directory %s: evicted %d ended request(s) to stay within %d bytes: %s",
                        self._folder, len(evicted), self._max_bytes, ", ".join(evicted))
        return _Room(fits, tuple(evicted), tuple(files), freed)

    def _no_room(self, size: int) -> str:
        return (
            f"{size} bytes do not fit in max_bytes {self._max_bytes} ({self._usage} used, "
            f"{self._reserved} being written), even with every ended request evicted"
        )

    # -- rows, files, errors ------------------------------------------------

    def _delete_row(self, db: sqlite3.Connection, key: int) -> tuple[list[Path], int]:
        """Delete request row ``key`` and its result rows; its files (to delete after commit) and bytes."""
        row = db.execute(
            f"SELECT checkpoint_file, {_ROW_BYTES} FROM requests WHERE id = ?", (key,)
        ).fetchone()
        named = db.execute("SELECT file FROM results WHERE request = ?", (key,)).fetchall()
        files = [self._results / r[0] for r in named]
        if row[0] is not None:
            files.append(self._checkpoints / row[0])
        db.execute("DELETE FROM requests WHERE id = ?", (key,))  # its results go with it (ON DELETE CASCADE)
        return files, int(row[1])

    @staticmethod
    def _end(
        db: sqlite3.Connection, key: int, ended_at: float, terminal: str | None
    ) -> tuple[str, int] | None:
        """Mark row ``key`` done and forget its checkpoint; the checkpoint's file and bytes, if any."""
        row = db.execute(
            "SELECT checkpoint_file, checkpoint_bytes FROM requests WHERE id = ?", (key,)
        ).fetchone()
        db.execute(
            "UPDATE requests SET status = 'done', ended_at = ?, terminal = COALESCE(?, terminal),"
            " checkpoint_file = NULL, checkpoint_step = NULL, checkpoint_bytes = 0 WHERE id = ?",
            (float(ended_at), terminal, key),
        )
        return None if row[0] is None else (row[0], int(row[1]))

    def _remove_files(self, paths: Sequence[Path]) -> None:
        # After the commit that stopped naming them: a failure leaves an orphan for the next open.
        for path in paths:
            try:
                remove(path)
            except OSError as exc:
                logger.warning("state directory %s: cannot delete %s (deleted on the next open): %s",
                               self._folder, path.name, exc)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise LifecycleError(f"the store of state directory {self._folder} is closed")
            yield

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction, with ``self._lock`` held: rolled back on an exception, else committed.

        A body may roll back itself (``ROLLBACK``) and return: nothing is committed then.
        """
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        if db.in_transaction:
            db.execute("COMMIT")

    @contextlib.contextmanager
    def _errors(self, doing: str, request_id: str | None = None) -> Iterator[None]:
        """Translate the disk's and the database's errors into StoreError, at this one boundary."""
        try:
            yield
        except (OSError, sqlite3.Error) as exc:
            message = f"state directory {self._folder}: {doing} failed: {exc}"
            raise StoreError(message, request_id=request_id) from exc

    # -- opening: what a crash or a hand left -------------------------------

    def _reconcile(self) -> Reconciliation:
        """Delete temporary and orphan files, clear rows whose files are gone, evict down to the bound."""
        on_disk: dict[Path, dict[str, int]] = {}
        temporary = 0
        for folder in (self._checkpoints, self._results):
            on_disk[folder] = {}
            with os.scandir(folder) as entries:
                for item in entries:
                    if not item.is_file(follow_symlinks=False):
                        continue  # not ours to judge: a folder or a link someone put there
                    if is_temporary(item.name):
                        temporary += remove(Path(item.path))
                    else:
                        on_disk[folder][item.name] = item.stat(follow_symlinks=False).st_size
        checkpoints, results = on_disk[self._checkpoints], on_disk[self._results]
        missing_checkpoints: list[str] = []
        missing_results: list[str] = []
        with self._lock, self._transaction() as db:
            named_checkpoints = set()
            for key, request_id, name in db.execute(
                "SELECT id, request_id, checkpoint_file FROM requests WHERE checkpoint_file IS NOT NULL"
            ).fetchall():
                if name in checkpoints:
                    named_checkpoints.add(name)
                    continue
                missing_checkpoints.append(request_id)
                db.execute(
                    "UPDATE requests SET checkpoint_file = NULL, checkpoint_step = NULL, checkpoint_bytes = 0"
                    " WHERE id = ?", (key,),
                )
            named_results = set()
            broken: dict[int, str] = {}
            for key, request_id, name, size in db.execute(
                "SELECT request, request_id, file, bytes FROM results JOIN requests ON requests.id = request"
            ).fetchall():
                if results.get(name) == size:
                    named_results.add(name)
                else:
                    broken[key] = request_id
            for key, request_id in broken.items():
                # All of a request's results or none: a client asking for image 2 of 3 gets all 3.
                files = db.execute("SELECT file FROM results WHERE request = ?", (key,)).fetchall()
                named_results -= {r[0] for r in files}
                db.execute("DELETE FROM results WHERE request = ?", (key,))
                missing_results.append(request_id)
            (self._usage,) = db.execute(f"SELECT COALESCE(SUM({_ROW_BYTES}), 0) FROM requests").fetchone()
            room = self._make_room(db, 0, exclude=None, all_or_nothing=False)
            self._usage -= room.freed
        orphans = [self._checkpoints / n for n in checkpoints.keys() - named_checkpoints]
        orphans += [self._results / n for n in results.keys() - named_results]
        for path in orphans:
            remove(path)
        self._remove_files(room.files)
        return Reconciliation(
            temporary_files=temporary,
            orphan_files=len(orphans),
            missing_checkpoints=tuple(sorted(missing_checkpoints)),
            missing_results=tuple(sorted(missing_results)),
            evicted=room.evicted,
        )


def _checkpoint_refusal(row: Any, step: int) -> str | None:
    """Why a checkpoint at ``step`` is not to be stored for ``row`` (id, status, step, ...), or None."""
    if row is None:
        return "the request is not recorded"
    if row[1] != "running":
        return f"the request has ended ({row[1]})"
    if row[2] is not None and step < row[2]:
        return f"a checkpoint of a later step ({row[2]}) is stored"
    return None


def _results_refusal(row: Any) -> str | None:
    """Why results are not to be stored for ``row`` (id, status, result count), or None."""
    if row is None:
        return "the request is not recorded"
    if row[1] in ("failed", "cancelled"):
        return f"the request has ended ({row[1]})"
    if row[2]:
        return "its results are stored already"
    return None


def _write_result(folder: Path, name: str, result: StoredResult) -> str:
    """Write one result's file; its sha256 (hex), which load_results checks."""
    digest = hashlib.sha256(result.data).hexdigest()
    write_atomic(folder, name, [result.data])
    return digest


def _json(value: dict[str, Any], request_id: str, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"request {request_id}: its {what} is not JSON: {exc}") from exc


def _entry(row: Any) -> RequestEntry:
    (request_id, principal, model, message, created_at, total, seed, status, ended_at, terminal,
     checkpoint_step, result_count) = row
    return RequestEntry(
        request_id=request_id, principal=principal, model=model, message=json.loads(message),
        created_at=created_at, total=total, seed=seed, status=status, ended_at=ended_at,
        terminal=None if terminal is None else json.loads(terminal),
        checkpoint_step=checkpoint_step, result_count=result_count,
    )
