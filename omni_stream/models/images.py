"""The built-in component images of the Mixture model, drawn at any size.

Each :class:`ComponentImage` is a small procedural drawing (shapes,
gradients, patterns, glyphs) rendered from signed distances, so edges are
anti-aliased at every size and nothing is loaded from disk. Drawing uses
numpy, not torch: single-threaded elementwise math that runs at full speed
on any thread (torch's OpenMP pool slows down badly when a second thread
uses it, and the model renders on the engine's producer thread). Every
image is tagged with words; :func:`select` maps a text prompt to the
components it names.

Rendered images are quantised to 257 levels (multiples of 1/128 in
[-1, 1]): the Mixture model relies on that to make its reductions exact.

Prompt rules (:func:`select`): words are lower-cased and split on anything
that is not a letter; the fillers ``a an and the with of on in`` are
skipped; a plural or a listed synonym maps to its tag (``circles`` ->
``circle``, ``striped`` -> ``stripes``). Every remaining word must be a
known tag, else ParamsError. The components tagged with *all* the words
are chosen; when none has all of them, those with the most of them are
(``red square`` gives the red things and the squares when no red square
exists). An empty prompt chooses every component.

A prompt of one colour and one shape and nothing else (:func:`plain`)
draws that instead, on a plain background: :func:`render_plain`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..errors import ParamsError
from ..params import positive_int

__all__ = [
    "COMPONENTS",
    "LEVELS",
    "PLAIN_COLOURS",
    "PLAIN_SHAPES",
    "VARIANTS",
    "VOCABULARY",
    "ComponentImage",
    "PlainPicture",
    "plain",
    "render",
    "render_all",
    "render_plain",
    "select",
]

#: Rendered values are multiples of 1 / LEVELS in [-1, 1].
LEVELS = 128

Color = tuple[float, float, float]
#: Float [S, S] planes and [3, S, S] images: float32 at run time, but numpy's
#: stubs promote float32 with a Python float to float64, so any float here.
Array = npt.NDArray[np.floating[Any]]

# sRGB in [0, 1].
RED: Color = (0.86, 0.13, 0.15)
ORANGE: Color = (0.98, 0.55, 0.10)
YELLOW: Color = (0.99, 0.84, 0.15)
GREEN: Color = (0.20, 0.70, 0.30)
LIME: Color = (0.65, 0.90, 0.20)
CYAN: Color = (0.15, 0.80, 0.90)
BLUE: Color = (0.15, 0.35, 0.85)
NAVY: Color = (0.05, 0.08, 0.30)
PURPLE: Color = (0.50, 0.20, 0.70)
PINK: Color = (0.97, 0.45, 0.70)
WHITE: Color = (0.97, 0.97, 0.95)
CREAM: Color = (0.98, 0.94, 0.82)
BLACK: Color = (0.06, 0.06, 0.08)
RAINBOW: tuple[Color, ...] = (RED, ORANGE, YELLOW, GREEN, CYAN, BLUE, PURPLE)


class _Canvas:
    """Pixel-centre coordinates in [-1, 1] (y down) and the pixel width.

    ``shift`` and ``scale`` move and grow the drawing: a point drawn at
    ``(x, y)`` lands at ``(x * scale + dx, y * scale + dy)``, edges still
    one pixel wide.
    """

    def __init__(self, size: int, shift: tuple[float, float] = (0.0, 0.0), scale: float = 1.0) -> None:
        self.size = size
        self.px = 2.0 / size / scale
        centres = (np.arange(size, dtype=np.float32) + 0.5) * np.float32(2.0 / size) - 1.0
        xs = ((centres - np.float32(shift[0])) / np.float32(scale)).astype(np.float32)
        ys = ((centres - np.float32(shift[1])) / np.float32(scale)).astype(np.float32)
        self.y = np.broadcast_to(ys[:, None], (size, size))
        self.x = np.broadcast_to(xs[None, :], (size, size))

    def fill(self, color: Color) -> Array:
        image: Array = np.broadcast_to(_rgb(color), (3, self.size, self.size)).copy()
        return image

    def cover(self, distance: Array) -> Array:
        """Anti-aliased coverage of the region where ``distance`` < 0."""
        coverage: Array = np.clip(0.5 - distance / self.px, 0.0, 1.0)
        return coverage


def _rgb(color: Color) -> Array:
    return np.array(color, dtype=np.float32).reshape(3, 1, 1)


def _paint(img: Array, coverage: Array, color: Color) -> Array:
    col = _rgb(color)
    return img + (col - img) * coverage


def _blend(a: Color, b: Color, t: Array) -> Array:
    """Per-pixel mix of two colours; ``t`` in [0, 1], shape [S, S]."""
    ca, cb = _rgb(a), _rgb(b)
    return ca + (cb - ca) * np.clip(t, 0.0, 1.0)


def _gradient(colors: Sequence[Color], t: Array) -> Array:
    """Piecewise-linear colour ramp through ``colors`` at ``t`` in [0, 1]."""
    pal = np.array(colors, dtype=np.float32)  # [N, 3]
    pos = np.clip(t, 0.0, 1.0) * (len(colors) - 1)
    lo = np.minimum(np.floor(pos), len(colors) - 2).astype(np.int64)
    frac = (pos - lo)[None]
    a: Array = pal[lo].transpose(2, 0, 1)
    b: Array = pal[lo + 1].transpose(2, 0, 1)
    return a + (b - a) * frac


def _band_weight(c: _Canvas, u: Array, per_unit: float) -> tuple[Array, Array]:
    """Band index ``m`` of ``u`` (canvas units) and the anti-aliasing weight of band m.

    Band ``m`` covers ``u * per_unit`` in [m - 0.5, m + 0.5). A pixel within
    half a pixel of the edge with band m - 1 gets weight < 1; the rest of
    its colour comes from band m - 1.
    """
    v = u * per_unit
    m = np.round(v)
    # Distance from the lower edge (v = m - 0.5), in canvas units.
    d_lower = (v - m + 0.5) / per_unit
    return m.astype(np.int64), np.clip(0.5 + d_lower / c.px, 0.0, 1.0)


def _bands(c: _Canvas, u: Array, per_unit: float, colors: Sequence[Color], *, wrap: bool = True) -> Array:
    """Bands of ``colors`` along ``u``; ``wrap`` cycles them, else the end colours extend."""
    idx, w = _band_weight(c, u, per_unit)
    n = len(colors)
    prev = idx - 1
    if wrap:
        idx, prev = idx % n, prev % n
    else:
        idx, prev = np.clip(idx, 0, n - 1), np.clip(prev, 0, n - 1)
    pal = np.array(colors, dtype=np.float32)
    a: Array = pal[prev].transpose(2, 0, 1)
    b: Array = pal[idx].transpose(2, 0, 1)
    return a + (b - a) * w[None]


def _odd_bands(c: _Canvas, u: Array, per_unit: float) -> Array:
    """Anti-aliased coverage [S, S] of the odd-numbered bands along ``u``."""
    idx, w = _band_weight(c, u, per_unit)
    odd = (idx % 2).astype(np.float32)
    return odd * w + (1 - odd) * (1 - w)


def _circle(c: _Canvas, cx: float, cy: float, r: float) -> Array:
    return np.sqrt((c.x - cx) ** 2 + (c.y - cy) ** 2) - r


def _rotate(c: _Canvas, cx: float, cy: float, angle: float) -> tuple[Array, Array]:
    cos, sin = math.cos(angle), math.sin(angle)
    dx, dy = c.x - cx, c.y - cy
    return dx * cos + dy * sin, -dx * sin + dy * cos


def _box(c: _Canvas, cx: float, cy: float, hw: float, hh: float, angle: float = 0.0) -> Array:
    px, py = _rotate(c, cx, cy, angle)
    qx, qy = np.abs(px) - hw, np.abs(py) - hh
    outside: Array = np.sqrt(np.maximum(qx, 0) ** 2 + np.maximum(qy, 0) ** 2)
    return outside + np.minimum(np.maximum(qx, qy), 0)


def _segment(c: _Canvas, ax: float, ay: float, bx: float, by: float) -> Array:
    px, py = c.x - ax, c.y - ay
    ex, ey = bx - ax, by - ay
    h = np.clip((px * ex + py * ey) / (ex * ex + ey * ey), 0.0, 1.0)
    return np.sqrt((px - ex * h) ** 2 + (py - ey * h) ** 2)


def _strokes(c: _Canvas, segments: Sequence[tuple[float, float, float, float]], width: float) -> Array:
    d: Array = np.min(np.stack([_segment(c, *seg) for seg in segments]), axis=0)
    return d - width / 2


def _polygon(c: _Canvas, points: Sequence[tuple[float, float]]) -> Array:
    """Signed distance to a simple polygon (negative inside)."""
    n = len(points)
    vx, vy = points[0]
    d = (c.x - vx) ** 2 + (c.y - vy) ** 2
    sign = np.ones_like(c.x)
    for i in range(n):
        ax, ay = points[i]
        bx, by = points[i - 1]
        ex, ey = bx - ax, by - ay
        wx, wy = c.x - ax, c.y - ay
        h = np.clip((wx * ex + wy * ey) / (ex * ex + ey * ey), 0.0, 1.0)
        d = np.minimum(d, (wx - ex * h) ** 2 + (wy - ey * h) ** 2)
        # Winding test (even-odd), as in Inigo Quilez's sdPolygon.
        c1 = c.y >= ay
        c2 = c.y < by
        c3 = ex * wy > ey * wx
        flip = (c1 & c2 & c3) | (~c1 & ~c2 & ~c3)
        sign = np.where(flip, -sign, sign)
    return sign * np.sqrt(d)


def _regular(
    n: int,
    r: float,
    *,
    inner: float | None = None,
    phase: float = -math.pi / 2,
    cx: float = 0.0,
    cy: float = 0.0,
) -> list[tuple[float, float]]:
    """Vertices of a regular polygon, or a star when ``inner`` is given."""
    pts = []
    count = n * 2 if inner is not None else n
    for i in range(count):
        rad = r if inner is None or i % 2 == 0 else inner
        a = phase + 2 * math.pi * i / count
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


# ---- the drawings --------------------------------------------------------


def _red_circle(c: _Canvas) -> Array:
    img = _gradient((NAVY, BLUE), (c.y + 1) / 2)
    return _paint(img, c.cover(_circle(c, 0, 0, 0.55)), RED)


def _blue_square(c: _Canvas) -> Array:
    img = c.fill(ORANGE)
    return _paint(img, c.cover(_box(c, 0, 0, 0.5, 0.5)), BLUE)


def _green_triangle(c: _Canvas) -> Array:
    img = c.fill(CREAM)
    return _paint(img, c.cover(_polygon(c, _regular(3, 0.7, cy=0.12))), GREEN)


def _yellow_star(c: _Canvas) -> Array:
    img = c.fill(PURPLE)
    return _paint(img, c.cover(_polygon(c, _regular(5, 0.75, inner=0.32, cy=0.05))), YELLOW)


def _rainbow_stripes(c: _Canvas) -> Array:
    return _bands(c, (c.y + 1) / 2 - 1 / 14, 7.0, RAINBOW, wrap=False)


def _vertical_stripes(c: _Canvas) -> Array:
    return _bands(c, c.x, 4.0, (BLACK, WHITE))


def _candy_stripes(c: _Canvas) -> Array:
    return _bands(c, (c.x + c.y) / math.sqrt(2), 5.0, (RED, WHITE))


def _sunset_gradient(c: _Canvas) -> Array:
    return _gradient((PURPLE, PINK, ORANGE, YELLOW), (c.y + 1) / 2)


def _sky_gradient(c: _Canvas) -> Array:
    return _gradient((BLUE, CYAN, WHITE), (c.y + 1) / 2)


def _radial_gradient(c: _Canvas) -> Array:
    r = np.sqrt(c.x**2 + c.y**2) / math.sqrt(2)
    return _gradient((YELLOW, ORANGE, RED, NAVY), r)


def _lime_gradient(c: _Canvas) -> Array:
    return _gradient((GREEN, LIME, CYAN), (c.x + c.y + 2) / 4)


def _colour_wheel(c: _Canvas) -> Array:
    hue = (np.arctan2(c.y, c.x) / (2 * math.pi)) % 1.0
    rgb: Array = np.stack(
        [
            np.clip(np.abs(hue * 6 - 3) - 1, 0, 1),
            np.clip(2 - np.abs(hue * 6 - 2), 0, 1),
            np.clip(2 - np.abs(hue * 6 - 4), 0, 1),
        ]
    )
    r: Array = np.minimum(np.sqrt(c.x**2 + c.y**2), 1.0)[None]
    return 1.0 + (rgb - 1.0) * r  # white centre, saturated rim


def _checkerboard(c: _Canvas) -> Array:
    ox, oy = _odd_bands(c, c.x, 4.0), _odd_bands(c, c.y, 4.0)
    return _blend(WHITE, BLACK, ox * (1 - oy) + oy * (1 - ox))


def _polka_dots(c: _Canvas) -> Array:
    n = 3.0
    lx = (c.x * n - np.round(c.x * n)) / n
    ly = (c.y * n - np.round(c.y * n)) / n
    d = np.sqrt(lx**2 + ly**2) - 0.11
    return _paint(c.fill(WHITE), c.cover(d), PINK)


def _target(c: _Canvas) -> Array:
    r = np.sqrt(c.x**2 + c.y**2)
    return _bands(c, r, 6.0, (RED, WHITE))


def _grid(c: _Canvas) -> Array:
    n = 4.0
    dx = np.abs(c.x * n - np.round(c.x * n)) / n
    dy = np.abs(c.y * n - np.round(c.y * n)) / n
    d = np.minimum(dx, dy) - 0.02
    return _paint(c.fill(BLACK), c.cover(d), CYAN)


def _waves(c: _Canvas) -> Array:
    u = c.y + 0.12 * np.sin(c.x * 2.5 * math.pi)
    return _bands(c, u, 3.5, (NAVY, BLUE, CYAN, WHITE, CYAN, BLUE))


def _letter_h(c: _Canvas) -> Array:
    d = _strokes(c, [(-0.4, -0.6, -0.4, 0.6), (0.4, -0.6, 0.4, 0.6), (-0.4, 0.0, 0.4, 0.0)], 0.2)
    return _paint(c.fill(RED), c.cover(d), WHITE)


def _letter_e(c: _Canvas) -> Array:
    d = _strokes(
        c,
        [
            (-0.35, -0.6, -0.35, 0.6),
            (-0.35, -0.6, 0.4, -0.6),
            (-0.35, 0.0, 0.25, 0.0),
            (-0.35, 0.6, 0.4, 0.6),
        ],
        0.2,
    )
    return _paint(c.fill(YELLOW), c.cover(d), BLACK)


def _letter_z(c: _Canvas) -> Array:
    d = _strokes(c, [(-0.45, -0.6, 0.45, -0.6), (0.45, -0.6, -0.45, 0.6), (-0.45, 0.6, 0.45, 0.6)], 0.2)
    return _paint(c.fill(PURPLE), c.cover(d), CYAN)


def _swiss_cross(c: _Canvas) -> Array:
    d = np.minimum(_box(c, 0, 0, 0.5, 0.15), _box(c, 0, 0, 0.15, 0.5))
    return _paint(c.fill(RED), c.cover(d), WHITE)


def _diamond(c: _Canvas) -> Array:
    img = _gradient((NAVY, BLUE), (c.x + 1) / 2)
    return _paint(img, c.cover(_box(c, 0, 0, 0.5, 0.5, math.pi / 4)), ORANGE)


def _crescent_moon(c: _Canvas) -> Array:
    d = np.maximum(_circle(c, 0, 0, 0.6), -_circle(c, 0.3, -0.15, 0.5))
    return _paint(c.fill(NAVY), c.cover(d), YELLOW)


def _smiley(c: _Canvas) -> Array:
    img = _paint(c.fill(CYAN), c.cover(_circle(c, 0, 0, 0.75)), YELLOW)
    eyes = np.minimum(_circle(c, -0.27, -0.22, 0.1), _circle(c, 0.27, -0.22, 0.1))
    ring = np.abs(np.sqrt(c.x**2 + c.y**2) - 0.45) - 0.05
    mouth = np.maximum(ring, 0.12 - c.y)
    return _paint(img, c.cover(np.minimum(eyes, mouth)), BLACK)


def _hexagon(c: _Canvas) -> Array:
    return _paint(c.fill(BLACK), c.cover(_polygon(c, _regular(6, 0.7, phase=0.0))), GREEN)


def _sun(c: _Canvas) -> Array:
    img = _gradient((CYAN, BLUE), (c.y + 1) / 2)
    rays = _polygon(c, _regular(12, 0.8, inner=0.45))
    img = _paint(img, c.cover(rays), ORANGE)
    return _paint(img, c.cover(_circle(c, 0, 0, 0.42)), YELLOW)


def _heart(c: _Canvas) -> Array:
    s = 0.42
    d = np.minimum(
        _box(c, 0, 0.12, s / math.sqrt(2) * 1.0, s / math.sqrt(2) * 1.0, math.pi / 4),
        np.minimum(_circle(c, -0.21, -0.1, 0.3), _circle(c, 0.21, -0.1, 0.3)),
    )
    return _paint(c.fill(PINK), c.cover(d), RED)


def _tricolour(c: _Canvas) -> Array:
    return _bands(c, (c.x + 1) / 2 - 1 / 6, 3.0, (BLUE, WHITE, RED), wrap=False)


def _nested_squares(c: _Canvas) -> Array:
    u = np.maximum(np.abs(c.x), np.abs(c.y))
    return _bands(c, u, 5.0, (PURPLE, YELLOW))


def _spiral(c: _Canvas) -> Array:
    r = np.sqrt(c.x**2 + c.y**2)
    theta = np.arctan2(c.y, c.x) / (2 * math.pi)
    # Two bands per turn, so the jump of one turn at the branch cut is seamless.
    u = 2 * (r * 3.0 - theta)
    # _bands measures in canvas units; one band of u spans 1/6 of a unit radially.
    return _bands(c, u / 6.0, 6.0, (PURPLE, WHITE))


@dataclass(frozen=True)
class ComponentImage:
    """One built-in image: a name, its tags and how to draw it."""

    name: str
    tags: frozenset[str]
    draw: Callable[[_Canvas], Array]


def _c(name: str, tags: str, draw: Callable[[_Canvas], Array]) -> ComponentImage:
    return ComponentImage(name, frozenset(tags.split()), draw)


#: The built-in images, in a fixed order (the Mixture model's component index).
COMPONENTS: tuple[ComponentImage, ...] = (
    _c("red circle", "circle red blue", _red_circle),
    _c("blue square", "square blue orange", _blue_square),
    _c("green triangle", "triangle green white", _green_triangle),
    _c("yellow star", "star yellow purple", _yellow_star),
    _c("rainbow stripes", "stripes horizontal rainbow", _rainbow_stripes),
    _c("vertical stripes", "stripes vertical black white", _vertical_stripes),
    _c("candy stripes", "stripes diagonal red white", _candy_stripes),
    _c("sunset gradient", "gradient sunset purple pink orange yellow", _sunset_gradient),
    _c("sky gradient", "gradient sky blue cyan white", _sky_gradient),
    _c("radial gradient", "gradient radial yellow orange red", _radial_gradient),
    _c("lime gradient", "gradient diagonal green cyan", _lime_gradient),
    _c("colour wheel", "gradient rainbow wheel circle", _colour_wheel),
    _c("checkerboard", "checkerboard black white", _checkerboard),
    _c("polka dots", "dots pink white", _polka_dots),
    _c("target", "rings target circle red white", _target),
    _c("grid", "grid cyan black", _grid),
    _c("waves", "waves blue cyan", _waves),
    _c("letter H", "glyph letter white red", _letter_h),
    _c("letter E", "glyph letter black yellow", _letter_e),
    _c("letter Z", "glyph letter cyan purple", _letter_z),
    _c("swiss cross", "cross red white", _swiss_cross),
    _c("diamond", "diamond orange blue", _diamond),
    _c("crescent moon", "moon night yellow blue", _crescent_moon),
    _c("smiley", "smiley face circle yellow cyan", _smiley),
    _c("hexagon", "hexagon green black", _hexagon),
    _c("sun", "sun circle yellow orange blue", _sun),
    _c("heart", "heart red pink", _heart),
    _c("tricolour flag", "flag stripes vertical blue white red", _tricolour),
    _c("nested squares", "square squares purple yellow", _nested_squares),
    _c("spiral", "spiral purple white", _spiral),
)

#: Every tag, sorted: the words a prompt may use (besides fillers and synonyms).
VOCABULARY: tuple[str, ...] = tuple(sorted(set().union(*(c.tags for c in COMPONENTS))))

_FILLERS = frozenset(["a", "an", "and", "the", "with", "of", "on", "in"])
_SYNONYMS = {
    "stripe": "stripes",
    "striped": "stripes",
    "stripy": "stripes",
    "dot": "dots",
    "dotted": "dots",
    "polka": "dots",
    "spotted": "dots",
    "ring": "rings",
    "checker": "checkerboard",
    "checkered": "checkerboard",
    "chessboard": "checkerboard",
    "wave": "waves",
    "wavy": "waves",
    "colour": "rainbow",
    "color": "rainbow",
    "colourful": "rainbow",
    "colorful": "rainbow",
    "violet": "purple",
    "magenta": "pink",
    "teal": "cyan",
    "round": "circle",
    "letters": "letter",
    "glyphs": "glyph",
    "smile": "smiley",
    "stars": "star",
}
_WORD = re.compile(r"[a-z]+")


def render(component: ComponentImage, size: int) -> torch.Tensor:
    """Draw one image: float32 [3, size, size], multiples of 1/LEVELS in [-1, 1].

    Raises ParamsError for a size below 1.
    """
    positive_int(size, "size", what="image size")
    return torch.from_numpy(_levels(component.draw(_Canvas(size))))


def _levels(img: Array) -> npt.NDArray[np.float32]:
    # sRGB [0, 1] -> [-1, 1], then onto the level grid; "+ 0.0" turns the
    # -0.0 that rounding leaves into +0.0.
    levels = np.clip(np.round((np.clip(img, 0.0, 1.0) * 2 - 1) * LEVELS), -LEVELS, LEVELS)
    out: npt.NDArray[np.float32] = (levels / LEVELS + 0.0).astype(np.float32)
    return out


def render_all(size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every component at ``size``: float32 [len(COMPONENTS), 3, size, size].

    Drawn into ``out`` when given (a contiguous float32 CPU tensor of that
    shape, returned), else into a new tensor. Raises ParamsError for a size
    below 1, ValueError for a wrong ``out``.
    """
    positive_int(size, "size", what="image size")
    target = _destination(out, len(COMPONENTS), size)
    for i, component in enumerate(COMPONENTS):
        target[i] = _levels(component.draw(_Canvas(size)))
    return out if out is not None else torch.from_numpy(target)


