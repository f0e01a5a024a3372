"""The scheduler (pure): batching rules, priorities, and that nobody starves."""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import omni_stream as om
from omni_stream.engine.scheduler import (
    AGE_ROUNDS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    BatchLimits,
    effective_priority,
    pick_batch,
)
from omni_stream.models import Synthetic


@dataclass
class R:
    name: str
    batch_key: Hashable | None = "k"
    last_scheduled: int = -1
    arrival: int = 0
    priority: int = 0
    arrival_round: int = 0
    remaining: int = 10
    run_streak: int = 0


def names(batch: Sequence[R]) -> list[str]:
    return [r.name for r in batch]


def run_rounds(pool: list[R], rounds: int, *, batch: int = 1, start: int = 0) -> dict[str, list[int]]:
    """Schedule ``pool`` (always runnable) for ``rounds`` rounds; the rounds each request ran in."""
    ran: dict[str, list[int]] = {r.name: [] for r in pool}
    for seq in range(start + 1, start + rounds + 1):
        for r in pick_batch(pool, BatchLimits(batch), now=seq - 1):
            r.last_scheduled = seq
            ran[r.name].append(seq)
    return ran


# -- the batching rules at equal priority (unchanged) ---------------------------------


def test_the_longest_waiting_leads_and_equal_keys_join_in_order() -> None:
    a = R("a", last_scheduled=5, arrival=1)
    b = R("b", last_scheduled=3, arrival=2)
    c = R("c", last_scheduled=4, arrival=3, batch_key="other")
    d = R("d", last_scheduled=4, arrival=4)
    assert names(pick_batch([a, b, c, d], BatchLimits(8))) == ["b", "d", "a"]
    assert names(pick_batch([a, b, c, d], BatchLimits(2))) == ["b", "d"]
    assert names(pick_batch([a, b, c, d], BatchLimits(1))) == ["b"]
    assert pick_batch([], BatchLimits(4)) == []


def test_a_new_request_leads_at_equal_priority_and_none_keys_run_alone() -> None:
    old = R("old", last_scheduled=6, arrival=1, arrival_round=0)
    new = R("new", arrival=2, arrival_round=6)
    assert names(pick_batch([old, new], BatchLimits(8))) == ["new", "old"]
    alone = R("alone", batch_key=None, arrival=0)
    assert names(pick_batch([old, new, alone], BatchLimits(8))) == ["alone"]
    assert names(pick_batch([old, new], BatchLimits(8))) == ["new", "old"]


# -- priorities -------------------------------------------------------------------------


def test_effective_priority_gains_a_point_every_age_rounds() -> None:
    assert effective_priority(0, 0) == 0
    assert effective_priority(0, AGE_ROUNDS - 1) == 0
    assert effective_priority(0, AGE_ROUNDS) == 1
    assert effective_priority(-3, 5 * AGE_ROUNDS + 1) == 2
    assert effective_priority(4, -7) == 4  # a clock skew never costs rank
    assert effective_priority(1, 10, age_rounds=5) == 3


def test_higher_priority_leads_and_its_peers_join_by_rank() -> None:
    low = R("low", last_scheduled=1, arrival=1, priority=-1)
    mid = R("mid", last_scheduled=3, arrival=2, priority=0)
    high = R("high", last_scheduled=3, arrival=3, priority=5)
    assert names(pick_batch([low, mid, high], BatchLimits(8), now=3)) == ["high", "mid", "low"]
    # A new request of low priority does not jump ahead of a running high one.
    new_low = R("new_low", arrival=4, priority=-5, arrival_round=3)
    assert names(pick_batch([new_low, high], BatchLimits(1), now=3)) == ["high"]


def test_waiting_gap_age_periods_leads_a_request_that_just_ran() -> None:
    gap = 4
    high = R("high", last_scheduled=100, arrival=1, priority=gap)
    waiting = R("low", last_scheduled=100 - gap * AGE_ROUNDS + 1, arrival=2)
    assert names(pick_batch([high, waiting], BatchLimits(1), now=100)) == ["high"]
    waiting.last_scheduled -= 1  # one round longer: equal rank, and it waited longer
    assert names(pick_batch([high, waiting], BatchLimits(1), now=100)) == ["low"]


def test_now_defaults_to_the_latest_round_seen() -> None:
    high = R("high", last_scheduled=50, arrival=1, priority=1)
    low = R("low", last_scheduled=50 - 2 * AGE_ROUNDS, arrival=2)
    assert names(pick_batch([high, low], BatchLimits(1))) == ["low"]
    assert names(pick_batch([high, low], BatchLimits(1), now=50)) == ["low"]


# -- no starvation ----------------------------------------------------------------------


