"""stream.py: FrameStream, one request's frames as an async iterator, over an OutputProcessor.

No engine: frames are dispatched by hand as the copier would hand them on
(or put on the request's Delivery, where the stream alone must know it is
done), and the table's clock is driven by hand where a bound is looked at.
On asyncio, uvloop and trio.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream._backend import running_loop
from omni_stream.config import STEP_TIMEOUT_ENV
from omni_stream.engine.output_processor import OutputProcessor
from omni_stream.engine.request import Request, Status
from omni_stream.engine.stream import FrameStream
from omni_stream.frame import engine_frame

from .test_output_processor import Whole, make, request, ticket

pytestmark = pytest.mark.anyio


def stream(
    total: int = 3, model: om.StepModel | None = None, **kw: Any
) -> tuple[FrameStream, OutputProcessor, Request]:
    out, _, _ = make(model=model)
    r = request(out, total=total, **kw)
    return FrameStream(out, r), out, r


def frame(r: Request, step: int) -> om.Frame:
    return engine_frame(r.id, step, r.total, torch.full((2,), float(step)), 0.0, 0.0, 0.0, 1, 0.0, False, 1)


class Loop:
    """A loop that records what is scheduled on it and runs nothing."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[Any, ...]] = []

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.scheduled.append((callback, *args))


def frozen_clock(out: OutputProcessor, start: float = 100.0) -> list[float]:
    """The table's clock, moved by hand: ``now[0] = t``."""
    now = [start]
    out._table.clock = lambda: now[0]
    return now


async def read_into(s: FrameStream, result: list[Any]) -> None:
    """One ``__anext__``: its frame, or the StepTimeoutError it raised, appended to ``result``."""
    try:
        result.append(await s.__anext__())
    except om.StepTimeoutError as exc:
        result.append(exc)


async def test_it_says_which_request_it_reads(anyio_backend) -> None:
    out, _, _ = make()
    r = request(out, "req-7", total=4)
    r.params = {"steps": 4, "seed": 1}  # as the model checked them, defaults filled in
    s = FrameStream(out, r)
    assert (s.request_id, s.total, s.params) == ("req-7", 4, {"steps": 4, "seed": 1})
    assert s.__aiter__() is s


async def test_frames_come_in_order_each_counted_consumed_and_it_stops_after_the_final(anyio_backend) -> None:
    s, out, r = stream(total=3)
    for step in (1, 2, 3):
        out.dispatch(ticket(r, step))
    steps = []
    async for frame in s:
        steps.append(frame.step)
        assert r.consumed == frame.step  # the producer's backpressure: counted as it is taken
    assert steps == [1, 2, 3]
    assert r.status is Status.FINISHED
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()


async def test_a_reader_waits_for_the_next_frame(anyio_backend) -> None:
    s, out, r = stream(total=2)
    got: list[int] = []

    async def read() -> None:
        async for frame in s:
            got.append(frame.step)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for step in (1, 2):
                await anyio.wait_all_tasks_blocked()
                assert got == list(range(1, step))  # waiting for this step
                out.dispatch(ticket(r, step))
    assert got == [1, 2]


async def test_the_requests_error_is_raised_after_the_frames_before_it(anyio_backend) -> None:
    s, out, r = stream(total=3)
    out.dispatch(ticket(r, 1))
    out.dispatch(ticket(r, 2, error=RuntimeError("copy failed")))
    assert (await s.__anext__()).step == 1
    with pytest.raises(om.StepFailedError) as raised:
        await s.__anext__()
    assert raised.value.request_id == "r"
    with pytest.raises(StopAsyncIteration):  # raised once; the stream is done after
        await s.__anext__()


async def test_the_ending_error_is_raised_as_it_is_and_the_request_keeps_its_ending(anyio_backend) -> None:
    s, out, r = stream(total=3)
    err = om.OmniStreamError("the engine went away", request_id="r")
    out.end(r, Status.FAILED, err)
    with pytest.raises(om.OmniStreamError) as raised:
        await s.__anext__()
    assert raised.value is err
    assert r.status is Status.FAILED and out.counts[Status.CANCELLED] == 0


async def test_a_reader_cancelled_while_it_waits_cancels_the_request(anyio_backend) -> None:
    s, out, r = stream(total=3)
    returned: list[Any] = []

    async def read() -> None:
        returned.append(await s.__anext__())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert returned == []  # the cancellation went through, neither swallowed nor turned into a frame
    assert r.status is Status.CANCELLED and r.finalized
    assert out.counts[Status.CANCELLED] == 1
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()


async def test_a_wait_past_the_bound_times_the_request_out(anyio_backend) -> None:
    s, out, r = stream(total=3, timeout=0.01)
    with anyio.fail_after(5), pytest.raises(om.StepTimeoutError) as raised:
        await s.__anext__()
    assert raised.value.request_id == "r" and raised.value.bound_s == 0.01
    assert r.status is Status.TIMED_OUT
    with pytest.raises(StopAsyncIteration):  # raised once
        await s.__anext__()


async def test_without_a_timeout_each_wait_reads_the_configured_bound(anyio_backend, monkeypatch) -> None:
    s, out, r = stream(total=3)
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "30")
    out.dispatch(ticket(r, 1))
    assert (await s.__anext__()).step == 1
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.01")  # changed between two frames: the next wait has it
    with anyio.fail_after(5), pytest.raises(om.StepTimeoutError) as raised:
        await s.__anext__()
    assert raised.value.bound_s == 0.01 and raised.value.step == 2


