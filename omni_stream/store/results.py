"""The store's results: a done request's encoded final frames, written with its end, read back.

A part of :class:`~omni_stream.store.Store` (``base.py`` says what the parts
share). A request's results are stored all or none: its files are written
first, then one commit names them all and marks the request done; a file
that is missing or not the bytes written (sha256) drops them all.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import StoreBase, to_json
from .entries import Saved, StoredResult
from .files import fsync_folder, new_name, write_atomic
from .schema import RESULT_COUNT

__all__ = ["ResultsMixin"]

logger = logging.getLogger("omni_stream.store")


class ResultsMixin(StoreBase):
    """Store's methods over its requests' results (see :class:`~omni_stream.store.Store`)."""

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
        text = None if terminal is None else to_json(terminal, request_id, "terminal")
        need = sum(r.nbytes for r in results)
        with self._errors("saving results", request_id), self._locked():
            with self._transaction() as db:
                row = db.execute(
                    f"SELECT id, status, {RESULT_COUNT} FROM requests WHERE request_id = ?",
                    (request_id,),
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
                        f"SELECT id, status, {RESULT_COUNT} FROM requests WHERE id = ?",
                        (key,),
                    ).fetchone()
                    refusal = _results_refusal(row)
                    if refusal is not None:
                        return Saved(False, evicted=room.evicted, reason=refusal)
                    db.executemany(
                        "INSERT INTO results (request, idx, images, step, format, mime, width, height, file,"
                        " bytes, sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [
                            (
                                key,
                                r.index,
                                r.images,
                                r.step,
                                r.format,
                                r.mime,
                                r.width,
                                r.height,
                                name,
                                r.nbytes,
                                digest,
                            )
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
