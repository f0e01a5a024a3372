"""The state directory's database: its tables, its version, opening it (SQLite, standard library).

The database holds what is small and must be searched (requests, which
checkpoint and which result files are theirs, sizes and checksums); the
files hold what is large. It runs in WAL mode (a reader never waits for the
writer, and a crash mid-commit leaves the last commit intact) with
``synchronous=FULL``: a commit is on the disk when it returns, because the
server acknowledges a request only after recording it.

``schema_version`` holds one row, the layout's version. A database of a
newer version than :data:`SCHEMA_VERSION` is refused (an older omni_stream
must not guess at a newer layout); an older one is migrated in place
(there is none yet: version 1 is the first).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from ..errors import StoreError

__all__ = ["RESULT_COUNT", "ROW_BYTES", "SCHEMA_VERSION", "connect"]

#: The layout of the tables below.
SCHEMA_VERSION: Final = 1

# ``id`` (an integer, the row's own, never reused: AUTOINCREMENT) names the
# request's files, not its request id: ids differ only in case on a
# case-insensitive file system, and a reused request id must never reach a
# file of the request it replaced, nor a write in flight the row it was for.
_TABLES: Final = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL UNIQUE,
    principal TEXT NOT NULL,
    model TEXT NOT NULL,
    message TEXT NOT NULL,
    message_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    total INTEGER NOT NULL,
    seed INTEGER,
    status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed', 'cancelled')),
    ended_at REAL,
    terminal TEXT,
    checkpoint_file TEXT UNIQUE,
    checkpoint_step INTEGER,
    checkpoint_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX requests_by_end ON requests (status, ended_at);
CREATE TABLE results (
    request INTEGER NOT NULL REFERENCES requests (id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    images INTEGER NOT NULL,
    step INTEGER NOT NULL,
    format TEXT NOT NULL,
    mime TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    file TEXT NOT NULL UNIQUE,
    bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (request, idx)
);
"""

#: A request row's result count, as a column of a query over ``requests``.
RESULT_COUNT: Final = "(SELECT COUNT(*) FROM results WHERE results.request = requests.id)"
#: What a request row costs against ``max_bytes``: its message, its checkpoint, its results.
ROW_BYTES: Final = (
    "message_bytes + checkpoint_bytes"
    " + COALESCE((SELECT SUM(bytes) FROM results WHERE results.request = requests.id), 0)"
)


def connect(path: Path, folder: Path) -> sqlite3.Connection:
    """The database at ``path``, created at :data:`SCHEMA_VERSION` when new.

    Autocommit mode (``isolation_level=None``): the store opens each
    transaction itself with ``BEGIN IMMEDIATE``. Usable from any thread;
    the store serialises its use. Raises StoreError naming ``folder`` for a
    newer schema version, a file that is not a database, or one that cannot
    be opened.
    """
    try:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    except sqlite3.Error as exc:
        raise StoreError(f"state directory {folder}: cannot open its database {path.name}: {exc}") from exc
    try:
        _prepare(db, folder)
    except BaseException:
        db.close()
        raise
    return db


def _prepare(db: sqlite3.Connection, folder: Path) -> None:
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("BEGIN IMMEDIATE")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            for statement in _TABLES.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            db.execute("COMMIT")
            return
        version = _version(db, tables)
        db.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise StoreError(
            f"state directory {folder}: its database cannot be read ({exc}); it may be damaged. "
            "With the server stopped, move the folder away (or delete it) to start empty"
        ) from exc
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"state directory {folder} was written by a newer omni_stream (schema version {version}; "
            f"this one reads up to {SCHEMA_VERSION}): run that version, or use another --state-dir"
        )


def _version(db: sqlite3.Connection, tables: set[str]) -> int:
    if "schema_version" not in tables:
        raise sqlite3.DatabaseError("it has tables but no schema_version: not an omni_stream state database")
    rows = db.execute("SELECT version FROM schema_version").fetchall()
    if len(rows) != 1 or not isinstance(rows[0][0], int):
        raise sqlite3.DatabaseError(f"its schema_version table holds {rows!r:.80}, not one version")
    version: int = rows[0][0]
    if version < 1:
        raise sqlite3.DatabaseError(f"its schema version {version} is not one omni_stream ever wrote")
    return version
