"""Which requests advance next, and together: a pure decision, no I/O.

Rank: a runnable request's effective priority is its ``priority`` plus one
point for every ``AGE_ROUNDS`` scheduling rounds it has waited since its
last step, or since it arrived (:func:`effective_priority`). The highest
rank leads the next batch; ties go to a request that has never run, then to
the one that has waited longest, then to the earliest arrival. At equal
priority that is longest-waiting first, so a long request cannot starve a
new one and a new one cannot starve a long one. Across priorities nobody
starves either: a request that just ran has no age points, so one that has
waited ``gap * AGE_ROUNDS`` rounds leads it, ``gap`` being the difference
of their priorities (at most ``PRIORITY_MAX - PRIORITY_MIN``).

The leader's compatible peers (same ``batch_key``) join it in rank order,
up to the batch limit. Requests whose key is ``None`` always run alone.

That is the ``round-robin`` policy (``BatchLimits``' default here).
``BatchLimits.policy`` picks another (``Engine(scheduling=...)``, whose
default is ``preemptive`` with a quantum of 1: measured best on a mixed
workload, docs/performance.md "Scheduling policies"):

- ``fcfs``: first come, first served (vLLM-Omni's): by priority, then
  arrival; the earliest requests hold the batch until they end and the
  others wait, however short.
- ``preemptive``: shortest remaining work first, with ageing: a request's
  rank is its remaining steps less the rounds it has waited since it last
  ran (so a long request behind a stream of short ones moves up, one step a
  round, and runs: nothing starves); priority still comes first. A request that
  just ran keeps its place for ``quantum`` consecutive rounds before a
  better-ranked one may take it (its state stays where it is: the next
  round picks it again), so a short request's first step comes within a
  quantum whatever holds the batch, and batches do not churn every round.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from ..params import positive_int

__all__ = [
    "AGE_ROUNDS",
    "POLICIES",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "BatchLimits",
    "Schedulable",
    "effective_priority",
    "pick_batch",
]

#: The range of ``priority``; bounded so that the wait of the lowest is bounded.
PRIORITY_MIN: Final = -10
PRIORITY_MAX: Final = 10
#: Rounds (batches) of waiting worth one point of priority: the full range
#: (20 points) still lets the lowest request run within ~160 rounds. At equal
#: priority the order is the old one (see ``pick_batch``).
AGE_ROUNDS: Final = 8
#: The scheduling policies (see the module docstring), the default first.
POLICIES: Final = ("round-robin", "fcfs", "preemptive")


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

    @property
    def priority(self) -> int:
        """Higher runs first, within PRIORITY_MIN..PRIORITY_MAX."""
        ...

    @property
    def arrival_round(self) -> int:
        """The batch sequence number when it arrived: it has waited since then until its first step."""
        ...

    @property
    def remaining(self) -> int:
        """Steps it has left to compute (the ``preemptive`` policy's measure of work)."""
        ...

    @property
    def run_streak(self) -> int:
        """Consecutive rounds it has run, up to the last one (0 if it did not run in it)."""
        ...


T = TypeVar("T", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int
    policy: str = "round-robin"
    #: ``preemptive``: the rounds a running request keeps its place before a better one takes it.
    quantum: int = 1

    def __post_init__(self) -> None:
        positive_int(self.max_batch_size, "max_batch_size")
        check_policy(self.policy)
        positive_int(self.quantum, "quantum")


def check_policy(policy: object) -> str:
    """``policy`` if it is one of POLICIES; ParamsError (field ``scheduling``) naming them."""
    if policy not in POLICIES:
        from ..errors import ParamsError

        raise ParamsError(
            f"scheduling must be one of {', '.join(POLICIES)}, got {str(policy)[:40]!r}", field="scheduling"
        )
    assert isinstance(policy, str)
    return policy


def effective_priority(priority: int, waited_rounds: int, *, age_rounds: int = AGE_ROUNDS) -> int:
    """``priority`` plus one point per ``age_rounds`` rounds waited (negative waits count as none)."""
    return priority + max(0, waited_rounds) // age_rounds


def _since(r: Schedulable) -> int:
    return r.last_scheduled if r.last_scheduled >= 0 else r.arrival_round


def _by_rank_within_groups(ordered: list[T]) -> list[T]:
    """``ordered`` with each group's requests moved among the places the group holds in it,
    highest ``rank`` first (ties: the order they had).

    A server's client orders its own requests by its own priority, which must
    not rank them against other clients' (whose places stay where the policy
    put them): so its highest-priority request takes the best place the policy
    gave any of its requests. Without it, a client's priority-10 request that
    came after its priority-0 ones waited behind them under ``fcfs`` and
    ``preemptive`` (issue #38). A request without ``group`` (None, or no such
    attribute) keeps its place.
    """
    places: dict[Hashable, list[int]] = {}
    for i, r in enumerate(ordered):
        group = getattr(r, "group", None)
        if group is not None:
            places.setdefault(group, []).append(i)
    out = ordered
    for indices in places.values():
        members = [ordered[i] for i in indices]
        ranked = sorted(members, key=lambda r: -getattr(r, "rank", 0))  # stable: ties keep their order
        if ranked != members:
            if out is ordered:
                out = list(ordered)
            for i, r in zip(indices, ranked, strict=True):
                out[i] = r
    return out


def pick_batch(runnable: Iterable[T], limits: BatchLimits, *, now: int | None = None) -> Sequence[T]:
    """Choose the next batch from ``runnable`` (an empty list when there is none).

    ``now`` is the current round (batch sequence number); by default the
    latest round any runnable request ran or arrived in, which is the
    current one unless the latest batch is all paused (then every wait is
    undercounted alike, and the order barely changes).
    """
    items = list(runnable)
    if not items:
        return []
    if now is None:
        now = max(_since(r) for r in items)

    # A request that has not run yet takes the age of the longest-waiting
    # request of its own priority: ageing is there so that lower priorities
    # are not starved by higher ones, not to put a new arrival behind every
    # request of its level that has waited a few rounds (at equal priority
    # the old order holds: never-run first, then the longest-waiting).
    oldest: dict[int, int] = {}
    for r in items:
        oldest[r.priority] = max(oldest.get(r.priority, 0), now - _since(r))

    def order(r: T) -> tuple[int, int, int]:
        waited = oldest[r.priority] if r.last_scheduled < 0 else now - _since(r)
        return (-effective_priority(r.priority, waited), r.last_scheduled, r.arrival)

    def first_come(r: T) -> tuple[int, int, int]:
        return (-r.priority, r.arrival, 0)

    def shortest(r: T) -> tuple[int, int, int]:
        # Within its quantum a running request keeps its place; the others
        # rank by remaining work, aged by their wait.
        keeps = r.last_scheduled == now and 0 < r.run_streak < limits.quantum
        waited = now - _since(r)
        return (-r.priority, 0 if keeps else 1, r.remaining - max(0, waited))

    key_of = {"round-robin": order, "fcfs": first_come, "preemptive": shortest}[limits.policy]
    ordered = _by_rank_within_groups(sorted(items, key=lambda r: (*key_of(r), r.arrival)))
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
