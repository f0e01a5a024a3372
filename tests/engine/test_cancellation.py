"""Cancellation at every point of a request's life never kills the pump or leaks a buffer."""

from __future__ import annotations

import gc
import threading

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.models import Synthetic

from .conftest import make_device, params, settled, wait_busy_with, wait_for


async def assert_pump_alive(engine: om.Engine, model: Synthetic) -> None:
    """Another request still runs to completion with exact frames."""
    p = params(steps=5, seed=77)
    frames = [f.data async for f in engine.stream(p)]
    assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
    engine.check_health()


@pytest.mark.asyncio
async def test_cancel_before_the_first_step(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        # Occupy the producer so the second request cannot have started.
        blocker = engine.stream(params(steps=2, hang_at=1, hang_s=0.2), request_id="blocker")
        await wait_busy_with(engine, "blocker")
        stream = engine.stream(params(steps=5), request_id="early")
        assert engine.statistics().queued == 1
        assert engine.cancel("early") is True
        with pytest.raises(om.RequestCancelledError):
            await stream.__anext__()
        assert len([f async for f in blocker]) == 2
        stats = await settled(engine)
        assert stats.cancelled == 1 and stats.buffers_in_use == 0
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_cancel_during_a_step(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        stream = engine.stream(params(steps=5, hang_at=2, hang_s=0.3), request_id="mid")
        first = await stream.__anext__()
        assert first.step == 1
        await wait_busy_with(engine, "mid")
        assert engine.cancel("mid") is True
        with pytest.raises(om.RequestCancelledError):
            await stream.__anext__()
        stats = await settled(engine)
        assert stats.buffers_in_use == 0
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_cancel_during_a_copy_waits_for_the_copy_before_reusing_its_buffer():
    model = Synthetic()
    device = om.device.SimDevice(compute_s=0.0, copy_s=0.3)
    async with om.Engine(model, device=device, max_buffers=1) as engine:
        held = engine.stream(params(steps=3, seed=1), request_id="copying")  # noqa: F841 - dropping it would cancel
        await wait_for(lambda: engine.statistics().buffers_in_flight == 1, what="a copy in flight")
        assert engine.cancel("copying") is True
        # The only buffer still has a copy in flight: it must not be released yet.
        assert engine.statistics().buffers_in_use == 1
        # The next request needs that buffer; it must get it only after the copy.
        p = params(steps=3, seed=2)
        frames = [f.data async for f in engine.stream(p)]
        assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
        stats = await settled(engine)
        assert stats.buffers_in_use == 0 and stats.cancelled == 1


@pytest.mark.asyncio
async def test_cancel_while_a_frame_waits_for_its_reader(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind), queue_size=4) as engine:
        stream = engine.stream(params(steps=20), request_id="unread")
        await wait_for(lambda: engine.statistics().frames_delivered >= 4, what="queued frames")
        assert engine.cancel("unread") is True
        with pytest.raises(om.RequestCancelledError):
            await stream.__anext__()
        stats = await settled(engine)
        assert stats.buffers_in_use == 0
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_cancel_after_the_final_frame_is_a_no_op(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        frames = [f async for f in engine.stream(params(steps=3), request_id="done")]
        assert frames[-1].final
        assert engine.cancel("done") is False
        assert engine.cancel("never-existed") is False
        stats = engine.statistics()
        assert stats.completed == 1 and stats.cancelled == 0
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_breaking_out_of_async_for_aborts_within_one_step(device_kind):
    model = Synthetic()
    async with om.Engine(
        model, device=make_device(device_kind), max_run_ahead=1, queue_size=64
    ) as engine:
        read = 0
        async for frame in engine.stream(params(steps=1000, shape=[4, 32, 32], work=2)):
            read += 1
            if read == 3:
                break
        gc.collect()
        stats = await settled(engine)
        # At most the one step ahead (run-ahead 1) plus the one running when
        # the cancel landed; without the abort it would run to queue_size.
        assert stats.steps <= read + 2
        assert stats.cancelled == 1
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_a_cancelled_reader_task_aborts_its_request(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        stream = engine.stream(params(steps=10, hang_at=2, hang_s=0.3), request_id="r")
        with anyio.move_on_after(0.05):
            async for _ in stream:
                pass
        stats = await settled(engine)
        assert stats.cancelled == 1
        await assert_pump_alive(engine, model)


@pytest.mark.asyncio
async def test_async_with_closes_an_unfinished_stream(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        async with engine.stream(params(steps=100)) as frames:
            await frames.__anext__()
        stats = await settled(engine)
        assert stats.cancelled == 1
        await assert_pump_alive(engine, model)


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
