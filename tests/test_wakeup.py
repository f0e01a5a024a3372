"""_wakeup.py: the single-reader hand-off's wake-up, its rule, and that nobody is stranded.

On every anyio backend the engine runs on (asyncio, uvloop, trio), through
anyio's pytest plugin: the event a Wakeup uses is the loop's own, picked at
its first wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from omni_stream import _wakeup
from omni_stream._wakeup import Wakeup

pytestmark = pytest.mark.anyio


async def test_a_wake_with_nobody_waiting_is_not_remembered(anyio_backend) -> None:
    wakeup = Wakeup()
    wakeup.wake()
    with anyio.move_on_after(0.05) as scope:
        await wakeup.wait()
    assert scope.cancelled_caught  # the waiter's own check sees the change, not the wait


async def test_every_waiter_is_woken_and_the_next_wait_waits_again(anyio_backend) -> None:
    wakeup = Wakeup()
    items: list[int] = []
    got: list[int] = []

    async def reader() -> None:
        while not items:
            await wakeup.wait()
        got.append(items[0])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(reader)  # a second reader must not strand the first
            await anyio.sleep(0.01)
            items.append(7)
            wakeup.wake()
    assert got == [7, 7]
    with anyio.move_on_after(0.05) as scope:
        await wakeup.wait()
    assert scope.cancelled_caught


async def test_a_cancelled_waiter_leaves_the_wakeup_usable(anyio_backend) -> None:
    wakeup = Wakeup()
    with anyio.move_on_after(0.01):
        await wakeup.wait()
    woken = anyio.Event()

    async def waiter() -> None:
        await wakeup.wait()
        woken.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.01)
            wakeup.wake()
            await woken.wait()


async def test_the_backend_is_asked_once_and_a_wait_is_the_loops_own(anyio_backend, monkeypatch) -> None:
    # The per-frame path: a wait must not ask which loop runs each time (anyio.Event
    # would, per event); on asyncio it is a bare future of the running loop.
    asked: list[object] = []
    real = _wakeup.current_backend

    def counting() -> Any:
        asked.append(None)
        return real()

    monkeypatch.setattr(_wakeup, "current_backend", counting)
    wakeup = Wakeup()
    items: list[int] = []
    kinds: set[type] = set()

    async def reader() -> None:
        while len(items) < 50:
            await wakeup.wait()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for i in range(50):
                await anyio.wait_all_tasks_blocked()  # the reader waits
                if anyio_backend[0] == "trio":
                    assert len(wakeup._tasks) == 1  # the reader's task, parked
                    kinds.add(type(wakeup._tasks[0]))
                else:
                    assert len(wakeup._waiters) == 1
                    kinds.add(type(wakeup._waiters[0]))
                    assert wakeup._waiters[0].get_loop() is asyncio.get_running_loop()
                items.append(i)
                wakeup.wake()
    assert len(asked) == 1
    if anyio_backend[0] == "trio":
        import trio

        assert kinds == {trio.lowlevel.Task}
    else:
        assert len(kinds) == 1 and issubclass(kinds.pop(), asyncio.Future)


async def test_a_cancelled_waiter_takes_no_other_waiters_wake_and_is_not_kept(anyio_backend) -> None:
    # asyncio cancels the future a cancelled task awaits: each waiter has its own,
    # so the other waiter is still woken, and the cancelled one is dropped at the next wait.
    wakeup = Wakeup()
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await wakeup.wait()
        woken.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as doomed:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(waiter, "cancelled")
                    tg.start_soon(waiter, "kept")
                    await anyio.wait_all_tasks_blocked()
                    doomed.cancel()
            await anyio.wait_all_tasks_blocked()
            wakeup.wake()
    assert woken == ["kept"]
    if anyio_backend[0] != "trio":
        for _ in range(100):  # a waiter cancelled each time, and never a wake between
            with anyio.move_on_after(0):
                await wakeup.wait()
        assert len(wakeup._waiters) <= 1
    else:
        assert wakeup._tasks == []  # a cancelled task took itself off


async def test_a_timed_wait_returns_after_its_timeout_and_leaves_the_next_wait_waiting(anyio_backend) -> None:
    wakeup = Wakeup()
    with anyio.fail_after(5):
        await wakeup.wait(0.01)  # returns as a wake would: nothing changed, the caller checks
    # The timer woke only that wait: a stale set event would make this return at once.
    with anyio.move_on_after(0.05) as scope:
        await wakeup.wait()
    assert scope.cancelled_caught


async def test_a_wake_ends_a_timed_wait_before_its_timeout(anyio_backend) -> None:
    wakeup = Wakeup()
    woken = anyio.Event()

    async def waiter() -> None:
        await wakeup.wait(60)
        woken.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            wakeup.wake()
            await woken.wait()


async def test_bounded_waits_share_one_timer_armed_again_only_for_an_earlier_deadline(anyio_backend) -> None:
    # A reader waits once a frame with a bound of minutes: one timer serves them all, not one a wait.
    wakeup = Wakeup()
    waits = 0

    async def reader(timeout: float) -> None:
        nonlocal waits
        waits += 1
        await wakeup.wait(timeout)

    timers = set()
    with anyio.fail_after(5):
        for _ in range(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader, 60.0)
                await anyio.wait_all_tasks_blocked()
                timers.add(id(wakeup._timer))
                wakeup.wake()
        assert waits == 20 and len(timers) == 1
        armed = wakeup._timer
        assert armed is not None and not armed.cancelled()
        # An earlier deadline: armed again, and it returns by then with nobody waking it.
        await wakeup.wait(0.01)
        assert armed.cancelled()
    wakeup.disarm()  # nothing bounded to come (an ended Delivery): nothing left in the loop's heap
    assert wakeup._timer is None


async def test_a_wait_no_shorter_than_the_armed_timers_bound_reads_no_clock(
    anyio_backend, monkeypatch
) -> None:
    # A reader waits once a frame with the same bound: the timer armed by an earlier wait
    # fires no later than this one's deadline, so the wait keeps it without reading the
    # clock (on trio three Python calls a frame). A shorter bound still looks.
    wakeup = Wakeup()

    async def woken_wait(bound: float) -> None:
        # A bounded wait ended by a wake (no cancel scope: anyio's read the clock too).
        async with anyio.create_task_group() as tg:
            tg.start_soon(_awaited, wakeup.wait(bound))
            await anyio.wait_all_tasks_blocked()
            wakeup.wake()

    await woken_wait(60.0)
    armed = wakeup._timer
    assert armed is not None
    reads = 0

    def counted(clock: Any) -> Any:
        def read() -> float:
            nonlocal reads
            reads += 1
            return float(clock())

        return read

    if anyio_backend[0] == "trio":
        import trio

        monkeypatch.setattr(trio, "current_time", counted(trio.current_time))
    else:
        wakeup._now = counted(wakeup._now)
    await woken_wait(60.0)
    await woken_wait(120.0)
    assert reads == 0 and wakeup._timer is armed and not armed.cancelled()
    await woken_wait(30.0)  # its deadline is earlier than the armed timer's: armed again
    assert reads == 1 and armed.cancelled()
    again = wakeup._timer
    assert again is not None and not again.cancelled()
    await woken_wait(45.0)  # no shorter than the bound it was armed with: kept, unread
    assert reads == 1 and wakeup._timer is again
    wakeup.disarm()


async def test_an_ended_delivery_leaves_no_timer(anyio_backend) -> None:
    from omni_stream.engine.delivery import Delivery

    delivery = Delivery("all")
    with anyio.move_on_after(0.01):
        await delivery.wait(60)
    assert delivery._wakeup._timer is not None
    delivery.end()
    assert delivery._wakeup._timer is None


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_bounded_wait_in_a_second_run_is_bounded(backend: str) -> None:
    # A Wakeup waited on under one loop (its timer armed, then woken) and again under another:
    # the first timer will never fire (its loop is gone), so the second wait arms its own.
    wakeup = Wakeup()

    async def waiter() -> None:
        await wakeup.wait(0.05)

    async def first() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            wakeup.wake()

    async def second() -> bool:
        with anyio.move_on_after(5) as scope:
            await wakeup.wait(0.5)
        return not scope.cancelled_caught

    if backend == "trio":
        import trio.testing

        # Clocks that start alike, so the first run's deadline is earlier than the second's.
        def clock() -> dict[str, object]:
            return {"clock": trio.testing.MockClock(autojump_threshold=0)}

        anyio.run(first, backend="trio", backend_options=clock())
        assert anyio.run(second, backend="trio", backend_options=clock())
    else:
        anyio.run(first, backend="asyncio")
        assert anyio.run(second, backend="asyncio")


def test_a_loop_with_its_own_clock_and_futures_has_them_used() -> None:
    # On asyncio's own loop a wait makes its future and reads the time with C calls,
    # not the loop's Python methods; a loop that overrides them (a test clock, a
    # loop with futures of its own) must keep its own: a timer armed on the
    # monotonic clock of a loop whose clock runs 1000 s ahead would fire at once.
    made: list[asyncio.Future[None]] = []

    class Ahead(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return super().time() + 1000.0

        def create_future(self) -> asyncio.Future[Any]:
            future = super().create_future()
            made.append(future)
            return future

    async def main() -> tuple[bool, bool]:
        wakeup = Wakeup()
        waiter = wakeup.wait(5.0)
        own = any(waiter is f for f in made)
        task = asyncio.ensure_future(_awaited(waiter))
        await asyncio.sleep(0.1)
        early = task.done()  # the timer is 5 s away on this loop's clock
        wakeup.wake()
        await task
        return early, own

    loop = Ahead()
    try:
        early, own_futures = loop.run_until_complete(main())
    finally:
        loop.close()
    assert not early
    assert own_futures

    # A clock replaced on the instance (a fake-clock fixture's way) is the loop's clock too.
    loop = asyncio.new_event_loop()
    real_time = loop.time
    loop.time = lambda: real_time() + 1000.0  # type: ignore[method-assign]

    async def patched() -> bool:
        wakeup = Wakeup()
        task = asyncio.ensure_future(_awaited(wakeup.wait(5.0)))
        await asyncio.sleep(0.1)
        early = task.done()
        wakeup.wake()
        await task
        return early

    try:
        assert not loop.run_until_complete(patched())
    finally:
        loop.close()

    # And asyncio's own loop: a future of that loop, a timer on its clock.
    async def plain() -> bool:
        wakeup = Wakeup()
        waiter = wakeup.wait(5.0)
        assert isinstance(waiter, asyncio.Future) and waiter.get_loop() is asyncio.get_running_loop()
        assert wakeup._timer is not None
        deadline = wakeup._timer.when()  # type: ignore[attr-defined]
        wakeup.wake()
        await waiter
        return abs(deadline - (asyncio.get_running_loop().time() + 5.0)) < 1.0

    assert asyncio.run(plain())


async def _awaited(awaitable: Any) -> None:
    await awaitable
