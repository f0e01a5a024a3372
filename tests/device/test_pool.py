"""PinnedBufferPool: reuse, the cap, eviction, never releasing a buffer in flight, and lending.

A lent buffer is the reader's frame: it comes back when the last reference to
its memory goes (from any thread, even inside a pool call on the same thread),
never sooner, and lending stops at its caps so that copies always get buffers.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from omni_stream.device import PinnedBufferPool, PoolClosedError


def alloc(shape, dtype):
    return torch.empty(shape, dtype=dtype)


class _Copy:
    """A copy's event with torch's host-side API: in flight until ``land()``."""

    def __init__(self) -> None:
        self._landed = threading.Event()

    def query(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        self._landed.wait()

    def land(self) -> None:
        self._landed.set()


def test_buffers_are_reused_by_shape_and_dtype():
    pool = PinnedBufferPool(alloc, max_buffers=4)
    a = pool.acquire((2, 2), torch.float32)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire((2, 2), torch.float32)
    assert b.buffer.data_ptr() == ptr
    c = pool.acquire((2, 2), torch.float16)
    assert c.buffer.dtype == torch.float16
    stats = pool.statistics()
    assert stats.buffers_total == 2 and stats.buffers_in_use == 2


def test_a_buffer_with_a_copy_in_flight_cannot_be_released():
    pool = PinnedBufferPool(alloc, max_buffers=1)
    lease = pool.acquire((4,), torch.float32)
    event = _Copy()
    lease.event = event
    assert pool.statistics().buffers_in_flight == 1
    with pytest.raises(RuntimeError, match="in flight"):
        pool.release(lease)
    event.land()
    pool.release(lease)
    assert pool.statistics().buffers_in_use == 0
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(lease)


def test_acquire_waits_while_every_buffer_is_leased():
    pool = PinnedBufferPool(alloc, max_buffers=1)
    first = pool.acquire((4,), torch.float32)
    got = []

    def second():
        got.append(pool.acquire((4,), torch.float32))

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.1)
    assert not got
    pool.release(first)
    t.join(5)
    assert got and pool.statistics().buffers_total == 1


def test_a_full_pool_evicts_an_idle_buffer_of_another_shape():
    pool = PinnedBufferPool(alloc, max_buffers=1)
    pool.release(pool.acquire((4,), torch.float32))
    lease = pool.acquire((8,), torch.float32)
    assert lease.buffer.shape == (8,)
    assert pool.statistics().buffers_total == 1


def test_close_wakes_a_waiter():
    pool = PinnedBufferPool(alloc, max_buffers=1)
    pool.acquire((4,), torch.float32)
    errors = []

    def waiter():
        try:
            pool.acquire((4,), torch.float32)
        except PoolClosedError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    pool.close()
    t.join(5)
    assert errors


def test_a_buffers_event_comes_back_with_it_for_the_next_copy():
    pool = PinnedBufferPool(alloc, max_buffers=1)
    lease = pool.acquire((4,), torch.float32)
    event = _Copy()
    event.land()
    lease.event = event
    pool.release(lease)
    again = pool.acquire((4,), torch.float32)
    assert again.event is event and not again.in_flight


# -- lending ------------------------------------------------------------------


def test_a_lent_buffer_is_the_frame_itself_and_comes_back_when_its_last_view_goes():
    pool = PinnedBufferPool(alloc, max_buffers=2)
    lease = pool.acquire((2, 3), torch.bfloat16)
    lease.buffer.copy_(torch.arange(6).reshape(2, 3))
    ptr = lease.buffer.data_ptr()
    frame = pool.lend(lease, "r")
    assert frame is not None and frame.data_ptr() == ptr
    assert frame.dtype == torch.bfloat16 and frame.shape == (2, 3)
    assert torch.equal(frame, torch.arange(6).reshape(2, 3).to(torch.bfloat16))
    stats = pool.statistics()
    assert (stats.buffers_lent, stats.buffers_in_use, stats.buffers_total) == (1, 0, 1)
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(lease)  # the lease is used up
    row = frame[1]
    as_numpy = frame.float().numpy()  # a copy: holds nothing
    del frame, as_numpy
    assert pool.statistics().buffers_lent == 1  # the view still uses the memory
    del row
    assert pool.statistics().buffers_lent == 0
    assert pool.acquire((2, 3), torch.bfloat16).buffer.data_ptr() == ptr


def test_a_lent_buffer_is_never_handed_out_while_a_frame_uses_it():
    pool = PinnedBufferPool(alloc, max_buffers=2)
    frame = pool.lend(pool.acquire((4,), torch.float32), "r")
    assert frame is not None
    frame.fill_(1.0)
    other = pool.acquire((4,), torch.float32)
    assert other.buffer.data_ptr() != frame.data_ptr()
    other.buffer.fill_(9.0)
    assert torch.equal(frame, torch.ones(4))


def test_a_buffer_with_a_copy_in_flight_cannot_be_lent():
    pool = PinnedBufferPool(alloc, max_buffers=2)
    lease = pool.acquire((4,), torch.float32)
    lease.event = _Copy()
    with pytest.raises(RuntimeError, match="in flight"):
        pool.lend(lease, "r")


def test_lending_stops_at_its_caps_and_the_lease_stays_the_callers():
    pool = PinnedBufferPool(alloc, max_buffers=6, max_lent=3, max_lent_per_owner=2)
    held = [pool.lend(pool.acquire((4,), torch.float32), "a") for _ in range(2)]
    assert all(f is not None for f in held)
    refused = pool.acquire((4,), torch.float32)
    assert pool.lend(refused, "a") is None  # a's share
    pool.release(refused)  # still the caller's to give back
    held.append(pool.lend(pool.acquire((4,), torch.float32), "b"))
    refused = pool.acquire((4,), torch.float32)
    assert pool.lend(refused, "c") is None  # the pool's cap
    pool.release(refused)
    held.pop(0)
    assert pool.lend(pool.acquire((4,), torch.float32), "c") is not None  # a frame went: room again


def test_a_pool_lends_nothing_with_max_lent_zero_and_refuses_a_cap_as_large_as_itself():
    pool = PinnedBufferPool(alloc, max_buffers=2, max_lent=0)
    assert pool.lend(pool.acquire((4,), torch.float32), "r") is None
    with pytest.raises(ValueError, match="max_lent"):
        PinnedBufferPool(alloc, max_buffers=2, max_lent=2)


def test_a_frame_dropped_on_another_thread_wakes_an_acquire_waiting_for_its_buffer():
    pool = PinnedBufferPool(alloc, max_buffers=2, max_lent=1)
    box = [pool.lend(pool.acquire((4,), torch.float32), "r")]
    busy = pool.acquire((4,), torch.float32)  # every buffer leased or lent
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire((4,), torch.float32)))
    t.start()
    time.sleep(0.1)
    assert not got
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    t.join(5)
    assert got and pool.statistics().buffers_total == 2
    pool.release(busy)


def test_a_frame_collected_inside_a_pool_call_on_the_same_thread_is_taken_back_later():
    # A garbage collection can run inside a pool call and free a frame there: its buffer
    # comes back without the pool's lock being taken again under itself.
    pool = PinnedBufferPool(alloc, max_buffers=2)
    frame = pool.lend(pool.acquire((4,), torch.float32), "r")
    cycle: list[object] = [frame]
    cycle.append(cycle)  # only the collector frees it
    del frame, cycle
    with pool._cond:
        gc.collect()
        assert len(pool._back) == 1  # noted, not yet taken back (no deadlock either)
    stats = pool.statistics()
    assert (stats.buffers_lent, stats.buffers_total) == (0, 1)


def test_a_frame_that_outlives_a_closed_pool_leaves_it_when_dropped():
    pool = PinnedBufferPool(alloc, max_buffers=2)
    frame = pool.lend(pool.acquire((4,), torch.float32), "r")
    pool.close()
    assert frame is not None
    frame.fill_(3.0)
    del frame
    stats = pool.statistics()
    assert (stats.buffers_lent, stats.buffers_total) == (0, 0)
