"""_handover.py: items from a thread reach the loop in order, one wake-up per batch, on every backend."""

from __future__ import annotations

import threading

import anyio
import pytest

from omni_stream import _backend
from omni_stream._handover import Handover

from .conftest import ANYIO_BACKENDS

BACKENDS = ANYIO_BACKENDS


@pytest.mark.anyio
async def test_items_posted_before_the_loop_comes_round_arrive_in_order_with_one_wake_up(
    anyio_backend,
) -> None:
    batches: list[list[int]] = []
    threads: set[int] = set()

    def receive(items: list[int]) -> None:
        batches.append(items)
        threads.add(threading.get_ident())

    handover: Handover[int] = Handover(receive, _backend.running_loop())

    def post_all() -> None:
        for i in range(100):
            handover.post([i, i + 1000])

    # The loop is not running while the thread posts: every post after the
    # first finds the drain still pending and rides along with it.
    post_all()
    await anyio.wait_all_tasks_blocked()
    await anyio.sleep(0)
    assert handover.wakeups == 1
    assert batches == [[x for i in range(100) for x in (i, i + 1000)]]
    assert threads == {threading.get_ident()}


@pytest.mark.anyio
async def test_a_post_after_a_drain_wakes_the_loop_again(anyio_backend) -> None:
    got: list[int] = []
    arrived = anyio.Event()

    def receive(items: list[int]) -> None:
        got.extend(items)
        if len(got) == 3:
            arrived.set()

    handover: Handover[int] = Handover(receive, _backend.running_loop())
    await anyio.to_thread.run_sync(handover.post, [1])
    with anyio.fail_after(5):
        while got != [1]:
            await anyio.sleep(0.001)
    await anyio.to_thread.run_sync(handover.post, [2, 3])
    with anyio.fail_after(5):
        await arrived.wait()
    assert got == [1, 2, 3]
    assert handover.wakeups == 2  # nothing stranded behind a drain that already ran


@pytest.mark.anyio
async def test_take_empties_a_pending_batch_and_its_drain_then_does_nothing(anyio_backend) -> None:
    received: list[list[int]] = []
    handover: Handover[int] = Handover(received.append, _backend.running_loop())
    handover.post([1, 2])
    handover.post([3])
    assert handover.take() == [1, 2, 3]  # what a shutdown drains (Copier.drain)
    await anyio.sleep(0.01)  # the scheduled drain runs and finds nothing
    assert received == []
    handover.post([4])  # take() cleared the pending flag: this schedules a drain
    with anyio.fail_after(5):
        while not received:
            await anyio.sleep(0.001)
    assert received == [[4]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_post_to_a_finished_loop_raises_and_keeps_its_items(backend) -> None:
    name, options = backend

    async def make() -> Handover[int]:
        return Handover(lambda items: None, _backend.running_loop())

    handover = anyio.run(make, backend=name, backend_options=options)
    with pytest.raises(RuntimeError):
        handover.post([1])
    with pytest.raises(RuntimeError):
        handover.post([2])  # the pending flag was cleared: it tried again
    assert handover.take() == [1, 2]
