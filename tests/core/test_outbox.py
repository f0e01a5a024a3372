"""Outbox: order, latest-wins per key, bounded must-deliver (count and bytes), close, MemoryBudget."""

from __future__ import annotations

import random

import anyio
import pytest

from omni_stream.core.outbox import MemoryBudget, Outbox, OutboxOverflowError


def drain(outbox: Outbox) -> list:
    out = []
    while (item := outbox.get_nowait()) is not None:
        out.append(item.data)
    return out


def test_must_deliver_keeps_order() -> None:
    box = Outbox(max_pending=10)
    for text in ("a", "b", "c"):
        box.put(text, "done")
    assert drain(box) == ["a", "b", "c"]


def test_latest_wins_per_key_and_moves_to_the_back() -> None:
    replaced: list[str] = []
    box = Outbox(max_pending=10, on_replaced=replaced.append)
    box.put("accepted", "accepted")
    box.put("p1", "progress", latest_key=("r", "progress"))
    box.put("i1", "preview", latest_key=("r", "preview"))
    box.put("p2", "progress", latest_key=("r", "progress"))
    box.put("i2", "preview", latest_key=("r", "preview"))
    box.put("q1", "progress", latest_key=("other", "progress"))
    assert drain(box) == ["accepted", "p2", "i2", "q1"]
    assert replaced == ["progress", "preview"]
    assert box.statistics().replaced == 2


def test_progress_stays_ahead_of_its_preview() -> None:
    # A newer progress arriving while an older preview waits must not let the
    # newer preview jump ahead of it (it would if replacement kept the slot).
    box = Outbox(max_pending=10)
    box.put("p1", "progress", latest_key=("r", "progress"))
    box.put("i1", "preview", latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert box.get_nowait().data == "p1"
    box.put("p2", "progress", latest_key=("r", "progress"))
    box.put("i2", "preview", latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert drain(box) == ["p2", "i2"]


def test_a_pinned_progress_is_not_replaced_before_its_preview() -> None:
    # [p3, i3] + p4 must not become [i3, p4]: a preview of a step whose
    # progress the client never got.
    box = Outbox(max_pending=10)
    box.put("p3", "progress", latest_key=("r", "progress"))
    box.put("i3", "preview", latest_key=("r", "preview"), pin_key=("r", "progress"))
    box.put("p4", "progress", latest_key=("r", "progress"))
    box.put("p5", "progress", latest_key=("r", "progress"))
    assert drain(box) == ["p3", "i3", "p5"]


def test_replacing_a_preview_drops_its_pinned_progress() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, on_replaced=dropped.append)
    for step in range(1, 50):
        box.put(f"p{step}", "progress", latest_key=("r", "progress"))
        box.put(f"i{step}", "preview", latest_key=("r", "preview"), pin_key=("r", "progress"))
    # Bounded for a client that never reads: one progress + one preview.
    assert drain(box) == ["p49", "i49"]
    assert dropped.count("progress") == 48 and dropped.count("preview") == 48


def test_interleavings_keep_the_documented_order() -> None:
    # Random interleavings of one request's puts (as the consumer makes
    # them) with a writer's gets; check docs/protocol.md's guarantees.
    rng = random.Random(1234)
    for every in (1, 3):
        for _ in range(200):
            box = Outbox(max_pending=10)
            wire: list[tuple[str, int]] = []
            total = rng.randint(1, 12)
            box.put(("accepted", 0), "accepted")
            for step in range(1, total + 1):
                box.put(("progress", step), "progress", latest_key="p")
                while rng.random() < 0.4 and (item := box.get_nowait()) is not None:
                    wire.append(item.data)
                if step % every == 0 or step == total:
                    final = step == total
                    if final:
                        box.discard("i")
                    box.put(("final" if final else "preview", step), "preview",
                            latest_key=None if final else "i", pin_key="p")
                while rng.random() < 0.4 and (item := box.get_nowait()) is not None:
                    wire.append(item.data)
                assert len(box) <= 4
            box.put(("done", total), "done")
            wire += drain(box)
            assert wire[0] == ("accepted", 0) and wire[-1] == ("done", total)
            assert wire[-2] == ("final", total) and wire[-3] == ("progress", total)
            steps = [s for _, s in wire]
            assert steps == sorted(steps), wire
            last_progress = 0
            for kind, step in wire:
                if kind == "progress":
                    last_progress = step
                elif kind in ("preview", "final"):
                    assert last_progress == step, wire


def test_final_messages_are_never_replaced() -> None:
    box = Outbox(max_pending=10)
    box.put("i1", "preview", latest_key=("r", "preview"))
    box.discard(("r", "preview"))
    box.put("final", "preview")
    box.put("done", "done")
    box.put("i9", "preview", latest_key=("r", "preview"))
    assert drain(box) == ["final", "done", "i9"]


def test_overflow_when_must_deliver_piles_up() -> None:
    box = Outbox(max_pending=3)
    for i in range(3):
        box.put(f"m{i}", "error")
    # Latest-wins entries do not count against the bound.
    box.put("p", "progress", latest_key=("r", "progress"))
    assert not box.overflowed
    box.put("m3", "error")
    assert box.overflowed
    with pytest.raises(OutboxOverflowError):
        box.get_nowait()
    box.put("ignored", "done")
    # What it queued is freed at once: none of it will be sent.
    assert box.statistics().pending_must == 0 and len(box) == 0


def test_get_counts_must_deliver_down() -> None:
    box = Outbox(max_pending=2)
    box.put("a", "done")
    box.put("b", "done")
    box.get_nowait()
    box.put("c", "done")
    assert not box.overflowed
    assert drain(box) == ["b", "c"]


def test_close_drains_then_ends() -> None:
    box = Outbox(max_pending=2)
    box.put("a", "done")
    box.close()
    box.put("late", "done")
    assert box.get_nowait().data == "a"
    with pytest.raises(anyio.EndOfStream):
        box.get_nowait()


def test_bad_bound() -> None:
    with pytest.raises(ValueError):
        Outbox(max_pending=0)


@pytest.mark.asyncio
async def test_get_waits_for_put() -> None:
    box = Outbox(max_pending=4)
    got: list[str] = []

    async def reader() -> None:
        while True:
            try:
                got.append((await box.get()).data)
            except anyio.EndOfStream:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.01)
            box.put("a", "done")
            await anyio.sleep(0.01)
            box.put("b", "progress", latest_key="k")
            box.close()
    assert got == ["a", "b"]


