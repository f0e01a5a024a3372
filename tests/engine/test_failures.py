"""Timeouts, model failures, a dead engine and shutdown: each known failure mode."""

from __future__ import annotations

import logging
import threading
import time

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.config import STEP_TIMEOUT_ENV
from omni_stream.engine.delivery import Delivery
from omni_stream.models import Synthetic, SyntheticFault

from .conftest import Counting, make_device, params, settled, wait_busy_with, wait_for


@pytest.mark.asyncio
async def test_a_hung_step_times_out_stalls_health_and_the_engine_recovers(
    device_kind, monkeypatch, caplog
):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.25")
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        stream = engine.stream(params(steps=4, hang_at=2, hang_s=1.2), request_id="hung")
        assert (await stream.__anext__()).step == 1
        with pytest.raises(om.StepTimeoutError) as info:
            await stream.__anext__()
        err = info.value
        assert err.request_id == "hung" and err.step == 2 and err.bound_s == 0.25
        assert STEP_TIMEOUT_ENV in str(err) and f"{0.25:.1f} s" in str(err)
        assert "computing step 2/4" in str(err)
        assert any(
            STEP_TIMEOUT_ENV in r.getMessage() and "larger value" in r.getMessage()
            for r in caplog.records
        )
        # Still inside the hung step: once it has run past the bound, health says stalled.
        await wait_for(lambda: engine.health().status == "stalled", what="a stalled health")
        assert engine._producer.busy_since is not None
        with pytest.raises(om.EngineStalledError, match=STEP_TIMEOUT_ENV):
            engine.check_health()
        assert engine.health().status == "stalled"
        await wait_for(lambda: engine._producer.busy_since is None, what="the hang to end")
        engine.check_health()
        p = params(steps=3, seed=11)
        frames = [f.data async for f in engine.stream(p)]
        assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
        stats = await settled(engine)
        assert stats.timed_out == 1 and stats.buffers_in_use == 0


@pytest.mark.asyncio
async def test_the_per_request_timeout_overrides_the_variable(monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "600")
    async with om.Engine(Synthetic(), device="cpu") as engine:
        t0 = time.monotonic()
        with pytest.raises(om.StepTimeoutError, match="timeout="):
            await engine.generate(params(steps=3, hang_at=1, hang_s=0.6), timeout=0.1)
        assert time.monotonic() - t0 < 5  # not the 600 s of the variable


@pytest.mark.asyncio
async def test_a_slow_step_within_the_bound_is_not_thrown_away(monkeypatch):
    # The upstream bug: a finished render discarded because the bound tracked step time.
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "2")
    async with om.Engine(Synthetic(), device="cpu") as engine:
        final = await engine.generate(params(steps=3, hang_at=2, hang_s=0.4))
    assert final.final


@pytest.mark.asyncio
async def test_timeout_mid_copy_then_other_requests_see_only_their_own_data(monkeypatch):
    model = Synthetic()
    device = om.device.SimDevice(compute_s=0.0, copy_s=0.4)
    async with om.Engine(model, device=device, max_buffers=2) as engine:
        with pytest.raises(om.StepTimeoutError):
            await engine.generate(params(steps=4, seed=1), timeout=0.1)
        assert engine.statistics().buffers_in_flight >= 1
        device.copy_s = 0.002
        for seed in (2, 3):
            p = params(steps=5, seed=seed)
            got = [f.data async for f in engine.stream(p)]
            assert all(torch.equal(a, b) for a, b in zip(got, model.expected_frames(p), strict=True))
        stats = await settled(engine)
        assert stats.timed_out == 1 and stats.buffers_in_use == 0


@pytest.mark.asyncio
async def test_a_model_that_raises_fails_only_its_request(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind), max_batch_size=8) as engine:
        results = {}

        async def run(name, p):
            try:
                results[name] = [f async for f in engine.stream(p, request_id=name)]
            except om.StepFailedError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "bad", params(steps=6, seed=1, fail_at=3))
            for i in range(4):
                tg.start_soon(run, f"good{i}", params(steps=6, seed=10 + i))
        err = results["bad"]
        assert isinstance(err, om.StepFailedError)
        assert err.request_id == "bad" and err.step == 3
        assert isinstance(err.__cause__, SyntheticFault)
        for i in range(4):
            frames = results[f"good{i}"]
            expected = model.expected_frames(params(steps=6, seed=10 + i))
            assert all(torch.equal(f.data, e) for f, e in zip(frames, expected, strict=True))
        stats = await settled(engine)
        assert stats.failed == 1 and stats.completed == 4
        engine.check_health()


