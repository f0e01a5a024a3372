"""stream.py: FrameStream, one request's frames as an async iterator, over an OutputProcessor.

No engine: frames are dispatched by hand as the copier would hand them on,
and the table's clock is driven by hand where a bound is looked at. On
asyncio, uvloop and trio.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import omni_stream as om
from omni_stream.engine.output_processor import OutputProcessor
from omni_stream.engine.request import Request, Status
from omni_stream.engine.stream import FrameStream

from .test_output_processor import make, request, ticket

pytestmark = pytest.mark.anyio


def stream(total: int = 3, **kw: Any) -> tuple[FrameStream, OutputProcessor, Request]:
    out, _, _ = make()
    r = request(out, total=total, **kw)
    return FrameStream(out, r), out, r


async def test_it_says_which_request_it_reads(anyio_backend) -> None:
    s, _, r = stream(total=4)
    assert (s.request_id, s.total, s.params) == ("r", 4, r.params)
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


async def test_a_reader_cancelled_while_it_waits_cancels_the_request(anyio_backend) -> None:
    s, out, r = stream(total=3)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.__anext__)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert r.status is Status.CANCELLED and r.finalized
    assert out.counts[Status.CANCELLED] == 1


async def test_a_wait_past_the_bound_times_the_request_out(anyio_backend) -> None:
    s, out, r = stream(total=3, timeout=0.01)
    with anyio.fail_after(5), pytest.raises(om.StepTimeoutError) as raised:
        await s.__anext__()
    assert raised.value.request_id == "r" and raised.value.bound_s == 0.01
    assert r.status is Status.TIMED_OUT


async def test_a_timer_that_fires_before_the_deadline_only_makes_the_reader_look_again(anyio_backend) -> None:
    # The bound is decided on the table's clock: a wake before the deadline is not a timeout.
    s, out, r = stream(total=2, timeout=30.0)
    table = out._table
    now = [100.0]
    table.clock = lambda: now[0]
    result: list[Any] = []

    async def read() -> None:
        try:
            result.append(await s.__anext__())
        except om.StepTimeoutError as exc:
            result.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            now[0] = 110.0  # 10 s of the 30 gone
            r.delivery._wakeup.wake()  # as the timer firing early would
            await anyio.wait_all_tasks_blocked()
            assert result == [] and r.status is Status.QUEUED  # waiting again, not timed out
            now[0] = 131.0  # past since + bound
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


async def test_closing_a_finished_stream_changes_nothing(anyio_backend) -> None:
    s, out, r = stream(total=1)
    out.dispatch(ticket(r, 1))
    async for _ in s:
        pass
    await s.aclose()
    assert r.status is Status.FINISHED and out.counts[Status.CANCELLED] == 0


async def test_an_unfinished_stream_dropped_unclosed_schedules_the_cancel_on_the_loop(anyio_backend) -> None:
    s, out, r = stream(total=3)
    scheduled: list[tuple[Any, ...]] = []

    class Loop:
        def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
            scheduled.append((callback, *args))

    out.loop = Loop()
    del s
    gc.collect()
    assert scheduled == [(out.abandon, r)]  # scheduled, not run: __del__ may run on any thread
    assert r.status is Status.QUEUED
    callback, *args = scheduled[0]
    callback(*args)
    assert r.status is Status.CANCELLED
