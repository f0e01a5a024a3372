"""First-Block Cache's per-request state (ParaAttention's, diffusers' ``FirstBlockCacheConfig``).

The transformer's first block runs every step; what it added to the hidden
states (its *residual*) is compared with the one it added at the request's
last fully computed step. When they differ by at most ``threshold`` (the mean
absolute difference over the mean absolute previous residual) the other
blocks are skipped: the step adds what they added at that last computed step
instead. :class:`~.block_cache.BlockCache` runs it inside a batched call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import torch

from .block_cache import Head

__all__ = ["DEFAULT_THRESHOLD", "FirstBlockState"]

#: diffusers' FirstBlockCacheConfig default.
DEFAULT_THRESHOLD: Final = 0.05


@dataclasses.dataclass
class FirstBlockState:
    """One request's First-Block Cache: its threshold, what its last computed step left, counts.

    Fields are replaced, never changed in place, so a shallow copy is a
    snapshot a failed step can put back (:class:`~.loop.Saved`).
    """

    method = "fbcache"

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

    def decide(self, head: Head) -> bool:
        """Whether to compute the other blocks this step (diffusers' rule: the relative mean
        absolute change of the first block's residual over ``threshold``), counted."""
        residual = head.output - head.input
        previous = self.head_residual
        compute = True
        if previous is not None and self.tail_hidden is not None:
            absmean = (residual - previous).abs().mean()
            compute = bool((absmean / previous.abs().mean()).item() > self.threshold)
        self.last_cached = not compute
        if compute:
            self.head_residual = residual
            self.computed += 1
        else:
            self.cached += 1
        return compute

    def reused(self, head: Head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A reused step's hidden states and text's after the last block: diffusers' order,
        the cached residual plus the first block's output."""
        assert self.tail_hidden is not None
        encoder = head.encoder
        if encoder is not None and self.tail_encoder is not None:
            encoder = self.tail_encoder + encoder
        return self.tail_hidden + head.output, encoder

    def keep(self, head: Head, hidden: torch.Tensor, encoder: torch.Tensor | None) -> None:
        """After a computed step's last block: what the other blocks added."""
        self.tail_hidden = hidden - head.output
        self.tail_encoder = None if encoder is None or head.encoder is None else encoder - head.encoder

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by name, copied to the host (a checkpoint's)."""
        named = {
            "head_residual": self.head_residual,
            "tail_hidden": self.tail_hidden,
            "tail_encoder": self.tail_encoder,
        }
        return {k: v.detach().to("cpu", copy=True) for k, v in named.items() if v is not None}

    def counts(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "threshold": self.threshold,
            "computed": self.computed,
            "cached": self.cached,
        }

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
