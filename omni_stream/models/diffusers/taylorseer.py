"""TaylorSeer per request inside a batched transformer call (diffusers' ``TaylorSeerCacheConfig``).

TaylorSeer (Liu et al., "From Reusing to Forecasting", 2025) computes the
transformer's attention modules in full on some steps and *forecasts* their
outputs on the others, from a Taylor series in the step index whose terms
are finite differences of the outputs of the last computed steps. Which steps
compute is fixed in advance: the first ``warmup`` steps, then one in every
``interval`` (diffusers' schedule: step ``s`` computes when ``s < warmup`` or
``(s - warmup - 1) % interval == 0``). ``order`` is the series' highest term
(0: the last output as it was).

diffusers keeps the series on each module, one per cache context. Here each
request carries its own (:class:`TaylorSeerState`: it pauses, snapshots and
resumes with the request), and :class:`AttentionCache` wraps the attention
modules diffusers' hook would wrap (its ``_TRANSFORMER_BLOCK_IDENTIFIERS``)
once: in a batched call, the modules run on the rows of the requests that
compute this step and forecast the rows of the others. A request alone
computes and forecasts exactly as diffusers' hooks do: its latents equal
``pipe()``'s with ``transformer.enable_cache(TaylorSeerCacheConfig(...))``
bit for bit (tests/models/test_step_cache_methods.py). The series is kept in
``TaylorSeerCacheConfig``'s default dtype, bfloat16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import torch

from .block_cache import rows_index

__all__ = ["DEFAULTS", "AttentionCache", "TaylorSeerState"]

#: diffusers' TaylorSeerCacheConfig defaults: interval, warmup (disable_cache_before_step), order.
DEFAULTS: Final = {"interval": 5, "warmup": 3, "order": 1}
#: The dtype the series is kept in (TaylorSeerCacheConfig's default).
FACTOR_DTYPE: Final = torch.bfloat16
#: The attention inputs that hold one row per request row.
_ROW_KWARGS = ("hidden_states", "encoder_hidden_states", "attention_mask")
#: Module names diffusers' hook wraps by default, should its private constant move.
_FALLBACK_PATTERNS = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn")

_Series = tuple[tuple[torch.Tensor, ...], ...]  # per output, its terms (order 0 first)


@dataclasses.dataclass
class TaylorSeerState:
    """One request's TaylorSeer: its schedule, each module's series, counts.

    Fields are replaced, never changed in place (a shallow copy is a snapshot:
    :class:`~.loop.Saved`).
    """

    method = "taylorseer"

    interval: int
    warmup: int
    order: int
    #: The latest call's index (diffusers' ``current_step``), and the last computed one.
    step: int = -1
    last_update: int | None = None
    #: Per wrapped module: its outputs' series, and their dtypes.
    series: dict[int, _Series] = dataclasses.field(default_factory=dict)
    dtypes: dict[int, tuple[torch.dtype, ...]] = dataclasses.field(default_factory=dict)
    computed: int = 0
    cached: int = 0
    last_cached: bool = False

    @property
    def computing(self) -> bool:
        return not self.last_cached

    def begin(self) -> None:
        """A new transformer call: this step computes or forecasts (diffusers' schedule; a
        request with nothing to forecast from computes)."""
        self.step += 1
        compute = (
            self.step < self.warmup
            or (self.step - self.warmup - 1) % self.interval == 0
            or self.last_update is None
        )
        self.last_cached = not compute
        if compute:
            self.computed += 1
        else:
            self.cached += 1

    def finish(self) -> None:
        """The call ran: a computed step is the series' newest point."""
        if self.computing:
            self.last_update = self.step

    def update(self, module: int, outputs: Sequence[torch.Tensor]) -> None:
        """Module ``module`` computed ``outputs`` for this request: its series from them and the
        last one (diffusers' divided differences)."""
        before = self.series.get(module, ())
        series = []
        for i, features in enumerate(outputs):
            terms = [features]
            if self.last_update is not None:
                delta = self.step - self.last_update
                previous = before[i] if i < len(before) else ()
                for j in range(self.order):
                    if j >= len(previous) or previous[j].shape != terms[j].shape:
                        break  # (a shape that changed starts the series again)
                    terms.append((terms[j] - previous[j].to(features.dtype)) / delta)
            series.append(tuple(t.to(FACTOR_DTYPE) for t in terms))
        self.series = {**self.series, module: tuple(series)}
        self.dtypes = {**self.dtypes, module: tuple(o.dtype for o in outputs)}

    def forecast(self, module: int) -> list[torch.Tensor]:
        """Module ``module``'s outputs for this step, from its series."""
        assert self.last_update is not None
        offset = self.step - self.last_update
        out = []
        for terms, dtype in zip(self.series[module], self.dtypes[module], strict=True):
            value = torch.zeros_like(terms[0], dtype=dtype)
            for order, term in enumerate(terms):
                value = value + term.to(dtype) * (offset**order / math.factorial(order))
            out.append(value)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"series.{m}.{i}.{j}": t.detach().to("cpu", copy=True)
            for m, outputs in self.series.items()
            for i, terms in enumerate(outputs)
            for j, t in enumerate(terms)
        }

    def counts(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "interval": self.interval,
            "warmup": self.warmup,
            "order": self.order,
            "step": self.step,
            "last_update": self.last_update,
            "dtypes": {str(m): [str(d).removeprefix("torch.") for d in ds] for m, ds in self.dtypes.items()},
            "computed": self.computed,
            "cached": self.cached,
        }

    @classmethod
    def rebuilt(
        cls, counts: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device
    ) -> TaylorSeerState:
        dtypes = {int(m): tuple(getattr(torch, d) for d in ds) for m, ds in counts["dtypes"].items()}
        series: dict[int, _Series] = {}
        for m, kinds in dtypes.items():
            outputs = []
            for i in range(len(kinds)):
                terms, j = [], 0
                while (key := f"series.{m}.{i}.{j}") in tensors:
                    terms.append(tensors[key].to(device, copy=True))
                    j += 1
                outputs.append(tuple(terms))
            series[m] = tuple(outputs)
        last = counts["last_update"]
        return cls(
            int(counts["interval"]),
            int(counts["warmup"]),
            int(counts["order"]),
            step=int(counts["step"]),
            last_update=None if last is None else int(last),
            series=series,
            dtypes=dtypes,
            computed=int(counts["computed"]),
            cached=int(counts["cached"]),
        )


