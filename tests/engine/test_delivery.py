"""delivery.py: one request's frames on their way to its reader, "all" and "latest".

Its own test, without an engine: frames are put by hand, as the output
processor puts them. The waits run under asyncio, uvloop and trio.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from omni_stream.engine.delivery import POLICIES, Delivery
from omni_stream.errors import RequestCancelledError, StepFailedError
from omni_stream.frame import Frame, engine_frame


def frame(step: int, total: int = 5) -> Frame:
    return engine_frame("r", step, total, torch.zeros(1), 0.0, 0.0, 0.0, 1, 0.0, False, 1)


def taken(delivery: Delivery) -> list[int]:
    """The steps get_nowait hands out until it has none (or raises)."""
    steps = []
    while (f := delivery.get_nowait()) is not None:
        steps.append(f.step)
    return steps


def test_the_policies_are_all_and_latest_and_another_is_refused_by_name() -> None:
    assert POLICIES == ("all", "latest")
    with pytest.raises(ValueError, match="'newest'"):
        Delivery("newest")


def test_all_hands_every_frame_out_in_order() -> None:
    delivery = Delivery("all")
    for step in (1, 2, 3):
        assert delivery.put(frame(step)) is None
    assert taken(delivery) == [1, 2, 3]


def test_latest_keeps_the_newest_and_returns_the_one_it_replaced_to_be_counted() -> None:
    delivery = Delivery("latest")
    first = frame(1)
    assert delivery.put(first) is None
    assert delivery.put(frame(2)) is first
    assert taken(delivery) == [2]
    assert delivery.put(frame(3)) is None  # the slot was emptied by the read: nothing replaced


def test_the_final_frame_is_never_replaced_and_ends_the_delivery() -> None:
    delivery = Delivery("latest")
    delivery.put(frame(4))
    delivery.put(frame(5))  # final
    late = frame(5)
    assert delivery.put(late) is late  # after the end: ignored, returned to be counted
    delivery.end(RequestCancelledError("too late", request_id="r"), drain=False)  # ended: no effect
    assert delivery.get_nowait().step == 5  # type: ignore[union-attr]
    with pytest.raises(StopAsyncIteration):
        delivery.get_nowait()


def test_an_end_without_error_lets_the_queue_drain_then_stops() -> None:
    delivery = Delivery("all")
    delivery.put(frame(1))
    delivery.end()
    assert delivery.put(frame(2)) is not None  # ignored
    assert delivery.get_nowait().step == 1  # type: ignore[union-attr]
    with pytest.raises(StopAsyncIteration):
        delivery.get_nowait()


def test_a_draining_error_comes_after_the_frames_before_it() -> None:
    # The model failed at step 3: steps 1 and 2 were real and were paid for.
    delivery = Delivery("all")
    delivery.put(frame(1))
    delivery.put(frame(2))
    error = StepFailedError("step 3 failed", request_id="r", step=3)
    delivery.end(error, drain=True)
    assert taken_until_error(delivery) == ([1, 2], error)


def test_an_error_that_does_not_drain_drops_the_queued_frames() -> None:
    # Cancelled or timed out: nobody wants stale frames.
    delivery = Delivery("all")
    delivery.put(frame(1))
    error = RequestCancelledError("cancelled", request_id="r")
    delivery.end(error, drain=False)
    assert taken_until_error(delivery) == ([], error)


def test_the_first_ending_wins() -> None:
    delivery = Delivery("all")
    first = RequestCancelledError("first", request_id="r")
    delivery.end(first, drain=False)
    delivery.end(StepFailedError("second", request_id="r", step=1))
    delivery.end()
    assert taken_until_error(delivery) == ([], first)


def taken_until_error(delivery: Delivery) -> tuple[list[int], BaseException | None]:
    steps: list[int] = []
    try:
        while (f := delivery.get_nowait()) is not None:
            steps.append(f.step)
    except BaseException as exc:  # noqa: BLE001 - the ending is what is looked at
        return steps, exc
    return steps, None


@pytest.mark.anyio
async def test_get_waits_for_a_put_and_returns_it(anyio_backend: Any) -> None:
    delivery = Delivery("all")
    got: list[int] = []

    async def reader() -> None:
        got.append((await delivery.get()).step)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert got == []  # nothing put yet: it waits
            delivery.put(frame(1))
    assert got == [1]


@pytest.mark.anyio
async def test_get_raises_the_ending_to_a_reader_that_waits(anyio_backend: Any) -> None:
    delivery = Delivery("all")
    error = RequestCancelledError("cancelled", request_id="r")
    raised: list[BaseException] = []

    async def reader() -> None:
        try:
            await delivery.get()
        except RequestCancelledError as exc:
            raised.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            delivery.end(error, drain=False)
    assert raised == [error]


@pytest.mark.anyio
async def test_a_bounded_wait_returns_at_its_bound_with_nothing_put(anyio_backend: Any) -> None:
    # wait(timeout) returns as a put would: the caller looks with get_nowait and finds nothing.
    delivery = Delivery("all")
    with anyio.fail_after(5):
        await delivery.wait(0.01)
    assert delivery.get_nowait() is None


@pytest.mark.anyio
async def test_the_final_frame_and_an_ending_leave_no_timer_behind(anyio_backend: Any) -> None:
    # An ended request's reader waits no more: its bound's timer must not stay in the loop's heap.
    for end in ("final", "error"):
        delivery = Delivery("all")
        with anyio.move_on_after(0.01):
            await delivery.wait(60.0)
        assert delivery._wakeup._timer is not None
        if end == "final":
            delivery.put(frame(5))
        else:
            delivery.end(RequestCancelledError("cancelled", request_id="r"), drain=False)
        assert delivery._wakeup._timer is None, end
