"""Frame: one step's output, handed to the caller, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Frame", "StepTimings"]


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Where one step's time went, in seconds.

    ``queued_s``: from the moment the request could run this step (submitted,
    or its previous step computed) until the step started; waiting for a
    batch slot, for other requests' steps, or for this request's reader to
    catch up all count here.
    ``compute_s``: the step call itself (for a batched step, the whole batch).
    ``copy_s``: from issuing the device-to-host copy until the frame was on
    the host and owned by the caller.
    ``batch_size``: how many requests advanced in the same model call.
    """

    queued_s: float
    compute_s: float
    copy_s: float
    batch_size: int = 1


@dataclass(frozen=True, slots=True)
class Frame:
    """One step's output.

    ``data`` is a CPU tensor the caller owns: it stays valid after later
    frames and after other requests run; it never aliases a pooled buffer.
    ``step`` is 1-based; ``final`` is True on the last frame only.
    """

    request_id: str
    step: int
    total: int
    data: torch.Tensor
    timings: StepTimings = field(default_factory=lambda: StepTimings(0.0, 0.0, 0.0))

    @property
    def final(self) -> bool:
        return self.step == self.total

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.data.shape)
        return (
            f"Frame(request_id={self.request_id!r}, step={self.step}/{self.total}, "
            f"data={shape} {self.data.dtype})"
        )