@pytest.mark.asyncio
async def test_waiting_get_sees_overflow() -> None:
    box = Outbox(max_pending=1)

    async def overflow_later() -> None:
        await anyio.sleep(0.01)
        box.put("a", "done")
        await anyio.sleep(0.01)
        box.put("b", "done")
        box.put("c", "done")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(overflow_later)
            first = await box.get()
            assert first.data == "a"
            with pytest.raises(OutboxOverflowError):
                await box.get()


def test_overflow_is_announced_once() -> None:
    calls: list[int] = []
    box = Outbox(max_pending=1, on_overflow=lambda: calls.append(1))
    box.put("a", "done")
    box.put("b", "done")
    box.put("c", "done")
    assert calls == [1]


# -- bytes ------------------------------------------------------------------------


def test_previews_give_way_to_the_byte_bound_oldest_first() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, max_pending_bytes=100, on_replaced=dropped.append)
    box.put("p" * 5, "progress", latest_key=("a", "progress"))
    box.put("A" * 40, "preview", latest_key=("a", "preview"), pin_key=("a", "progress"))
    box.put("B" * 40, "preview", latest_key=("b", "preview"))
    box.put("m" * 30, "done")  # 115 > 100: a's preview (and its pinned progress) goes
    assert drain(box) == ["B" * 40, "m" * 30]
    assert dropped == ["preview", "progress"]
    assert box.statistics().pending_bytes == 0


def test_a_preview_that_does_not_fit_beside_must_deliver_is_dropped() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, max_pending_bytes=100, on_replaced=dropped.append)
    box.put("m" * 80, "done")
    box.put("p", "progress", latest_key=("a", "progress"))  # tiny progress always fits
    box.put("i" * 30, "preview", latest_key=("a", "preview"), pin_key=("a", "progress"))
    assert not box.overflowed
    assert drain(box) == ["m" * 80, "p"]
    assert dropped == ["preview"]


def test_must_deliver_over_the_byte_bound_overflows() -> None:
    big = 100 * 1024
    box = Outbox(max_pending=10, max_pending_bytes=big)
    box.put(b"x" * (big + 1), "preview")  # one message alone may be larger: a result is never refused
    assert not box.overflowed
    # The small messages behind it (done, errors) count against max_pending only:
    # a client reading an oversize result is not closed for its "done".
    box.put('{"type":"done"}', "done")
    assert not box.overflowed
    box.put(b"y" * (65 * 1024), "preview")  # a second large one does not fit
    assert box.overflowed
    with pytest.raises(OutboxOverflowError) as info:
        box.get_nowait()
    assert info.value.limit == "max_pending_bytes"
    assert box.statistics().pending_bytes == 0


def test_overflow_names_the_count_bound() -> None:
    box = Outbox(max_pending=1)
    box.put("a", "done")
    box.put("b", "done")
    with pytest.raises(OutboxOverflowError) as info:
        box.get_nowait()
    assert info.value.limit == "max_pending"


def test_abort_frees_everything_and_breaks_the_callback() -> None:
    budget = MemoryBudget(1000)
    box = Outbox(max_pending=4, budget=budget, on_overflow=lambda: None)
    box.put("a" * 10, "done")
    box.put("b" * 20, "preview", latest_key="k")
    assert budget.used == 30
    box.abort()
    assert len(box) == 0 and budget.used == 0 and box.on_overflow is None
    box.put("late", "done")
    with pytest.raises(anyio.EndOfStream):
        box.get_nowait()


