"""request.py and table.py: one request's record and the table the producer and the loop share.

Plain synchronous tests: no engine, no event loop. What the producer asks of
a request once a step (``runnable``) is checked against every reason it may
not run.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from omni_stream.engine.delivery import Delivery
from omni_stream.engine.request import Request, Status
from omni_stream.engine.table import Limits, RequestTable

RUN_AHEAD, QUEUE = 2, 3


def make(*, total: int = 10, policy: str = "all", params: dict[str, Any] | None = None, **kw: Any) -> Request:
    return Request(
        request_id="r",
        params=params or {},
        total=total,
        batch_key=None,
        policy=policy,
        timeout=None,
        arrival=1,
        delivery=Delivery(policy),
        **kw,
    )


def runnable(r: Request) -> bool:
    return r.runnable(RUN_AHEAD, QUEUE)


# -- Request -------------------------------------------------------------------


def test_a_new_request_is_queued_with_its_counters_at_zero_and_runnable() -> None:
    r = make()
    assert r.status is Status.QUEUED and not r.status.ended
    assert (r.issued, r.delivered, r.consumed) == (0, 0, 0)
    assert (r.in_flight, r.unconsumed, r.remaining) == (0, 0, 10)
    assert runnable(r)


def test_only_queued_and_running_are_live_statuses() -> None:
    assert {s for s in Status if not s.ended} == {Status.QUEUED, Status.RUNNING}


@pytest.mark.parametrize("status", [s for s in Status if s.ended])
def test_an_ended_request_is_not_runnable(status: Status) -> None:
    r = make()
    r.status = status
    assert not runnable(r)


def test_a_running_request_is_runnable() -> None:
    r = make()
    r.status = Status.RUNNING
    assert runnable(r)


def test_a_request_with_every_step_issued_is_not_runnable() -> None:
    r = make(total=2)
    r.issued = r.delivered = r.consumed = 2
    assert r.remaining == 0 and not runnable(r)


@pytest.mark.parametrize("flag", ["preparing", "paused"])
def test_a_preparing_or_paused_request_is_not_runnable(flag: str) -> None:
    r = make()
    setattr(r, flag, True)
    assert not runnable(r)


def test_steps_in_flight_to_the_delivery_are_bounded_by_max_run_ahead() -> None:
    r = make()
    r.issued = RUN_AHEAD  # computed, not yet delivered
    assert r.in_flight == RUN_AHEAD and not runnable(r)
    r.delivered = r.consumed = 1
    assert r.in_flight == RUN_AHEAD - 1 and runnable(r)


def test_all_waits_for_a_reader_queue_size_frames_behind() -> None:
    r = make(policy="all")
    r.issued = r.delivered = QUEUE  # all delivered, none read
    assert r.unconsumed == QUEUE and not runnable(r)
    r.consumed = 1
    assert runnable(r)


def test_latest_never_waits_for_its_reader() -> None:
    # Newer frames replace older ones: a reader that is behind slows nobody.
    r = make(policy="latest")
    r.issued = r.delivered = QUEUE + 5
    assert r.unconsumed == QUEUE + 5 and runnable(r)
    r.issued = r.delivered + RUN_AHEAD  # but the run-ahead bound still holds
    assert not runnable(r)


def test_a_preview_is_every_nth_step_and_never_the_final_one() -> None:
    r = make(total=6, preview_every=2)
    assert [n for n in range(1, 7) if r.previewed(n)] == [2, 4]
    assert not any(make(total=6).previewed(n) for n in range(1, 7))  # no previews asked


def test_a_request_resumed_from_a_checkpoint_counts_its_steps_as_made_and_read() -> None:
    r = make(total=10, resume_from=SimpleNamespace(step=4))
    assert (r.issued, r.delivered, r.consumed) == (4, 4, 4)
    assert r.remaining == 6 and runnable(r)


@pytest.mark.parametrize(
    ("num_images", "images"), [(None, 1), (1, 1), (3, 3), (True, 1), ("3", 1), (0, 1)]
)
def test_the_images_a_frame_holds_come_from_an_integer_num_images_above_one(
    num_images: object, images: int
) -> None:
    params = {} if num_images is None else {"num_images": num_images}
    assert make(params=params).images == images


# -- RequestTable --------------------------------------------------------------


def table() -> RequestTable:
    return RequestTable(Limits(max_batch_size=4, max_run_ahead=RUN_AHEAD, queue_size=QUEUE))


def test_the_tables_condition_is_on_its_lock_and_the_lock_is_reentrant() -> None:
    # The loop's ``end`` takes the condition while it may already hold the lock.
    t = table()
    with t.lock, t.cond, t.lock:
        assert t.cond._is_owned()  # type: ignore[attr-defined]


def test_wake_producer_notifies_only_a_producer_that_waits() -> None:
    t = table()
    woken = threading.Event()

    def producer() -> None:
        with t.cond:
            t.producer_waiting = True
            try:
                while not woken.is_set():
                    t.cond.wait()
            finally:
                t.producer_waiting = False

    with t.cond:
        notified: list[int] = []
        t.cond.notify = lambda n=1: notified.append(n)  # type: ignore[method-assign]
        t.wake_producer()  # nobody waits: no notify
        assert notified == []
        del t.cond.notify
    thread = threading.Thread(target=producer)
    thread.start()
    while True:  # until the producer waits (it set the flag under the lock, then waited)
        with t.cond:
            if t.producer_waiting:
                woken.set()
                t.wake_producer()
                break
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_default_limits_schedule_preemptively_a_step_at_a_time() -> None:
    limits = Limits(max_batch_size=4, max_run_ahead=2, queue_size=3)
    assert (limits.scheduling, limits.quantum) == ("preemptive", 1)
    with pytest.raises(AttributeError):
        limits.queue_size = 5  # type: ignore[misc]
