"""The state directory: requests, checkpoints and results that survive the process (issue #22).

``serve --state-dir DIR`` writes down every accepted request, its latest
checkpoint and its results, and reads them back after a crash or a restart:
SQLite from the standard library and plain files in that folder, nothing to
install or run. docs/reliability.md ("The state directory") describes the
layout and what is safe to delete.

.. code-block:: text

    store.py        Store: open (and repair what a crash left), close; the parts below
    requests.py     record, annotate, end, read, list, prune and delete requests
    checkpoints.py  a request's latest checkpoint: save, load, discard
    results.py      a done request's results: save (with its end), load (checked)
    base.py         what the parts share: the database and its lock, the bound (eviction),
                    the error boundary (StoreError)
    entries.py      the records it takes and returns: RequestEntry, StoredResult, Saved, ...
    schema.py       the database: tables, schema version, WAL
    files.py        atomic writes (temporary file, fsync, rename, fsync of the folder), the folder lock

Every Store method that touches the disk is synchronous: the server calls
it in a worker thread (``anyio.to_thread.run_sync`` with a limiter).
"""

from .base import CHECKPOINTS, DATABASE, RESULTS
from .entries import (
    ENDED,
    STATUSES,
    Reconciliation,
    RequestEntry,
    Saved,
    Status,
    StoredResult,
    StoreStatistics,
)
from .schema import SCHEMA_VERSION
from .store import Store

__all__ = [
    "CHECKPOINTS",
    "DATABASE",
    "ENDED",
    "RESULTS",
    "SCHEMA_VERSION",
    "STATUSES",
    "Reconciliation",
    "RequestEntry",
    "Saved",
    "Status",
    "Store",
    "StoreStatistics",
    "StoredResult",
]
