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
    "DECIDED",
    "DETAIL",
    "DETAIL_SHARE",
    "FORMING",
    "LONG_STEP",
    "PLACED",
    "RHO",
    "SAMPLERS",
    "SIGMA_MIN",
    "TOP",
    "Posterior",
    "Update",
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


#: ``sigma_max`` as a multiple of ``sqrt(dims)``: where the posterior is
#: still close to its prior for every seed (at 0.5 a seed whose noise
#: leans on one image had begun to choose it in the first frame).
TOP = 1.0


def sigma_max(dims: int) -> float:
    """The largest noise level for images of ``dims`` values.

    Two images ``d`` apart per value are told apart once ``sigma`` falls
    below about ``d * sqrt(dims)``, so a fixed ``sigma_max`` would spend
    fewer early steps on the interesting part the larger the image (the
    reason large-image models shift their schedules). Scaling with
    ``sqrt(dims)`` keeps the choice between components in the first steps
    at every size.
    """
    return TOP * math.sqrt(dims)


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


#: Where a schedule's steps bend, as ``sigma / sqrt(dims)``. Two images
#: ``d`` apart per value are told apart near ``sigma = d sqrt(dims) / 2``,
#: and a plain picture's variants (``images.VARIANTS``) are 0.3 to 0.8
#: apart, its COMPONENTS further: from ``TOP`` down to ``PLACED`` a seed
#: whose noise leans on some images early chooses among them (where the
#: shape sits, how large it is), from ``PLACED`` to ``DECIDED`` every other
#: seed makes its choices. When a seed chooses is random: the README's
#: picture, run with 120 steps from 1.0 down, came within 5% of its final
#: image anywhere from 0.28 down to 0.085 on 20 seeds (at 0.6 on one seed
#: of 200 with 30 steps).
PLACED = 0.32
DECIDED = 0.05
#: The share of the deciding steps above ``PLACED``: with fewer, the seeds
#: that choose early were done a third of the way in (their previews within
#: 5% of the final image for two thirds of the frames); with more, the
#: others chose within two or three frames.
FORMING = 0.7
#: The noise level (per value, whatever the size) where the last detail
#: starts: each image's ``spread`` (0.05 by default) is drawn from about
#: here down, after every choice between images is made.
DETAIL = 1.0
#: The share of the steps that draw the detail: a Karras curve from
#: DETAIL to SIGMA_MIN. 4 of 30 keep as much of the spread as the 9 Karras
#: steps below 0.15 sqrt(dims) did (0.030 of the exact 0.046 at the default
#: spread). Below 17 steps there are 1 or 2, and an image is the chosen one
#: with less of its spread (12 steps: 0.005, where that schedule kept 0.02
#: to 0.03; at 8 it left most images a blend of several).
DETAIL_SHARE = 0.15


def schedule(steps: int, dims: int) -> list[float]:
    """The Mixture's noise levels for ``steps`` steps on images of ``dims`` values: ``steps + 1``, then 0.

    The deciding steps (all but :data:`DETAIL_SHARE` of them) fall
    geometrically, :data:`FORMING` of them from ``sigma_max`` to
    ``PLACED sqrt(dims)``, the rest on to ``DECIDED sqrt(dims)``; then a
    Karras curve from :data:`DETAIL` to ``SIGMA_MIN``. Both ends of the
    deciding part grow with the image, so every size spends the same share
    of its steps choosing the picture. At the README's settings no seed's
    preview is its final picture (within 5%, RMS) in the first 20 frames
    of 30 (100 seeds tried), where some were from frame 17 and others
    snapped in within one step at 22 (issue #34; one Karras curve over the
    whole range had every picture done by the third frame).
    Raises ParamsError for ``steps`` < 1.
    """
    positive_int(steps, "steps")
    root = math.sqrt(dims)
    hi = sigma_max(dims)
    if steps == 1:
        return [hi, 0.0]
    tail = max(1, round(steps * DETAIL_SHARE))
    body = steps - tail
    upper = max(1, round(body * FORMING))
    # Each segment leaves out its lower end: the next one starts there.
    levels = _geometric(hi, PLACED * root, upper) + _geometric(PLACED * root, DECIDED * root, body - upper)
    # DETAIL is per value: below DECIDED sqrt(dims) at every size the model takes (32 pixels: 2.8).
    return levels + karras_sigmas(tail, min(DETAIL, levels[-1] / 2), SIGMA_MIN)


def _geometric(hi: float, lo: float, n: int) -> list[float]:
    """``n`` levels from ``hi`` falling by a constant ratio towards ``lo`` (not reached)."""
    return [hi * (lo / hi) ** (i / n) for i in range(n)]


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


#: dpmpp_2m takes a step more than this many times as long (in log sigma)
#: as the one before at first order. Its second-order step extrapolates the
#: x0 prediction along the line through the last two, ``h / (2 h_last)`` of
#: their difference past the newer: where the schedule leaves its deciding
#: steps for the detail (a step 10 to 30 times as long), that ran far past
#: a prediction still turning as a choice was made, and 16-step images came
#: out a blend of two (0.15 from the nearest image where 0.05 is its spread).
#: Karras curves lengthen their steps by less than 2 at a time.
LONG_STEP = 2.0


def update(sampler: str, sigmas: list[float], i: int, eta: float) -> Update:
    """The coefficients of step ``i`` (0-based), from ``sigmas[i]`` to ``sigmas[i + 1]``.

    ``ddim`` and ``euler_a`` share one rule, the k-diffusion ancestral step
    in VE variables (``X = x / a``): with ``sigma_up = min(sigma_next,
    eta sigma_next sqrt(sigma^2 - sigma_next^2) / sigma)`` and
    ``sigma_down = sqrt(sigma_next^2 - sigma_up^2)``,
    ``X_next = x0 + sigma_down (X - x0) / sigma + sigma_up z``. That is DDIM
    with its ``eta`` exactly; ``eta = 0`` is deterministic DDIM, ``eta = 1``
    is Euler ancestral. ``dpmpp_2m`` is DPM-Solver++(2M) (Lu et al. 2022),
    first order on the first and last steps and on a step more than
    :data:`LONG_STEP` times the one before. Raises ValueError for an
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
        first = Update(cx=an * ratio / a, c0=an * (1.0 - ratio), cp=0.0, cn=0.0)
        if i == 0 or nxt == 0.0:
            return first
        h = math.log(sig / nxt)
        h_last = math.log(sigmas[i - 1] / sig)
        if h > LONG_STEP * h_last:
            return first
        k = 1.0 / (2.0 * (h_last / h))
        return Update(
            cx=an * ratio / a,
            c0=an * (1.0 - ratio) * (1.0 + k),
            cp=-an * (1.0 - ratio) * k,
            cn=0.0,
        )
    raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
