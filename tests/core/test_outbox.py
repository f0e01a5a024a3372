"""Outbox: order, latest-wins per key, bounded must-deliver (count and bytes), close, MemoryBudget."""

from __future__ import annotations

import random

import anyio
import pytest

from omni_stream import protocol
from omni_stream.core.outbox import MemoryBudget, Outbox, OutboxItem, OutboxOverflowError

#: The unit the byte bounds below are written in: the smallest real message
#: (a progress, ~60 bytes; a preview's header, ~110) fits in a few of them.
U = 32


def done(label: str, size: int | None = None) -> protocol.ServerMessage:
    """A must-deliver text message for request ``label``: ``done``, or an ``error``
    exactly ``size`` bytes on the wire when ``size`` is given."""
    if size is None:
        return protocol.Done.build(label, total=1, elapsed_s=0.0)
    # The constructor, not build: build clips the message, and sizes here go beyond it.
    pad = size - len(protocol.ErrorMessage("internal", "", label, None).wire)
    assert pad >= 0, f"{size} bytes is smaller than an error message"
    message = protocol.ErrorMessage("internal", "x" * pad, label, None)
    assert len(message.wire) == size
    return message


def error(label: str) -> protocol.ErrorMessage:
    return protocol.ErrorMessage.build("internal", "boom", request_id=label)


def progress(label: str, step: int = 1) -> protocol.Progress:
    return protocol.Progress.build(label, step=step, total=max(step, 1), eta_s=0.0)


def preview(label: str, size: int | None = None, *, step: int = 1, final: bool = False) -> protocol.Preview:
    """A preview for request ``label``, exactly ``size`` bytes on the wire when given."""
    header = protocol.PreviewHeader(label, step, max(step, 1), final, "jpeg", 1, 1, "image/jpeg")
    overhead = len(protocol.Preview.build(header, b"").wire)
    pad = 1 if size is None else size - overhead
    assert pad >= 0, f"{size} bytes is smaller than a preview's header"
    frame = protocol.Preview.build(header, b"\xff" * pad)
    assert size is None or len(frame.wire) == size
    return frame


def label(item: OutboxItem) -> str:
    """Which message ``item`` is: the request id it was built for."""
    message = item.message
    return message.header.id if isinstance(message, protocol.Preview) else message.id


def drain(outbox: Outbox) -> list:
    out = []
    while (item := outbox.get_nowait()) is not None:
        out.append(label(item))
    return out


def test_must_deliver_keeps_order() -> None:
    box = Outbox(max_pending=10)
    for text in ("a", "b", "c"):
        box.put(done(text))
    assert drain(box) == ["a", "b", "c"]


def test_an_item_is_its_message_and_its_kind() -> None:
    box = Outbox(max_pending=10)
    message = progress("r")
    box.put(message, latest_key=("r", "progress"))
    box.put(done("r"))
    first, second = box.get_nowait(), box.get_nowait()
    assert first.message is message and first.kind == "progress" and not first.must_deliver
    assert second.kind == "done" and second.must_deliver
    assert second.message.wire == '{"type":"done","id":"r","total":1,"elapsed_s":0.0}'


def test_latest_wins_per_key_and_moves_to_the_back() -> None:
    replaced: list[str] = []
    box = Outbox(max_pending=10, on_replaced=replaced.append)
    box.put(protocol.Accepted.build("accepted", total=1, detach=False, attached=False, preview={}))
    box.put(progress("p1"), latest_key=("r", "progress"))
    box.put(preview("i1"), latest_key=("r", "preview"))
    box.put(progress("p2"), latest_key=("r", "progress"))
    box.put(preview("i2"), latest_key=("r", "preview"))
    box.put(progress("q1"), latest_key=("other", "progress"))
    assert drain(box) == ["accepted", "p2", "i2", "q1"]
    assert replaced == ["progress", "preview"]
    assert box.statistics().replaced == 2


