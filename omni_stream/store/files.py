"""The state directory's files: atomic writes, names, the folder lock (no database here).

A file is written the one way that survives a crash at any point: into a
temporary file in the same folder (``.tmp-`` names, which :func:`is_temporary`
recognises and ``Store.open`` deletes), flushed and fsync'ed, renamed over
its final name with ``os.replace`` (atomic within one file system), and the
folder fsync'ed so the rename itself is on the disk. A crash leaves either
no file or the whole file under its final name, plus at worst a temporary
file that nothing refers to.

Every file gets a name never used before (:func:`new_name`: a random part),
so writing a request's next checkpoint can never replace, and then delete,
the file it is meant to keep.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Final

__all__ = [
    "TEMP_PREFIX",
    "FolderLock",
    "fsync_folder",
    "is_temporary",
    "new_name",
    "remove",
    "write_atomic",
]

#: The prefix of a file being written; one left behind is a crash's.
TEMP_PREFIX: Final = ".tmp-"


def new_name(prefix: str, suffix: str) -> str:
    """A file name never used before: ``prefix``, a random part, ``suffix``."""
    return f"{prefix}-{secrets.token_hex(8)}{suffix}"


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`write_atomic`."""
    return name.startswith(TEMP_PREFIX)


def write_atomic(folder: Path, name: str, chunks: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write ``chunks`` as ``folder / name``, all or nothing (see the module docstring); the bytes written.

    The folder is not fsync'ed here (:func:`fsync_folder`), so that one
    request's several results cost one folder sync. Raises OSError; the
    temporary file is removed then.
    """
    temp = folder / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    written = 0
    try:
        with open(temp, "xb") as out:
            for chunk in chunks:
                written += _write_all(out, chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, folder / name)
    except BaseException:
        remove(temp)
        raise
    return written


def _write_all(out: IO[bytes], chunk: bytes | bytearray | memoryview) -> int:
    view = memoryview(chunk).cast("B")
    done = 0
    while done < len(view):  # a raw write may be short; a buffered one normally is not
        done += out.write(view[done:])
    return done


def fsync_folder(folder: Path) -> None:
    """Make the renames and deletions in ``folder`` durable (a no-op where a folder cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except (PermissionError, IsADirectoryError):  # Windows: a folder cannot be opened; NTFS journals it
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> bool:
    """Delete ``path``; False when it was not there. Raises OSError for anything else."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class FolderLock:
    """An exclusive lock on the state directory, held while a Store is open.

    Two servers on one folder would each take the other's temporary files for
    a crash's and delete them, and each evict what the other still serves.
    ``flock`` is released by the kernel when the process dies, so a crash
    never leaves the folder locked. Where ``fcntl`` does not exist (Windows)
    nothing is locked.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[bytes] | None = None

    def acquire(self) -> bool:
        """Take the lock; False when another process holds it. Raises OSError."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return True
        handle = open(self._path, "ab")  # noqa: SIM115 - held open while the store is: it is the lock
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        except BaseException:
            handle.close()
            raise
        self._file = handle
        return True

    def release(self) -> None:
        """Let the lock go (closing the file releases ``flock``)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
