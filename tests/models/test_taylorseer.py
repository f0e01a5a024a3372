"""TaylorSeer's per-request state against diffusers' own, piece by piece (no model):
the schedule of computed and forecast steps, the series' update and its forecast."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.hooks.hooks import CacheContext, StateManager  # noqa: E402
from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState as Theirs  # noqa: E402

from omni_stream.models.diffusers.taylorseer import FACTOR_DTYPE, TaylorSeerState  # noqa: E402


@pytest.mark.parametrize("interval, warmup", [(5, 3), (2, 1), (1, 0), (3, 0), (4, 6)])
def test_the_schedule_is_diffusers_and_never_forecasts_from_nothing(interval: int, warmup: int) -> None:
    manager = StateManager(Theirs)
    manager.set_context(CacheContext("cond"))
    hook = TaylorSeerCacheHook(interval, warmup, torch.bfloat16, manager)
    ours = TaylorSeerState(interval, warmup, order=1)
    for step in range(30):
        theirs, _ = hook._measure_should_compute()
        ours.begin()
        if step == 0:  # diffusers raises forecasting with nothing computed; ours computes
            assert ours.computing
        else:
            assert ours.computing == theirs, step
        ours.finish()
    assert ours.computed + ours.cached == 30


@pytest.mark.parametrize("order", [0, 1, 2])
def test_the_series_and_its_forecast_are_diffusers_bit_for_bit(order: int) -> None:
    theirs = Theirs(taylor_factors_dtype=FACTOR_DTYPE, max_order=order)
    ours = TaylorSeerState(interval=3, warmup=2, order=order)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        outputs = (torch.randn(2, 5, 4, generator=g), torch.randn(2, 3, 4, generator=g))
        theirs.current_step = step
        ours.begin()
        if ours.computing:
            theirs.update(outputs)
            ours.update(0, list(outputs))
        else:
            assert all(torch.equal(a, b) for a, b in zip(ours.forecast(0), theirs.predict(), strict=True)), step
        ours.finish()
    assert ours.cached > 0


def test_a_failed_call_leaves_the_state_as_it_was() -> None:
    import dataclasses

    state = TaylorSeerState(interval=2, warmup=1, order=1)
    for _ in range(3):
        state.begin()
        state.update(0, [torch.ones(1, 2)])
        state.finish()
    before = dataclasses.replace(state)
    kept = dict(vars(state))  # what loop.Saved keeps: a shallow copy
    state.begin()
    state.update(0, [torch.zeros(1, 2)])  # (then the call raises: no finish)
    vars(state).update(kept)
    assert state == before and torch.equal(state.series[0][0][0], torch.ones(1, 2, dtype=FACTOR_DTYPE))