def _destination(out: torch.Tensor | None, count: int, size: int) -> npt.NDArray[np.float32]:
    # The caller's tensor, seen as numpy: each image is written straight into
    # its row, with no list of images stacked (a second full copy) after.
    shape = (count, 3, size, size)
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (
        tuple(out.shape) != shape
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous float32 CPU tensor of shape {list(shape)}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    target: npt.NDArray[np.float32] = out.numpy()
    return target


# ---- a colour and a shape -------------------------------------------------
#
# A prompt that names one colour and one shape ("red circle", "a blue
# square", "green stripes") draws that, on a plain background: a family of
# VARIANTS of the one picture, each moved and sized a little differently, so
# that the sampler's posterior has something left to decide at every noise
# level (where the shape sits, how large it is), as a real model's has.

#: The colours a prompt may name for a plain picture, by tag.
PLAIN_COLOURS: dict[str, Color] = {
    "red": RED,
    "orange": ORANGE,
    "yellow": YELLOW,
    "green": GREEN,
    "cyan": CYAN,
    "blue": BLUE,
    "purple": PURPLE,
    "pink": PINK,
    "white": WHITE,
    "black": BLACK,
}


def _star(c: _Canvas) -> Array:
    return _polygon(c, _regular(5, 0.75, inner=0.32, cy=0.05))


def _heart_shape(c: _Canvas) -> Array:
    s = 0.42 / math.sqrt(2)
    return np.minimum(
        _box(c, 0, 0.12, s, s, math.pi / 4),
        np.minimum(_circle(c, -0.21, -0.1, 0.3), _circle(c, 0.21, -0.1, 0.3)),
    )


def _dots(c: _Canvas) -> Array:
    n = 3.0
    lx = (c.x * n - np.round(c.x * n)) / n
    ly = (c.y * n - np.round(c.y * n)) / n
    return c.cover(np.sqrt(lx**2 + ly**2) - 0.11)


#: The shapes a prompt may name for a plain picture: coverage [S, S] in [0, 1].
PLAIN_SHAPES: dict[str, Callable[[_Canvas], Array]] = {
    "circle": lambda c: c.cover(_circle(c, 0, 0, 0.55)),
    "square": lambda c: c.cover(_box(c, 0, 0, 0.5, 0.5)),
    "triangle": lambda c: c.cover(_polygon(c, _regular(3, 0.7, cy=0.12))),
    "star": lambda c: c.cover(_star(c)),
    "heart": lambda c: c.cover(_heart_shape(c)),
    "hexagon": lambda c: c.cover(_polygon(c, _regular(6, 0.6, phase=0.0))),
    "diamond": lambda c: c.cover(_box(c, 0, 0, 0.45, 0.45, math.pi / 4)),
    "cross": lambda c: c.cover(np.minimum(_box(c, 0, 0, 0.5, 0.15), _box(c, 0, 0, 0.15, 0.5))),
    "stripes": lambda c: _odd_bands(c, c.x, 4.0),
    "rings": lambda c: _odd_bands(c, np.sqrt(c.x**2 + c.y**2), 6.0),
    "dots": _dots,
}

#: How each variant of a plain picture is moved (dx, dy) and sized: offsets
#: at two scales, so that where the shape sits is decided coarse to fine.
VARIANTS: tuple[tuple[float, float, float], ...] = tuple(
    (dx, dy, scale)
    for scale in (0.85, 1.15)
    for dx in (-0.2, -0.07, 0.07, 0.2)
    for dy in (-0.2, -0.07, 0.07, 0.2)
)


@dataclass(frozen=True)
class PlainPicture:
    """A shape in a colour on a plain background (see :func:`plain`)."""

    shape: str
    colour: str

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


def plain(prompt: str) -> PlainPicture | None:
    """The colour and shape ``prompt`` names, when it names exactly one of each and nothing else.

    ``"red circle"``, ``"a blue square"``, ``"green striped"``; None for any
    other prompt (those choose among :data:`COMPONENTS`, see :func:`select`).
    Raises nothing: :func:`select` checks the words.
    """
    words = [w for w in map(_normalise, _WORD.findall(prompt.lower())) if w is not None]
    colours = [w for w in words if w in PLAIN_COLOURS]
    shapes = [w for w in words if w in PLAIN_SHAPES]
    if len(set(colours)) == 1 and len(set(shapes)) == 1 and len(colours) + len(shapes) == len(words):
        return PlainPicture(shapes[0], colours[0])
    return None


def render_plain(picture: PlainPicture, size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every variant of ``picture``: float32 [len(VARIANTS), 3, size, size], on the level grid.

    The background is white (black for a white shape). Drawn into ``out``
    when given (as :func:`render_all`). Raises ParamsError for a size below
    1, ValueError for a wrong ``out``.
    """
    positive_int(size, "size", what="image size")
    target = _destination(out, len(VARIANTS), size)
    colour = PLAIN_COLOURS[picture.colour]
    background = BLACK if picture.colour == "white" else WHITE
    for i, (dx, dy, scale) in enumerate(VARIANTS):
        c = _Canvas(size, (dx, dy), scale)
        target[i] = _levels(_paint(c.fill(background), PLAIN_SHAPES[picture.shape](c), colour))
    return out if out is not None else torch.from_numpy(target)


def _normalise(word: str) -> str | None:
    if word in _FILLERS:
        return None
    if word in _SYNONYMS:
        return _SYNONYMS[word]
    if word not in VOCABULARY and word.endswith("s") and word[:-1] in VOCABULARY:
        return word[:-1]
    return word


@functools.lru_cache(maxsize=1024)
def select(prompt: str) -> tuple[int, ...]:
    """Indices into COMPONENTS of the images ``prompt`` names (see the module docstring).

    Raises ParamsError (field ``prompt``) naming any unknown word and listing
    the known ones.
    """
    words = []
    for raw in _WORD.findall(prompt.lower()):
        word = _normalise(raw)
        if word is not None and word not in words:
            words.append(word)
    unknown = [w for w in words if w not in VOCABULARY]
    if unknown:
        raise ParamsError(
            f"mixture param 'prompt': unknown word(s) {', '.join(map(repr, unknown))}; "
            f"known words: {', '.join(VOCABULARY)}",
            field="prompt",
        )
    if not words:
        if _WORD.search(prompt.lower()):
            # Only fillers ("a the"): that names nothing, which is an error, not "everything".
            raise ParamsError(
                f"mixture param 'prompt': {prompt!r} names no image; known words: {', '.join(VOCABULARY)}",
                field="prompt",
            )
        return tuple(range(len(COMPONENTS)))
    hits = [sum(w in c.tags for w in words) for c in COMPONENTS]
    best = max(hits)
    return tuple(i for i, h in enumerate(hits) if h == best)
