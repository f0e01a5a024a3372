"""Every async test runs twice: under asyncio's default loop and under uvloop
(once, under asyncio's, when marked ``one_loop``: it tests a server in another process).

Also what tests in several folders share: ``one_torch_thread``, the ``Slow``
model and a ``running`` server (tests/server/conftest.py has the server
tests' own helpers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import torch

from omni_stream.models import Synthetic


#: The anyio backends the engine, its streams and the client run on, as anyio's plugin takes them.
ANYIO_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A test marked ``anyio`` runs on each of them (a module may narrow it with its own fixture)."""
    return request.param  # type: ignore[no-any-return]


# optionalhook: the GPU machine runs the GPU tests without pytest-asyncio.
@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config, item) -> Mapping[str, object]:
    factories: dict[str, object] = {"asyncio": asyncio.new_event_loop}
    if item.get_closest_marker("one_loop") is not None:
        # What it tests runs in another process (a real serve): a second loop here tests nothing more.
        return factories
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(params=["cuda", "sim"])
def gpu_kind(request: pytest.FixtureRequest) -> str:
    """A GPU test's two halves: on a real GPU (skipped without one) and on the simulated GPU
    (``device/simcuda.py``, torch.cuda's API on the CPU), so no GPU test goes unrun in CI."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the sim half of this test ran)")
    return str(request.param)


def gpu_torch_device(kind: str) -> torch.device:
    """Where a GPU test's tensors go: the GPU, or the simulated GPU's (the CPU)."""
    return torch.device("cuda") if kind == "cuda" else torch.device("cpu")


@pytest.fixture(autouse=True)
def _omni_stream_logs(caplog):
    caplog.set_level(logging.INFO, logger="omni_stream")
    yield


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread meanwhile.

    One thread is the engine producer's default on a small box, so results
    compare bit for bit with ``pipe()`` run here; and tiny models on a shared
    2-core box spend far longer (~40x measured) with two OpenMP threads
    waiting for each other than computing.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Slow(Synthetic):
    """Synthetic whose steps sleep (no CPU burned): requests that stay running a while."""

    name = "slow"

    def __init__(self, delay: float = 0.01) -> None:
        super().__init__()
        self.delay = delay

    def step(self, states: Sequence[Any]) -> list[Any]:
        time.sleep(self.delay)
        return super().step(states)


@asynccontextmanager
async def running(model: Any = None, **options: Any) -> AsyncIterator[Any]:
    """A started Server on 127.0.0.1, a free port, short shutdown bounds; ``options`` as Server's."""
    # Imported here: the engine's tests run where the server's dependencies are missing.
    from omni_stream.server import Server

    options.setdefault("device", "cpu")
    options.setdefault("shutdown_timeout_s", 0.5)
    options.setdefault("close_timeout_s", 1.0)
    async with Server(model or Synthetic(), host="127.0.0.1", port=0, **options) as server:
        yield server