@dataclasses.dataclass
class _Call:
    spans: list[tuple[slice, TaylorSeerState | None]]
    rows: int
    #: The row indexes made this call, by the rows they pick (one per layout, on the device).
    indexes: dict[tuple[tuple[tuple[int, int], ...], int], torch.Tensor] = dataclasses.field(
        default_factory=dict
    )


class AttentionCache:
    """A transformer's attention modules wrapped for :class:`TaylorSeerState`: inert outside
    :meth:`batch`. ``subset`` tells, while a :class:`~.block_cache.BlockCache` runs the blocks
    on some requests' rows only, which requests those are."""

    def __init__(self, transformer: torch.nn.Module, subset: Callable[[], list[bool] | None]) -> None:
        try:
            from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS as patterns
        except ImportError:  # pragma: no cover - a diffusers that renamed it
            patterns = _FALLBACK_PATTERNS
        self._call: _Call | None = None
        self._subset = subset
        count = 0
        for name, module in transformer.named_modules():
            if any(re.fullmatch(p, name) for p in patterns):
                module.forward = self._wrap(count, module.forward)
                count += 1
        if not count:
            raise ValueError(f"{type(transformer).__name__} has no attention modules TaylorSeer knows")

    @contextlib.contextmanager
    def batch(self, spans: Sequence[tuple[int, TaylorSeerState | None]]) -> Iterator[None]:
        """During a transformer call on requests of ``spans`` (each: its rows, its state or None)."""
        out, start = [], 0
        for rows, state in spans:
            out.append((slice(start, start + rows), state))
            start += rows
            if state is not None:
                state.begin()
        self._call = _Call(out, start)
        try:
            yield
        finally:
            self._call = None
        for _, state in out:  # (not on a raise: the step is undone, its state with it)
            if state is not None:
                state.finish()

    def _spans(self, call: _Call) -> list[tuple[slice, TaylorSeerState | None]]:
        """The spans of the rows a module is called on now: all, or a block cache's subset."""
        present = self._subset()
        if present is None:
            return call.spans
        out, start = [], 0
        for (rows, state), there in zip(call.spans, present, strict=True):
            if there:
                n = rows.stop - rows.start
                out.append((slice(start, start + n), state))
                start += n
        return out

    def _wrap(self, module: int, original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._call
            if call is None:
                return original(*args, **kwargs)
            spans = self._spans(call)
            computing = [state is None or state.computing for _, state in spans]
            if all(computing):
                output = original(*args, **kwargs)
                outputs = (output,) if isinstance(output, torch.Tensor) else output
                for rows, state in spans:
                    if state is not None:
                        state.update(module, [o[rows] for o in outputs])
                return output
            parts: list[list[torch.Tensor]] = []
            if any(computing):
                if args:
                    raise RuntimeError(
                        f"{type(original.__self__).__name__} was called with positional arguments"
                    )
                rows_now = spans[-1][0].stop
                picked = [r for (r, _), c in zip(spans, computing, strict=True) if c]
                key = (tuple((r.start, r.stop) for r in picked), rows_now)  # (slices hash from 3.12 on)
                index = call.indexes.get(key)
                if index is None:  # once a call per layout, not once an attention module
                    first = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                    index = call.indexes[key] = rows_index(picked, first.device)
                sub = {
                    k: (
                        v.index_select(0, index)
                        if k in _ROW_KWARGS and isinstance(v, torch.Tensor) and v.shape[0] == rows_now
                        else v
                    )
                    for k, v in kwargs.items()
                }
                output = original(**sub)
                computed = (output,) if isinstance(output, torch.Tensor) else tuple(output)
            offset = 0
            for (rows, state), compute in zip(spans, computing, strict=True):
                if compute:
                    n = rows.stop - rows.start
                    mine = [o[offset : offset + n] for o in computed]
                    offset += n
                    if state is not None:
                        state.update(module, mine)
                else:
                    assert state is not None
                    mine = state.forecast(module)
                parts.append(mine)
            outputs = [p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts, strict=True)]
            return outputs[0] if len(outputs) == 1 else tuple(outputs)

        return forward