def test_progress_stays_ahead_of_its_preview() -> None:
    # A newer progress arriving while an older preview waits must not let the
    # newer preview jump ahead of it (it would if replacement kept the slot).
    box = Outbox(max_pending=10)
    box.put(progress("p1"), latest_key=("r", "progress"))
    box.put(preview("i1"), latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert label(box.get_nowait()) == "p1"
    box.put(progress("p2"), latest_key=("r", "progress"))
    box.put(preview("i2"), latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert drain(box) == ["p2", "i2"]


def test_a_pinned_progress_is_not_replaced_before_its_preview() -> None:
    # [p3, i3] + p4 must not become [i3, p4]: a preview of a step whose
    # progress the client never got.
    box = Outbox(max_pending=10)
    box.put(progress("p3"), latest_key=("r", "progress"))
    box.put(preview("i3"), latest_key=("r", "preview"), pin_key=("r", "progress"))
    box.put(progress("p4"), latest_key=("r", "progress"))
    box.put(progress("p5"), latest_key=("r", "progress"))
    assert drain(box) == ["p3", "i3", "p5"]


def test_replacing_a_preview_drops_its_pinned_progress() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, on_replaced=dropped.append)
    for step in range(1, 50):
        box.put(progress(f"p{step}"), latest_key=("r", "progress"))
        box.put(preview(f"i{step}"), latest_key=("r", "preview"), pin_key=("r", "progress"))
    # Bounded for a client that never reads: one progress + one preview.
    assert drain(box) == ["p49", "i49"]
    assert dropped.count("progress") == 48 and dropped.count("preview") == 48


def _step_of(item: OutboxItem) -> tuple[str, int]:
    # What the interleavings test reads off the wire: (kind, step).
    message = item.message
    if isinstance(message, protocol.Preview):
        return ("final" if message.final else "preview", message.header.step)
    if isinstance(message, protocol.Progress):
        return ("progress", message.step)
    if isinstance(message, protocol.Done):
        return ("done", message.total)
    assert isinstance(message, protocol.Accepted)
    return ("accepted", 0)


def test_interleavings_keep_the_documented_order() -> None:
    # Random interleavings of one request's puts (as the consumer makes
    # them) with a writer's gets; check docs/protocol.md's guarantees.
    rng = random.Random(1234)
    for every in (1, 3):
        for _ in range(200):
            box = Outbox(max_pending=10)
            wire: list[tuple[str, int]] = []
            total = rng.randint(1, 12)
            box.put(protocol.Accepted.build("r", total=total, detach=False, attached=False, preview={}))
            for step in range(1, total + 1):
                box.put(protocol.Progress.build("r", step=step, total=total, eta_s=0.0), latest_key="p")
                while rng.random() < 0.4 and (item := box.get_nowait()) is not None:
                    wire.append(_step_of(item))
                if step % every == 0 or step == total:
                    final = step == total
                    if final:
                        box.discard("i")
                    box.put(preview("r", step=step, final=final),
                            latest_key=None if final else "i", pin_key="p")
                while rng.random() < 0.4 and (item := box.get_nowait()) is not None:
                    wire.append(_step_of(item))
                assert len(box) <= 4
            box.put(protocol.Done.build("r", total=total, elapsed_s=0.0))
            while (item := box.get_nowait()) is not None:
                wire.append(_step_of(item))
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
    box.put(preview("i1"), latest_key=("r", "preview"))
    box.discard(("r", "preview"))
    box.put(preview("final", final=True))
    box.put(done("done"))
    box.put(preview("i9"), latest_key=("r", "preview"))
    assert drain(box) == ["final", "done", "i9"]


def test_overflow_when_must_deliver_piles_up() -> None:
    box = Outbox(max_pending=3)
    for i in range(3):
        box.put(error(f"m{i}"))
    # Latest-wins entries do not count against the bound.
    box.put(progress("p"), latest_key=("r", "progress"))
    assert not box.overflowed
    box.put(error("m3"))
    assert box.overflowed
    with pytest.raises(OutboxOverflowError):
        box.get_nowait()
    box.put(done("ignored"))
    # What it queued is freed at once: none of it will be sent.
    assert box.statistics().pending_must == 0 and len(box) == 0


def test_get_counts_must_deliver_down() -> None:
    box = Outbox(max_pending=2)
    box.put(done("a"))
    box.put(done("b"))
    box.get_nowait()
    box.put(done("c"))
    assert not box.overflowed
    assert drain(box) == ["b", "c"]


def test_close_drains_then_ends() -> None:
    box = Outbox(max_pending=2)
    box.put(done("a"))
    box.close()
    box.put(done("late"))
    assert label(box.get_nowait()) == "a"
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
                got.append(label(await box.get()))
            except anyio.EndOfStream:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.01)
            box.put(done("a"))
            await anyio.sleep(0.01)
            box.put(progress("b"), latest_key="k")
            box.close()
    assert got == ["a", "b"]