@pytest.mark.asyncio
async def test_frames_before_a_failure_are_delivered_first():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        got = []
        with pytest.raises(om.StepFailedError):
            async for frame in engine.stream(params(steps=6, fail_at=4)):
                got.append(frame.step)
        assert got == [1, 2, 3]


@pytest.mark.asyncio
async def test_an_error_delivering_to_one_request_is_contained(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        victim = engine.stream(params(steps=5), request_id="victim")

        class Exploding(Delivery):
            def put(self, frame):
                raise RuntimeError("reader exploded")

        victim._request.delivery = Exploding("all")
        with pytest.raises(om.OmniStreamError, match="delivering step 1 failed") as info:
            await victim.__anext__()
        assert info.value.request_id == "victim"
        p = params(steps=4, seed=3)
        frames = [f.data async for f in engine.stream(p)]
        assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
        engine.check_health()


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["copier-wait", "copier-inline", "producer"])
async def test_an_internal_failure_kills_the_engine_visibly(where, monkeypatch):
    # copier-wait: the copier task finishing copies it waited for (sim);
    # copier-inline: the loop callback handing on CPU frames that need no wait.
    device = om.device.SimDevice(compute_s=0.0, copy_s=0.001) if where == "copier-wait" else "cpu"
    async with om.Engine(Synthetic(), device=device) as engine:
        pending = [engine.stream(params(steps=50, hang_at=3, hang_s=0.1), request_id=f"p{i}") for i in range(3)]
        await pending[0].__anext__()

        def boom(*args, **kwargs):
            raise RuntimeError(f"injected {where} failure")

        if where == "copier-wait":
            monkeypatch.setattr(engine._copier, "_complete", boom)
        elif where == "copier-inline":
            monkeypatch.setattr(engine._copier, "_deliver", boom)
        else:
            # Handing tickets to the loop is machinery, not any request's output.
            monkeypatch.setattr(engine._copier, "post", boom)
        for stream in pending:
            # Bounded: without the fix the engine is a zombie and this would hang.
            with anyio.fail_after(20), pytest.raises(om.EngineDeadError) as info:
                async for _ in stream:
                    pass
            assert info.value.request_id == stream.request_id
        health = engine.health()
        assert health.status == "dead" and "injected" in (health.reason or "")
        with pytest.raises(om.EngineDeadError):
            engine.check_health()
        with pytest.raises(om.EngineDeadError):
            engine.stream(params(steps=2))


@pytest.mark.asyncio
async def test_shutdown_ends_pending_streams_within_a_bound(device_kind, caplog):
    engine = om.Engine(Synthetic(), device=make_device(device_kind), shutdown_timeout=0.3)
    outcomes = []
    async with anyio.create_task_group() as tg:
        await engine.start()

        async def reader(stream):
            try:
                async for _ in stream:
                    pass
                outcomes.append("finished")
            except om.EngineClosedError as exc:
                outcomes.append(exc.request_id)

        tg.start_soon(reader, engine.stream(params(steps=5, hang_at=1, hang_s=3.0), request_id="stuck"))
        tg.start_soon(reader, engine.stream(params(steps=5), request_id="queued"))
        await wait_busy_with(engine, "stuck")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="omni_stream"):
            await engine.aclose()
        elapsed = time.monotonic() - t0
    assert elapsed < 2.0, "a step stuck on the device held shutdown beyond its bound"
    assert sorted(outcomes) == ["queued", "stuck"]
    assert any("abandoning" in r.getMessage() for r in caplog.records)
    assert engine.health().status == "closed"


class _NeverEvent:
    def __init__(self) -> None:
        self._never = threading.Event()

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self._never.wait()


class _HungCopyDevice(om.device.CpuDevice):
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
