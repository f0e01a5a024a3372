"""Step caching per request inside a batched transformer call (issue #35): the ``cache`` param,
each request's state, and the wrappers a native loop's denoiser call runs under.

Three methods skip work a step would repeat, each with its state on the
request (it pauses, snapshots and resumes with the request) and its own
decisions inside a batched call:

- ``fbcache``, First-Block Cache (:mod:`.first_block`): a step whose first
  block's residual barely moved reuses the other blocks' output;
- ``teacache``, TeaCache (:mod:`.teacache`): a step whose first block's
  modulated input barely moved, added up since the last computed step,
  reuses the whole block stack's output (Flux only: its fitted polynomial);
- ``taylorseer``, TaylorSeer (:mod:`.taylorseer`): on a fixed schedule the
  attention modules' outputs are forecast from a Taylor series instead of
  computed.

The first two work at block level (:class:`~.block_cache.BlockCache`), the
third inside the blocks (:class:`~.taylorseer.AttentionCache`); requests of
every method, and requests without one, share one call (:class:`StepCache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import torch

from ...params import Param
from .block_cache import BlockCache
from .first_block import DEFAULT_THRESHOLD, FirstBlockState
from .taylorseer import DEFAULTS as TAYLOR, FACTOR_DTYPE, AttentionCache, TaylorSeerState
from .teacache import DEFAULT_REL_L1, TeaCacheState

__all__ = [
    "METHODS",
    "CacheShape",
    "CacheState",
    "StepCache",
    "cache_param",
    "rebuilt",
    "state_bytes",
    "state_for",
]

#: Every method a request may name; a model offers those its denoiser can use.
METHODS: Final = ("none", "fbcache", "teacache", "taylorseer")

_FACTOR_BYTES: Final = torch.empty((), dtype=FACTOR_DTYPE).element_size()

CacheState: TypeAlias = FirstBlockState | TeaCacheState | TaylorSeerState
_STATES: Final[dict[str, Any]] = {
    "fbcache": FirstBlockState,
    "teacache": TeaCacheState,
    "taylorseer": TaylorSeerState,
}


def cache_param(methods: tuple[str, ...], why_not: str = "") -> Param:
    """The ``cache`` param of a model whose denoiser can use ``methods`` (``why_not``: why it
    has no other, for its help and its error)."""
    knobs = {
        "fbcache": "fbcache (First-Block Cache, knob threshold)",
        "teacache": "teacache (TeaCache, knob rel_l1)",
        "taylorseer": "taylorseer (TaylorSeer, knobs interval, warmup, order)",
    }
    offered = ", ".join(knobs[m] for m in methods if m in knobs)
    help = f"step caching, per request: {{method: none}} (the default), {offered}: docs/diffusers.md"
    if len(methods) == 1:
        help = f"step caching: none only ({why_not})"
    return Param(
        "cache",
        "object",
        {
            "method": "none",
            "threshold": DEFAULT_THRESHOLD,
            "rel_l1": DEFAULT_REL_L1,
            **TAYLOR,
            "results": True,
        },
        help,
        fields=(
            Param(
                "method",
                "str",
                "none",
                why_not or "the caching method",
                choices=methods,
            ),
            Param(
                "threshold",
                "float",
                DEFAULT_THRESHOLD,
                "fbcache: the largest relative change of the first block's residual that reuses "
                "(diffusers' FirstBlockCacheConfig)",
                minimum=0.0,
                maximum=10.0,
            ),
            Param(
                "rel_l1",
                "float",
                DEFAULT_REL_L1,
                "teacache: the rescaled change of the first block's modulated input, added up over "
                "steps, below which a step reuses (TeaCache's rel_l1_thresh: 0.25 ~1.5x, 0.4 ~1.8x, "
                "0.6 ~2x, 0.8 ~2.25x on Flux.1-dev)",
                minimum=0.0,
                maximum=10.0,
            ),
            Param(
                "interval",
                "int",
                TAYLOR["interval"],
                "taylorseer: after the warmup, one step in this many computes (cache_interval)",
                minimum=1,
                maximum=100,
            ),
            Param(
                "warmup",
                "int",
                TAYLOR["warmup"],
                "taylorseer: the first steps, computed (disable_cache_before_step)",
                minimum=0,
                maximum=1000,
            ),
            Param(
                "order",
                "int",
                TAYLOR["order"],
                "taylorseer: the Taylor series' highest term (max_order; 0 reuses the last output)",
                minimum=0,
                maximum=3,
            ),
            Param(
                "results",
                "bool",
                True,
                "an exact repeat of a finished request (every param, the seed it ran with) gets "
                "that one's results instead of a run (the server's repeat_cache_bytes); false runs it",
            ),
        ),
    )


def state_for(params: Any, total: int) -> CacheState | None:
    """The cache state a request of checked ``params`` and ``total`` denoiser calls starts with;
    None without caching."""
    cache: Mapping[str, Any] = (params.get("cache") if hasattr(params, "get") else None) or {}
    method = cache.get("method", "none")
    if method == "fbcache":
        return FirstBlockState(float(cache["threshold"]))
    if method == "teacache":
        return TeaCacheState(float(cache["rel_l1"]), total)
    if method == "taylorseer":
        return TaylorSeerState(int(cache["interval"]), int(cache["warmup"]), int(cache["order"]))
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class CacheShape:
    """What a request's step cache holds is made of: its rows, its image and text tokens, the
    transformer's width and blocks (double: image and text outputs; single: one of both), and
    the bytes of a value in the transformer's dtype."""

    rows: int
    image_tokens: int
    text_tokens: int
    width: int
    double_blocks: int
    single_blocks: int
    value_bytes: int


