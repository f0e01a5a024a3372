"""_wakeup.py: the single-reader hand-off's wake-up, its rule, and that nobody is stranded."""

from __future__ import annotations

import anyio
import pytest

from omni_stream._wakeup import Wakeup


@pytest.mark.asyncio
async def test_a_wake_with_nobody_waiting_is_not_remembered() -> None:
    wakeup = Wakeup()
    wakeup.wake()
    with anyio.move_on_after(0.05) as scope:
        await wakeup.wait()
    assert scope.cancelled_caught  # the waiter's own check sees the change, not the wait


@pytest.mark.asyncio
async def test_every_waiter_is_woken_and_the_next_wait_waits_again() -> None:
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


@pytest.mark.asyncio
async def test_a_cancelled_waiter_leaves_the_wakeup_usable() -> None:
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
