"""The CUDA device: a side copy stream, pinned host buffers, blocking events.

The ordering rules this module relies on (torch CUDA semantics):

* ``copy_stream.wait_stream(compute)`` makes every later operation on the
  copy stream wait for all work queued on ``compute`` so far, so the copy
  reads the step's finished output, without blocking the host.
* ``dst.copy_(src, non_blocking=True)`` into pinned memory returns before
  the bytes are there; only the event recorded after it says they are.
* ``torch.cuda.Event(blocking=True)`` makes ``synchronize()`` sleep in the
  driver instead of spinning a core, which matters on a 2-core host where
  the waiting thread would otherwise steal the producer's CPU.
* ``src`` was allocated on the compute stream. If its last reference went
  away while the copy stream still read it, the caching allocator could hand
  the memory to the next step and the copy would read garbage. The copier
  keeps ``src`` referenced until the event completes (no ``record_stream``).
* A dtype change is done on the device before the copy (by the copier):
  ``tensor.to("cpu", dtype=..., non_blocking=True)`` would silently go
  through pageable memory.
"""

from __future__ import annotations

import torch

from .base import CopyEvent, Device

__all__ = ["CudaDevice"]


class CudaDevice(Device):
    """One CUDA device; the producer thread's current stream is the compute stream."""

    kind = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        if index is None:
            index = torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"device 'cuda:{index}' does not exist; "
                f"{torch.cuda.device_count()} CUDA device(s) visible"
            )
        self.torch_device = torch.device("cuda", index)
        self._copy_stream: torch.cuda.Stream | None = None

    def prepare_thread(self) -> None:
        # The current device is per thread: set it on the producer thread.
        torch.cuda.set_device(self.torch_device)
        # torch declares Stream.__new__ without types.
        self._copy_stream = torch.cuda.Stream(device=self.torch_device)  # type: ignore[no-untyped-call]

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        stream = self._copy_stream
        if stream is None:
            raise RuntimeError("CudaDevice.copy_to_host before prepare_thread()")
        compute = torch.cuda.current_stream(self.torch_device)
        stream.wait_stream(compute)
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # untyped __new__ in torch
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event.record(stream)
        return event

    def close(self) -> None:
        self._copy_stream = None
