"""The A1111 calls running now, per principal, and what ``/progress`` says of one (pure).

A1111 runs one job at a time for everyone, and ``/progress``,
``/interrupt`` and ``/skip`` act on it. Here each principal has its own:
a :class:`Job` is one ``txt2img`` / ``img2img`` call (its ``n_iter``
iterations, one after the other, of ``batch_size`` requests of one image,
run together),
kept in the :class:`JobBook` while the call runs; ``/progress`` reads the caller's principal's latest, and
``/interrupt`` and ``/skip`` stop its request. The book holds only calls
that are open (each one of the server's bounded connections).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.records import RequestRecord

__all__ = ["Job", "JobBook", "idle_progress", "progress_payload"]


@dataclass(slots=True)
class Job:
    """One A1111 call while it runs: its iteration ``iteration``'s requests (``records``, by
    image; ``record`` the one ``/progress`` shows), and whether its caller's principal skipped
    or interrupted it."""

    kind: str
    n_iter: int
    batch_size: int = 1
    #: Wall clock (A1111's ``job_timestamp``) and monotonic (its ETA) at the start.
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    iteration: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    #: ``/interrupt``: no more images. ``/skip``: no more of this iteration; the next goes on.
    interrupted: bool = False
    skipped: bool = False

    @property
    def index(self) -> int:
        """The image of its iteration ``/progress`` shows: the first still running, else the last."""
        for i, record in enumerate(self.records):
            if not record.ended:
                return i
        return max(0, len(self.records) - 1)

    @property
    def record(self) -> RequestRecord | None:
        return self.records[self.index] if self.records else None

    @property
    def timestamp(self) -> str:
        return time.strftime("%Y%m%d%H%M%S", time.localtime(self.started_at))


class JobBook:
    """The running :class:`Job` s of each principal (its key), in the order they started."""

    def __init__(self) -> None:
        self._jobs: dict[str, list[Job]] = {}

    def add(self, principal: str, job: Job) -> None:
        self._jobs.setdefault(principal, []).append(job)

    def remove(self, principal: str, job: Job) -> None:
        jobs = self._jobs.get(principal, [])
        if job in jobs:
            jobs.remove(job)
        if not jobs:
            self._jobs.pop(principal, None)

    def latest(self, principal: str) -> Job | None:
        jobs = self._jobs.get(principal)
        return jobs[-1] if jobs else None

    def __iter__(self) -> Iterator[Job]:
        return (job for jobs in self._jobs.values() for job in jobs)


def _state(
    job: str, count: int, number: int, step: int, steps: int, timestamp: str, **flags: bool
) -> dict[str, Any]:
    # A1111's ``shared.state.dict()``.
    return {
        "skipped": flags.get("skipped", False),
        "interrupted": flags.get("interrupted", False),
        "stopping_generation": False,
        "job": job,
        "job_count": count,
        "job_timestamp": timestamp,
        "job_no": number,
        "sampling_step": step,
        "sampling_steps": steps,
    }


def idle_progress() -> dict[str, Any]:
    """``/progress`` when the caller's principal runs nothing: progress 0, ``job_count`` 0
    (what webuiapi's ``util_wait_for_ready`` waits for)."""
    return {
        "progress": 0.0,
        "eta_relative": 0.0,
        "state": _state("", 0, 0, 0, 0, "0"),
        "current_image": None,
        "textinfo": None,
    }


def progress_payload(
    *,
    kind: str,
    count: int,
    number: int,
    step: int,
    steps: int,
    elapsed_s: float,
    eta_s: float | None,
    timestamp: str,
    image: str | None,
    batch_size: int = 1,
    index: int = 0,
    skipped: bool = False,
    interrupted: bool = False,
) -> dict[str, Any]:
    """``/progress`` for the request of image ``index`` of iteration ``number`` (both 0-based)
    of ``count`` iterations of ``batch_size`` images, at ``step`` of ``steps``: ``progress``
    the share of the call done, ``eta_relative`` the seconds left (this request's estimate,
    ``eta_s``, plus the ones after it at the pace so far), ``image`` its live preview (base64).
    ``job_no`` is the iteration, as A1111's."""
    share = step / steps if steps > 0 else 0.0
    requests = count * batch_size
    current = number * batch_size + index
    done = (current + share) / requests if requests > 0 else 0.0
    left = (eta_s or 0.0) + (requests - current - 1) * (
        elapsed_s / (current + share) if current + share > 0 else 0.0
    )
    if eta_s is None and done > 0:
        left = elapsed_s / done - elapsed_s
    return {
        "progress": min(1.0, done),
        "eta_relative": max(0.0, left),
        "state": _state(
            kind, count, number, step, steps, timestamp, skipped=skipped, interrupted=interrupted
        ),
        "current_image": image,
        "textinfo": None,
    }
