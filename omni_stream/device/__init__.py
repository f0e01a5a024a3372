"""Accelerators as the engine sees them; ``resolve_device`` turns a name into one."""

from __future__ import annotations

import torch

from ..errors import ParamsError
from . import simcuda
from .base import CompletedEvent, CopyEvent, Device
from .cpu import CpuDevice
from .pool import BufferLease, PinnedBufferPool, PoolClosedError, PoolStatistics
from .sim import SimDevice

__all__ = [
    "Device",
    "CopyEvent",
    "CompletedEvent",
    "CpuDevice",
    "SimDevice",
    "simcuda",
    "BufferLease",
    "PinnedBufferPool",
    "PoolStatistics",
    "PoolClosedError",
    "resolve_device",
]


def resolve_device(spec: str | torch.device | Device) -> Device:
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"sim"``.

    A Device instance is returned as is; a ``torch.device`` is taken by its
    name. Raises ParamsError naming the spec when it is unknown or CUDA is
    asked for and missing.
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ParamsError(f"device must be a string or Device, got {type(spec).__name__}", field="device")
    name = spec.strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return CpuDevice()
    if name == "sim":
        return SimDevice()
    if name == "cuda" or name.startswith("cuda:"):
        from .cuda import CudaDevice

        index: int | None = None
        if name != "cuda":
            try:
                index = int(name.split(":", 1)[1])
            except ValueError:
                raise ParamsError(
                    f"device {spec!r}: expected cuda:N with an integer N", field="device"
                ) from None
        try:
            return CudaDevice(index)
        except (RuntimeError, ValueError) as exc:
            raise ParamsError(f"device {spec!r}: {exc}", field="device") from exc
    raise ParamsError(f"unknown device {spec!r}; expected auto, cpu, cuda, cuda:N or sim", field="device")
