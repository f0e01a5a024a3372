"""Step caching per request inside a batched transformer call: First-Block Cache (issue #35).

First-Block Cache (ParaAttention's, diffusers' ``FirstBlockCacheConfig``)
runs a transformer's first block, compares what that block added to the
hidden states (its *residual*) with the residual it added at the request's
last fully computed step, and, when they differ by at most ``threshold``
(the mean absolute difference over the mean absolute previous residual),
skips every other block: it adds what those blocks added at that last
computed step instead. Steps whose input barely moved cost one block.

diffusers keeps that state on the module and decides for a whole batch.
Here each request carries its own :class:`FirstBlockState` (it pauses,
snapshots and resumes with the request) and decides for itself inside a
batched call: :class:`BlockCache` wraps the transformer's blocks once, and
during a call (:meth:`BlockCache.batch`, given each request's rows and
state) the first block's output decides each request; the rest of the
blocks run on the rows of the requests that compute only (a request
without a cache always computes), and the rows of those that reuse take
their cached residuals. A request alone decides and computes exactly as
diffusers' hooks do, the same operations on the same tensors: its latents
equal ``pipe()``'s with ``transformer.enable_cache(FirstBlockCacheConfig(
threshold=t))`` bit for bit (tests/models/test_step_cache.py). Batched, a
request's rows are computed in a smaller or larger call than alone, with
the batching tolerance the native loops document; its decisions depend on
its own rows only.

The blocks are found as diffusers finds them (the ``transformer_blocks`` and
``single_transformer_blocks`` lists) and read through diffusers'
``TransformerBlockRegistry`` (which output is the hidden states, which the
text's), so the wrapping knows the blocks diffusers' own hook knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch

from ...params import Param

__all__ = ["BLOCK_LISTS", "METHODS", "BlockCache", "FirstBlockState", "cache_param"]

#: The methods a request may name, by what a denoiser has: ``fbcache`` needs a
#: transformer's block lists (Flux, SD3); a UNet has none.
METHODS: Final = ("none", "fbcache")
#: diffusers' FirstBlockCacheConfig default.
DEFAULT_THRESHOLD: Final = 0.05

#: The transformer's block lists, in the order its forward runs them.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
#: The block inputs that hold one row per request row (sliced for a subset).
_ROW_KWARGS = ("hidden_states", "encoder_hidden_states", "temb")


def cache_param(methods: tuple[str, ...], why_not: str = "") -> Param:
    """The ``cache`` param of a model whose denoiser can use ``methods`` (``why_not``: why a
    model that has only ``none`` has no other, for its help and its error)."""
    help = (
        "step caching, per request: {method: none} (the default), or {method: fbcache, threshold: t}: "
        "First-Block Cache, a step whose first block's residual moved by at most t (relative mean "
        "absolute change) reuses the other blocks' output of the last computed step (diffusers' "
        f"FirstBlockCacheConfig; default t {DEFAULT_THRESHOLD})"
    )
    if len(methods) == 1:
        help = f"step caching: none only ({why_not})"
    return Param(
        "cache",
        "object",
        {"method": "none", "threshold": DEFAULT_THRESHOLD, "results": True},
        help,
        fields=(
            Param("method", "str", "none", why_not or "the caching method", choices=methods),
            Param(
                "threshold",
                "float",
                DEFAULT_THRESHOLD,
                "fbcache: the largest relative change of the first block's residual that reuses",
                minimum=0.0,
                maximum=10.0,
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


def state_for(params: Any) -> FirstBlockState | None:
    """The cache state a request of checked ``params`` starts with; None without caching."""
    cache = params.get("cache") if hasattr(params, "get") else None
    if not cache or cache.get("method", "none") == "none":
        return None
    return FirstBlockState(float(cache["threshold"]))


@dataclasses.dataclass
class FirstBlockState:
    """One request's First-Block Cache: its threshold, what its last computed step left, counts.

    Fields are replaced, never changed in place, so a shallow copy is a
    snapshot a failed step can put back (:class:`~.loop.Saved`).
    """

    threshold: float
    #: What the first block added at the last computed step (None before the first).
    head_residual: torch.Tensor | None = None
    #: What the other blocks added then, to the hidden states and to the text's (None: none).
    tail_hidden: torch.Tensor | None = None
    tail_encoder: torch.Tensor | None = None
    #: Steps computed in full, and steps that reused the cache.
    computed: int = 0
    cached: int = 0
    #: Whether the latest step reused the cache.
    last_cached: bool = False

    def decide(self, residual: torch.Tensor) -> bool:
        """Whether to compute the other blocks, given this step's first-block ``residual``
        (diffusers' rule: the relative mean absolute change over ``threshold``)."""
        previous = self.head_residual
        if previous is None or self.tail_hidden is None:
            return True
        absmean = (residual - previous).abs().mean()
        return bool((absmean / previous.abs().mean()).item() > self.threshold)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by name, copied to the host (a checkpoint's)."""
        named = {
            "head_residual": self.head_residual,
            "tail_hidden": self.tail_hidden,
            "tail_encoder": self.tail_encoder,
        }
        return {k: v.detach().to("cpu", copy=True) for k, v in named.items() if v is not None}

    def counts(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "computed": self.computed, "cached": self.cached}

    @classmethod
    def rebuilt(
        cls, counts: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device
    ) -> FirstBlockState:
        """The state :meth:`counts` and :meth:`tensors` describe, its tensors on ``device``."""
        state = cls(
            float(counts["threshold"]), computed=int(counts["computed"]), cached=int(counts["cached"])
        )
        for name in ("head_residual", "tail_hidden", "tail_encoder"):
            if name in tensors:
                setattr(state, name, tensors[name].to(device, copy=True))
        return state


@dataclasses.dataclass
class _Call:
    """One transformer call: each request's rows and state, and what its first block decided."""

    spans: list[tuple[slice, FirstBlockState | None]]
    rows: int
    #: Per span: compute the other blocks (None until the first block ran).
    compute: list[bool] | None = None
    #: The rows that compute, as an index (None: all of them).
    index: torch.Tensor | None = None
    #: The first block's outputs (hidden, text), for the tail residuals.
    head: tuple[torch.Tensor, torch.Tensor | None] | None = None


class BlockCache:
    """A transformer's blocks wrapped for :class:`FirstBlockState`: inert outside :meth:`batch`."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        blocks = [
            block
            for name in BLOCK_LISTS
            if isinstance(listed := getattr(transformer, name, None), torch.nn.ModuleList)
            for block in listed
        ]
        if not blocks:
            raise ValueError(f"{type(transformer).__name__} has no {' or '.join(BLOCK_LISTS)} to cache")
        self._call: _Call | None = None
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            meta = TransformerBlockRegistry.get(type(block))
            original = block.forward
            if i == 0:
                block.forward = self._head(original, meta)
            else:
                block.forward = self._tail(original, meta, last=i == last)

    @contextlib.contextmanager
    def batch(self, spans: Sequence[tuple[int, FirstBlockState | None]]) -> Iterator[None]:
        """During a transformer call on requests of ``spans`` (each: its rows, its state or None),
        in that order."""
        out, start = [], 0
        for rows, state in spans:
            out.append((slice(start, start + rows), state))
            start += rows
        self._call = _Call(out, start)
        try:
            yield
        finally:
            self._call = None

    # -- the wrappers ----------------------------------------------------------------

    def _head(self, original: Any, meta: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._call
            if call is None:
                return original(*args, **kwargs)
            hidden_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            output = original(*args, **kwargs)
            hidden, encoder = _split(output, meta)
            residual = hidden - hidden_in
            call.compute = []
            new_hidden: list[torch.Tensor] = []
            new_encoder: list[torch.Tensor] = []
            any_cached = False
            for rows, state in call.spans:
                if state is None:
                    compute = True
                else:
                    compute = state.decide(residual[rows])
                    state.last_cached = not compute
                    if compute:
                        state.head_residual = residual[rows]
                        state.computed += 1
                    else:
                        state.cached += 1
                call.compute.append(compute)
                if compute or state is None or state.tail_hidden is None:
                    new_hidden.append(hidden[rows])
                    if encoder is not None:
                        new_encoder.append(encoder[rows])
                else:
                    any_cached = True
                    # diffusers' order: the cached residual plus the block's output.
                    new_hidden.append(state.tail_hidden + hidden[rows])
                    if encoder is not None:
                        tail = state.tail_encoder
                        new_encoder.append(encoder[rows] if tail is None else tail + encoder[rows])
            call.head = (hidden, encoder)
            if any(call.compute) and not all(call.compute):
                picked = [
                    torch.arange(r.start, r.stop)
                    for (r, _), c in zip(call.spans, call.compute, strict=True)
                    if c
                ]
                call.index = torch.cat(picked).to(hidden.device)
            if not any_cached:
                return output
            if len(call.spans) == 1:
                hidden = new_hidden[0]
                encoder = None if encoder is None else new_encoder[0]
            else:
                hidden = torch.cat(new_hidden)
                encoder = None if encoder is None else torch.cat(new_encoder)
            return _join(output, meta, hidden, encoder)

        return forward

    def _tail(self, original: Any, meta: Any, *, last: bool) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._call
            if call is None or call.compute is None:
                return original(*args, **kwargs)
            if all(call.compute):
                output = original(*args, **kwargs)
                if last:
                    self._keep_tail(call, *_split(output, meta), None)
                return output
            hidden_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            encoder_in = (
                meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
                if meta.return_encoder_hidden_states_index is not None
                else None
            )
            if not any(call.compute):
                # Every request reuses its cache: the block is skipped, its inputs go on.
                return _join(None, meta, hidden_in, encoder_in)
            if args:
                raise RuntimeError(f"{type(original.__self__).__name__} was called with positional arguments")
            index = call.index
            assert index is not None
            sub = {
                k: (
                    v.index_select(0, index)
                    if k in _ROW_KWARGS and isinstance(v, torch.Tensor) and v.shape[0] == call.rows
                    else v
                )
                for k, v in kwargs.items()
            }
            sub_hidden, sub_encoder = _split(original(**sub), meta)
            hidden = hidden_in.index_copy(0, index, sub_hidden)
            if sub_encoder is None:
                encoder = None
            else:
                assert encoder_in is not None
                encoder = encoder_in.index_copy(0, index, sub_encoder)
            if last:
                self._keep_tail(call, hidden, encoder, index)
            return _join(None, meta, hidden, encoder)

        return forward

    @staticmethod
    def _keep_tail(
        call: _Call, hidden: torch.Tensor, encoder: torch.Tensor | None, index: torch.Tensor | None
    ) -> None:
        """After the last block: what the other blocks added, for each computing request."""
        assert call.head is not None and call.compute is not None
        head_hidden, head_encoder = call.head
        for (rows, state), compute in zip(call.spans, call.compute, strict=True):
            if state is None or not compute:
                continue
            state.tail_hidden = hidden[rows] - head_hidden[rows]
            state.tail_encoder = (
                None if encoder is None or head_encoder is None else encoder[rows] - head_encoder[rows]
            )


def _split(output: Any, meta: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's output as (hidden states, text's hidden states or None)."""
    if not isinstance(output, tuple):
        return output, None
    encoder = None
    if meta.return_encoder_hidden_states_index is not None:
        encoder = output[meta.return_encoder_hidden_states_index]
    return output[meta.return_hidden_states_index], encoder


def _join(template: Any, meta: Any, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    """A block's output of ``hidden`` and ``encoder``, shaped as the block returns it."""
    if meta.return_encoder_hidden_states_index is None:
        return hidden
    out: list[Any] = [None, None] if template is None else list(template)
    out[meta.return_hidden_states_index] = hidden
    out[meta.return_encoder_hidden_states_index] = encoder
    return tuple(out)
