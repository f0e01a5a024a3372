"""Noise schedule and sampler update rules of the Mixture model (pure scalar math).

The state is kept in variance-preserving (VP) form, ``x = a x0 + s eps``
with ``a = 1 / sqrt(1 + sigma^2)`` and ``s = sigma a``, where ``sigma`` is
the variance-exploding (VE, k-diffusion) noise level. Every sampler's step
is then an affine combination, per request::

    x_next = cx * x + c0 * x0_hat + cp * x0_prev + cn * z,   z ~ N(0, I)

so requests on different samplers, step counts and step indices advance in
one vectorised call with per-request coefficients. The functions here
compute those coefficients; :mod:`omni_stream.models.mixture` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..params import positive_int

__all__ = [
    "RHO",
    "SAMPLERS",
    "SIGMA_MIN",
    "Posterior",
    "Update",
    "FORMING",
    "SPLIT",
    "default_eta",
    "karras_sigmas",
    "posterior",
    "schedule",
    "sigma_max",
    "update",
]

#: Sampler names: DDIM (``eta`` 0 by default), Euler ancestral, DPM-Solver++(2M).
SAMPLERS = ("ddim", "euler_a", "dpmpp_2m")
#: Smallest nonzero noise level of every schedule (as in EDM).
SIGMA_MIN = 0.002
#: Karras et al.'s schedule exponent.
RHO = 7.0


def sigma_max(dims: int) -> float:
    """The largest noise level for images of ``dims`` values.

    Two images ``d`` apart per value are told apart once ``sigma`` falls
    below about ``d * sqrt(dims)``, so a fixed ``sigma_max`` would spend
    fewer early steps on the interesting part the larger the image (the
    reason large-image models shift their schedules). Scaling with
    ``sqrt(dims)`` keeps the choice between components in the first steps
    at every size.
    """
    return 0.5 * math.sqrt(dims)


def karras_sigmas(steps: int, sig_max: float, sig_min: float = SIGMA_MIN, rho: float = RHO) -> list[float]:
    """``steps + 1`` noise levels from ``sig_max`` down to ``sig_min``, then 0.

    Raises ParamsError for ``steps`` < 1, ValueError for a bad range.
    """
    positive_int(steps, "steps")
    if not 0 < sig_min < sig_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got {sig_min}, {sig_max}")
    if steps == 1:
        return [sig_max, 0.0]
    hi, lo = sig_max ** (1 / rho), sig_min ** (1 / rho)
    sig = [(hi + i / (steps - 1) * (lo - hi)) ** rho for i in range(steps)]
    return sig + [0.0]


#: Where a schedule splits (as a fraction of ``sqrt(dims)``, see
#: :func:`schedule`): two images ``d`` apart per value are told apart near
#: ``sigma = d sqrt(dims) / 2``, and the variants of a plain picture
#: (``images.VARIANTS``) are about 0.2 to 0.5 apart: from here down they
#: are being told apart, above it the picture is a blend of them.
SPLIT = 0.15
#: The fraction of a schedule's steps above the split.
FORMING = 0.7


def schedule(steps: int, dims: int) -> list[float]:
    """The Mixture's noise levels for ``steps`` steps on images of ``dims`` values: ``steps + 1``, then 0.

    Two Karras segments: :data:`FORMING` of the steps from ``sigma_max``
    down to ``SPLIT * sqrt(dims)``, where the posterior decides what the
    picture is and where its parts sit (the previews show it forming), the
    rest from there to ``SIGMA_MIN``, where only the fine per-value detail
    is left. One Karras curve over the whole range spends two thirds of its
    steps below the split: a 30-step preview that is done by its third frame.
    Raises ParamsError for ``steps`` < 1.
    """
    positive_int(steps, "steps")
    hi = sigma_max(dims)
    if steps == 1:
        return [hi, 0.0]
    split = SPLIT * math.sqrt(dims)
    upper = min(steps - 1, max(1, round(steps * FORMING)))
    # upper levels above the split, which starts the lower segment.
    top = karras_sigmas(upper + 1, hi, split)[:-2]
    return top + karras_sigmas(steps - upper, split, SIGMA_MIN)


def default_eta(sampler: str) -> float:
    """The ancestral-noise fraction a sampler uses when ``eta`` is not given."""
    return 1.0 if sampler == "euler_a" else 0.0


def _vp(sigma: float) -> tuple[float, float]:
    a = 1.0 / math.sqrt(1.0 + sigma * sigma)
    return a, sigma * a


@dataclass(frozen=True, slots=True)
class Posterior:
    """Coefficients of the exact posterior at one noise level (VP state ``x``).

    For components ``N(mu_k, spread^2 I)`` with weights ``w_k``::

        logit_k = dot * <x, mu_k> - norm * |mu_k|^2 + log w_k
        E[x0 | x] = c_x * x + c_mu * sum_k softmax(logit)_k mu_k
    """

    dot: float
    norm: float
    c_x: float
    c_mu: float


def posterior(sigma: float, spread: float) -> Posterior:
    """The posterior coefficients at VE noise level ``sigma`` (> 0).

    With ``v = a^2 spread^2 + s^2`` the variance of ``x`` given a component,
    ``log p(x | k) = -|x - a mu_k|^2 / 2v + const``; the ``|x|^2`` term is the
    same for every k and cancels in the softmax. Per component,
    ``E[x0 | x, k] = mu_k + (a spread^2 / v)(x - a mu_k)``.
    Raises ValueError for ``sigma`` <= 0 (the posterior is not needed there).
    """
    if not sigma > 0:
        raise ValueError(f"the posterior needs sigma > 0, got {sigma}")
    a, s = _vp(sigma)
    v = a * a * spread * spread + s * s
    return Posterior(dot=a / v, norm=a * a / (2 * v), c_x=a * spread * spread / v, c_mu=s * s / v)


@dataclass(frozen=True, slots=True)
class Update:
    """``x_next = cx * x + c0 * x0_hat + cp * x0_prev + cn * z`` (VP)."""

    cx: float
    c0: float
    cp: float
    cn: float


def update(sampler: str, sigmas: list[float], i: int, eta: float) -> Update:
    """The coefficients of step ``i`` (0-based), from ``sigmas[i]`` to ``sigmas[i + 1]``.

    ``ddim`` and ``euler_a`` share one rule, the k-diffusion ancestral step
    in VE variables (``X = x / a``): with ``sigma_up = min(sigma_next,
    eta sigma_next sqrt(sigma^2 - sigma_next^2) / sigma)`` and
    ``sigma_down = sqrt(sigma_next^2 - sigma_up^2)``,
    ``X_next = x0 + sigma_down (X - x0) / sigma + sigma_up z``. That is DDIM
    with its ``eta`` exactly; ``eta = 0`` is deterministic DDIM, ``eta = 1``
    is Euler ancestral. ``dpmpp_2m`` is DPM-Solver++(2M) (Lu et al. 2022),
    first order on the first and last steps. Raises ValueError for an
    unknown sampler or step index.
    """
    if not 0 <= i < len(sigmas) - 1:
        raise ValueError(f"step index {i} out of range for {len(sigmas) - 1} steps")
    sig, nxt = sigmas[i], sigmas[i + 1]
    a, _ = _vp(sig)
    an, _ = _vp(nxt)
    if sampler in ("ddim", "euler_a"):
        up = min(nxt, eta * nxt * math.sqrt(max(sig * sig - nxt * nxt, 0.0)) / sig)
        down = math.sqrt(max(nxt * nxt - up * up, 0.0))
        ratio = down / sig
        return Update(cx=an * ratio / a, c0=an * (1.0 - ratio), cp=0.0, cn=an * up)
    if sampler == "dpmpp_2m":
        ratio = nxt / sig  # exp(-h) with h = log(sigma / sigma_next)
        if i == 0 or nxt == 0.0:
            return Update(cx=an * ratio / a, c0=an * (1.0 - ratio), cp=0.0, cn=0.0)
        h = math.log(sig / nxt)
        h_last = math.log(sigmas[i - 1] / sig)
        k = 1.0 / (2.0 * (h_last / h))
        return Update(
            cx=an * ratio / a,
            c0=an * (1.0 - ratio) * (1.0 + k),
            cp=-an * (1.0 - ratio) * k,
            cn=0.0,
        )
    raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
