"""Failure modes found in review; each test fails without its fix."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.config import STEP_TIMEOUT_ENV
from omni_stream.device import CpuDevice
from omni_stream.models import Synthetic

from .conftest import settled, wait_for

SMALL = {"shape": [4, 8, 8], "work": 0}


def params(**kw):
    return {**SMALL, **kw}


class Counting(Synthetic):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.started = 0
        self.closed = 0

    def start(self, params, device):
        self.started += 1
        return super().start(params, device)

    def close(self, state):
        self.closed += 1


@pytest.mark.asyncio
async def test_aclose_under_an_outer_cancellation_still_closes_the_engine():
    model = Counting()
    engine = om.Engine(model, device="cpu")
    with anyio.move_on_after(0.2):
        async with engine:
            held = engine.stream(params(steps=10_000))  # noqa: F841
            await anyio.sleep(1)  # cancelled here; aclose runs under cancellation
    assert engine.health().status == "closed"
    assert engine._state == "closed"
    assert engine.statistics().buffers_in_use == 0
    assert model.closed == model.started == 1


@pytest.mark.asyncio
async def test_a_batch_larger_than_the_pool_cannot_wedge_the_producer():
    async with om.Engine(Synthetic(), device="sim", max_batch_size=4, max_buffers=2) as engine:
        results = []

        async def run(i):
            results.append(await engine.generate(params(steps=5, seed=i), timeout=10))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
        assert len(results) == 4
        assert max(engine.statistics().batch_sizes) <= 2


class _NeverEvent:
    def __init__(self) -> None:
        self._never = threading.Event()

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self._never.wait()


class _HungCopyDevice(CpuDevice):
    """Like a GPU whose queue hung: steps return at once, copies never land."""

    def copy_owned(self, src):
        return None  # take the asynchronous path, as a GPU does

    def copy_to_host(self, src, dst):
        return _NeverEvent()


@pytest.mark.asyncio
async def test_a_copy_that_never_completes_makes_health_stalled_and_shutdown_bounded(monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.3")
    engine = om.Engine(Synthetic(), device=_HungCopyDevice(), shutdown_timeout=0.5)
    await engine.start()
    with pytest.raises(om.StepTimeoutError, match="copying step 1"):
        await engine.generate(params(steps=5))
    await wait_for(lambda: engine.health().status == "stalled", what="stalled health")
    assert "copy" in (engine.health().reason or "")
    t0 = time.monotonic()
    await engine.aclose()  # must not block on the copy that never lands
    assert time.monotonic() - t0 < 3
    assert engine.health().status == "closed"


class _BadOutput(Synthetic):
    """Returns a non-tensor for request seed 666 at step 2."""

    def step(self, states):
        outs = super().step(states)
        return [None if s.params["seed"] == 666 and s.step == 2 else o for s, o in zip(states, outs)]


@pytest.mark.asyncio
async def test_a_bad_output_in_a_batch_fails_its_request_and_never_restepps_the_others():
    model = _BadOutput()
    async with om.Engine(model, device="cpu", max_batch_size=4) as engine:
        good = engine.stream(params(steps=4, seed=1))
        bad = engine.stream(params(steps=4, seed=666))
        with pytest.raises(om.StepFailedError, match="must return tensors"):
            async for _ in bad:
                pass
        frames = [f.data async for f in good]
    expected = Synthetic().expected_frames(params(steps=4, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(frames, expected, strict=True))


@pytest.mark.asyncio
async def test_model_close_runs_for_every_started_request_at_shutdown_and_on_death(monkeypatch):
    model = Counting()
    async with om.Engine(model, device="cpu", queue_size=1) as engine:
        held = engine.stream(params(steps=100))  # noqa: F841
        await wait_for(lambda: model.started == 1, what="start")
    assert model.closed == 1

    model = Counting()
    async with om.Engine(model, device="cpu", queue_size=1) as engine:
        streams = [engine.stream(params(steps=100, seed=i)) for i in range(2)]
        await wait_for(lambda: model.started == 2, what="both started")

        def boom(*a, **k):
            raise RuntimeError("injected")

        monkeypatch.setattr(engine._copier, "post", boom)
        for s in streams:  # unread frames let the producer run into the failure
            with pytest.raises(om.EngineDeadError):
                async for _ in s:
                    pass
        await wait_for(lambda: model.closed == 2, what="states closed after death")


class _Sparse(Synthetic):
    def step(self, states):
        outs = super().step(states)
        return [o.to_sparse() if s.params["seed"] == 7 else o for s, o in zip(states, outs)]


@pytest.mark.asyncio
async def test_an_output_that_cannot_be_copied_fails_only_its_request():
    async with om.Engine(_Sparse(), device="cpu") as engine:
        with pytest.raises(om.StepFailedError) as info:
            await engine.generate(params(steps=3, seed=7))
        assert info.value.request_id
        final = await engine.generate(params(steps=3, seed=8))
        assert final.final
        engine.check_health()
        assert (await settled(engine)).buffers_in_use == 0


class _SlowStart(Synthetic):
    def start(self, params, device):
        if params["seed"] == 99:
            time.sleep(0.8)
        return super().start(params, device)


@pytest.mark.asyncio
async def test_a_hang_in_model_start_is_reported_as_stalled(monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.2")
    async with om.Engine(_SlowStart(), device="cpu") as engine:
        held = engine.stream(params(steps=2, seed=99), request_id="slow-start")  # noqa: F841
        await wait_for(lambda: engine.health().status == "stalled", what="stalled health")
        assert "slow-start" in (engine.health().reason or "")
        await wait_for(lambda: engine.health().status == "ok", what="recovery")


class _BadTotal(Synthetic):
    def total_steps(self, params):
        return 0


@pytest.mark.asyncio
async def test_an_invalid_total_is_refused_at_submission():
    async with om.Engine(_BadTotal(), device="cpu") as engine:
        with pytest.raises(om.ParamsError, match="total_steps returned 0"):
            engine.stream(params())


@pytest.mark.asyncio
async def test_a_cancel_from_another_thread_never_hits_a_later_request_with_the_same_id():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        first = engine.stream(params(steps=3), request_id="job-1")
        answer = []
        t = threading.Thread(target=lambda: answer.append(engine.cancel("job-1")))
        t.start()
        t.join()
        await first.aclose()  # job-1 ends before the scheduled cancel runs
        retry = engine.stream(params(steps=3), request_id="job-1")
        frames = [f async for f in retry]
        assert answer == [True] and frames[-1].final


class _NoEventDevice(CpuDevice):
    def copy_owned(self, src):
        return None  # take the pool path, where the missing event matters

    def copy_to_host(self, src, dst):
        dst.copy_(src)
        return None  # the copier treats a missing event as complete


@pytest.mark.asyncio
async def test_a_device_without_events_still_delivers_frames():
    async with om.Engine(Synthetic(), device=_NoEventDevice()) as engine:
        frames = [f async for f in engine.stream(params(steps=3))]
    assert len(frames) == 3


@pytest.mark.asyncio
async def test_two_readers_of_one_stream_both_make_progress():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        stream = engine.stream(params(steps=6, hang_at=1, hang_s=0.1))
        got = []

        async def reader():
            try:
                while True:
                    got.append(await stream.__anext__())
            except StopAsyncIteration:
                pass

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                tg.start_soon(reader)
        assert sorted(f.step for f in got) == list(range(1, 7))