def _bound(pool_size: int) -> int:
    # A request outranks any request that just ran within (gap + 1) * AGE_ROUNDS
    # rounds; the others ahead of it then run once each before it.
    return (PRIORITY_MAX - PRIORITY_MIN + 1) * AGE_ROUNDS + pool_size


@pytest.mark.parametrize("batch", [1, 3])
def test_no_request_starves_whatever_the_priorities(batch: int) -> None:
    pool = [
        R(f"r{i}", batch_key=i % 2, arrival=i, priority=p)
        for i, p in enumerate([PRIORITY_MAX, PRIORITY_MAX, 5, 0, 0, -3, PRIORITY_MIN, PRIORITY_MIN])
    ]
    rounds = 2000
    ran = run_rounds(pool, rounds, batch=batch)
    bound = _bound(len(pool))
    for name, seqs in ran.items():
        gaps = [b - a for a, b in zip([0, *seqs], [*seqs, rounds + 1])]
        assert max(gaps) <= bound, f"{name} waited {max(gaps)} rounds (bound {bound})"
    # And priority matters: the highest ran far more often than the lowest.
    assert len(ran["r0"]) > 5 * len(ran["r6"])


def test_a_stream_of_new_high_priority_requests_cannot_starve_a_low_one() -> None:
    # A top-priority request is always there: each runs 3 steps, and the
    # next one arrives as it leaves. New arrivals start without age points.
    low = R("low", arrival=0, priority=PRIORITY_MIN)
    high, arrivals, first_run = None, 0, None
    for seq in range(1, 1000):
        if high is None:
            arrivals += 1
            high = R(f"h{arrivals}", arrival=arrivals, priority=PRIORITY_MAX, arrival_round=seq - 1)
            steps = 0
        (r,) = pick_batch([low, high], BatchLimits(1), now=seq - 1)
        r.last_scheduled = seq
        if r is low:
            first_run = seq
            break
        steps += 1
        if steps == 3:
            high = None
    assert first_run is not None, "the low-priority request never ran"
    assert first_run <= (PRIORITY_MAX - PRIORITY_MIN + 1) * AGE_ROUNDS + 1
    assert arrivals > 1


# -- the engine passes priority through --------------------------------------------------


class _Sleepy(Synthetic):
    """Steps sleep instead of computing: the loop always keeps up with the producer."""

    def step(self, states: Sequence[Any]) -> list[Any]:
        time.sleep(0.003)
        return super().step(states)


