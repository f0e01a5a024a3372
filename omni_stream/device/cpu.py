"""The CPU device: the copier's path with synchronous copies."""

from __future__ import annotations

import torch

from .base import COMPLETED, CopyEvent, Device

__all__ = ["CpuDevice"]


class CpuDevice(Device):
    """Steps run on the CPU; a frame's "copy" is one clone on the producer thread."""

    kind = "cpu"
    computes_on_cpu = True

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # CPU-only torch cannot pin memory (pin_memory raises without an
        # accelerator), and nothing would gain from it here.
        return torch.empty(shape, dtype=dtype)

    def copy_owned(self, src: torch.Tensor) -> torch.Tensor | None:
        # Frames are already on the host: one copy on the producer thread,
        # before its next step (a model may reuse its output tensor), and no
        # pool buffer. With the producer's single torch thread a large clone
        # starts no OpenMP team.
        if not src.is_cpu or src.layout is not torch.strided:
            # An output on another device (or sparse) goes the general way:
            # copy_to_host moves it into a dense CPU buffer, or fails its
            # request with the reason.
            return None
        return src.clone(memory_format=torch.contiguous_format)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, event: CopyEvent | None = None) -> CopyEvent:
        # For what copy_owned declines. Synchronous: the producer thread
        # copies before it runs the next step, so a model that reuses its
        # output tensor cannot race us.
        dst.copy_(src)
        return COMPLETED
