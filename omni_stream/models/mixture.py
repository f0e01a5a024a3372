"""Mixture: a real diffusion sampler over a Gaussian mixture of built-in images.

The data distribution is ``p(x0) = sum_k w_k N(mu_k, spread^2 I)`` over the
images of :mod:`omni_stream.models.images`, with ``w`` uniform over the
components the prompt names. Its posterior mean ``E[x0 | x_t]`` is exact and
closed-form (see :func:`omni_stream.models.samplers.posterior`), so this is a
genuine sampler with an exact denoiser: no training, no weights. Each step's
frame is the current x0 prediction; the last frame is the sample. A prompt
of one colour and one shape (``images.plain``) adds that picture's variants
as components, which its posterior weighs alone (the unconditional model,
for guidance, stays the built-in images).

Bit-identical frames alone or in any batch. Two reductions touch every pixel:
the dot products ``<x, mu_k>`` (over pixels) and the mixture mean
``sum_k r_k mu_k`` (over components). BLAS sums in an order that depends on
the batch shape (gemv vs gemm, blocking, threads), so instead of hoping for
a stable order both are made *exact*: images are multiples of 1/128, ``x`` is
rounded to a multiple of ``2^-q`` and ``r`` to ``2^-36``, and the products are
summed in float64 as integers that stay below ``2^53``, where every order
gives the same answer. Everything else is per-element arithmetic (+ - * /,
round, clamp: correctly rounded wherever it runs) or a softmax over one row,
and the noise comes from a generator seeded by (seed, step) alone. The
rounding only enters the softmax logits, far below the noise they measure.

Memory: the images at one size and plain picture (a *bank*: float32, plus
a float64 copy up to 512 pixels) are built on the producer thread when a
request first needs them, at a peak a little above the bank itself, and
cached (an LRU bounded by ``cache_sizes`` and ``cache_bytes``); ``load``
builds the default size's, which stays. Mixture is an
:class:`omni_stream.model.ModelMemory`: ``request_memory_bytes`` is the
building peak of a bank not cached yet, ``cache_bytes`` and ``trim_cache``
the banks requests left behind.

Several images a request (``num_images``, OpenAI's ``n``): each image is a
row of its own, with its own noise stream (:func:`_image_seed`), the first
the stream a request for one image draws; so image 0 of ``n`` is bit for
bit the picture the same request for one makes, and each image's frames
are the same in any batch. Frames hold them along a leading dimension
(``Frame.image_count``).

Snapshot and restore: a request's state is its ``x_t``, its previous x0
prediction (dpmpp_2m) and its step index; everything else (the bank, the
prompt's weights, the schedule, every later step's noise) follows from its
params and seed, so a restored request goes on bit for bit.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from ..checkpoint import Checkpoint, plain_params
from ..device.heap import trim_heap
from ..errors import CheckpointError, ParamsError
from ..model import StepModel
from ..params import MAX_IMAGES, Param, images_param, positive_int, seed_param
from . import images, samplers

__all__ = ["Mixture"]

#: Guidance at most this (the exactness bound on the mixture mean assumes it).
MAX_GUIDANCE = 20.0
#: The posterior weights are rounded to multiples of 2**-R_BITS.
R_BITS = 36
#: x is clamped to |x| <= 2**X_RANGE_BITS before it is rounded for the dot
#: products (Gaussian noise never gets there; a state beyond it, from extreme
#: guidance, only makes the logits approximate, never the sums inexact).
X_RANGE_BITS = 6
_LEVEL_BITS = 7  # images.LEVELS == 2**7
_EXACT_BITS = 53  # float64 integers are exact up to 2**53
_FLOAT32_BITS = 24  # float32 integers are exact up to 2**24
#: A step works on at most this many values per group of requests (bounds
#: the float64 temporaries at large sizes; grouping never changes a bit).
CHUNK_VALUES = 1 << 23
#: Up to this many values per image the float64 copy of the images is kept;
#: above it (sizes over 512) it is made slice by slice at each step instead.
LEVELS64_MAX_DIMS = 3 * 512 * 512
_SLICE_DIMS = 1 << 16
_FLOAT32 = 4
_FLOAT64 = 8
#: A bank is built this many columns at a time (the float64 chunk buffer).
_BUILD_COLUMNS = 1 << 13
#: Building a bank takes, beyond the bank and its chunk buffer, the drawing
#: of an image: numpy temporaries of about 86 bytes a pixel at their peak
#: (tracemalloc, the gradients; 48 for a plain picture's variants). Measured
#: peak RSS increase of one build in a fresh process (32 to 2048 pixels,
#: with and without plain pictures), over the bank and the chunk buffer: at
#: most 81 bytes a pixel (800 and up, no plain picture; 40-55 with one),
#: and at most 1.2 MiB below 512 pixels. E.g. 512: 276.6 MiB for a 270.0 MiB
#: bank (561.6 for 558.0 with "red circle"), 1024: 440.2 for 360.0 (799.6
#: for 744.0), 2048: 1743.6 for 1440.0 (3139.6 for 2976.0). The estimate
#: (_build_peak_bytes) is the bank, the buffer and these two on top.
BUILD_BYTES_PER_PIXEL = 96
BUILD_BYTES_BASE = 8 << 20
#: The size ``load`` renders ahead of the first request (the ``size`` default).
DEFAULT_SIZE = 256
#: Default bounds of the banks requests leave cached (``load``'s is outside
#: them; the newest always stays). A bank saves what building it costs: at
#: 256 and 512 pixels about a whole 30-step request (measured on two cores:
#: 0.12-0.17 s against 0.16 s of steps at 256, 0.42-0.64 s against 0.52 s
#: at 512). 256 MiB (it was 1 GiB) is a quarter of the server's default
#: max_memory_bytes, held while idle: a colour-and-shape bank at 256 pixels
#: (140 MiB) beside smaller sizes, or a 384-pixel bank (152 MiB); a larger
#: size in repeated use stays as the newest, and two alternating large sizes
#: are rebuilt. The server trims further (``trim_cache``) when its budget is over.
CACHE_SIZES = 4
CACHE_BYTES = 256 << 20
#: ``num_images``' bound unless ``max_images`` says otherwise (the diffusers
#: adapters' too): each image is a row of every step's products.
DEFAULT_MAX_IMAGES = 4

assert images.LEVELS == 2**_LEVEL_BITS
# The mixture-mean bound: |r| sums to at most 1 + 2 * MAX_GUIDANCE, each
# |level| <= 2^7, so |sum_k rq_k level_k| < 2^53.
assert (1 + 2 * MAX_GUIDANCE) * 2 ** (R_BITS + _LEVEL_BITS) < 2**_EXACT_BITS


@dataclass(frozen=True)
class _Bank:
    """The component images at one size, on one device, ready for the exact sums."""

    size: int
    picture: images.PlainPicture | None  # whose VARIANTS follow the COMPONENTS rows, if any
    mu: torch.Tensor  # float32 [K, D]: the images, the component means (multiples of 1/128)
    levels: torch.Tensor | None  # float64 [K, D]: images * 128 (integers); None above LEVELS64_MAX_DIMS
    norms: torch.Tensor  # float64 [K]: sum of levels^2 (exact)
    x_bits: int  # x is rounded to multiples of 2**-x_bits before the dot products

    @property
    def dims(self) -> int:
        return self.mu.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors: the images, their float64 copy when kept, the norms."""
        extra = 0 if self.levels is None else self.levels.nbytes
        return self.mu.nbytes + extra + self.norms.nbytes

    def level_slices(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """(columns, float64 levels [K, n]) covering every column."""
        if self.levels is not None:
            yield slice(None), self.levels
            return
        for lo in range(0, self.dims, _SLICE_DIMS):
            cols = slice(lo, lo + _SLICE_DIMS)
            yield cols, _levels64(self.mu, cols)


def _levels64(mu: torch.Tensor, cols: slice) -> torch.Tensor:
    """float64 ``mu[:, cols] * 128``: integers, exact (a power-of-two scale of float32 values)."""
    return mu[:, cols].to(torch.float64).mul_(images.LEVELS)


def _x_bits(dims: int) -> int:
    # |round(x * 2^q)| <= 2^(q + X_RANGE_BITS), |level| <= 2^7, dims terms:
    # the dot product stays an exact float64 integer while
    # dims * 2^(q + X_RANGE_BITS + 7) <= 2^53. Capped so the rounded values
    # (<= 2^24) are exact in float32, where rounding them is cheaper.
    exact = _EXACT_BITS - X_RANGE_BITS - _LEVEL_BITS - math.ceil(math.log2(dims))
    return min(exact, _FLOAT32_BITS - X_RANGE_BITS)


def _rows(picture: images.PlainPicture | None) -> int:
    return len(images.COMPONENTS) + (0 if picture is None else len(images.VARIANTS))


def _bank_bytes(size: int, picture: images.PlainPicture | None = None) -> int:
    """Bytes of the bank for ``size`` and ``picture``, as ``_Bank.nbytes`` will count them once built."""
    rows, dims = _rows(picture), 3 * size * size
    per_value = _FLOAT32 + (_FLOAT64 if dims <= LEVELS64_MAX_DIMS else 0)
    return rows * dims * per_value + rows * _FLOAT64


def _build_peak_bytes(size: int, picture: images.PlainPicture | None = None) -> int:
    """Memory building that bank takes at its peak: the bank, its chunk buffer, the drawing.

    At or above the measured peak RSS increase (see BUILD_BYTES_PER_PIXEL).
    On an accelerator the device holds the bank and the chunk buffer, and
    the host the images in float32 while they are drawn: both below this.
    """
    rows, dims = _rows(picture), 3 * size * size
    chunk = rows * min(dims, _BUILD_COLUMNS) * _FLOAT64
    return _bank_bytes(size, picture) + chunk + BUILD_BYTES_PER_PIXEL * size * size + BUILD_BYTES_BASE


def _make_bank(size: int, picture: images.PlainPicture | None, device: torch.device) -> _Bank:
    """Draw the images at ``size`` and build their float64 levels and norms on ``device``.

    Nothing twice: the images are drawn straight into the bank's float32
    tensor, and the float64 levels (integers up to 128) are made column chunk
    by column chunk, straight into the kept copy when there is one. The
    chunked norms are the whole-row sums bit for bit: every partial sum is an
    integer below 2^14 * 3 * 2048^2 < 2^38, exact in float64 in any order.
    Raises ParamsError for a size below 1.
    """
    rows, fixed = _rows(picture), len(images.COMPONENTS)
    drawn = torch.empty(rows, 3, size, size, dtype=torch.float32)
    images.render_all(size, out=drawn[:fixed])
    if picture is not None:
        images.render_plain(picture, size, out=drawn[fixed:])
    mu = drawn.view(rows, -1).to(device)  # no copy on the CPU
    del drawn
    dims = mu.shape[1]
    levels = (
        torch.empty(rows, dims, dtype=torch.float64, device=device) if dims <= LEVELS64_MAX_DIMS else None
    )
    norms = torch.zeros(rows, dtype=torch.float64, device=device)
    # One narrow buffer reused for every chunk: a fresh tensor per chunk left
    # freed blocks in glibc's heap (RSS held after the build), and chunks as
    # wide as the step's slices made the buffer as large as the float64 copy
    # itself at sizes up to 147 pixels (peak 1.7x the bank).
    buffer = torch.empty(rows, min(dims, _BUILD_COLUMNS), dtype=torch.float64, device=device)
    for lo in range(0, dims, _BUILD_COLUMNS):
        cols = slice(lo, lo + _BUILD_COLUMNS)
        part = buffer[:, : min(_BUILD_COLUMNS, dims - lo)]
        part.copy_(mu[:, cols]).mul_(images.LEVELS)  # as _levels64, in place
        if levels is not None:
            levels[:, cols] = part
        norms.add_(part.mul_(part).sum(1))
    return _Bank(size=size, picture=picture, mu=mu, levels=levels, norms=norms, x_bits=_x_bits(dims))


_Key: TypeAlias = tuple[int, images.PlainPicture | None, str]


class _BankCache:
    """An LRU of banks keyed by (size, picture, device), bounded in entries and bytes; thread-safe.

    One bank may be pinned (``load``'s): never evicted, outside the bounds
    and :meth:`nbytes`. Of the others, the newest always stays on insertion,
    whatever its size (the request that built it is using it); :meth:`trim`
    may take it. Banks in use by running requests stay alive through their
    states even once evicted here.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        positive_int(max_entries, "cache_sizes")
        if max_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._banks: OrderedDict[_Key, _Bank] = OrderedDict()
        self._pinned: _Key | None = None
        self._bytes = 0  # of the unpinned banks
        # Held only for dictionary work, never while a bank is drawn: the
        # event loop reads and trims the cache while the producer thread builds.
        self._lock = threading.Lock()

    def get(
        self,
        size: int,
        device: torch.device,
        picture: images.PlainPicture | None = None,
        *,
        pin: bool = False,
    ) -> _Bank:
        """The bank, built now if it is not cached; ``pin`` keeps it for good (``load``)."""
        key = (size, picture, str(device))
        with self._lock:
            bank = self._banks.get(key)
            if bank is not None:
                self._banks.move_to_end(key)
                if pin:
                    self._pin(key)
                    self._evict(self.max_entries, self.max_bytes, spare=key)
                return bank
        bank = _make_bank(size, picture, device)  # outside the lock: drawing takes a while
        with self._lock:
            old = self._banks.pop(key, None)  # built twice by two threads: keep the new one
            if old is not None and key != self._pinned:
                self._bytes -= old.nbytes
            self._banks[key] = bank
            if key != self._pinned:
                self._bytes += bank.nbytes
            if pin:
                self._pin(key)
            self._evict(self.max_entries, self.max_bytes, spare=key)
        return bank

    def _pin(self, key: _Key) -> None:
        # Called with the lock held. A previously pinned bank becomes an ordinary entry.
        if key == self._pinned:
            return
        if self._pinned is not None and self._pinned in self._banks:
            self._bytes += self._banks[self._pinned].nbytes
        self._bytes -= self._banks[key].nbytes
        self._pinned = key

    def _evict(self, max_entries: int, max_bytes: int, spare: _Key | None) -> int:
        # Called with the lock held: least recently used first, never the
        # pinned bank or ``spare``. Returns the bytes evicted.
        freed = 0
        for key in list(self._banks):
            if len(self._banks) - (self._pinned is not None) <= max_entries and self._bytes <= max_bytes:
                break
            if key in (self._pinned, spare):
                continue
            bank = self._banks.pop(key)
            self._bytes -= bank.nbytes
            freed += bank.nbytes
        return freed

    def trim(self, keep_bytes: int) -> int:
        """Evict unpinned banks, least recently used first, down to ``keep_bytes``; the bytes evicted."""
        with self._lock:
            return self._evict(len(self._banks), keep_bytes, spare=None)

    def nbytes(self) -> int:
        """Bytes of the unpinned banks."""
        with self._lock:
            return self._bytes

    def holds(self, size: int, picture: images.PlainPicture | None, device: torch.device | None) -> bool:
        """Whether the bank is cached (on any device when ``device`` is None)."""
        with self._lock:
            if device is not None:
                return (size, picture, str(device)) in self._banks
            return any(key[:2] == (size, picture) for key in self._banks)

    def entries(self) -> list[_Key]:
        """(size, picture, device) of the cached banks, least recently used first."""
        with self._lock:
            return list(self._banks)


def _dots(xq: torch.Tensor, bank: _Bank) -> torch.Tensor:
    """``xq @ levels.T`` [B, K] for integer-valued float64 ``xq``: exact."""
    out: torch.Tensor | None = None
    for cols, levels in bank.level_slices():
        part = torch.mm(xq[:, cols], levels.T)
        out = part if out is None else out.add_(part)  # exact integers: any order
    assert out is not None
    return out


def _mix64(seed: int, step: int) -> int:
    """A 64-bit generator seed from (seed, step): splitmix64 of both."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _noise(seed: int, step: int, dims: int) -> torch.Tensor:
    # A fresh CPU generator per (seed, step): the noise is a pure function of
    # them, so neither batch order nor a retried step can shift it.
    gen = torch.Generator(device="cpu").manual_seed(_mix64(seed, step))
    return torch.randn(dims, generator=gen, dtype=torch.float32)


#: Keeps the image streams apart from the step streams _mix64 makes of a seed.
_IMAGE_STREAMS = 0x6A09E667F3BCC909


def _image_seed(seed: int, image: int) -> int:
    """The noise stream of a request's ``image``-th image: the request's own seed for the first
    (so it is the picture a request for one image makes), a splitmix64 of both for the others.

    Not one draw of ``[n, dims]`` values: torch's CPU normals are made 16 at
    a time, and a size not a multiple of 16 redraws its last ones, so the
    first image of such a draw would not be the one-image picture.
    """
    return seed if image == 0 else _mix64(seed ^ _IMAGE_STREAMS, image)


def _mixture_mean(rq: torch.Tensor, bank: _Bank, *, shortcuts: bool) -> torch.Tensor:
    """``sum_k r_k mu_k`` as float32 [B, D], for ``rq = round(r * 2**R_BITS)`` [B, K].

    The float64 product ``rq @ levels`` is exact (every product and partial
    sum is an integer below 2**53), so any way of computing it gives the
    same bits. With ``shortcuts`` (on the CPU) it takes the cheap ways: a row
    whose whole weight is on one component (every row, once the posterior
    has picked one) is that image, copied; other rows leave out the
    components no row weighs. On an accelerator the plain product is cheap,
    and finding those rows would synchronise with the host.
    """
    if shortcuts:
        nonzero = rq.ne(0)
        whole = nonzero.sum(1).eq(1) & rq.amax(1).eq(2.0**R_BITS)
        n_whole = int(whole.sum())
        if n_whole == rq.shape[0]:
            return bank.mu.index_select(0, rq.argmax(1))
        if n_whole:
            out = torch.empty(rq.shape[0], bank.dims, dtype=torch.float32)
            for rows in (whole.nonzero().flatten(), (~whole).nonzero().flatten()):
                out[rows] = _mixture_mean(rq.index_select(0, rows), bank, shortcuts=True)
            return out
        used = nonzero.any(0).nonzero().flatten()
        if used.numel() < rq.shape[1]:
            return _weighted_sum(rq.index_select(1, used), bank, used)
    return _weighted_sum(rq, bank, None)


def _weighted_sum(rq: torch.Tensor, bank: _Bank, used: torch.Tensor | None) -> torch.Tensor:
    scale = 2.0 ** -(R_BITS + _LEVEL_BITS)
    if bank.levels is not None:
        levels = bank.levels if used is None else bank.levels.index_select(0, used)
        return torch.mm(rq, levels).mul_(scale).to(torch.float32)
    out = torch.empty(rq.shape[0], bank.dims, dtype=torch.float32, device=rq.device)
    for cols, levels in bank.level_slices():
        if used is not None:
            levels = levels.index_select(0, used)
        out[:, cols] = torch.mm(rq, levels).mul_(scale)
    return out


@dataclass
class _State:
    params: Mapping[str, Any]  # checked: what a snapshot writes down
    sampler: str
    eta: float
    guidance: float
    spread: float
    sigmas: list[float]
    bank: _Bank
    log_all: torch.Tensor  # float64 [K]: 0 for COMPONENTS (the unconditional model), -inf for variants
    log_w: torch.Tensor  # float64 [K]: 0 for the prompt's components, -inf elsewhere
    #: float32: the VP state x_t, [D] for one image (what a snapshot of one
    #: always held), [n, D] for n (num_images).
    x: torch.Tensor
    seeds: tuple[int, ...]  # each image's noise stream (_image_seed)
    x0_prev: torch.Tensor | None = None  # the previous x0 prediction (dpmpp_2m), shaped as x
    step: int = 0  # steps completed

    @property
    def images(self) -> int:
        return len(self.seeds)


class Mixture(StepModel):
    """Mixture: an exact diffusion sampler over built-in images (shapes, gradients, patterns, glyphs)."""

    name = "mixture"
    #: The CLI and the server preview frames with the plain RGB decoder.
    preview_decoder = "rgb"
    #: 2: the schedule of issue #34. A state saved at step k of the older
    #: schedule sits at another noise level than step k of this one, and
    #: would go on into a picture neither makes.
    snapshot_format = 2
    params: tuple[Param, ...] = (
        Param(
            "prompt",
            "str",
            "",
            "words naming images, e.g. 'red circle', 'stripes'; empty for all of them",
            max_len=200,
        ),
        seed_param(),
        images_param(DEFAULT_MAX_IMAGES),
        Param("steps", "int", 30, "sampling steps (frames)", minimum=1, maximum=10_000),
        Param("size", "int", DEFAULT_SIZE, "image width and height in pixels", minimum=32, maximum=2048),
        Param(
            "sampler", "str", "ddim", "ddim, euler_a (Euler ancestral) or dpmpp_2m", choices=samplers.SAMPLERS
        ),
        Param(
            "eta",
            "float",
            None,
            "ancestral noise fraction (ddim: default 0, euler_a: default 1; not for dpmpp_2m)",
            minimum=0.0,
            maximum=1.0,
        ),
        Param(
            "guidance",
            "float",
            1.0,
            "pull toward the prompt's images vs all of them (0: ignore the prompt, 1: exact, >1: sharper)",
            minimum=0.0,
            maximum=MAX_GUIDANCE,
        ),
        Param(
            "spread", "float", 0.05, "standard deviation of each image component", minimum=0.0, maximum=1.0
        ),
    )

    def __init__(
        self,
        *,
        max_batch_size: int = 64,
        cache_sizes: int = CACHE_SIZES,
        cache_bytes: int = CACHE_BYTES,
        max_images: int = DEFAULT_MAX_IMAGES,
    ) -> None:
        """``cache_sizes`` and ``cache_bytes`` bound the image banks requests built and left (LRU);
        ``max_images`` the images one request may ask for (``num_images``, 1 to 64).

        One size takes 12 bytes per image value up to 512 pixels (the images
        in float32 and float64: 68 MiB at 256, 270 MiB at 512), 4 above it
        (220 MiB at 800); a size with a plain picture (a colour-and-shape
        prompt) caches its 32 variants beside them (140 MiB at 256). The
        bank ``load`` builds for the default size stays outside the bounds.
        Raises ParamsError for a bound below 1 or ``max_images`` above 64
        (ValueError for ``cache_bytes`` below 0).
        """
        positive_int(max_batch_size, "max_batch_size")
        self.max_batch_size = max_batch_size
        self._banks = _BankCache(cache_sizes, cache_bytes)
        self._device: torch.device | None = None  # load's: where the banks are built
        if max_images != DEFAULT_MAX_IMAGES:
            self.set_max_images(max_images)

    def set_max_images(self, max_images: int) -> None:
        """Let a request ask for up to ``max_images`` images (``num_images``), before the engine
        starts (``--max-images``). Raises ParamsError for a count below 1 or above 64."""
        positive_int(max_images, "max_images")
        if max_images > MAX_IMAGES:
            raise ParamsError(
                f"max_images must be at most {MAX_IMAGES}, got {max_images}", field="max_images"
            )
        self.params = tuple(images_param(max_images) if p.name == "num_images" else p for p in self.params)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Check params (see :data:`params`); raises ParamsError naming the field."""
        out = super().validate(params)
        images.select(out["prompt"])  # raises ParamsError(field="prompt")
        if out["eta"] is not None and out["sampler"] == "dpmpp_2m":
            raise ParamsError("mixture param 'eta' applies to ddim and euler_a, not dpmpp_2m", field="eta")
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        return int(params["steps"])

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        # Prompts, seeds, samplers, step counts and step indices are all per
        # request inside one call; the images must match to stack: the size,
        # and the plain picture whose variants a colour-and-shape prompt adds.
        picture = images.plain(params["prompt"])
        return ("mixture", int(params["size"]), None if picture is None else picture.name)

    def load(self, device: torch.device) -> None:
        self._device = device
        self._banks.get(DEFAULT_SIZE, device, pin=True)

    # -- memory (omni_stream.model.ModelMemory) --------------------------------

    def request_memory_bytes(self, params: Mapping[str, Any]) -> int:
        """Bytes a request with these checked params adds on the model's device beyond its frames.

        The bank of its size and plain picture, at its building peak, when
        that bank is not cached now; 0 when it is. An estimate at admission:
        a bank trimmed or evicted before the request starts is built again.
        A bank still being built counts as not cached. Cheap (no drawing),
        thread-safe; raises KeyError for params without ``size`` or ``prompt``.
        """
        size = int(params["size"])
        picture = images.plain(params["prompt"])
        if size == DEFAULT_SIZE and picture is None:
            # ``load``'s bank: there (or being built by ``load``) for the
            # model's whole life, whatever requests come; a request admitted
            # while the engine still loads adds nothing by asking for it.
            return 0
        if self._banks.holds(size, picture, self._device):
            return 0
        return _build_peak_bytes(size, picture)

    def cache_bytes(self) -> int:
        """Bytes of the banks requests built and the cache keeps (not ``load``'s); thread-safe."""
        return self._banks.nbytes()

    def trim_cache(self, keep_bytes: int = 0) -> int:
        """Evict banks, least recently used first, until :meth:`cache_bytes` <= ``keep_bytes``.

        Never ``load``'s bank; a running request keeps its bank alive through
        its state. Returns the bytes the cache no longer holds. Thread-safe.
        Raises ValueError for ``keep_bytes`` below 0.
        """
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        freed = self._banks.trim(keep_bytes)
        if freed:
            trim_heap()  # what glibc keeps of freed banks, back to the system
        return freed

    def needs_prepare(self, params: Mapping[str, Any]) -> bool:
        """Whether the request's bank is to be built (model.py, Preparing); cheap, thread-safe."""
        return self.request_memory_bytes(params) > 0

    def prepare(self, params: Mapping[str, Any], device: torch.device) -> None:
        """Build and cache the request's bank (a worker thread, before ``start``; model.py, Preparing).

        Rendering a bank takes 0.1 s at 256 px, 1.3-1.6 s at 800, 2-3 s at
        1024: on the producer thread every other request's steps would wait
        that long. Then ``start`` finds it cached.
        """
        self._banks.get(int(params["size"]), device, images.plain(params["prompt"]))
        if device.type == "cuda":
            # Built on this thread's stream; the producer uses it on its own.
            torch.cuda.synchronize(device)
        # The build's temporaries are freed; give what glibc keeps of them back
        # (tens of MiB the server's memory bound cannot see).
        trim_heap()

    def start(self, params: Mapping[str, Any], device: torch.device) -> _State:
        """Draw the initial noise for one request; raises ParamsError for bad params."""
        chosen = images.select(params["prompt"])
        picture = images.plain(params["prompt"])
        bank = self._banks.get(int(params["size"]), device, picture)
        fixed = len(images.COMPONENTS)
        rows = bank.mu.shape[0]
        log_all = torch.full((rows,), -math.inf, dtype=torch.float64)
        log_all[:fixed] = 0.0
        log_w = torch.full((rows,), -math.inf, dtype=torch.float64)
        # A colour and a shape: its variants are the prompt's images; else
        # the COMPONENTS its words pick.
        log_w[list(range(fixed, rows)) if picture is not None else list(chosen)] = 0.0
        sampler = params["sampler"]
        eta = params["eta"]
        seed = int(params["seed"])
        seeds = tuple(_image_seed(seed, i) for i in range(int(params.get("num_images", 1))))
        # The VP state at sigma_max is (almost) N(0, I); one image's is [D], as its snapshots hold.
        x = torch.stack([_noise(s, 0, bank.dims) for s in seeds])
        return _State(
            params=params,
            sampler=sampler,
            eta=samplers.default_eta(sampler) if eta is None else float(eta),
            guidance=float(params["guidance"]),
            spread=float(params["spread"]),
            sigmas=samplers.schedule(int(params["steps"]), bank.dims),
            bank=bank,
            log_all=log_all.to(device),
            log_w=log_w.to(device),
            x=(x[0] if len(seeds) == 1 else x).to(device),
            seeds=seeds,
        )

    def step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        """Advance every state one step; return each one's x0 prediction: [3, S, S], or
        [n, 3, S, S] for a request of n images."""
        if not states:
            return []
        bank = states[0].bank
        for s in states:
            if s.bank is not bank:
                raise ValueError("Mixture.step: states of different sizes or pictures cannot share a step")
            if s.step >= len(s.sigmas) - 1:
                raise ValueError(f"Mixture.step: request already finished its {s.step} steps")
        # Groups of at most this many image rows (a request's images stay together).
        most = max(1, CHUNK_VALUES // bank.dims)
        groups: list[list[_State]] = [[]]
        rows = 0
        for s in states:
            if groups[-1] and rows + s.images > most:
                groups.append([])
                rows = 0
            groups[-1].append(s)
            rows += s.images
        results: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for group in groups:
            results.extend(self._advance(group, bank))
        # Commit only once every group has computed: a raising step leaves
        # every state as it was.
        frames = []
        side = bank.size
        for s, (x_next, x0, frame) in zip(states, results, strict=True):
            s.x = x_next
            s.x0_prev = x0
            s.step += 1
            frames.append(frame.view(3, side, side) if s.images == 1 else frame.view(s.images, 3, side, side))
        return frames

    def _advance(
        self, states: Sequence[_State], bank: _Bank
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Compute (x_next, x0, frame) per state without touching the states.

        Each image of each state is one row; every operation is per row or an
        exact sum, so a row's values do not depend on the others in the call.
        """
        device = bank.mu.device
        dims = bank.dims
        scale_dot = 2.0 ** -(bank.x_bits + _LEVEL_BITS)
        scale_norm = 2.0 ** -(2 * _LEVEL_BITS)
        per_state = []
        for s in states:
            post = samplers.posterior(s.sigmas[s.step], s.spread)
            upd = samplers.update(s.sampler, s.sigmas, s.step, s.eta)
            per_state.append(
                (
                    post.dot * scale_dot,
                    post.norm * scale_norm,
                    s.guidance,
                    post.c_x,
                    post.c_mu,
                    upd.cx,
                    upd.c0,
                    upd.cp,
                    upd.cn,
                )
            )
        counts = [s.images for s in states]
        bounds = [sum(counts[:i]) for i in range(len(states) + 1)]  # state i's rows: bounds[i]:bounds[i + 1]
        total = bounds[-1]
        rows = [row for row, n in zip(per_state, counts, strict=True) for _ in range(n)]
        c64 = torch.tensor(rows, dtype=torch.float64).to(device)
        c32 = c64[:, 3:].to(torch.float32)
        dot, norm, guide = c64[:, 0:1], c64[:, 1:2], c64[:, 2:3]
        c_x, c_mu, cx, c0, cp, cn = (c32[:, i : i + 1] for i in range(6))

        # In-place ops below work on this step's own temporaries only; a
        # state's tensors are never written (a raising step changes nothing).
        x = torch.cat([s.x.view(-1, dims) for s in states])  # [R, D] float32, a fresh tensor
        # <x, mu_k>, exactly: x on a 2^-q grid, images on a 2^-7 grid, float64 integer sums.
        lim = 2.0**X_RANGE_BITS
        xq = x.clamp(-lim, lim).mul_(2.0**bank.x_bits).round_().to(torch.float64)
        dots = _dots(xq, bank)  # [R, K]
        del xq
        logits = dots.mul_(dot).sub_(bank.norms * norm)
        log_all = torch.stack([s.log_all for s, n in zip(states, counts, strict=True) for _ in range(n)])
        log_w = torch.stack([s.log_w for s, n in zip(states, counts, strict=True) for _ in range(n)])
        # Softmax subtracts each row's max: the log-sum-exp form, stable for any logits.
        weights = torch.softmax(torch.cat([logits + log_all, logits + log_w]), dim=-1)
        r_all, r_prompt = weights[:total], weights[total:]
        # Guidance mixes the two posteriors' means; the mean is linear in r.
        rq = (r_all + guide * (r_prompt - r_all)).mul_(2.0**R_BITS).round_()
        # E[x0 | x_t] (guided) = c_mu * mu_bar + c_x * x.
        x0 = _mixture_mean(rq, bank, shortcuts=device.type == "cpu").mul_(c_mu).add_(x * c_x)
        frames = x0.clamp(-1.0, 1.0)  # a fresh tensor each step, never written again

        # x_next = cx * x + c0 * x0 + cp * x0_prev + cn * z. A term whose
        # coefficient is 0 in every row is left out. Including it in a row
        # could only turn a -0.0 into +0.0, and cx * x + c0 * x0 is never
        # -0.0: c0 >= 0, and x0 is never -0.0 because mu_bar is not (the
        # images hold no -0.0, and a zero sum with a positive weight is +0.0).
        x_next = x.mul_(cx).add_(x0 * c0)
        if any(row[7] != 0.0 for row in per_state):
            prev = torch.cat(
                [
                    x0[bounds[i] : bounds[i + 1]] if s.x0_prev is None else s.x0_prev.view(-1, dims)
                    for i, s in enumerate(states)
                ]
            )
            x_next.add_(prev.mul_(cp))
            del prev
        if any(row[8] != 0.0 for row in per_state):
            z = torch.zeros(total, dims, dtype=torch.float32)
            for i, s in enumerate(states):
                if per_state[i][8] != 0.0:
                    for j, seed in enumerate(s.seeds):
                        z[bounds[i] + j] = _noise(seed, s.step + 1, dims)
            x_next.add_(z.to(device).mul_(cn))
            del z
        out = []
        for i, s in enumerate(states):
            lo, hi = bounds[i], bounds[i + 1]
            if s.images == 1:  # [D], as the state of one image has always been
                out.append((x_next[lo], x0[lo], frames[lo]))
            else:
                out.append((x_next[lo:hi], x0[lo:hi], frames[lo:hi]))
        return out

    # -- snapshot and restore (omni_stream.model) --------------------------------

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        return True

    def snapshot(self, state: _State) -> Checkpoint:
        """``x_t``, the previous x0 and the step index; raises CheckpointError for a closed state."""
        if state.x is None:
            raise CheckpointError(f"{self.name}: a closed request has no state to snapshot")
        tensors = {"x": state.x.detach().to("cpu", copy=True)}  # copies: the state goes on stepping
        if state.x0_prev is not None:
            tensors["x0_prev"] = state.x0_prev.detach().to("cpu", copy=True)
        return Checkpoint(
            model=self.snapshot_kind,
            format=self.snapshot_format,
            step=state.step,
            total=self.total_steps(state.params),
            params=plain_params(state.params),
            tensors=tensors,
        )

    def restore(self, checkpoint: Checkpoint, device: torch.device) -> _State:
        """The state ``checkpoint`` holds, on ``device``; raises CheckpointError (see StepModel.restore)."""
        params = self.restored_params(checkpoint)
        # start rebuilds what the params and seed decide (the bank, the weights,
        # the schedule); its fresh noise is then replaced by the saved x_t.
        state = self.start(params, device)
        for name in checkpoint.tensors:
            if name not in ("x", "x0_prev"):
                raise CheckpointError(f"{self.name}: the checkpoint holds an unknown tensor {name!r}")
        x = checkpoint.tensors.get("x")
        prev = checkpoint.tensors.get("x0_prev")
        for name, value in (("x", x), ("x0_prev", prev)):
            if value is not None and (value.shape != state.x.shape or value.dtype != state.x.dtype):
                raise CheckpointError(
                    f"{self.name}: the checkpoint's {name} {tuple(value.shape)} {value.dtype} does not "
                    f"fit {tuple(state.x.shape)} {state.x.dtype}"
                )
        if x is None:
            raise CheckpointError(f"{self.name}: the checkpoint holds no 'x' tensor")
        state.x = x.to(device, copy=True)
        state.x0_prev = None if prev is None else prev.to(device, copy=True)
        state.step = checkpoint.step
        return state

    def close(self, state: _State) -> None:
        # Drop the tensors now rather than whenever the engine lets go of the state.
        state.x = state.x0_prev = None  # type: ignore[assignment]

    def cached_sizes(self) -> list[int]:
        """Sizes whose images are rendered and cached, least recently used first."""
        return [size for size, _, _ in self._banks.entries()]
