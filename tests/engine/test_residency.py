"""residency.py: which loaded model gives way, when, and the swap budget; pure, no clock of its own."""

from __future__ import annotations

import math

import pytest

from omni_stream.engine.residency import MIN_RESIDENCY_ENV, Residency, Resident
from omni_stream.errors import ParamsError


def rules(scheduling: str = "preemptive", *, quantum: float = 2.0, swaps: int = 6) -> Residency:
    return Residency(min_residency_s=quantum, max_swaps_per_min=swaps, scheduling=scheduling)


def test_an_unused_model_goes_once_its_quantum_is_over() -> None:
    idle = {"a": Resident(loaded_at=0.0, last_used=1.0, in_use=False)}
    assert rules().victim(idle, [(5, 2.5)], now=2.5) == (None, 0.5)  # 1.5 s since its last request
    assert rules().victim(idle, [(5, 2.5)], now=3.0) == ("a", 0.0)


def test_a_model_in_use_keeps_its_quantum_then_the_policy_decides() -> None:
    busy = {"a": Resident(loaded_at=0.0, last_used=0.0, in_use=True, running=(50,))}
    assert rules().victim(busy, [(20, 1.0)], now=1.0) == (None, 1.0)
    # Past its quantum, preemptive: its 50 steps left give way to a 20-step request.
    assert rules().victim(busy, [(20, 1.0)], now=2.0) == ("a", 0.0)
    # A longer waiting request waits, aged: at most ten quanta.
    short = {"a": Resident(loaded_at=0.0, last_used=0.0, in_use=True, running=(5,))}
    assert rules().victim(short, [(20, 1.0)], now=3.0) == (None, 18.0)
    assert rules().victim(short, [(20, 1.0)], now=21.0) == ("a", 0.0)
    assert rules("round-robin").victim(short, [(20, 1.0)], now=3.0) == ("a", 0.0)
    assert not rules("fcfs").preempts and rules("round-robin").preempts


def test_the_least_recently_used_gives_way_first_and_none_is_none() -> None:
    loaded = {
        "a": Resident(loaded_at=0.0, last_used=5.0, in_use=False),
        "b": Resident(loaded_at=0.0, last_used=4.0, in_use=False),
    }
    assert rules().victim(loaded, [], now=10.0) == ("b", 0.0)
    assert rules().victim({}, [], now=10.0) == (None, math.inf)


def test_the_swap_budget_holds_for_a_minute() -> None:
    budget = rules(swaps=2)
    assert budget.swap_wait(0.0) == 0.0
    budget.swapped(0.0)
    budget.swapped(10.0)
    assert budget.swaps == 2 and budget.swap_wait(30.0) == 30.0
    assert budget.swap_wait(60.0) == 0.0  # the first switch is a minute old


def test_bad_settings_name_their_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ParamsError, match=MIN_RESIDENCY_ENV) as info:
        Residency(min_residency_s=-1.0)
    assert info.value.field == "min_residency_s"
    with pytest.raises(ParamsError):
        Residency(max_swaps_per_min=0)
    monkeypatch.setenv(MIN_RESIDENCY_ENV, "0.25")
    assert Residency().min_residency_s == 0.25
