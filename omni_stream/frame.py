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
    ``decode_s``: the part of ``compute_s`` spent decoding this frame on the
    device (the final decode, or a preview decoder network), 0 when none ran.
    """

    queued_s: float
    compute_s: float
    copy_s: float
    batch_size: int = 1
    decode_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Frame:
    """One step's output.

    ``data`` is a CPU tensor the caller owns: it stays valid after later
    frames and after other requests run; it never aliases a pooled buffer.
    ``step`` is 1-based; ``final`` is True on the last frame only.
    ``decoded`` is True when ``data`` is pixels the model decoded on its
    device: the request's output (an image ``[3, H, W]`` or a video
    ``[T, 3, H, W]``, floats in ``[-1, 1]`` or ``uint8``) or a preview made
    by a decoder network; False for a frame in the model's own space (a
    latent, or an image for models that work in pixels).
    """

    request_id: str
    step: int
    total: int
    data: torch.Tensor
    timings: StepTimings = field(default_factory=lambda: StepTimings(0.0, 0.0, 0.0))
    decoded: bool = False

    @property
    def final(self) -> bool:
        return self.step == self.total

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.data.shape)
        return (
            f"Frame(request_id={self.request_id!r}, step={self.step}/{self.total}, "
            f"data={shape} {self.data.dtype}{', decoded' if self.decoded else ''})"
        )
