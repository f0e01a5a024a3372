"""TeaCache's per-request state (Liu et al., "Timestep Embedding Tells: It's Time to Cache for
Video Diffusion Model", 2024; the authors' TeaCache4FLUX).

Before the blocks run, TeaCache looks at the first block's *modulated input*
(its ``norm1`` of the hidden states under the timestep embedding): its
relative mean absolute change since the previous step, mapped through a
polynomial the authors fitted per model (it rescales the input's change into
the output's), is added up over the steps. While that sum stays under
``rel_l1`` the step reuses what the whole block stack added at the last
computed step; once it reaches ``rel_l1`` the step computes and the sum
starts again. The first and last steps always compute.

The authors fitted the polynomial for Flux.1 (below); SD3 has none, so SD3
does not offer the method. :class:`~.block_cache.BlockCache` runs it inside a
batched call; there the first block runs for a reused request's rows too
(the batch is split at block granularity), so a reused step costs one block
where the authors' single-request forward costs none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import torch

from .block_cache import Head

__all__ = ["DEFAULT_REL_L1", "FLUX_COEFFICIENTS", "TeaCacheState", "rescaled"]

#: The TeaCache4FLUX threshold of its 1.8x setting ("0.4: ~1.8x").
DEFAULT_REL_L1: Final = 0.4
#: TeaCache4FLUX's rescaling polynomial, highest power first (numpy.poly1d's order).
FLUX_COEFFICIENTS: Final = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


def rescaled(change: float, coefficients: tuple[float, ...] = FLUX_COEFFICIENTS) -> float:
    """The polynomial at ``change`` (Horner's rule; numpy.poly1d's value)."""
    out = 0.0
    for c in coefficients:
        out = out * change + c
    return out


@dataclasses.dataclass
class TeaCacheState:
    """One request's TeaCache: its threshold and step count, what its last steps left, counts.

    Fields are replaced, never changed in place (a shallow copy is a snapshot:
    :class:`~.loop.Saved`).
    """

    method = "teacache"

    rel_l1: float
    #: The request's denoiser evaluations: the last one always computes.
    total: int
    #: Calls so far (TeaCache4FLUX's ``cnt``), and the change added up since the last compute.
    step: int = 0
    accumulated: float = 0.0
    #: The previous step's modulated input (None before the first).
    previous: torch.Tensor | None = None
    #: What the whole block stack added to the hidden states at the last computed step.
    residual: torch.Tensor | None = None
    computed: int = 0
    cached: int = 0
    last_cached: bool = False

    def decide(self, head: Head) -> bool:
        """Whether this step computes the blocks (the authors' rule), counted."""
        modulated = head.modulated()
        if self.step == 0 or self.step == self.total - 1 or self.previous is None or self.residual is None:
            compute = True
            accumulated = 0.0
        else:
            change = ((modulated - self.previous).abs().mean() / self.previous.abs().mean()).item()
            accumulated = self.accumulated + rescaled(change)
            compute = accumulated >= self.rel_l1
            if compute:
                accumulated = 0.0
        self.accumulated = accumulated
        self.previous = modulated
        self.step += 1
        self.last_cached = not compute
        if compute:
            self.computed += 1
        else:
            self.cached += 1
        return compute

    def reused(self, head: Head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A reused step's hidden states after the last block: its input plus the stack's
        residual. The text's states go on as the first block left them: after the last block
        Flux reads the image's hidden states only."""
        assert self.residual is not None
        return head.input + self.residual, head.encoder

    def keep(self, head: Head, hidden: torch.Tensor, encoder: torch.Tensor | None) -> None:
        self.residual = hidden - head.input

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"previous": self.previous, "residual": self.residual}
        return {k: v.detach().to("cpu", copy=True) for k, v in named.items() if v is not None}

    def counts(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "rel_l1": self.rel_l1,
            "total": self.total,
            "step": self.step,
            "accumulated": self.accumulated,
            "computed": self.computed,
            "cached": self.cached,
        }

    @classmethod
    def rebuilt(
        cls, counts: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device
    ) -> TeaCacheState:
        state = cls(
            float(counts["rel_l1"]),
            int(counts["total"]),
            step=int(counts["step"]),
            accumulated=float(counts["accumulated"]),
            computed=int(counts["computed"]),
            cached=int(counts["cached"]),
        )
        for name in ("previous", "residual"):
            if name in tensors:
                setattr(state, name, tensors[name].to(device, copy=True))
        return state
