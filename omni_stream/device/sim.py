"""A simulated accelerator: the copier's asynchronous path without a GPU.

Two worker threads stand in for a CUDA compute stream and a copy stream.
``after_step`` queues ``compute_s`` of simulated kernel time on the compute
stream; ``copy_to_host`` queues, on the copy stream, a wait for the compute
queued so far, ``copy_s`` of transfer time, and only then the real
``dst.copy_(src)``. So, exactly as on a GPU, a host buffer holds stale bytes
until its event completes: a copier that read too early, released a buffer
still in flight, or dropped ``src`` too soon would hand out wrong frames,
and the tests comparing frames bit for bit would catch it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from .base import CopyEvent, Device

__all__ = ["SimDevice", "SimEvent"]


class SimEvent:
    """A CUDA-event stand-in: completes when its stream reaches it."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def _complete(self) -> None:
        self._done.set()


class _SimStream:
    """A FIFO of operations run one after another by one worker thread.

    ``busy(seconds)`` keeps a device clock: back-to-back operations end at
    ``previous end + latency``, not ``now + latency``, so the sleep's
    wake-up jitter does not accumulate (a GPU runs queued kernels back to
    back too).
    """

    def __init__(self, name: str) -> None:
        self._clock = 0.0
        self._ops: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def busy(self, seconds: float) -> None:
        """Occupy the stream for ``seconds`` (call from an op on this stream)."""
        now = time.monotonic()
        end = max(self._clock, now) + seconds
        self._clock = end
        if end > now:
            time.sleep(end - now)

    def enqueue(self, op: Callable[[], None]) -> None:
        self._ops.put(op)

    def _run(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            op()

    def close(self) -> None:
        self._ops.put(None)


class SimDevice(Device):
    """Simulated device with ``compute_s`` per step and ``copy_s`` per copy.

    Tensors live on the CPU. Host buffers come only from ``host_buffer``
    (the simulated pinned pool), and ``copy_to_host`` refuses any other
    destination, as a check that the copier never copies elsewhere.
    """

    kind = "sim"
    computes_on_cpu = True

    def __init__(self, *, compute_s: float = 0.0, copy_s: float = 0.0) -> None:
        if compute_s < 0 or copy_s < 0:
            raise ValueError(f"SimDevice latencies must be >= 0, got {compute_s=} {copy_s=}")
        self.torch_device = torch.device("cpu")
        self.compute_s = float(compute_s)
        self.copy_s = float(copy_s)
        self._compute: _SimStream | None = None
        self._copy: _SimStream | None = None
        self._last_compute: SimEvent | None = None
        self._pinned: set[int] = set()
        self.copies = 0

    def prepare_thread(self) -> None:
        self._compute = _SimStream("omni-stream-sim-compute")
        self._copy = _SimStream("omni-stream-sim-copy")

    def after_step(self) -> None:
        stream = self._compute
        assert stream is not None, "SimDevice used before prepare_thread()"
        done = SimEvent()
        latency = self.compute_s

        def kernel() -> None:
            if latency:
                stream.busy(latency)
            done._complete()

        stream.enqueue(kernel)
        self._last_compute = done

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        self._pinned.add(buf.data_ptr())
        return buf

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        stream = self._copy
        assert stream is not None, "SimDevice used before prepare_thread()"
        if dst.data_ptr() not in self._pinned:
            raise RuntimeError("SimDevice: copy destination is not a buffer from host_buffer()")
        # Like copy_stream.wait_stream(compute): wait for what was queued so far.
        after = self._last_compute
        done = SimEvent()
        latency = self.copy_s
        self.copies += 1

        def transfer() -> None:
            if after is not None:
                after.synchronize()
            if latency:
                stream.busy(latency)
            dst.copy_(src)
            done._complete()

        stream.enqueue(transfer)
        return done

    def close(self) -> None:
        for stream in (self._compute, self._copy):
            if stream is not None:
                stream.close()
        self._compute = self._copy = None
