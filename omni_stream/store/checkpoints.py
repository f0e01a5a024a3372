"""The store's checkpoints: a request's latest one written, read back, discarded.

A part of :class:`~omni_stream.store.Store` (``base.py`` says what the parts
share). A request keeps one checkpoint, its latest: the new file is durable
under its own name before the row names it, and the old one is deleted
after that commit.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from .base import StoreBase
from .entries import Saved
from .files import fsync_folder, new_name, write_atomic

__all__ = ["CheckpointsMixin"]

logger = logging.getLogger("omni_stream.store")


class CheckpointsMixin(StoreBase):
    """Store's methods over its requests' checkpoints (see :class:`~omni_stream.store.Store`)."""

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
                        " WHERE id = ?",
                        (key,),
                    ).fetchone()
                    # The request may have ended, been deleted or checkpointed again meanwhile.
                    refusal = _checkpoint_refusal(row, step)
                    if refusal is not None:
                        return Saved(False, evicted=room.evicted, reason=refusal)
                    db.execute(
                        "UPDATE requests SET checkpoint_file = ?, checkpoint_step = ?, checkpoint_bytes = ?"
                        " WHERE id = ?",
                        (name, step, size, key),
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
                " AND status = 'running' AND checkpoint_file IS NOT NULL",
                (request_id,),
            ).fetchone()
        if row is None:
            return None
        name, step = row
        try:
            return Checkpoint.from_bytes((self._checkpoints / name).read_bytes(), keep_bytes=keep_bytes)
        except (OSError, CheckpointError) as exc:
            logger.warning(
                "request %s: its checkpoint of step %d (%s) cannot be used; it starts again from step 0: %s",
                request_id,
                step,
                name,
                exc,
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
                    " WHERE id = ?",
                    (row[0],),
                )
            self._usage -= row[1]
        self._remove_files([self._checkpoints / name])
        return True


def _checkpoint_refusal(row: Any, step: int) -> str | None:
    """Why a checkpoint at ``step`` is not to be stored for ``row`` (id, status, step, ...), or None."""
    if row is None:
        return "the request is not recorded"
    if row[1] != "running":
        return f"the request has ended ({row[1]})"
    if row[2] is not None and step < row[2]:
        return f"a checkpoint of a later step ({row[2]}) is stored"
    return None
