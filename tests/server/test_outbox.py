"""Outbox: order, latest-wins per key, bounded must-deliver, close."""

from __future__ import annotations

import random

import anyio
import pytest

from omni_stream.server.outbox import Outbox, OutboxOverflowError


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
    assert box.statistics().pending_must == 3


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