@pytest.mark.asyncio
async def test_the_engine_runs_the_higher_priority_request_first() -> None:
    small = {"shape": [4, 8, 8], "work": 0}
    async with om.Engine(_Sleepy(), device="cpu", max_batch_size=1) as engine:
        # Submitted together, before the producer picks either.
        low = engine.stream({**small, "steps": 60}, request_id="low", policy="latest", priority=-10)
        high = engine.stream({**small, "steps": 20}, request_id="high", policy="latest", priority=10)
        low_steps_when_high_done: list[int] = []
        seen = {"low": 0}

        async def read_low() -> None:
            async with low:
                async for frame in low:
                    seen["low"] = frame.step

        async def read_high() -> None:
            async with high:
                async for frame in high:
                    if frame.final:
                        low_steps_when_high_done.append(seen["low"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_low)
            tg.start_soon(read_high)
    # Round robin would have given "low" ~20 steps by then.
    assert low_steps_when_high_done and low_steps_when_high_done[0] <= 3


@pytest.mark.asyncio
async def test_a_bad_priority_is_a_params_error() -> None:
    async with om.Engine(Synthetic(), device="cpu") as engine:
        for bad in (11, -11, True, 1.5, "1"):
            with pytest.raises(om.ParamsError) as info:
                engine.stream({"steps": 1}, priority=bad)
            assert info.value.field == "priority"
        assert engine.statistics().queued == 0
        assert engine.max_batch_size == 8


def test_a_new_request_runs_next_at_equal_priority_whatever_the_load():
    # 40 running requests at batch size 1 have all waited 8+ rounds: ageing
    # alone would put a new arrival behind every one of them (33 rounds).
    from omni_stream.engine.scheduler import BatchLimits, pick_batch

    class R:
        def __init__(self, arrival, last, priority=0, arrival_round=0):
            self.batch_key, self.arrival, self.last_scheduled = None, arrival, last
            self.priority, self.arrival_round = priority, arrival_round

    now = 100
    running = [R(i, now - 40 + i) for i in range(40)]
    new = R(40, -1, arrival_round=now)
    assert pick_batch([*running, new], BatchLimits(1), now=now) == [new]
    # A new low-priority request still waits behind equal-aged higher ones...
    low = R(41, -1, priority=-1, arrival_round=now)
    assert pick_batch([*running, low], BatchLimits(1), now=now)[0] is not low
    # ...but takes the age of its own level's oldest, so it is not starved by a fresh level.
    old_low = R(42, now - 200, priority=-1)
    assert pick_batch([*running, old_low], BatchLimits(1), now=now) == [old_low]



# -- the policies (issue #22) ------------------------------------------------------------


def run_policy(pool: list[R], rounds: int, limits: BatchLimits, *, first: int = 1) -> list[list[str]]:
    """Schedule ``pool`` for ``rounds`` rounds from round ``first`` under ``limits``, each run
    costing a step; the batches."""
    batches = []
    for seq in range(first, first + rounds):
        live = [r for r in pool if r.remaining > 0]
        if not live:
            break
        batch = pick_batch(live, limits, now=seq - 1)
        for r in batch:
            r.run_streak = r.run_streak + 1 if r.last_scheduled == seq - 1 else 1
            r.last_scheduled = seq
            r.remaining -= 1
        batches.append(names(batch))
    return batches


def test_fcfs_runs_the_earliest_to_its_end_before_a_later_short_one() -> None:
    pool = [R("long", arrival=1, remaining=5), R("short", arrival=2, remaining=1)]
    assert run_policy(pool, 10, BatchLimits(1, "fcfs")) == [["long"]] * 5 + [["short"]]


def test_round_robin_takes_turns() -> None:
    pool = [R("long", arrival=1, remaining=3), R("short", arrival=2, remaining=1)]
    assert run_policy(pool, 10, BatchLimits(1, "round-robin")) == [["long"], ["short"], ["long"], ["long"]]


def test_preemptive_lets_a_short_request_in_within_a_quantum_and_the_long_one_finishes() -> None:
    long = R("long", arrival=1, remaining=12)
    pool = [long]
    batches = run_policy(pool, 3, BatchLimits(1, "preemptive", quantum=4))  # long runs 3 rounds
    pool.append(R("short", arrival=2, remaining=2, arrival_round=3))
    batches += run_policy(pool, 20, BatchLimits(1, "preemptive", quantum=4), first=4)
    # long keeps its place for its 4th round (its quantum), then the short one runs to its end.
    assert batches[:7] == [["long"]] * 4 + [["short"]] * 2 + [["long"]]
    assert sum(b == ["long"] for b in batches) == 12  # nothing lost


def test_preemptive_ages_a_long_request_so_a_stream_of_short_ones_cannot_starve_it() -> None:
    long = R("long", arrival=0, remaining=100, run_streak=0)
    pool = [long]
    ran_long = 0
    for seq in range(1, 400):
        # A new one-step request arrives every round.
        pool.append(R(f"s{seq}", arrival=seq, remaining=1, arrival_round=seq - 1))
        live = [r for r in pool if r.remaining > 0]
        batch = pick_batch(live, BatchLimits(1, "preemptive", quantum=2), now=seq - 1)
        for r in batch:
            r.run_streak = r.run_streak + 1 if r.last_scheduled == seq - 1 else 1
            r.last_scheduled = seq
            r.remaining -= 1
        ran_long += batch[0] is long
    assert ran_long > 0


def test_an_unknown_policy_is_refused_naming_them() -> None:
    with pytest.raises(om.ParamsError) as info:
        BatchLimits(1, "lottery")
    assert info.value.field == "scheduling" and "preemptive" in str(info.value)
    with pytest.raises(om.ParamsError):
        om.Engine(Synthetic(), device="cpu", scheduling="sjf")


@dataclass
class G(R):
    group: Hashable | None = None
    rank: int = 0


@pytest.mark.parametrize("policy", ["round-robin", "fcfs", "preemptive"])
def test_a_groups_highest_rank_takes_the_best_place_its_group_holds(policy: str) -> None:
    """Issue #38: a client's priority-10 request that came after its priority-0 ones runs first
    under every policy, and another client's request keeps the place the policy gave it."""
    pool = [
        G("a0", arrival=1, group="a"),
        G("b0", arrival=2, group="b"),
        G("a1", arrival=3, group="a"),
        G("a-hi", arrival=4, group="a", rank=10),
    ]
    assert names(pick_batch(pool, BatchLimits(1, policy), now=0)) == ["a-hi"]
    # A batch of two: the group's two best places (1st and 3rd) would be a0 and a1; b0 keeps its
    # place (2nd), and the group fills its first place with its highest rank.
    assert names(pick_batch(pool, BatchLimits(2, policy), now=0)) == ["a-hi", "b0"]
    # Another group's rank orders nothing of group a's.
    pool[1].rank = 10
    assert names(pick_batch(pool, BatchLimits(2, policy), now=0)) == ["a-hi", "b0"]
    # Without groups, the policy's order, as before.
    plain = [R("x", arrival=1), R("y", arrival=2)]
    assert names(pick_batch(plain, BatchLimits(1, policy), now=0)) == ["x"]
