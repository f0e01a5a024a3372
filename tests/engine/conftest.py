"""Shared by the engine tests: devices, small request params, counting models, waits."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

import omni_stream as om
from omni_stream.models import Synthetic

#: Small, fast request params: 4x8x8 frames, no matmul load.
SMALL: dict[str, Any] = {"shape": [4, 8, 8], "work": 0}


def params(**kw: Any) -> dict[str, Any]:
    """SMALL with ``kw`` on top."""
    return {**SMALL, **kw}


class Counting(Synthetic):
    """Synthetic that counts the requests it started and the states it closed."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.started = 0
        self.closed = 0

    def start(self, params: Any, device: Any) -> Any:
        self.started += 1
        return super().start(params, device)

    def close(self, state: Any) -> None:
        self.closed += 1


def make_device(kind: str) -> om.device.Device:
    if kind == "sim":
        # Slow enough that copies are really in flight when the loop looks.
        return om.device.SimDevice(compute_s=0.001, copy_s=0.003)
    return om.device.resolve_device(kind)


@pytest.fixture(params=["cpu", "sim"])
def device_kind(request) -> str:
    return request.param


async def wait_for(predicate, *, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.002)


async def settled(engine: om.Engine) -> om.EngineStatistics:
    """Wait until no host buffer is leased and no request is live; return the stats."""
    await wait_for(
        lambda: engine.statistics().buffers_in_use == 0
        and engine.statistics().active == 0
        and engine.statistics().queued == 0,
        what="buffers back in the pool",
    )
    return engine.statistics()


async def wait_busy_with(engine: om.Engine, request_id: str) -> None:
    """Wait until the producer is inside model code for ``request_id``."""
    p = engine._producer
    await wait_for(
        lambda: p.busy_since is not None and request_id in p.busy_with,
        what=f"a step of {request_id}",
    )
