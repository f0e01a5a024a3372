"""The Mixture model's schedule and sampler coefficients (pure scalar math)."""

from __future__ import annotations

import itertools
import math

import pytest

from omni_stream.models import samplers
from omni_stream.models.samplers import karras_sigmas, posterior, update


def test_karras_schedule_shape() -> None:
    sig = karras_sigmas(10, 80.0)
    assert len(sig) == 11
    assert sig[0] == pytest.approx(80.0) and sig[-2] == pytest.approx(samplers.SIGMA_MIN)
    assert sig[-1] == 0.0
    assert all(a > b for a, b in itertools.pairwise(sig))
    assert karras_sigmas(1, 5.0) == [5.0, 0.0]


@pytest.mark.parametrize("steps, hi, lo", [(0, 10.0, 0.1), (5, 1.0, 2.0), (5, 1.0, 0.0)])
def test_karras_schedule_rejects_bad_input(steps: int, hi: float, lo: float) -> None:
    with pytest.raises(ValueError):
        karras_sigmas(steps, hi, lo)


def test_sigma_max_grows_with_the_image() -> None:
    assert samplers.sigma_max(4 * 3 * 64 * 64) == pytest.approx(2 * samplers.sigma_max(3 * 64 * 64))


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 12, 30, 100])
@pytest.mark.parametrize("size", [32, 256, 2048])
def test_schedule_falls_from_sigma_max_to_sigma_min_then_zero(steps: int, size: int) -> None:
    dims = 3 * size * size
    sig = samplers.schedule(steps, dims)
    assert len(sig) == steps + 1 and sig[0] == samplers.sigma_max(dims) and sig[-1] == 0.0
    assert all(a > b for a, b in itertools.pairwise(sig))
    if steps > 1:
        # The detail's one step (below 10 steps) ends at DETAIL: the image is the chosen
        # images' mean there, with none of their spread drawn.
        last = samplers.SIGMA_MIN if steps >= 10 else samplers.DETAIL
        assert sig[-2] == pytest.approx(last)


@pytest.mark.parametrize("size", [32, 256, 1024])
def test_schedule_spends_two_thirds_of_the_readmes_steps_before_every_seed_chooses(size: int) -> None:
    # At every size the same steps fall in each part (issue #34: 21 of 30 above
    # 0.15 sqrt(dims), where no seed had chosen, then the disc in two frames).
    root = math.sqrt(3 * size * size)
    sig = samplers.schedule(30, 3 * size * size)
    placing = [s for s in sig if s >= samplers.PLACED * root * 0.999]
    choosing = [s for s in sig if samplers.DECIDED * root <= s < samplers.PLACED * root * 0.999]
    detail = [s for s in sig if 0 < s <= samplers.DETAIL]
    assert (len(placing), len(choosing), len(detail)) == (19, 7, 4)
    ratios = [a / b for a, b in itertools.pairwise(placing + choosing)]
    assert max(ratios) < 1.3  # no step decides much more than its neighbours


def test_dpmpp_2m_takes_a_step_much_longer_than_the_one_before_at_first_order() -> None:
    # Its line through the last two predictions ran h / (2 h_last) = 10 of their
    # difference past the newer, into a blend of two images.
    sig = [10.0, 9.0, 1.0, 0.5, 0.0]
    jump = update("dpmpp_2m", sig, 1, 0.0)  # h = log 9 after h_last = log(10 / 9)
    assert jump == update("dpmpp_2m", [9.0, 1.0, 0.0], 0, 0.0)  # the first-order step
    after = update("dpmpp_2m", sig, 2, 0.0)  # h = log 2 after log 9: second order
    assert after.cp != 0.0


@pytest.mark.parametrize("sigma, spread", [(0.01, 0.05), (1.0, 0.0), (3.0, 0.3), (500.0, 1.0)])
def test_posterior_coefficients(sigma: float, spread: float) -> None:
    p = posterior(sigma, spread)
    a = 1 / math.sqrt(1 + sigma * sigma)
    s = sigma * a
    v = a * a * spread * spread + s * s
    # E[x0|x] = c_x x + c_mu mu for one component: c_x + c_mu a = 1 (unbiased at x = a mu).
    assert p.c_x * a + p.c_mu == pytest.approx(1.0)
    assert p.c_mu == pytest.approx(s * s / v)
    # -|x - a mu|^2 / 2v = (a <x, mu> - a^2 |mu|^2 / 2) / v + const.
    assert p.dot == pytest.approx(a / v) and p.norm == pytest.approx(a * a / (2 * v))
    with pytest.raises(ValueError):
        posterior(0.0, spread)


@pytest.mark.parametrize("sampler", samplers.SAMPLERS)
def test_last_step_lands_on_the_prediction(sampler: str) -> None:
    sig = karras_sigmas(5, 50.0)
    u = update(sampler, sig, 4, samplers.default_eta(sampler))
    assert (u.cx, u.c0, u.cp, u.cn) == (0.0, 1.0, 0.0, 0.0)


def test_ddim_is_deterministic_and_euler_ancestral_adds_the_right_noise() -> None:
    sig = karras_sigmas(8, 50.0)
    i = 3
    s, n = sig[i], sig[i + 1]
    a, an = 1 / math.sqrt(1 + s * s), 1 / math.sqrt(1 + n * n)
    ddim = update("ddim", sig, i, 0.0)
    assert ddim.cn == 0.0
    assert ddim.cx == pytest.approx(an * (n / s) / a)  # X' = x0 + sigma' (X - x0) / sigma
    anc = update("euler_a", sig, i, 1.0)
    up = n * math.sqrt(s * s - n * n) / s
    down = math.sqrt(n * n - up * up)
    assert anc.cn == pytest.approx(an * up)
    assert anc.cx == pytest.approx(an * (down / s) / a)
    # The marginal variance is preserved: down^2 + up^2 = sigma'^2.
    assert (anc.cn / an) ** 2 + (anc.cx * a / an * s) ** 2 == pytest.approx(n * n)


def test_dpmpp_2m_uses_the_previous_prediction_after_the_first_step() -> None:
    sig = karras_sigmas(8, 50.0)
    first, later = update("dpmpp_2m", sig, 0, 0.0), update("dpmpp_2m", sig, 3, 0.0)
    assert first.cp == 0.0
    assert later.cp < 0.0 < later.c0
    # The two predictions' weights sum to the first-order weight.
    n, s = sig[4], sig[3]
    an = 1 / math.sqrt(1 + n * n)
    assert later.c0 + later.cp == pytest.approx(an * (1 - n / s))


def test_update_rejects_bad_input() -> None:
    sig = karras_sigmas(3, 10.0)
    with pytest.raises(ValueError, match="unknown sampler"):
        update("plms", sig, 0, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        update("ddim", sig, 3, 0.0)
