"""A transformer's blocks wrapped so each request of a batched call decides its own step cache.

diffusers' cache hooks keep their state on the module and decide for a whole
batch. Here each request carries its own state (First-Block Cache:
:mod:`.first_block`; TeaCache: :mod:`.teacache`) and decides for itself:
:class:`BlockCache` wraps the transformer's blocks once, and during a call
(:meth:`BlockCache.batch`, given each request's rows and state) the first
block's input and output decide each request; the rest of the blocks run on
the rows of the requests that compute only (a request without a state always
computes), and the rows of those that reuse take what their state gives
(:meth:`BlockState.reused`). A request alone decides and computes exactly as
diffusers' hooks do, the same operations on the same tensors. Batched, a
request's rows are computed in a smaller or larger call than alone, with the
batching tolerance the native loops document; its decisions depend on its
own rows only.

The blocks are found as diffusers finds them (the ``transformer_blocks`` and
``single_transformer_blocks`` lists) and read through diffusers'
``TransformerBlockRegistry`` (which output is the hidden states, which the
text's), so the wrapping knows the blocks diffusers' own hook knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = ["BLOCK_LISTS", "BlockCache", "BlockState", "Head", "rows_index"]

#: The transformer's block lists, in the order its forward runs them.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
#: The block inputs that hold one row per request row (sliced for a subset).
_ROW_KWARGS = ("hidden_states", "encoder_hidden_states", "temb")


@dataclasses.dataclass
class Head:
    """The first block of one request's rows: its input and outputs, and (asked for only by
    TeaCache, so computed on demand) its modulated input."""

    input: torch.Tensor
    output: torch.Tensor
    encoder: torch.Tensor | None
    modulated: Callable[[], torch.Tensor]


class BlockState(Protocol):
    """A request's block-level step cache (:class:`~.first_block.FirstBlockState`,
    :class:`~.teacache.TeaCacheState`)."""

    last_cached: bool

    def decide(self, head: Head) -> bool:
        """Whether this step computes the other blocks (and counts the step)."""
        ...

    def reused(self, head: Head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A reused step's hidden states and text's, as after the last block."""
        ...

    def keep(self, head: Head, hidden: torch.Tensor, encoder: torch.Tensor | None) -> None:
        """After a computed step's last block, given its outputs: what to reuse later."""
        ...


@dataclasses.dataclass
class _Call:
    """One transformer call: each request's rows and state, and what its first block decided."""

    spans: list[tuple[slice, BlockState | None]]
    rows: int
    #: Per span: compute the other blocks (None until the first block ran).
    compute: list[bool] | None = None
    #: The rows that compute, as an index (None: all of them).
    index: torch.Tensor | None = None
    #: Per span, the first block's rows (None for a span without a state).
    heads: list[Head | None] | None = None


class BlockCache:
    """A transformer's blocks wrapped for :class:`BlockState`: inert outside :meth:`batch`."""

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
        #: While the blocks run on a subset of the rows: which spans are in it.
        self.subset: list[bool] | None = None
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            meta = TransformerBlockRegistry.get(type(block))
            original = block.forward
            if i == 0:
                block.forward = self._head(block, original, meta)
            else:
                block.forward = self._tail(original, meta, last=i == last)

    @contextlib.contextmanager
    def batch(self, spans: Sequence[tuple[int, BlockState | None]]) -> Iterator[None]:
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
            self.subset = None

    # -- the wrappers ----------------------------------------------------------------

    def _head(self, block: torch.nn.Module, original: Any, meta: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._call
            if call is None:
                return original(*args, **kwargs)
            hidden_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            output = original(*args, **kwargs)
            hidden, encoder = _split(output, meta)
            modulated = _Modulated(block, meta, args, kwargs)
            call.compute, call.heads = [], []
            new_hidden: list[torch.Tensor] = []
            new_encoder: list[torch.Tensor] = []
            any_cached = False
            for rows, state in call.spans:
                enc = None if encoder is None else encoder[rows]
                if state is None:
                    call.compute.append(True)
                    call.heads.append(None)
                    new_hidden.append(hidden[rows])
                    if enc is not None:
                        new_encoder.append(enc)
                    continue
                head = Head(hidden_in[rows], hidden[rows], enc, functools.partial(modulated.rows, rows))
                compute = state.decide(head)
                call.compute.append(compute)
                call.heads.append(head)
                if compute:
                    new_hidden.append(head.output)
                    if enc is not None:
                        new_encoder.append(enc)
                else:
                    any_cached = True
                    reused_hidden, reused_encoder = state.reused(head)
                    new_hidden.append(reused_hidden)
                    if enc is not None:
                        new_encoder.append(enc if reused_encoder is None else reused_encoder)
            if any(call.compute) and not all(call.compute):
                call.index = rows_index(
                    [r for (r, _), c in zip(call.spans, call.compute, strict=True) if c], hidden.device
                )
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
                    self._keep_tail(call, *_split(output, meta))
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
            self.subset = call.compute  # (what AttentionCache's wrappers inside read)
            try:
                sub_hidden, sub_encoder = _split(original(**sub), meta)
            finally:
                self.subset = None
            hidden = hidden_in.index_copy(0, index, sub_hidden)
            if sub_encoder is None:
                encoder = None
            else:
                assert encoder_in is not None
                encoder = encoder_in.index_copy(0, index, sub_encoder)
            if last:
                self._keep_tail(call, hidden, encoder)
            return _join(None, meta, hidden, encoder)

        return forward

    @staticmethod
    def _keep_tail(call: _Call, hidden: torch.Tensor, encoder: torch.Tensor | None) -> None:
        """After the last block: each computing request keeps what it will reuse."""
        assert call.heads is not None and call.compute is not None
        for (rows, state), head, compute in zip(call.spans, call.heads, call.compute, strict=True):
            if state is None or head is None or not compute:
                continue
            state.keep(head, hidden[rows], None if encoder is None else encoder[rows])


def rows_index(spans: Sequence[slice], device: torch.device) -> torch.Tensor:
    """The rows of ``spans``, in order, as an index made on ``device`` itself: a host tensor
    copied there would be a synchronous copy on CUDA, a stall of every call that splits."""
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in spans])


class _Modulated:
    """The first block's modulated input (its ``norm1`` of the hidden states under ``temb``),
    computed once per call, when a request first asks."""

    def __init__(self, block: torch.nn.Module, meta: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._block, self._meta, self._args, self._kwargs = block, meta, args, kwargs
        self._value: torch.Tensor | None = None

    def rows(self, rows: slice) -> torch.Tensor:
        if self._value is None:
            get = self._meta._get_parameter_from_args_kwargs
            hidden = get("hidden_states", self._args, self._kwargs)
            temb = get("temb", self._args, self._kwargs)
            norm = getattr(self._block, "norm1", None)
            if norm is None:
                raise RuntimeError(
                    f"{type(self._block).__name__} has no norm1 to read a modulated input from"
                )
            self._value = norm(hidden, emb=temb)[0]
        return self._value[rows]


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
