"""``model.prepare``: a request's setup in a worker thread, never on the producer (model.py, Preparing).

A model that builds something for a request before its first step (the
Mixture's image bank for a new size: seconds) would hold the producer
thread, and every other request's steps, that long if it built it in
``start``. Gated with threading events: no test waits on a clock.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.errors import RequestCancelledError, StepFailedError
from omni_stream.models import Mixture, Synthetic

from .conftest import make_device, params, settled, wait_for


class Prepares(Synthetic):
    """Synthetic whose requests with ``seed=1`` need a preparation, gated on ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.prepared: set[int] = set()
        self.threads: set[int] = set()
        self.fail = False

    def needs_prepare(self, params: Any) -> bool:
        return params["seed"] in (1, 3)

    def prepare(self, params: Any, device: torch.device) -> None:
        self.threads.add(threading.get_ident())
        if params["seed"] == 1:
            self.entered.set()
            assert self.release.wait(20), "never released"
            if self.fail:
                raise RuntimeError("no room for its tables")
        self.prepared.add(params["seed"])

    def start(self, params: Any, device: torch.device) -> Any:
        # What prepare built is there: start never builds it on the producer.
        assert params["seed"] not in (1, 3) or params["seed"] in self.prepared, "started unprepared"
        return super().start(params, device)


@pytest.mark.asyncio
async def test_others_step_while_one_request_prepares_in_a_worker_thread(device_kind: str) -> None:
    model = Prepares()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        slow = engine.stream(params(steps=3, seed=1))
        async with anyio.create_task_group() as tg:
            got: list[om.Frame] = []

            async def read() -> None:
                got.extend([f async for f in slow])

            tg.start_soon(read)
            await anyio.to_thread.run_sync(model.entered.wait, 20)
            # The producer is free: a request with nothing to prepare runs to its end.
            frames = [f async for f in engine.stream(params(steps=5, seed=2))]
            assert [f.step for f in frames] == [1, 2, 3, 4, 5] and not got
            model.release.set()
        assert [f.step for f in got] == [1, 2, 3]
        assert threading.get_ident() not in model.threads
        await settled(engine)


@pytest.mark.asyncio
async def test_a_failed_preparation_fails_its_request_alone() -> None:
    model = Prepares()
    model.fail = True
    model.release.set()
    async with om.Engine(model, device="cpu") as engine:
        with pytest.raises(StepFailedError) as info:
            await engine.generate(params(steps=3, seed=1), request_id="doomed")
        assert info.value.request_id == "doomed" and "no room for its tables" in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert (await engine.generate(params(steps=2, seed=3))).final
        assert engine.health().ok
        assert engine.statistics().failed == 1


@pytest.mark.asyncio
async def test_a_request_cancelled_while_it_prepares_ends_and_never_starts() -> None:
    model = Prepares()
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream(params(steps=3, seed=1), request_id="gone")
        await anyio.to_thread.run_sync(model.entered.wait, 20)
        assert engine.cancel("gone")
        with pytest.raises(RequestCancelledError):
            await stream.__anext__()
        model.release.set()
        await wait_for(lambda: 1 in model.prepared, what="the preparation to finish")
        assert (await engine.generate(params(steps=2, seed=4))).final
        stats = await settled(engine)
        assert stats.cancelled == 1 and stats.active == 0


@pytest.mark.asyncio
async def test_the_mixture_builds_a_new_sizes_bank_before_start() -> None:
    model = Mixture()
    built_on: list[int] = []
    make = model._banks.get

    def spy(*args: Any, **kwargs: Any) -> Any:
        built_on.append(threading.get_ident())
        return make(*args, **kwargs)

    model._banks.get = spy  # type: ignore[method-assign]
    async with om.Engine(model, device="cpu") as engine:
        built_on.clear()  # load's
        frame = await engine.generate({"prompt": "red circle", "size": 48, "steps": 2})
        assert frame.data.shape == (3, 48, 48)
    # Built in prepare (a worker thread); start found it cached.
    assert len(built_on) == 2 and len({*built_on}) == 2
