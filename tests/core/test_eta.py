"""The time a running request has left (core/eta.py): from its own recent steps (issue #38)."""

from __future__ import annotations

from omni_stream.core.eta import WINDOW, StepRate


def _run(rate: StepRate, t: float, steps: range, step_s: float) -> float:
    for step in steps:
        t += step_s
        rate.observe(t, step)
    return t


def test_a_wait_in_the_queue_and_a_slow_first_step_are_not_step_time() -> None:
    # Issue #38: admitted at 0, 3 s in the queue, a 1 s setup, then 0.1 s steps: at step 7 of
    # 40 the old estimate (time since admission over steps done) said 17.3 s for 3.3 s left.
    rate = StepRate()
    rate.start(3.0, 0)
    rate.observe(4.1, 1)
    assert abs(rate.eta(1, 40) - 1.1 * 39) < 1e-9  # the first interval is all it has
    _run(rate, 4.1, range(2, 8), 0.1)
    assert abs(rate.eta(7, 40) - 3.3) < 1e-9


def test_it_follows_a_change_of_pace_within_a_window_and_skips_a_pause() -> None:
    rate = StepRate()
    rate.start(0.0, 0)
    t = _run(rate, 0.0, range(1, 11), 0.1)
    # Batched beside others from here: 0.3 s a step. Within WINDOW steps it says so.
    t = _run(rate, t, range(11, 11 + WINDOW), 0.3)
    assert abs(rate.eta(10 + WINDOW, 50) - 0.3 * (40 - WINDOW)) < 1e-9
    # Paused 60 s, then resumed: the pause is no step's time.
    rate.gap()
    rate.observe(t + 60.0, 10 + WINDOW)  # (the frame it was paused after, seen again)
    _run(rate, t + 60.0, range(11 + WINDOW, 12 + WINDOW), 0.3)
    assert abs(rate.eta(11 + WINDOW, 50) - 0.3 * (39 - WINDOW)) < 1e-9


def test_within_thirty_percent_from_a_quarter_of_the_steps_on() -> None:
    """Steps whose time jitters (±20 %) after a wait and a slow first step: from a quarter of
    the steps on the estimate is within 30 % of the time really left."""
    import random

    draw = random.Random(7)
    total = 40
    times = [0.2 * (1 + draw.uniform(-0.2, 0.2)) for _ in range(total)]
    rate = StepRate()
    rate.start(5.0, 0)
    t = 5.0 + 1.0  # a slow first step
    estimates = {}
    for step in range(1, total + 1):
        t += times[step - 1]
        rate.observe(t, step)
        estimates[step] = rate.eta(step, total)
    for step in range(total // 4, total - 1):
        left = sum(times[step:])
        assert abs(estimates[step] - left) <= 0.3 * left, (step, estimates[step], left)
    assert rate.eta(total, total) == 0