async def test_a_timer_that_fires_before_the_deadline_only_makes_the_reader_look_again(anyio_backend) -> None:
    # The bound is decided on the table's clock: a wake before the deadline is not a timeout.
    s, out, r = stream(total=2, timeout=30.0)
    now = frozen_clock(out)
    result: list[Any] = []

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_into, s, result)
            await anyio.wait_all_tasks_blocked()
            now[0] = 110.0  # 10 s of the 30 gone
            r.delivery._wakeup.wake()  # as the timer firing early would
            await anyio.wait_all_tasks_blocked()
            assert result == [] and r.status is Status.QUEUED  # waiting again, not timed out
            now[0] = 131.0  # past since + bound
            r.delivery._wakeup.wake()
    assert len(result) == 1 and isinstance(result[0], om.StepTimeoutError)
    assert r.status is Status.TIMED_OUT


async def test_behind_a_whole_run_no_bound_runs_until_the_producer_hands_it_the_device(anyio_backend) -> None:
    s, out, r = stream(total=2, model=Whole(), timeout=30.0)
    now = frozen_clock(out)
    result: list[Any] = []

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_into, s, result)
            await anyio.wait_all_tasks_blocked()
            now[0] = 200.0  # far past since + bound, queued behind another request's whole run
            r.delivery._wakeup.wake()
            await anyio.wait_all_tasks_blocked()
            assert result == [] and r.status is Status.QUEUED
            with out._table.cond:
                r.handed_at = 190.0  # as the producer stamps it, on the same clock
            r.delivery._wakeup.wake()
            await anyio.wait_all_tasks_blocked()
            assert result == [] and r.status is Status.QUEUED  # 10 s of the 30 since it was handed the device
            now[0] = 221.0
            r.delivery._wakeup.wake()
    assert len(result) == 1 and isinstance(result[0], om.StepTimeoutError)
    assert r.status is Status.TIMED_OUT


async def test_poll_never_waits_and_leaves_the_ending_to_the_next_anext(anyio_backend) -> None:
    s, out, r = stream(total=3)
    assert s.poll() is None  # nothing yet
    out.dispatch(ticket(r, 1))
    frame = s.poll()
    assert frame is not None and frame.step == 1 and r.consumed == 1
    out.dispatch(ticket(r, 2, error=RuntimeError("copy failed")))
    assert s.poll() is None  # the error is not raised here
    with pytest.raises(om.StepFailedError):
        await s.__anext__()
    assert s.poll() is None  # done


async def test_poll_takes_the_newest_frame_for_latest(anyio_backend) -> None:
    s, out, r = stream(total=4, policy="latest")
    for step in (1, 2, 3):
        out.dispatch(ticket(r, step))
    frame = s.poll()
    assert frame is not None and frame.step == 3
    assert r.consumed == 3  # the two replaced count as consumed too: the producer runs on
    out.dispatch(ticket(r, 4))
    final = s.poll()
    assert final is not None and final.final
    assert s.poll() is None


async def test_closing_an_unfinished_stream_cancels_its_request_once(anyio_backend) -> None:
    s, out, r = stream(total=3)
    async with s:
        out.dispatch(ticket(r, 1))
        assert (await s.__anext__()).step == 1
    assert r.status is Status.CANCELLED
    await s.aclose()
    assert out.counts[Status.CANCELLED] == 1
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()


@pytest.mark.parametrize("take", ["anext", "poll"])
async def test_a_stream_that_took_its_final_frame_cancels_nothing_after(anyio_backend, take: str) -> None:
    # Fed through the Delivery alone, so the request is not finalized: what
    # stops a cancel here is the stream knowing it is done, not the table.
    s, out, r = stream(total=2)
    loop = Loop()
    out.loop = loop
    for step in (1, 2):
        r.delivery.put(frame(r, step))
    steps = [(await s.__anext__()).step]
    final = await s.__anext__() if take == "anext" else s.poll()
    assert final is not None and final.final and steps == [1]
    assert s.poll() is None
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()
    async with s:
        pass
    await s.aclose()
    del s
    gc.collect()
    assert loop.scheduled == [] and r.status is Status.QUEUED and not r.finalized


async def test_an_unfinished_stream_dropped_unclosed_schedules_the_cancel_on_the_loop(anyio_backend) -> None:
    s, out, r = stream(total=3)
    loop = Loop()
    out.loop = loop
    del s
    gc.collect()
    assert loop.scheduled == [(out.abandon, r)]  # scheduled, not run: __del__ may run on any thread
    assert r.status is Status.QUEUED
    callback, *args = loop.scheduled[0]
    callback(*args)
    assert r.status is Status.CANCELLED


async def test_a_stream_dropped_on_another_thread_is_cancelled_on_the_loops_thread(
    anyio_backend, monkeypatch
) -> None:
    s, out, r = stream(total=3)
    out.loop = running_loop()
    abandon = out.abandon
    ran_on: list[int] = []
    cancelled = anyio.Event()

    def recording_abandon(req: Request) -> None:
        ran_on.append(threading.get_ident())
        abandon(req)
        cancelled.set()

    monkeypatch.setattr(out, "abandon", recording_abandon)
    holder = [s]
    del s
    await anyio.to_thread.run_sync(holder.clear)  # the last reference goes on a worker thread
    with anyio.fail_after(5):
        await cancelled.wait()
    assert ran_on == [threading.get_ident()]
    assert r.status is Status.CANCELLED
