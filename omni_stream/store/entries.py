"""What the store holds and reports, as frozen records (pure, no I/O)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

__all__ = [
    "ENDED",
    "STATUSES",
    "Reconciliation",
    "RequestEntry",
    "Saved",
    "Status",
    "StoreStatistics",
    "StoredResult",
]

#: A request's status: ``running`` until it ends one of the three other ways.
Status = Literal["running", "done", "failed", "cancelled"]
STATUSES: Final[tuple[str, ...]] = get_args(Status)
#: The statuses of a request that has ended.
ENDED: Final = frozenset({"done", "failed", "cancelled"})

# A result's format names its file's suffix, so it is kept to what a suffix may be.
_FORMAT = re.compile(r"[a-z0-9]{1,16}")


@dataclass(frozen=True, slots=True)
class RequestEntry:
    """One accepted request as written down.

    What ``record_request`` takes: ``request_id``; ``principal``, the key of
    who sent it (``core/principal.py``); ``model``, the served model's name;
    ``message``, what the server needs to start it again, as JSON (the
    server's: ``generate``, the message with params, preview, output,
    priority, detach, webhook; ``accepted``; ``cross_priority``, what its
    token granted);
    ``created_at``, wall time (``time.time()``) of its acceptance; ``total``,
    its step count; ``seed``, the seed it runs with (drawn ones included, so
    a restart renders the same picture), None for a model without one.

    What the store adds when it reads one back: ``status``; ``ended_at``
    (wall time) and ``terminal`` (the terminal message the server sent:
    ``done``, ``error`` or ``cancelled``, as JSON, for ``attach`` to replay)
    once it ended; ``checkpoint_step``, the step of its latest checkpoint
    (None: it would start from step 0); ``result_count``, the results stored.
    """

    request_id: str
    principal: str
    model: str
    message: dict[str, Any]
    created_at: float
    total: int
    seed: int | None = None
    status: Status = "running"
    ended_at: float | None = None
    terminal: dict[str, Any] | None = None
    checkpoint_step: int | None = None
    result_count: int = 0

    @property
    def ended(self) -> bool:
        """Whether the request has ended (done, failed or cancelled)."""
        return self.status in ENDED


@dataclass(frozen=True, slots=True)
class StoredResult:
    """One result of a finished request: an encoded final frame and its header's fields.

    ``data`` is what the server sends as the frame's image (a PNG, JPEG,
    WebP, GIF or MP4 file, or raw RGB bytes); ``format`` and ``mime`` name
    it, ``width`` and ``height`` its size, ``step`` the frame's step (the
    request's ``total``), ``index`` of ``images`` which image of a request
    for several it is (0 of 1 for one). Raises ValueError for a field out of
    range or a format that is not 1-16 of ``a-z 0-9``.
    """

    step: int
    format: str
    mime: str
    width: int
    height: int
    data: bytes | bytearray | memoryview = field(repr=False)
    index: int = 0
    images: int = 1

    def __post_init__(self) -> None:
        if not _FORMAT.fullmatch(self.format):
            raise ValueError(f"result format {self.format!r:.40} is not 1-16 characters of a-z 0-9")
        if self.width < 1 or self.height < 1:
            raise ValueError(f"result size {self.width}x{self.height} is not positive")
        if self.images < 1 or not 0 <= self.index < self.images:
            raise ValueError(f"result index {self.index} of {self.images} images is out of range")
        if self.step < 0:
            raise ValueError(f"result step {self.step} is negative")

    @property
    def nbytes(self) -> int:
        """The size of ``data`` in bytes."""
        return memoryview(self.data).nbytes


@dataclass(frozen=True, slots=True)
class Saved:
    """What a ``save_checkpoint`` or ``save_results`` did.

    ``stored``: whether the bytes are now on the disk as the request's
    latest checkpoint, or its results. When not, ``reason`` says why in
    words (the request is not running, a later checkpoint is already
    stored, the bytes do not fit in ``max_bytes``). ``evicted``: the ids of
    finished requests deleted (their results and records) to make room,
    oldest ended first.
    """

    stored: bool
    evicted: tuple[str, ...] = ()
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What ``Store.open`` found and repaired after the last run (a crash leaves some of each).

    ``temporary_files``: half-written files deleted; ``orphan_files``:
    files no record refers to, deleted; ``missing_checkpoints``: ids of
    running requests whose checkpoint file was gone (they start from step
    0); ``missing_results``: ids of finished requests whose result files
    were gone or of the wrong size (their results are dropped, the record
    kept); ``evicted``: ids of finished requests deleted because the folder
    was over ``max_bytes`` (a smaller bound than the last run's).
    """

    temporary_files: int = 0
    orphan_files: int = 0
    missing_checkpoints: tuple[str, ...] = ()
    missing_results: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """Whether there was nothing to repair."""
        return self == Reconciliation()


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of the store's state (``Store.statistics()``).

    ``usage_bytes`` counts what ``max_bytes`` bounds: every checkpoint and
    result file, and every recorded ``generate`` message (one may carry an
    input image as a data URL). ``reserved_bytes``: writes in progress.
    """

    usage_bytes: int
    reserved_bytes: int
    max_bytes: int
    running: int
    finished: int
    checkpoints: int
    results: int
