"""PinnedBufferPool: reuse, the cap, eviction, and never releasing a buffer in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omni_stream.device import PinnedBufferPool, PoolClosedError, SimEvent


def alloc(shape, dtype):
    return torch.empty(shape, dtype=dtype)


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
    event = SimEvent()
    lease.event = event
    assert pool.statistics().buffers_in_flight == 1
    with pytest.raises(RuntimeError, match="in flight"):
        pool.release(lease)
    event._complete()
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
