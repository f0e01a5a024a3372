"""The simulated accelerator: ``CudaDevice``'s own code on the simulated GPU of ``simcuda``.

Nothing of the copy path is re-implemented here: the copy stream, the
events, the wait of the copy stream for the compute stream and the queued
``copy_`` are ``CudaDevice``'s, driving ``simcuda`` (torch.cuda's API on the
CPU). This class adds only what a simulation needs to say:

* ``compute_s``: the device time each step's kernels take. ``after_step``
  keeps this producer's compute stream busy that long (``_sleep``), so a
  copy issued after the step waits for it, as on a GPU.
* ``copy_s``: the time each device-to-host transfer takes on the copy stream.
* Host buffers come only from ``host_buffer`` (the simulated pinned
  memory), and ``copy_to_host`` refuses any other destination: a check
  that the copier never copies elsewhere.

So, exactly as on a GPU, a host buffer holds stale bytes until its event
completes, and a source dropped before its copy ran is read as garbage: a
copier that read too early, released a buffer still in flight or dropped
``src`` too soon hands out wrong frames, and the tests comparing frames bit
for bit catch it.
"""

from __future__ import annotations

import torch

from . import simcuda
from .base import CopyEvent
from .cuda import CudaDevice

__all__ = ["SimDevice"]


class SimDevice(CudaDevice):
    """Simulated device with ``compute_s`` of device time per step and ``copy_s`` per copy."""

    kind = "sim"
    computes_on_cpu = True

    def __init__(self, *, compute_s: float = 0.0, copy_s: float = 0.0) -> None:
        if compute_s < 0 or copy_s < 0:
            raise ValueError(f"SimDevice latencies must be >= 0, got {compute_s=} {copy_s=}")
        self._use(simcuda, torch.device("cpu"))
        self.compute_s = float(compute_s)
        self.copy_s = float(copy_s)
        self._compute: simcuda.Stream | None = None
        #: Copies issued (for tests).
        self.copies = 0
        #: Bytes the device copied to the host (for tests: a frame's one copy).
        self.copied_bytes = 0

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_compute"] = None
        return state

    def prepare_thread(self) -> None:
        super().prepare_thread()
        # A compute stream of this device's own, current on the producer thread (a GPU's
        # compute is queued on the thread's current stream): two simulated devices, as two
        # GPUs, compute side by side.
        self._compute = simcuda.Stream()
        simcuda.set_stream(self._compute)

    def after_step(self) -> None:
        if self.compute_s:
            simcuda._sleep(round(self.compute_s * simcuda.CLOCK_HZ))

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return simcuda.pinned_empty(shape, dtype)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, event: CopyEvent | None = None) -> CopyEvent:
        if not simcuda.is_pinned(dst):
            raise RuntimeError("SimDevice: copy destination is not a buffer from host_buffer()")
        event = super().copy_to_host(src, dst, event)
        self.copies += 1
        self.copied_bytes += dst.numel() * dst.element_size()
        return event

    def _keep_for(self, tensor: torch.Tensor, stream: object) -> None:
        # The simulated GPU's tensors are CPU tensors, freed by reference counting, and its
        # decodes run on the calling thread: nothing is read after it returns.
        return None

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy_s:
            simcuda._sleep(round(self.copy_s * simcuda.CLOCK_HZ))
        dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        super().close()
        if self._compute is not None:
            simcuda._reset_stream(self._compute)  # (on the thread that prepared it: tests)
            self._compute = None
