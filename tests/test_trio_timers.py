"""_trio_timers.py: call_at on trio, one system task for a run's timers."""

from __future__ import annotations

import trio
import trio.testing

from omni_stream import _trio_timers
from omni_stream._trio_timers import timers


def test_timers_fire_in_deadline_order_and_an_earlier_one_wakes_the_sleeping_task() -> None:
    fired: list[str] = []

    async def main() -> None:
        t = timers()
        assert timers() is t  # one per run
        now = trio.current_time()
        t.call_at(now + 0.2, lambda: fired.append("late"))
        await trio.sleep(0.01)  # the task sleeps until +0.2 ...
        t.call_at(now + 0.05, lambda: fired.append("early"))  # ... and is woken for this one
        await trio.sleep(0.1)
        assert fired == ["early"]
        await trio.sleep(0.2)
        assert fired == ["early", "late"]

    trio.run(main)


def test_a_cancelled_timer_never_fires_and_cancelled_ones_do_not_pile_up() -> None:
    fired: list[int] = []

    async def main() -> None:
        t = timers()
        now = trio.current_time()
        keep = t.call_at(now + 0.05, lambda: fired.append(1))
        gone = t.call_at(now + 0.01, lambda: fired.append(2))
        gone.cancel()
        assert gone.cancelled() and not keep.cancelled()
        # A busy server: many requests' timers, minutes away, disarmed as each request ends.
        for _ in range(1000):
            t.call_at(now + 600, lambda: fired.append(3)).cancel()
        assert len(t) < 200
        await trio.sleep(0.1)
        assert fired == [1]
        assert keep.cancelled()  # fired: done, and a cancel() now is a no-op
        keep.cancel()

    trio.run(main)


def test_a_raising_callback_is_logged_and_the_other_timers_still_fire(caplog) -> None:
    fired: list[int] = []

    def boom() -> None:
        raise ValueError("boom")

    async def main() -> None:
        t = timers()
        now = trio.current_time()
        t.call_at(now + 0.01, boom)
        t.call_at(now + 0.02, lambda: fired.append(1))
        await trio.sleep(0.1)

    trio.run(main)
    assert fired == [1]
    assert "a timer's callback raised" in caplog.text


def test_each_run_has_its_own_timers_and_the_task_ends_with_the_run() -> None:
    seen: list[_trio_timers.Timers] = []

    async def main() -> None:
        seen.append(timers())
        timers().call_at(trio.current_time() + 600, lambda: None)  # pending when the run ends

    trio.run(main)  # returns: the system task was cancelled with the run
    trio.run(main)
    assert len(seen) == 2 and seen[0] is not seen[1]


def test_cancelling_the_earliest_timer_lets_the_task_sleep_until_the_next() -> None:
    import math

    async def main() -> None:
        t = timers()
        await trio.testing.wait_all_tasks_blocked()  # the timers' task sleeps in its scope
        handle = t.call_at(trio.current_time() + 600, lambda: None)  # a reader's bound
        assert t._scope is not None and t._scope.deadline < math.inf
        handle.cancel()  # its request ended: nothing is due, and nothing should wake the task
        assert t._scope.deadline == math.inf and len(t) == 0

    trio.run(main)


def test_a_runs_timers_read_as_done_once_it_ended() -> None:
    # A Wakeup waited on again in a later run must not take a dead run's timer for an armed one.
    kept: list[_trio_timers.TimerHandle] = []

    async def main() -> None:
        kept.append(timers().call_at(trio.current_time() + 600, lambda: None))

    trio.run(main)
    assert kept[0].cancelled()
