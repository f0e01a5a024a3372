"""protocol/inbox.py: one request's inbox on the client, a pure state machine fed by the reader.

Fed by hand, as the connection's reader feeds it; ``get`` waits under
asyncio, uvloop and trio (the client runs on all three).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest

from omni_stream.client import (
    ParamsRejectedError,
    PreviewFrame,
    Progress,
    ProtocolError,
    RemoteCancelledError,
    RequestFailedError,
    RequestRejectedError,
)
from omni_stream.protocol import client as wire
from omni_stream.protocol.inbox import Inbox
from omni_stream.protocol.server_messages import Paused, Restarted, Resumed

pytestmark = pytest.mark.anyio

RID = "req-1"


def _accepted(rid: str = RID) -> wire.Accepted:
    return wire.Accepted(rid, 5, False, False, {"format": "png"})


def _preview(step: int, *, final: bool = False) -> PreviewFrame:
    return PreviewFrame(RID, step, 5, final, "raw", 1, 1, b"\x00\x00\x00")


async def _drain(inbox: Inbox) -> list[Any]:
    items: list[Any] = []
    with anyio.fail_after(5):
        while True:
            try:
                items.append(await inbox.get())
            except StopAsyncIteration:
                return items


async def test_inbox_keeps_finals_and_drops_oldest_intermediates_when_behind(anyio_backend) -> None:
    inbox = Inbox(RID, want_progress=True, max_buffered=3)
    inbox.feed(_accepted())
    for step in range(1, 5):
        inbox.feed(Progress(RID, step, 5, 1.0))
        inbox.feed(_preview(step))
    inbox.feed(Progress(RID, 5, 5, 0.0))
    inbox.feed(_preview(5, final=True))
    inbox.feed(wire.Done(RID, 5, 0.5))
    items = await _drain(inbox)
    # Ten items arrived unread; the seven oldest intermediates made room.
    assert items == [_preview(4), Progress(RID, 5, 5, 0.0), _preview(5, final=True)]
    assert inbox.dropped == 7


async def test_inbox_without_progress_only_records_the_latest(anyio_backend) -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=64)
    inbox.feed(_accepted())
    inbox.feed(Progress(RID, 5, 5, 0.0))
    inbox.feed(_preview(5, final=True))
    inbox.feed(wire.Done(RID, 5, 0.5))
    assert await _drain(inbox) == [_preview(5, final=True)]
    assert inbox.last_progress == Progress(RID, 5, 5, 0.0)


@pytest.mark.parametrize(
    ("events", "error", "match"),
    [
        ([_preview(1)], ProtocolError, "before 'accepted'"),
        ([_accepted(), _accepted()], ProtocolError, "second 'accepted'"),
        ([_accepted(), _preview(4), wire.Done(RID, 5, 1.0)], ProtocolError, "without a final"),
        # A request of three images ended after two of its results.
        ([_accepted(), dataclasses.replace(_preview(5, final=True), index=0, images=3),
          dataclasses.replace(_preview(5, final=True), index=1, images=3), wire.Done(RID, 5, 1.0)],
         ProtocolError, "after 2 of the request's 3 results"),
        ([wire.ErrorMessage("bad_params", "steps must be >= 1", RID, "steps")], ParamsRejectedError,
         "steps"),
        ([wire.ErrorMessage("duplicate_id", "in use", RID, None)], RequestRejectedError, "in use"),
        ([_accepted(), wire.ErrorMessage("step_failed", "boom", RID, None)], RequestFailedError, "boom"),
        ([_accepted(), wire.ErrorMessage("brand_new_code", "?", RID, None)], RequestFailedError, r"\?"),
        ([_accepted(), wire.Cancelled(RID, "shutdown")], RemoteCancelledError, "shutdown"),
    ],
)
async def test_inbox_outcomes(anyio_backend, events: list[Any], error: type[Exception], match: str) -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    for event in events:
        inbox.feed(event)
    with pytest.raises(error, match=match) as info:
        await _drain(inbox)
    assert info.value.request_id == RID  # type: ignore[attr-defined]
    # The outcome is raised once; the stream is then simply over.
    assert await _drain(inbox) == []


async def test_inbox_keeps_every_result_of_several_images_and_a_loading_note(anyio_backend) -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=2)
    inbox.feed(_accepted())
    inbox.feed(wire.Queued(RID, 3))
    assert inbox.queued == wire.Queued(RID, 3)
    inbox.feed(wire.Loading(RID, "sd"))
    assert inbox.loading == wire.Loading(RID, "sd") and inbox.queued is None
    inbox.feed(wire.Queued(RID, 0))
    inbox.feed(Progress(RID, 5, 5, 0.0))
    assert inbox.loading is None and inbox.queued is None
    finals = [dataclasses.replace(_preview(5, final=True), index=i, images=3) for i in range(3)]
    for final in finals:
        inbox.feed(final)
    inbox.feed(wire.Done(RID, 5, 0.5))
    # max_buffered=2, but results are never dropped.
    assert await _drain(inbox) == finals


async def test_inbox_ignores_a_rejection_about_a_running_request(anyio_backend) -> None:
    # A cancel racing the request's end is answered not_found: that rejects
    # the cancel message, not the request, whose 'done' follows.
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    inbox.feed(wire.ErrorMessage("not_found", "no such request", RID, None))
    inbox.feed(_preview(5, final=True))
    inbox.feed(wire.Done(RID, 5, 0.1))
    assert await _drain(inbox) == [_preview(5, final=True)]


async def test_a_get_waits_for_the_next_item_and_is_woken_by_a_feed(anyio_backend) -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    got: list[Any] = []

    async def consume() -> None:
        got.append(await inbox.get())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            inbox.feed(_preview(1))
    assert got == [_preview(1)]


async def test_a_get_waiting_when_the_request_ends_gets_its_outcome(anyio_backend) -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    raised: list[BaseException] = []

    async def consume() -> None:
        try:
            await inbox.get()
        except RemoteCancelledError as exc:
            raised.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            inbox.feed(wire.Cancelled(RID, "client"))
    assert len(raised) == 1 and raised[0].request_id == RID  # type: ignore[attr-defined]


def test_pause_resume_and_restart_are_recorded_and_a_restart_clears_the_pause() -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    inbox.feed(Paused(RID, 2))
    assert inbox.paused
    inbox.feed(Resumed(RID, 2))
    assert not inbox.paused
    inbox.feed(Paused(RID, 3))
    restarted = Restarted(RID, 3, "crash")
    inbox.feed(restarted)  # the new server process runs it: nothing paused it there
    assert inbox.restarted == restarted and not inbox.paused
    assert list(inbox.items) == [] and not inbox.finished  # notes, not items or endings


def test_what_arrives_after_the_outcome_is_ignored() -> None:
    inbox = Inbox(RID, want_progress=True, max_buffered=8)
    inbox.feed(_accepted())
    inbox.feed(_preview(5, final=True))
    done = wire.Done(RID, 5, 0.5)
    inbox.feed(done)
    inbox.feed(_preview(6))
    inbox.feed(wire.Progress(RID, 6, 5, 0.0))
    inbox.feed(wire.ErrorMessage("step_failed", "late", RID, None))
    assert inbox.done == done and inbox.outcome is None
    assert list(inbox.items) == [_preview(5, final=True)]


def test_fail_ends_a_request_once_and_never_replaces_its_outcome() -> None:
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    first = ProtocolError("first", request_id=RID)
    inbox.fail(first)
    inbox.fail(ProtocolError("second", request_id=RID))
    assert inbox.finished and inbox.outcome is first


def test_a_done_after_an_earlier_failure_is_not_taken_for_success() -> None:
    # 'done' without its final preview fails the request; a later final and done change nothing.
    inbox = Inbox(RID, want_progress=False, max_buffered=8)
    inbox.feed(_accepted())
    inbox.feed(wire.Done(RID, 5, 0.5))
    assert isinstance(inbox.outcome, ProtocolError)
    inbox.feed(_preview(5, final=True))
    inbox.feed(wire.Done(RID, 5, 0.5))
    assert inbox.done is None and isinstance(inbox.outcome, ProtocolError)