def state_bytes(cache: Mapping[str, Any] | None, shape: CacheShape) -> int:
    """The bytes a request's ``cache`` (its checked param) holds on the device at most:
    fbcache the first block's residual and the others' to the image and text states; teacache
    the previous modulated input and the stack's residual; taylorseer ``order + 1`` terms
    (bfloat16) of every attention output. 0 without caching."""
    method = (cache or {}).get("method", "none")
    one = shape.rows * shape.width  # values per token
    if method == "fbcache":
        return one * (2 * shape.image_tokens + shape.text_tokens) * shape.value_bytes
    if method == "teacache":
        return one * 2 * shape.image_tokens * shape.value_bytes
    if method == "taylorseer":
        assert cache is not None
        terms = int(cache.get("order", TAYLOR["order"])) + 1
        blocks = shape.double_blocks + shape.single_blocks
        return one * terms * blocks * (shape.image_tokens + shape.text_tokens) * _FACTOR_BYTES
    return 0


def rebuilt(counts: Mapping[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> CacheState:
    """The state a checkpoint's ``counts`` and ``tensors`` describe (a checkpoint from before
    the methods were named holds a First-Block Cache)."""
    kind = _STATES.get(str(counts.get("method", "fbcache")))
    if kind is None:
        raise ValueError(f"a step cache of unknown method {counts.get('method')!r}")
    state: CacheState = kind.rebuilt(dict(counts), tensors, device)
    return state


class StepCache:
    """A denoiser's wrappers for every method, made on first use; :meth:`batch` runs a call."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        self._denoiser = denoiser
        self._blocks: BlockCache | None = None
        self._attention: AttentionCache | None = None

    def batch(self, spans: Sequence[tuple[int, CacheState | None]]) -> contextlib.ExitStack[bool | None]:
        """The context of one call on requests of ``spans`` (each: its rows, its state or None)."""
        stack = contextlib.ExitStack()
        block = [(rows, s if isinstance(s, (FirstBlockState, TeaCacheState)) else None) for rows, s in spans]
        taylor = [(rows, s if isinstance(s, TaylorSeerState) else None) for rows, s in spans]
        if any(s is not None for _, s in block) or any(s is not None for _, s in taylor):
            blocks = self._blocks = self._blocks or BlockCache(self._denoiser)
        if any(s is not None for _, s in block):
            stack.enter_context(blocks.batch(block))
        if any(s is not None for _, s in taylor):
            if self._attention is None:
                self._attention = AttentionCache(self._denoiser, lambda: blocks.subset)
            stack.enter_context(self._attention.batch(taylor))
        return stack
