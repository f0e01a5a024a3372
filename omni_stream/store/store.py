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

This module opens, repairs and closes; the methods over requests,
checkpoints and results are its parts' (``requests.py``, ``checkpoints.py``,
``results.py``), over what they share (``base.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
from pathlib import Path

from ..errors import StoreError
from .base import CHECKPOINTS, DATABASE, LOCK, RESULTS
from .checkpoints import CheckpointsMixin
from .entries import Reconciliation
from .files import FolderLock, is_temporary, remove
from .requests import RequestsMixin
from .results import ResultsMixin
from .schema import ROW_BYTES, connect

__all__ = ["CHECKPOINTS", "DATABASE", "RESULTS", "Store"]

logger = logging.getLogger("omni_stream.store")


class Store(RequestsMixin, CheckpointsMixin, ResultsMixin):
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
        lock = FolderLock(folder / LOCK)
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
                    " WHERE id = ?",
                    (key,),
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
            (self._usage,) = db.execute(f"SELECT COALESCE(SUM({ROW_BYTES}), 0) FROM requests").fetchone()
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
