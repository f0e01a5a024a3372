"""Which requests advance next, and together: a pure decision, no I/O.

Fairness: the request that has waited longest since its last step (or since
it arrived) leads the next batch, so a long request cannot starve a new one
and a new one cannot starve a long one. The leader's compatible peers (same
``batch_key``) join it, longest-waiting first, up to the batch limit.
Requests whose key is ``None`` always run alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Schedulable", "pick_batch", "BatchLimits"]


class Schedulable(Protocol):
    @property
    def batch_key(self) -> Hashable | None: ...

    @property
    def last_scheduled(self) -> int:
        """Sequence number of the batch that last advanced it; -1 if never."""
        ...

    @property
    def arrival(self) -> int:
        """Arrival order, to break ties deterministically."""
        ...


T = TypeVar("T", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


def pick_batch(runnable: Iterable[T], limits: BatchLimits) -> Sequence[T]:
    """Choose the next batch from ``runnable`` (an empty list when there is none)."""
    ordered = sorted(runnable, key=lambda r: (r.last_scheduled, r.arrival))
    if not ordered:
        return []
    leader = ordered[0]
    key = leader.batch_key
    if key is None or limits.max_batch_size == 1:
        return [leader]
    batch = [leader]
    for r in ordered[1:]:
        if len(batch) >= limits.max_batch_size:
            break
        if r.batch_key == key:
            batch.append(r)
    return batch