def test_has_room_leaves_space_for_one_reply() -> None:
    box = Outbox(max_pending=5, max_pending_bytes=100)
    assert box.has_room()
    box.put("a", "error")
    box.put("b", "error")
    assert box.has_room()  # 2 + 3 <= 5
    box.put("c", "error")
    assert not box.has_room()
    box.get_nowait()
    assert box.has_room()
    small = Outbox(max_pending=1)
    small.put("a", "error")
    assert not small.has_room()
    small.get_nowait()
    assert small.has_room()  # nothing waiting: always room, whatever the bound


@pytest.mark.asyncio
async def test_wait_for_room_wakes_on_get_and_on_close() -> None:
    box = Outbox(max_pending=3)
    for text in "abc":
        box.put(text, "error")
    woke: list[str] = []

    async def waiter(tag: str) -> None:
        await box.wait_for_room()
        woke.append(tag)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "get")
            await anyio.sleep(0.01)
            assert woke == []
            box.get_nowait()
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "close")
            await anyio.sleep(0.01)
            box.close()
    assert woke == ["get", "close"]


# -- the server-wide budget --------------------------------------------------------


def test_budget_counts_every_outbox() -> None:
    budget = MemoryBudget(1000)
    a, b = Outbox(max_pending=4, budget=budget), Outbox(max_pending=4, budget=budget)
    a.put("x" * 100, "done")
    b.put("y" * 50, "preview", latest_key="k")
    b.put("z" * 70, "preview", latest_key="k")  # replaces: 100 + 70
    assert budget.used == 170
    a.get_nowait()
    assert budget.used == 70


def test_budget_over_refuses_new_previews_not_progress() -> None:
    budget = MemoryBudget(100)
    dropped: list[str] = []
    box = Outbox(max_pending=4, budget=budget, on_replaced=dropped.append)
    box.put("m" * 90, "done")
    box.put("p" * 5, "progress", latest_key=("r", "progress"))
    box.put("i" * 20, "preview", latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert drain(box) == ["m" * 90, "p" * 5]
    assert dropped == ["preview"]


def test_budget_closes_the_connection_holding_most_first() -> None:
    budget = MemoryBudget(100)
    small = Outbox(max_pending=4, budget=budget)
    big = Outbox(max_pending=4, budget=budget)
    small.put("s" * 20, "done")
    small.put("i" * 10, "preview", latest_key="k")
    big.put("b" * 60, "done")
    big.put("c" * 15, "done")  # 105: previews go first (-10), then still 95: fine
    assert budget.used == 95 and not big.overflowed and not small.overflowed
    assert small.statistics().pending == 1
    big.put("d" * 10, "done")  # 105, no previews left: the biggest holder is closed
    assert big.overflowed and not small.overflowed
    assert budget.used == 20
    with pytest.raises(OutboxOverflowError) as info:
        big.get_nowait()
    assert info.value.limit == "max_memory_bytes"


class Retained:
    """Stands in for the registry: ended results, forgotten oldest first."""

    def __init__(self, budget: MemoryBudget, sizes: list[int]) -> None:
        self.budget = budget
        self.sizes = sizes
        for n in sizes:
            budget.add(n)

    def evict_oldest_retained(self) -> bool:
        if not self.sizes:
            return False
        self.budget.release(self.sizes.pop(0))
        return True


def test_budget_sheds_the_larger_side_first() -> None:
    budget = MemoryBudget(100)
    retained = Retained(budget, [30, 40])
    budget.set_retained(retained)
    box = Outbox(max_pending=4, budget=budget)
    box.put("q" * 20, "done")  # 90
    box.put("r" * 20, "done")  # 110: retained (70) > queued (40): the oldest result goes
    assert retained.sizes == [40] and not box.overflowed and budget.used == 80
    box.put("s" * 40, "done")  # 120: queued (80) > retained (40): the connection goes
    assert box.overflowed and retained.sizes == [40] and budget.used == 40


def test_budget_is_weak_on_outboxes() -> None:
    import gc
    import weakref

    budget = MemoryBudget(100)
    box = Outbox(max_pending=4, budget=budget)
    ref = weakref.ref(box)
    gc.disable()
    try:
        del box
        assert ref() is None
    finally:
        gc.enable()


def test_a_lone_preview_larger_than_the_bound_is_still_sent() -> None:
    box = Outbox(max_pending=4, max_pending_bytes=10)
    box.put("i" * 50, "preview", latest_key="k")
    box.put("j" * 50, "preview", latest_key="k")  # replaces it: still alone
    assert drain(box) == ["j" * 50]


def test_budget_does_not_close_connections_for_running_requests() -> None:
    class Running:
        def evict_oldest_retained(self) -> bool:
            return False  # nothing ended: only running requests hold bytes

    budget = MemoryBudget(100)
    source = Running()
    budget.set_retained(source)
    budget.add(90)  # the latest previews of running requests
    box = Outbox(max_pending=4, budget=budget)
    box.put("m" * 20, "done")  # 110, but 90 of it is not this connection's doing
    assert not box.overflowed
    box.put("i" * 5, "preview", latest_key="k")  # over: previews are refused
    assert drain(box) == ["m" * 20]
