"""What the copier needs from an accelerator: streams, events, host buffers.

Three implementations share this interface and the same copier code:
``cuda`` (real streams and ``torch.cuda.Event(blocking=True)``), ``cpu``
(frames already on the host: one owned copy on the producer, through
``copy_owned``) and ``sim`` (worker threads standing in for a compute
stream and a copy stream, with configurable latencies, so the asynchronous
path is exercised without a GPU).

Threading: ``prepare_thread``, ``after_step``, ``host_buffer``,
``copy_owned`` and ``copy_to_host`` run on the producer thread, the one
thread that owns the accelerator. ``CopyEvent.query`` and ``CopyEvent.synchronize`` may run on
any thread (the copier waits on them through ``anyio.to_thread``).
"""

from __future__ import annotations

import abc
import time
from typing import Protocol

import torch

__all__ = ["CopyEvent", "CompletedEvent", "Device", "wait_event"]


class CopyEvent(Protocol):
    """Completion of one device-to-host copy."""

    def query(self) -> bool:
        """True once the copy has landed in its host buffer; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the copy has landed."""
        ...


def wait_event(event: CopyEvent, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True once it completed.

    Bounded, unlike ``synchronize()``: the copier's worker thread returns to
    the loop regularly, so a wedged device can neither pin a thread past
    shutdown nor keep the interpreter from exiting. Events with a timed
    ``wait`` (the simulator's) use it; others (CUDA) are polled with a short
    back-off, which releases the GIL while it sleeps.
    """
    timed_wait = getattr(event, "wait", None)
    if timed_wait is not None:
        return bool(timed_wait(timeout))
    if event.query():
        return True
    deadline = time.monotonic() + timeout
    pause = 20e-6
    while not event.query():
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)
    return True


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
    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        """Start copying ``src`` into ``dst``, ordered after all compute issued so far.

        Returns at once on asynchronous devices. The caller must keep ``src``
        referenced and must not read or reuse ``dst`` until the returned
        event completes.
        """

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
