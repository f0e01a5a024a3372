"""``StoreBase``: what every part of :class:`~omni_stream.store.Store` shares.

The database and the lock that guards it, the bytes counted against
``max_bytes`` and making room for a write (eviction of the requests that
ended longest ago), deleting a request's row, and the one boundary where
the disk's and the database's errors become StoreError. The parts
(``requests.py``, ``checkpoints.py``, ``results.py``) add the methods;
``store.py`` opens and closes.

The lock is held only for the database's part of a call: the parts write
their files (the large, slow part: write, fsync, rename) outside it, with
the bytes they will need counted as reserved meanwhile, so several
requests' writes run side by side without overrunning the bound.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import LifecycleError, StoreError
from .entries import Reconciliation, StoreStatistics
from .files import FolderLock, remove
from .schema import ROW_BYTES

__all__ = ["CHECKPOINTS", "DATABASE", "LOCK", "RESULTS", "Room", "StoreBase", "to_json"]

logger = logging.getLogger("omni_stream.store")

#: The layout of a state directory (docs/reliability.md, "The state directory").
DATABASE: Final = "state.db"
CHECKPOINTS: Final = "checkpoints"
RESULTS: Final = "results"
LOCK: Final = "lock"


@dataclass(frozen=True, slots=True)
class Room:
    """The outcome of making room for a write: whether it fits, who was evicted, their files."""

    fits: bool
    evicted: tuple[str, ...]
    files: tuple[Path, ...]
    freed: int


class StoreBase:
    """The state shared by Store's parts, and the primitives they are written with.

    Not used alone: :class:`~omni_stream.store.Store` is this with its parts.
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
                usage_bytes=self._usage,
                reserved_bytes=self._reserved,
                max_bytes=self._max_bytes,
                running=running,
                finished=finished,
                checkpoints=checkpoints,
                results=results,
            )

    def _make_room(
        self, db: sqlite3.Connection, need: int, *, exclude: int | None, all_or_nothing: bool = True
    ) -> Room:
        """Evict the longest-ended requests until ``need`` more bytes fit; inside a transaction.

        With ``all_or_nothing``, evicts nothing when even all of them would
        not make room: a write refused must not cost the results that were
        kept. Without (on open, over a bound lowered since), gets as close
        as it can.
        """
        over = self._usage + self._reserved + need - self._max_bytes
        if over <= 0:
            return Room(True, (), (), 0)
        candidates = db.execute(
            f"SELECT id, request_id, {ROW_BYTES} FROM requests WHERE status != 'running' AND id != ?"
            " ORDER BY ended_at, id",
            (-1 if exclude is None else exclude,),
        ).fetchall()
        fits = sum(row[2] for row in candidates) >= over
        if not fits and all_or_nothing:
            return Room(False, (), (), 0)
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
            logger.info(
                "state directory %s: evicted %d ended request(s) to stay within %d bytes: %s",
                self._folder,
                len(evicted),
                self._max_bytes,
                ", ".join(evicted),
            )
        return Room(fits, tuple(evicted), tuple(files), freed)

    def _no_room(self, size: int) -> str:
        return (
            f"{size} bytes do not fit in max_bytes {self._max_bytes} ({self._usage} used, "
            f"{self._reserved} being written), even with every ended request evicted"
        )

    # -- rows, files, errors ------------------------------------------------

    def _delete_row(self, db: sqlite3.Connection, key: int) -> tuple[list[Path], int]:
        """Delete request row ``key`` and its result rows; its files (to delete after commit) and bytes."""
        row = db.execute(f"SELECT checkpoint_file, {ROW_BYTES} FROM requests WHERE id = ?", (key,)).fetchone()
        named = db.execute("SELECT file FROM results WHERE request = ?", (key,)).fetchall()
        files = [self._results / r[0] for r in named]
        if row[0] is not None:
            files.append(self._checkpoints / row[0])
        db.execute("DELETE FROM requests WHERE id = ?", (key,))  # its results go with it (ON DELETE CASCADE)
        return files, int(row[1])

    def _remove_files(self, paths: Sequence[Path]) -> None:
        # After the commit that stopped naming them: a failure leaves an orphan for the next open.
        for path in paths:
            try:
                remove(path)
            except OSError as exc:
                logger.warning(
                    "state directory %s: cannot delete %s (deleted on the next open): %s",
                    self._folder,
                    path.name,
                    exc,
                )

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


def to_json(value: dict[str, Any], request_id: str, what: str) -> str:
    """``value`` as compact JSON text; ValueError naming the request and ``what`` for one that is not JSON."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"request {request_id}: its {what} is not JSON: {exc}") from exc
