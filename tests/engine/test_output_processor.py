"""The output processor without an engine: dispatch, endings, the reader's side, timeouts.

Everything but ``consume`` is plain synchronous code: these tests build a
request table, requests and tickets by hand and run no event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import omni_stream as om
from omni_stream.engine.copier import CopyTicket
from omni_stream.engine.delivery import Delivery
from omni_stream.engine.output_processor import OutputProcessor
from omni_stream.engine.request import Request, Status
from omni_stream.engine.table import Limits, RequestTable


@dataclass
class Activity:
    busy_since: float | None = None
    busy_with: tuple[str, ...] = ()


class Stepped(om.models.Synthetic):
    runs_whole_requests = False


class Whole(om.models.Synthetic):
    runs_whole_requests = True


def make(
    *, model: om.StepModel | None = None, activity: Activity | None = None, queue_size: int = 8
) -> tuple[OutputProcessor, RequestTable, Activity]:
    table = RequestTable(Limits(max_batch_size=8, max_run_ahead=3, queue_size=queue_size))
    activity = activity or Activity()
    return OutputProcessor(table, activity, model or Stepped()), table, activity


def request(
    out: OutputProcessor,
    request_id: str = "r",
    *,
    total: int = 3,
    policy: str = "all",
    timeout: float | None = None,
) -> Request:
    r = Request(
        request_id=request_id,
        params={},
        total=total,
        batch_key=None,
        policy=policy,
        timeout=timeout,
        arrival=len(out.by_id) + 1,
        delivery=Delivery(policy),
    )
    out.by_id[request_id] = r
    return r


def ticket(r: Request, step: int, **fields: Any) -> CopyTicket:
    r.issued = max(r.issued, step)
    fields.setdefault("data", torch.full((2,), float(step)))
    return CopyTicket(request=r, step=step, **fields)


def drain(r: Request) -> list[int]:
    """The steps queued for the reader, in order (stops at the end or when empty)."""
    steps = []
    while (frame := r.delivery.get_nowait()) is not None:
        steps.append(frame.step)
        if frame.final:
            break
    return steps


def drain_until_error(r: Request) -> list[int]:
    """The steps queued before the ending error."""
    steps = []
    try:
        while (frame := r.delivery.get_nowait()) is not None:
            steps.append(frame.step)
    except om.OmniStreamError:
        pass
    return steps


# -- dispatch ------------------------------------------------------------------


def test_a_copied_frame_reaches_its_delivery_with_its_timings() -> None:
    out, _, _ = make()
    r = request(out)
    out.dispatch(ticket(r, 1, queued_s=0.1, compute_s=0.2, copy_s=0.3, batch_size=2, decode_s=0.4))
    frame = r.delivery.get_nowait()
    assert frame is not None
    assert (frame.request_id, frame.step, frame.total, frame.final) == ("r", 1, 3, False)
    assert frame.data.tolist() == [1.0, 1.0]
    assert frame.timings == om.StepTimings(0.1, 0.2, 0.3, 2, 0.4)
    assert r.delivered == 1 and r.consumed == 0
    assert out.frames_delivered == 1 and out.frames_dropped == 0
    assert r.status is Status.QUEUED and not r.finalized and out.by_id == {"r": r}


def test_the_final_frame_finishes_the_request() -> None:
    out, _, _ = make()
    r = request(out, total=2)
    out.dispatch(ticket(r, 1))
    out.dispatch(ticket(r, 2))
    assert r.status is Status.FINISHED and r.finalized
    assert out.by_id == {}
    assert out.counts[Status.FINISHED] == 1
    assert drain(r) == [1, 2]
    with pytest.raises(StopAsyncIteration):
        r.delivery.get_nowait()


def test_latest_counts_a_replaced_frame_as_dropped_and_consumed() -> None:
    out, _, _ = make()
    r = request(out, policy="latest")
    out.dispatch(ticket(r, 1))
    out.dispatch(ticket(r, 2))
    assert out.frames_delivered == 2 and out.frames_dropped == 1
    assert r.consumed == 1  # the producer's backpressure sees the replaced frame as taken
    assert drain(r) == [2]


def test_a_failed_copy_fails_the_request_after_the_frames_before_it() -> None:
    out, _, _ = make()
    r = request(out)
    out.dispatch(ticket(r, 1))
    boom = RuntimeError("copy failed")
    out.dispatch(ticket(r, 2, data=None, error=boom))
    assert r.status is Status.FAILED and out.counts[Status.FAILED] == 1 and out.by_id == {}
    assert r.delivered == 1  # an error is not a frame
    assert drain_until_error(r) == [1]
    with pytest.raises(om.StepFailedError) as info:
        r.delivery.get_nowait()
    assert info.value.request_id == "r" and info.value.step == 2
    assert info.value.__cause__ is boom
    assert "copying step 2/3 to the host failed" in str(info.value)


def test_an_omni_stream_error_in_a_ticket_is_raised_as_it_is() -> None:
    out, _, _ = make()
    r = request(out)
    err = om.StepFailedError("the model failed", request_id="r", step=1)
    out.dispatch(ticket(r, 1, data=None, error=err))
    with pytest.raises(om.StepFailedError) as info:
        r.delivery.get_nowait()
    assert info.value is err


def test_a_frame_of_an_ended_request_is_counted_delivered_and_dropped() -> None:
    out, _, _ = make()
    r = request(out)
    out.abandon(r)
    out.dispatch(ticket(r, 1))
    # Its step left the pipeline (run-ahead frees), but nobody sees the frame.
    assert r.delivered == 1 and out.frames_delivered == 0
    with pytest.raises(om.RequestCancelledError):
        r.delivery.get_nowait()


def test_a_ticket_without_data_only_counts_the_step() -> None:
    out, _, _ = make()
    r = request(out)
    out.dispatch(ticket(r, 1, data=None))
    assert r.delivered == 1 and out.frames_delivered == 0
    assert r.delivery.get_nowait() is None


def test_dispatch_wakes_a_waiting_producer() -> None:
    out, table, _ = make()
    r = request(out)
    notified = []
    table.producer_waiting = True
    table.cond.notify = lambda n=1: notified.append(n)  # type: ignore[method-assign]
    out.dispatch(ticket(r, 1))
    assert notified == [1]


# -- endings -------------------------------------------------------------------


def test_a_request_ends_once() -> None:
    out, _, _ = make()
    r = request(out)
    assert out.end(r, Status.CANCELLED, om.RequestCancelledError("x", request_id="r"))
    assert not out.end(r, Status.FAILED, om.StepFailedError("y", request_id="r", step=1))
    assert r.status is Status.CANCELLED
    assert out.counts == {Status.FINISHED: 0, Status.CANCELLED: 1, Status.FAILED: 0, Status.TIMED_OUT: 0}
    with pytest.raises(om.RequestCancelledError):
        r.delivery.get_nowait()


def test_ending_an_old_request_leaves_a_new_one_with_its_id() -> None:
    out, _, _ = make()
    old = request(out, "same")
    new = request(out, "same")  # the id was reused after the old one was replaced
    out.end(old, Status.CANCELLED, None)
    assert out.by_id == {"same": new}


def test_an_ending_that_does_not_drain_drops_the_queued_frames() -> None:
    out, _, _ = make()
    r = request(out)
    out.dispatch(ticket(r, 1))
    out.end(r, Status.TIMED_OUT, om.StepTimeoutError("late", request_id="r", step=2, bound_s=1.0))
    with pytest.raises(om.StepTimeoutError):
        r.delivery.get_nowait()


# -- the reader's side ---------------------------------------------------------


def test_consumed_counts_a_taken_frame() -> None:
    out, _, _ = make()
    r = request(out)
    out.consumed(r)
    out.consumed(r)
    assert r.consumed == 2


def test_abandon_cancels_a_running_request_and_nothing_else() -> None:
    out, _, _ = make()
    r = request(out, total=1)
    out.abandon(r)
    assert r.status is Status.CANCELLED and out.counts[Status.CANCELLED] == 1
    with pytest.raises(om.RequestCancelledError, match="closed before its final frame"):
        r.delivery.get_nowait()
    done = request(out, "done", total=1)
    out.dispatch(ticket(done, 1))
    out.abandon(done)  # finished already: abandoning it changes nothing
    assert done.status is Status.FINISHED and out.counts[Status.CANCELLED] == 1


class RecordingLoop:
    def __init__(self, *, closed: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.closed = closed

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, *args))


def test_abandon_threadsafe_only_schedules_the_abandon_on_the_loop() -> None:
    out, _, _ = make()
    r = request(out)
    out.abandon_threadsafe(r)  # not started: no loop, nothing to do
    loop = RecordingLoop()
    out.loop = loop  # type: ignore[assignment]
    out.abandon_threadsafe(r)
    assert loop.calls == [(out.abandon, r)] and not r.finalized
    fn, arg = loop.calls[0]
    fn(arg)
    assert r.status is Status.CANCELLED
    out.abandon_threadsafe(r)  # ended: nothing scheduled
    assert len(loop.calls) == 1


def test_abandon_threadsafe_on_a_closed_loop_does_not_raise() -> None:
    out, _, _ = make()
    r = request(out)
    loop = asyncio.new_event_loop()
    loop.close()
    out.loop = loop
    out.abandon_threadsafe(r)
    assert not r.finalized


# -- timeouts ------------------------------------------------------------------


def test_the_step_timeout_is_the_requests_else_the_environment_read_now(monkeypatch) -> None:
    out, _, _ = make()
    assert out.step_timeout(request(out, "own", timeout=2.5)) == 2.5
    default = request(out, "default")
    monkeypatch.setenv("OMNI_STREAM_STEP_TIMEOUT", "7")
    assert out.step_timeout(default) == 7.0
    monkeypatch.setenv("OMNI_STREAM_STEP_TIMEOUT", "9")
    assert out.step_timeout(default) == 9.0


def test_a_stepped_requests_bound_runs_from_when_its_reader_began_to_wait() -> None:
    out, _, _ = make()
    r = request(out)
    assert out.step_deadline(r, 10.0, 2.0) == 12.0
    r.handed_at = 11.0  # queueing behind other steps counts: one or two batches at most
    assert out.step_deadline(r, 10.0, 2.0) == 12.0


def test_behind_a_whole_run_the_bound_runs_from_when_the_producer_handed_it_the_device() -> None:
    out, _, _ = make(model=Whole())
    r = request(out)
    assert out.step_deadline(r, 10.0, 2.0) is None  # queued: another request's whole run
    r.handed_at = 50.0  # long after its reader began to wait
    assert out.step_deadline(r, 10.0, 2.0) == 52.0
    assert out.step_deadline(r, 60.0, 2.0) == 62.0  # running already: from the reader's wait


def test_a_timeout_ends_the_request_and_says_what_the_step_waited_on(caplog) -> None:
    out, _, _ = make()
    r = request(out, timeout=1.5)
    out.dispatch(ticket(r, 1))
    r.issued = 2
    with caplog.at_level(logging.WARNING, logger="omni_stream.engine"):
        err = out.time_out(r, 1.5)
    assert isinstance(err, om.StepTimeoutError)
    assert (err.request_id, err.step, err.bound_s) == ("r", 2, 1.5)
    assert "it was copying step 2/3 to the host" in str(err)
    assert "the request's timeout=" in str(err)
    assert r.status is Status.TIMED_OUT and out.counts[Status.TIMED_OUT] == 1 and out.by_id == {}
    assert "request r timed out after 1.5 s waiting for step 2/3" in caplog.text
    with pytest.raises(om.StepTimeoutError):
        r.delivery.get_nowait()  # the queued frame is dropped: nobody wants it late


def test_a_timeout_without_its_own_bound_names_the_environment_variable() -> None:
    out, _, _ = make()
    err = out.time_out(request(out), 600.0)
    assert "(bound from OMNI_STREAM_STEP_TIMEOUT)" in str(err)
    assert err.step == 1


@pytest.mark.parametrize(
    ("step", "busy_since", "busy_with", "policy", "stage"),
    [
        (2, None, (), "all", "copying step 2/3 to the host"),  # issued: 2
        (3, 1.0, ("r",), "all", "computing step 3/3"),
        (3, 1.0, ("a", "b"), "all", "queued behind a running step of request(s) a, b"),
        (3, None, ("r",), "latest", "queued for step 3/3"),  # not busy: busy_with is stale
        (3, None, (), "all", "paused: its reader is behind"),  # 2 unread, queue_size 2
        (3, None, (), "latest", "queued for step 3/3"),  # "latest" never waits for its reader
    ],
)
def test_what_a_step_waited_on(
    step: int, busy_since: float | None, busy_with: tuple[str, ...], policy: str, stage: str
) -> None:
    out, _, _ = make(activity=Activity(busy_since, busy_with), queue_size=2)
    r = request(out, policy=policy)
    r.issued = 2
    assert out.waiting_on(r, step) == stage


# -- dispatch, where the copier hands frames over ------------------------------------


class BrokenDelivery(Delivery):
    def put(self, frame: om.Frame) -> om.Frame | None:
        raise ValueError("no room")


@pytest.mark.asyncio
async def test_a_delivery_that_fails_ends_its_request_only() -> None:
    out, _, _ = make()
    broken = request(out, "broken")
    broken.delivery = BrokenDelivery("all")
    fine = request(out, "fine", total=1)
    # Dispatched in the call that receives them: no task runs between (_handover.py).
    out.deliver([ticket(broken, 1), ticket(fine, 1)])
    assert fine.finalized
    assert broken.status is Status.FAILED and fine.status is Status.FINISHED
    with pytest.raises(om.OmniStreamError, match="delivering step 1 failed") as info:
        broken.delivery.get_nowait()
    assert isinstance(info.value.__cause__, ValueError)
    assert drain(fine) == [1]
