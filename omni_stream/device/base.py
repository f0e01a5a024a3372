"""What the copier needs from an accelerator: streams, events, host buffers.

Three implementations share this interface and the same copier code:
``cuda`` (a side copy stream, pinned buffers, ``torch.cuda.Event(blocking=True)``),
``sim`` (the same ``CudaDevice`` code driving ``device/simcuda.py``, a
simulated GPU with torch.cuda's API, so the asynchronous path runs in CI
without a GPU) and ``cpu`` (frames already on the host: one owned copy on
the producer, through ``copy_owned``).

Threading: ``prepare_thread``, ``after_step``, ``host_buffer``,
``copy_owned`` and ``copy_to_host`` run on the producer thread, the one
thread that owns the accelerator. ``CopyEvent.query`` and
``CopyEvent.synchronize`` may run on any thread: the copier's waiting
thread blocks in ``synchronize`` (torch releases the GIL there, and a
``blocking=True`` CUDA event sleeps in the driver instead of spinning).
A host never waits on a CUDA event any other way: ``Event.wait(stream)``
is a *device-side* wait of a stream, not a timed host wait.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["CopyEvent", "CompletedEvent", "Device"]

T = TypeVar("T")


class CopyEvent(Protocol):
    """Completion of one device-to-host copy: the part of ``torch.cuda.Event`` a host waits with."""

    def query(self) -> bool:
        """True once the copy has landed in its host buffer; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the copy has landed."""
        ...


class CompletedEvent:
    """An event for a copy that finished before it was returned (CPU)."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


COMPLETED = CompletedEvent()


class Device(abc.ABC):
    """An accelerator as the producer and copier see it."""

    #: "cpu", "cuda" or "sim".
    kind: str
    #: Where models put their tensors.
    torch_device: torch.device

    #: ``copy_to_host`` returns before the bytes land (CUDA, sim): the copier
    #: waits for its events on a thread of its own. False where copies are done
    #: by the time they return (cpu).
    asynchronous_copies: bool = False

    #: The model's compute runs on host cores, so torch threads and OpenMP
    #: teams matter: true for ``cpu`` and ``sim`` (whose kernels are CPU ops).
    computes_on_cpu: bool = False

    @property
    def name(self) -> str:
        return str(self.torch_device) if self.kind != "sim" else "sim"

    def prepare_thread(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Called once on the producer thread before any model code runs."""

    def after_step(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Called on the producer thread after each ``model.step`` returns."""

    @abc.abstractmethod
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate one host buffer for the pool (pinned where that exists)."""

    @abc.abstractmethod
    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, event: CopyEvent | None = None) -> CopyEvent:
        """Start copying ``src`` into ``dst``, ordered after all compute issued so far.

        Returns at once on asynchronous devices. The caller must keep ``src``
        referenced and must not read or reuse ``dst`` until the returned
        event completes. ``event``: one this device returned for an earlier
        copy that has completed, recorded again (and returned) instead of a
        new one being made.
        """

    def decode_aside(self, decode: Callable[[Any, torch.Tensor], T], state: Any, frame: torch.Tensor) -> T:
        """``decode(state, frame)``: a preview decoder network (a tiny VAE) on a step's output.

        Producer thread. Here, in line; CUDA queues it on a side stream, so the
        next step's kernels need not wait for it on the device, and a later
        ``copy_to_host`` still waits for it.
        """
        return decode(state, frame)

    def copy_owned(self, src: torch.Tensor) -> torch.Tensor | None:
        """A host tensor of ``src``'s bytes that the caller owns, or None.

        Devices whose frames already live in host memory (the CPU) copy here,
        synchronously, once: staging the frame in a pool buffer and copying it
        out again on the loop would be a second full copy, and the loop's copy
        holds the GIL that the producer's next step needs. Devices with a real
        device-to-host transfer return None and go through ``copy_to_host``.
        """
        return None

    def close(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Release streams and worker threads; idempotent."""