@pytest.mark.asyncio
async def test_waiting_get_sees_overflow() -> None:
    box = Outbox(max_pending=1)

    async def overflow_later() -> None:
        await anyio.sleep(0.01)
        box.put(done("a"))
        await anyio.sleep(0.01)
        box.put(done("b"))
        box.put(done("c"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(overflow_later)
            first = await box.get()
            assert label(first) == "a"
            with pytest.raises(OutboxOverflowError):
                await box.get()


def test_overflow_is_announced_once() -> None:
    calls: list[int] = []
    box = Outbox(max_pending=1, on_overflow=lambda: calls.append(1))
    box.put(done("a"))
    box.put(done("b"))
    box.put(done("c"))
    assert calls == [1]


# -- bytes ------------------------------------------------------------------------


def test_sizes_are_the_wire_forms() -> None:
    box = Outbox(max_pending=10)
    text, frame = progress("p"), preview("i", 7 * U)
    box.put(text, latest_key="p")
    box.put(frame, latest_key="i")
    assert box.pending_bytes == len(text.wire) + 7 * U
    assert box.statistics().pending_must_bytes == 0
    box.put(done("m", 3 * U))
    assert box.statistics().pending_must_bytes == 3 * U


def test_previews_give_way_to_the_byte_bound_oldest_first() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, max_pending_bytes=100 * U, on_replaced=dropped.append)
    small = progress("p")
    assert len(small.wire) <= 5 * U
    box.put(small, latest_key=("a", "progress"))
    box.put(preview("A", 40 * U), latest_key=("a", "preview"), pin_key=("a", "progress"))
    box.put(preview("B", 40 * U), latest_key=("b", "preview"))
    box.put(done("m", 30 * U))  # > 100 U: a's preview (and its pinned progress) goes
    assert drain(box) == ["B", "m"]
    assert dropped == ["preview", "progress"]
    assert box.statistics().pending_bytes == 0


def test_a_preview_that_does_not_fit_beside_must_deliver_is_dropped() -> None:
    dropped: list[str] = []
    box = Outbox(max_pending=10, max_pending_bytes=100 * U, on_replaced=dropped.append)
    box.put(done("m", 80 * U))
    box.put(progress("p"), latest_key=("a", "progress"))  # tiny progress always fits
    box.put(preview("i", 30 * U), latest_key=("a", "preview"), pin_key=("a", "progress"))
    assert not box.overflowed
    assert drain(box) == ["m", "p"]
    assert dropped == ["preview"]


def test_must_deliver_over_the_byte_bound_overflows() -> None:
    big = 100 * 1024
    box = Outbox(max_pending=10, max_pending_bytes=big)
    box.put(preview("x", big + 1, final=True))  # one message alone may be larger: a result is never refused
    assert not box.overflowed
    # The small messages behind it (done, errors) count against max_pending only:
    # a client reading an oversize result is not closed for its "done".
    box.put(done("x"))
    assert not box.overflowed
    box.put(preview("y", 65 * 1024, final=True))  # a second large one does not fit
    assert box.overflowed
    with pytest.raises(OutboxOverflowError) as info:
        box.get_nowait()
    assert info.value.limit == "max_pending_bytes"
    assert box.statistics().pending_bytes == 0


def test_overflow_names_the_count_bound() -> None:
    box = Outbox(max_pending=1)
    box.put(done("a"))
    box.put(done("b"))
    with pytest.raises(OutboxOverflowError) as info:
        box.get_nowait()
    assert info.value.limit == "max_pending"


def test_abort_frees_everything_and_breaks_the_callback() -> None:
    budget = MemoryBudget(1000 * U)
    box = Outbox(max_pending=4, budget=budget, on_overflow=lambda: None)
    box.put(done("a", 10 * U))
    box.put(preview("b", 20 * U), latest_key="k")
    assert budget.used == 30 * U
    box.abort()
    assert len(box) == 0 and budget.used == 0 and box.on_overflow is None
    box.put(done("late"))
    with pytest.raises(anyio.EndOfStream):
        box.get_nowait()


def test_has_room_leaves_space_for_one_reply() -> None:
    box = Outbox(max_pending=5, max_pending_bytes=100 * U)
    assert box.has_room()
    box.put(error("a"))
    box.put(error("b"))
    assert box.has_room()  # 2 + 3 <= 5
    box.put(error("c"))
    assert not box.has_room()
    box.get_nowait()
    assert box.has_room()
    small = Outbox(max_pending=1)
    small.put(error("a"))
    assert not small.has_room()
    small.get_nowait()
    assert small.has_room()  # nothing waiting: always room, whatever the bound


def test_has_room_leaves_half_the_bytes_for_replies() -> None:
    box = Outbox(max_pending=10, max_pending_bytes=100 * U)
    box.put(done("a", 50 * U))
    assert box.has_room()  # half the bound: still room
    box.put(done("b", 2 * U))
    assert not box.has_room()


@pytest.mark.asyncio
async def test_wait_for_room_wakes_on_get_and_on_close() -> None:
    box = Outbox(max_pending=3)
    for text in "abc":
        box.put(error(text))
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
    budget = MemoryBudget(1000 * U)
    a, b = Outbox(max_pending=4, budget=budget), Outbox(max_pending=4, budget=budget)
    a.put(done("x", 100 * U))
    b.put(preview("y", 50 * U), latest_key="k")
    b.put(preview("z", 70 * U), latest_key="k")  # replaces: 100 + 70
    assert budget.used == 170 * U
    a.get_nowait()
    assert budget.used == 70 * U


def test_budget_over_refuses_new_previews_not_progress() -> None:
    budget = MemoryBudget(100 * U)
    dropped: list[str] = []
    box = Outbox(max_pending=4, budget=budget, on_replaced=dropped.append)
    box.put(done("m", 90 * U))
    small = progress("p")
    assert len(small.wire) <= 5 * U
    box.put(small, latest_key=("r", "progress"))
    box.put(preview("i", 20 * U), latest_key=("r", "preview"), pin_key=("r", "progress"))
    assert drain(box) == ["m", "p"]
    assert dropped == ["preview"]


def test_budget_closes_the_connection_holding_most_first() -> None:
    budget = MemoryBudget(100 * U)
    small = Outbox(max_pending=4, budget=budget)
    big = Outbox(max_pending=4, budget=budget)
    small.put(done("s", 20 * U))
    small.put(preview("i", 10 * U), latest_key="k")
    big.put(done("b", 60 * U))
    big.put(done("c", 15 * U))  # 105: previews go first (-10), then still 95: fine
    assert budget.used == 95 * U and not big.overflowed and not small.overflowed
    assert small.statistics().pending == 1
    big.put(done("d", 10 * U))  # 105, no previews left: the biggest holder is closed
    assert big.overflowed and not small.overflowed
    assert budget.used == 20 * U
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
    budget = MemoryBudget(100 * U)
    retained = Retained(budget, [30 * U, 40 * U])
    budget.set_retained(retained)
    box = Outbox(max_pending=4, budget=budget)
    box.put(done("q", 20 * U))  # 90
    box.put(done("r", 20 * U))  # 110: retained (70) > queued (40): the oldest result goes
    assert retained.sizes == [40 * U] and not box.overflowed and budget.used == 80 * U
    box.put(done("s", 40 * U))  # 120: queued (80) > retained (40): the connection goes
    assert box.overflowed and retained.sizes == [40 * U] and budget.used == 40 * U


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
    box = Outbox(max_pending=4, max_pending_bytes=10 * U)
    box.put(preview("i", 50 * U), latest_key="k")
    box.put(preview("j", 50 * U), latest_key="k")  # replaces it: still alone
    assert drain(box) == ["j"]


def test_budget_does_not_close_connections_for_running_requests() -> None:
    class Running:
        def evict_oldest_retained(self) -> bool:
            return False  # nothing ended: only running requests hold bytes

    budget = MemoryBudget(100 * U)
    source = Running()
    budget.set_retained(source)
    budget.add(90 * U)  # the latest previews of running requests
    box = Outbox(max_pending=4, budget=budget)
    box.put(done("m", 20 * U))  # 110, but 90 of it is not this connection's doing
    assert not box.overflowed
    box.put(preview("i", 5 * U), latest_key="k")  # over: previews are refused
    assert drain(box) == ["m"]


def test_one_message_put_to_many_outboxes_is_encoded_once() -> None:
    # The fan-out shares the message: every outbox queues the same object, its wire cached.
    message = progress("r")
    boxes = [Outbox(max_pending=4) for _ in range(3)]
    for box in boxes:
        box.put(message, latest_key="p")
    items = [box.get_nowait() for box in boxes]
    assert all(item.message is message for item in items)
    assert all(item.message.wire is message.wire for item in items)
