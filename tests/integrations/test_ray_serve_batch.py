"""Batched transit without a cluster: what the replica takes together, what the reader unpacks and acks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

import omni_stream as om  # noqa: E402
from omni_stream.integrations.ray_serve.replica import take_ready  # noqa: E402
from omni_stream.integrations.ray_serve.stream import RemoteStream  # noqa: E402
from omni_stream.integrations.ray_serve.wire import Header, Item, WireBatch, WireFrame  # noqa: E402

pytestmark = pytest.mark.ray

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])

TOTAL = 10


def _frame(step: int) -> om.Frame:
    return om.Frame("r", step, TOTAL, torch.full((1,), float(step)), om.StepTimings(0, 0, 0, 1, 0), False)


class _Ready:
    """A FrameStreamLike's ``poll()`` over the frames the engine has ready now."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.ready = [_frame(s) for s in steps]

    def poll(self) -> om.Frame | None:
        return self.ready.pop(0) if self.ready else None


# -- the replica: take_ready ---------------------------------------------------------------


def test_all_takes_what_is_ready_in_order_up_to_the_windows_room() -> None:
    ready = _Ready([2, 3, 4, 5])
    batch = take_ready(ready, _frame(1), room=3, latest=False)  # type: ignore[arg-type]
    assert [f.step for f in batch] == [1, 2, 3]
    assert [f.step for f in ready.ready] == [4, 5]  # left for the next batch, none skipped


def test_all_stops_at_the_final_frame_and_takes_one_without_room() -> None:
    assert [f.step for f in take_ready(_Ready([9, 10]), _frame(8), room=16, latest=False)] == [8, 9, 10]  # type: ignore[arg-type]
    assert [f.step for f in take_ready(_Ready([2]), _frame(1), room=0, latest=False)] == [1]  # type: ignore[arg-type]


def test_latest_sends_only_the_newest_and_the_final() -> None:
    ready = _Ready([3, 4, 5])
    assert [f.step for f in take_ready(ready, _frame(2), room=2, latest=True)] == [5]  # type: ignore[arg-type]
    assert ready.ready == []  # the steps in between were taken, and never cross
    batch = take_ready(_Ready([7, 8, 9, 10]), _frame(6), room=2, latest=True)  # type: ignore[arg-type]
    assert [f.step for f in batch] == [9, 10]
    # With room for one frame only, the final one: it is never dropped.
    assert [f.step for f in take_ready(_Ready([9, 10]), _frame(8), room=1, latest=True)] == [10]  # type: ignore[arg-type]


# -- the reader: RemoteStream unpacks a batch, acknowledges per half window ---------------------


class _Response:
    def __init__(self, items: Sequence[Item]) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Item:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Engine:
    def __init__(self) -> None:
        self.acks: list[int] = []

    def _ack(self, key: str, seq: int) -> None:
        self.acks.append(seq)

    def _forget(self, stream: Any) -> None:
        pass


def _wired(steps: Sequence[int], first_seq: int) -> tuple[WireFrame, ...]:
    return tuple(WireFrame.of(_frame(s), first_seq + i) for i, s in enumerate(steps))


def _stream(items: Sequence[Item]) -> tuple[RemoteStream, _Engine, _Response]:
    engine, response = _Engine(), _Response(items)
    stream = RemoteStream(
        engine, response, key="k", request_id="r", total=TOTAL, params={}  # type: ignore[arg-type]
    )
    return stream, engine, response


@ASYNCIO
async def test_a_batch_arrives_as_its_frames_in_order_and_poll_takes_them_without_waiting() -> None:
    stream, _, response = _stream([
        Header("rep", "r", TOTAL, window=4),
        WireBatch(_wired([1, 2, 3], 1)),
        WireBatch(_wired(range(4, 11), 4)),
    ])
    first = await stream.__anext__()
    assert first.step == 1
    polled = stream.poll()
    assert polled is not None and polled.step == 2  # already here: no Ray round trip
    rest = [f.step async for f in stream]
    assert rest == list(range(3, 11))
    assert stream.poll() is None and not response.cancelled


@ASYNCIO
async def test_the_reader_acks_every_half_window_so_the_replica_never_runs_dry() -> None:
    window = 4
    stream, engine, _ = _stream([Header("rep", "r", TOTAL, window=window), WireBatch(_wired(range(1, 11), 1))])
    taken = 0
    async for frame in stream:
        taken = frame.step
        if not frame.final:
            unacked = taken - (engine.acks[-1] if engine.acks else 0)
            # Below half the window unacknowledged after every take: the replica,
            # blocked at `window` in transit, always has an ack on its way.
            assert unacked < window // 2
    assert engine.acks == [2, 4, 6, 8]  # one ack a half window of a batch, not one a frame


@ASYNCIO
async def test_the_reader_acks_a_batch_once_taken_and_a_lone_frame_at_once() -> None:
    items: list[Item] = [Header("rep", "r", TOTAL, window=8), WireBatch(_wired([1, 2, 3], 1))]
    items += [*_wired([4, 5], 4), WireBatch(_wired(range(6, 11), 6))]
    stream, engine, _ = _stream(items)
    assert [f.step async for f in stream] == list(range(1, 11))
    assert engine.acks == [3, 4, 5, 9]  # the batch, each lone frame, half the window (the final needs none)
