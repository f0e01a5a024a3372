"""copier.py: device-to-host copies issued on the producer thread and waited for on a thread of their own.

The promises of the module's docstring, one by one: the cast happens on the
device and never for decoded pixels; a frame is handed on only after its copy
landed, in issue order, and never waits for a later one; a large frame is the
pool buffer itself, lent to the reader and given back when the reader lets
it go, a small one a clone; a buffer goes back to the pool only after its
copy completed (even for a request that ended); waiting never blocks the loop
and waits on an event only as torch's API means (``query``, ``synchronize``);
a failed hand-over, or a failure of the waiting thread, kills the copier's
task; shutdown drains what was posted. The simulated device stands in for an
accelerator, its copy stream held shut by a gate for as long as a test needs
a copy in flight.

Covered elsewhere and not repeated here: one wake-up per batch of posts and a
submitted ticket's fields (test_handover_path.py), the CPU path end to end
(test_host_frames.py), the engine dying of a copier failure (test_failures.py).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from omni_stream import _backend
from omni_stream.device import PinnedBufferPool, SimDevice, simcuda
from omni_stream.device.cpu import CpuDevice
from omni_stream.engine import copier as copier_module
from omni_stream.engine.copier import Copier, CopyTicket
from omni_stream.engine.delivery import Delivery
from omni_stream.engine.request import Request

pytestmark = pytest.mark.anyio


class _GatedSim(SimDevice):
    """The simulator with its copy stream held until ``gate`` opens: a copy in flight at will."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        simcuda.current_stream()._enqueue(self.gate.wait)  # the copy stream, current here
        super()._transfer(dst, src)


@pytest.fixture
def sim() -> Iterator[_GatedSim]:
    device = _GatedSim()
    device.prepare_thread()
    yield device
    device.gate.set()  # never leave the stream's thread parked
    device.close()


class _Event:
    """A copy event with torch's host-side API (``query``, ``synchronize``), told what to answer.

    ``landed``: what ``query`` says; ``synchronize`` waits for ``release`` (set at once when
    landed), then raises if ``fails``. Its ``wait`` is torch's: a *stream* waits, device side;
    a host thread calling it is the bug that killed the engine on its first GPU.
    """

    def __init__(self, *, landed: bool, fails: bool = False) -> None:
        self.landed = landed
        self.fails = fails
        self.release = threading.Event()
        if landed:
            self.release.set()
        self.synchronized = 0

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.synchronized += 1
        self.release.wait()
        if self.fails:
            raise RuntimeError("the copy failed on the device")
        self.landed = True

    def wait(self, stream: Any = None) -> None:
        raise AssertionError("Event.wait(stream) makes a stream wait; a host never calls it")


class _Deliveries:
    """The ``deliver`` callback: records each batch handed on, and the loop can wait for them."""

    def __init__(self) -> None:
        self.batches: list[list[CopyTicket]] = []
        self._event: anyio.Event | None = None

    def __call__(self, batch: list[CopyTicket]) -> None:
        self.batches.append(list(batch))
        if self._event is not None:
            self._event.set()

    @property
    def steps(self) -> list[int]:
        return [t.step for batch in self.batches for t in batch]

    async def until(self, count: int) -> None:
        with anyio.fail_after(5):
            while len(self.steps) < count:
                self._event = anyio.Event()
                await self._event.wait()


def _request(request_id: str = "r", arrival: int = 1) -> Request:
    return Request(
        request_id=request_id, params={}, total=100, batch_key=None, policy="all",
        timeout=None, arrival=arrival, delivery=Delivery("all"),
    )


def _pool(device: Any, **kw: Any) -> PinnedBufferPool:
    return PinnedBufferPool(device.host_buffer, max_buffers=4, **kw)


def _submit(copier: Copier, r: Request, step: int, out: torch.Tensor, **kw: Any) -> CopyTicket:
    return copier.submit(r, step, out, queued_s=0.0, compute_s=0.0, batch_size=1, **kw)


def _plain(r: Request, step: int) -> CopyTicket:
    """A ticket with nothing to wait for: a host-resident frame."""
    return CopyTicket(request=r, step=step, data=torch.full((2,), float(step)))


def _leased(pool: PinnedBufferPool, r: Request, step: int, event: _Event) -> CopyTicket:
    lease = pool.acquire((2,), torch.float32)
    lease.buffer.fill_(float(step))
    lease.event = event
    return CopyTicket(request=r, step=step, src=torch.zeros(2), lease=lease, issued_at=time.monotonic())


#: A frame large enough to be lent (float32 elements).
LARGE = copier_module.LEND_MIN_BYTES // 4


def _in_buffer(frame: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.untyped_storage().data_ptr()
    return start <= frame.data_ptr() < start + buffer.untyped_storage().nbytes()


@asynccontextmanager
async def _running(copier: Copier, deliver: Callable[[list[CopyTicket]], Any]) -> AsyncIterator[None]:
    copier.loop = _backend.running_loop()
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, deliver)
        await anyio.wait_all_tasks_blocked()
        yield
        tg.cancel_scope.cancel()


# -- submit (the producer thread) ---------------------------------------------------


async def _deliver_one(copier: Copier, t: CopyTicket) -> CopyTicket:
    deliveries = _Deliveries()
    async with _running(copier, deliveries):
        copier.post([t])
        await deliveries.until(1)
    return deliveries.batches[0][0]


@pytest.mark.parametrize("kind", ["cpu", "sim"])
async def test_frames_are_cast_to_the_frame_dtype_before_the_copy(
    anyio_backend, kind: str, sim: _GatedSim
) -> None:
    device = CpuDevice() if kind == "cpu" else sim
    sim.gate.set()
    copier = Copier(device, _pool(device), frame_dtype=torch.float16)
    out = torch.linspace(0, 1, 6)
    t = _submit(copier, _request(), 1, out)
    if kind == "cpu":
        assert t.data is not None and t.data.dtype == torch.float16
    else:
        # Cast on the device: the copy itself moves float16 into a float16 buffer.
        assert t.src is not None and t.src.dtype == torch.float16
        assert t.lease is not None and t.lease.buffer.dtype == torch.float16
        await _deliver_one(copier, t)
    assert t.data is not None and torch.equal(t.data, out.to(torch.float16))


@pytest.mark.parametrize("kind", ["cpu", "sim"])
async def test_decoded_pixels_are_never_cast_to_the_frame_dtype(anyio_backend, kind: str, sim: _GatedSim) -> None:
    device = CpuDevice() if kind == "cpu" else sim
    sim.gate.set()
    copier = Copier(device, _pool(device), frame_dtype=torch.float16)
    pixels = torch.arange(12, dtype=torch.uint8).reshape(2, 2, 3)
    t = _submit(copier, _request(), 1, pixels, decoded=True)
    if t.data is None:
        await _deliver_one(copier, t)
    assert t.data is not None and t.data.dtype == torch.uint8 and torch.equal(t.data, pixels)


async def test_a_staged_output_in_an_autograd_graph_is_copied_as_plain_data(anyio_backend, sim: _GatedSim) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))
    out = torch.ones(2, 3, requires_grad=True) * 3
    t = _submit(copier, _request(), 1, out)
    assert t.src is not None and not t.src.requires_grad
    await _deliver_one(copier, t)
    assert t.data is not None and not t.data.requires_grad and torch.equal(t.data, out.detach())


def test_a_copy_that_cannot_be_issued_gives_its_buffer_back_and_raises(sim: _GatedSim) -> None:
    # A pool whose buffers the simulator did not allocate: its copy_to_host refuses them.
    pool = PinnedBufferPool(lambda shape, dtype: torch.empty(shape, dtype=dtype), max_buffers=1)
    copier = Copier(sim, pool)
    with pytest.raises(RuntimeError, match="host_buffer"):
        _submit(copier, _request(), 1, torch.zeros(4))
    assert pool.statistics().buffers_in_use == 0


def test_a_buffers_event_is_recorded_again_for_its_next_copy(sim: _GatedSim) -> None:
    sim.gate.set()
    pool = _pool(sim)
    copier = Copier(sim, pool)
    first = _submit(copier, _request(), 1, torch.zeros(4))
    assert first.lease is not None
    event = first.lease.event
    assert isinstance(event, simcuda.Event)
    event.synchronize()
    copier._complete(first)
    second = _submit(copier, _request(), 2, torch.ones(4))  # the same buffer, free again
    assert second.lease is not None and second.lease.event is event
    event.synchronize()
    copier._complete(second)
    assert second.data is not None and torch.equal(second.data, torch.ones(4))


def test_a_device_without_the_event_parameter_gets_a_copy_call_it_understands() -> None:
    class OldStyle(CpuDevice):
        def copy_owned(self, src: torch.Tensor) -> torch.Tensor | None:
            return None

        def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:  # type: ignore[override]
            dst.copy_(src)
            return _Event(landed=True)

    device = OldStyle()
    copier = Copier(device, _pool(device))
    for step in (1, 2):  # the second reuses the buffer, whose last event it must not pass
        t = _submit(copier, _request(), step, torch.full((3,), float(step)))
        copier._complete(t)
        assert t.data is not None and torch.equal(t.data, torch.full((3,), float(step)))


# -- the waiting thread and the loop ----------------------------------------------------


async def test_tickets_with_nothing_to_wait_for_are_handed_on_by_the_callback_that_receives_them(
    anyio_backend,
) -> None:
    copier = Copier(CpuDevice(), _pool(CpuDevice()))
    deliveries = _Deliveries()
    r = _request()
    failed = CopyTicket(request=r, step=2, error=RuntimeError("step 2 failed"))
    async with _running(copier, deliveries):
        copier._receive([_plain(r, 1), failed])
        # No await in between: no task switch to the copier's task.
        assert deliveries.steps == [1, 2] and len(deliveries.batches) == 1


async def test_a_frame_is_handed_on_only_once_its_copy_landed_and_then_its_buffer_goes_back(
    anyio_backend, sim: _GatedSim
) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    deliveries = _Deliveries()
    out = torch.arange(8, dtype=torch.float32)
    async with _running(copier, deliveries):
        t = _submit(copier, _request(), 1, out)
        copier.post([t])
        with anyio.fail_after(5):
            while copier.waiting_since is None:  # the waiting thread blocks in synchronize()
                await anyio.sleep(0.001)
        assert copier.waiting_since == t.issued_at
        await anyio.sleep(0.05)  # the loop runs on meanwhile; nothing is handed on
        assert deliveries.steps == []
        assert pool.statistics().buffers_in_flight == 1
        assert t.src is out  # kept referenced while the copy may still read it
        sim.gate.set()
        await deliveries.until(1)
    assert t.data is not None and torch.equal(t.data, out)
    assert t.lease is None and t.src is None
    assert pool.statistics().buffers_in_use == 0
    assert copier.waiting_since is None


async def test_the_waiting_thread_waits_on_an_event_only_as_torch_means_it(anyio_backend) -> None:
    # On CUDA, Event.wait(stream) makes a stream wait: a host thread that calls it to wait
    # (as the engine once did, with a timeout) dies at the first copy still in flight.
    class Staged(CpuDevice):
        asynchronous_copies = True

    device = Staged()
    pool = _pool(device)
    copier = Copier(device, pool)
    deliveries = _Deliveries()
    event = _Event(landed=False)
    t = _leased(pool, _request(), 1, event)
    async with _running(copier, deliveries):
        copier.post([t])
        with anyio.fail_after(5):
            while event.synchronized == 0:
                await anyio.sleep(0.001)
        event.release.set()
        await deliveries.until(1)
    assert t.error is None and t.data is not None and torch.equal(t.data, torch.full((2,), 1.0))


async def test_a_frame_never_waits_for_a_later_ones_copy(anyio_backend, sim: _GatedSim) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    deliveries = _Deliveries()
    r = _request()
    landed = _leased(pool, r, 1, _Event(landed=True))
    async with _running(copier, deliveries):
        copier.post([landed, _submit(copier, r, 2, torch.zeros(4))])  # step 2 gated
        await deliveries.until(1)  # step 1 came while step 2 is still in flight
        assert deliveries.steps == [1]
        sim.gate.set()
        await deliveries.until(2)
    assert deliveries.steps == [1, 2]


async def test_a_frame_with_nothing_to_wait_for_never_overtakes_a_copy_in_flight(
    anyio_backend, sim: _GatedSim
) -> None:
    copier = Copier(sim, _pool(sim))
    deliveries = _Deliveries()
    r = _request()
    async with _running(copier, deliveries):
        copier.post([_submit(copier, r, 1, torch.zeros(4))])
        copier.post([_plain(r, 2)])
        await anyio.sleep(0.05)
        assert deliveries.steps == []
        sim.gate.set()
        await deliveries.until(2)
    assert deliveries.steps == [1, 2]


async def test_a_synchronous_devices_copy_still_in_flight_is_waited_for_off_the_loop(anyio_backend) -> None:
    # A device that says its copies are done when issued, but whose event has not completed:
    # the loop must not block in synchronize(), and later tickets keep their order.
    device = CpuDevice()
    pool = _pool(device)
    copier = Copier(device, pool)
    deliveries = _Deliveries()
    r = _request()
    event = _Event(landed=False)
    async with _running(copier, deliveries):
        copier.post([_plain(r, 1)])
        copier.post([_leased(pool, r, 2, event)])
        copier.post([_plain(r, 3)])
        await deliveries.until(1)
        await anyio.sleep(0.05)  # the loop is free: this sleep returns
        assert deliveries.steps == [1]
        event.release.set()
        await deliveries.until(3)
    assert deliveries.steps == [1, 2, 3]


async def test_tickets_received_behind_a_queued_one_wait_their_turn(anyio_backend) -> None:
    pool = _pool(CpuDevice())
    copier = Copier(CpuDevice(), pool)
    deliveries = _Deliveries()
    r = _request()
    copier.loop = _backend.running_loop()
    # Two receptions before the copier task runs: both queued, then handed on in order.
    copier._receive([_leased(pool, r, 1, _Event(landed=True))])
    copier._receive([_plain(r, 2)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, deliveries)
        await deliveries.until(2)
        tg.cancel_scope.cancel()
    assert deliveries.steps == [1, 2]


async def test_tickets_posted_before_the_copier_runs_are_handed_on_once_it_does(
    anyio_backend, sim: _GatedSim
) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))
    copier.loop = _backend.running_loop()
    deliveries = _Deliveries()
    r = _request()
    out = torch.arange(4, dtype=torch.float32)
    # trio may run the producer's task before the copier's: its posts must wait for it.
    copier.post([_plain(r, 1)])
    copier.post([_submit(copier, r, 2, out), _plain(r, 3)])
    copier.post([_plain(r, 4)])
    await anyio.sleep(0.02)
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, deliveries)
        await deliveries.until(4)
        tg.cancel_scope.cancel()
    assert deliveries.steps == [1, 2, 3, 4]
    staged = [t for batch in deliveries.batches for t in batch][1]
    assert staged.data is not None and torch.equal(staged.data, out)


# -- lent buffers: a large frame is copied once ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
async def test_a_large_frame_is_the_pool_buffer_itself_and_goes_back_when_the_reader_drops_it(
    anyio_backend, sim: _GatedSim, dtype: torch.dtype
) -> None:
    sim.gate.set()
    pool = _pool(sim)
    copier = Copier(sim, pool)
    numel = copier_module.LEND_MIN_BYTES // torch.empty(0, dtype=dtype).element_size()
    out = (torch.arange(numel) % 251).reshape(2, -1).to(dtype)
    t = _submit(copier, _request(), 1, out)
    assert t.lease is not None
    buffer = t.lease.buffer
    await _deliver_one(copier, t)
    frame = t.data
    assert frame is not None and frame.dtype == dtype and frame.shape == out.shape and torch.equal(frame, out)
    # One copy of the frame's bytes in all: the device's, into the buffer the reader now holds.
    assert _in_buffer(frame, buffer)
    assert (copier.frames_lent, copier.frames_cloned, copier.host_copy_bytes) == (1, 0, 0)
    assert sim.copied_bytes == out.numel() * out.element_size()
    stats = pool.statistics()
    assert (stats.buffers_lent, stats.buffers_in_use) == (1, 0)
    # While the reader holds it (or any view of it), the buffer is nobody else's.
    view = frame[1]
    t.data = frame = None  # type: ignore[assignment]
    other = pool.acquire(tuple(out.shape), dtype)
    other_ptr = other.buffer.data_ptr()
    assert other_ptr != buffer.data_ptr()
    other.buffer.fill_(7)
    assert torch.equal(view, out[1])
    pool.release(other)
    del view
    gc.collect()
    assert pool.statistics().buffers_lent == 0
    # Back in the pool: two free buffers of this shape, the lent one reused again.
    again = [pool.acquire(tuple(out.shape), dtype) for _ in range(2)]
    assert {a.buffer.data_ptr() for a in again} == {buffer.data_ptr(), other_ptr}
    assert pool.statistics().buffers_total == 2


async def test_a_small_frame_is_a_clone_and_its_buffer_goes_back_at_once(anyio_backend, sim: _GatedSim) -> None:
    sim.gate.set()
    pool = _pool(sim)
    copier = Copier(sim, pool)
    out = torch.arange(16, dtype=torch.float32)
    t = _submit(copier, _request(), 1, out)
    assert t.lease is not None
    buffer = t.lease.buffer
    await _deliver_one(copier, t)
    assert t.data is not None and torch.equal(t.data, out) and not _in_buffer(t.data, buffer)
    assert (copier.frames_lent, copier.frames_cloned, copier.host_copy_bytes) == (0, 1, 64)
    assert pool.statistics().buffers_lent == 0


async def test_a_reader_keeping_its_frames_gets_clones_past_its_share_and_never_starves_the_pool(
    anyio_backend, sim: _GatedSim
) -> None:
    sim.gate.set()
    pool = PinnedBufferPool(sim.host_buffer, max_buffers=8, max_lent=3, max_lent_per_owner=2)
    copier = Copier(sim, pool)
    hoarder, other = _request("hoarder", arrival=1), _request("other", arrival=2)
    deliveries = _Deliveries()
    kept: list[torch.Tensor] = []
    async with _running(copier, deliveries):
        for step in range(1, 6):
            out = torch.full((LARGE,), float(step))
            copier.post([_submit(copier, hoarder, step, out)])
            await deliveries.until(step)
            data = deliveries.batches[-1][0].data
            assert data is not None and torch.equal(data, out)
            kept.append(data)
        # Two lent (its share), three cloned: the pool still has buffers for everyone.
        assert (copier.frames_lent, copier.frames_cloned) == (2, 3)
        assert pool.statistics().buffers_lent == 2
        for step in range(1, 3):
            out = torch.full((LARGE,), -float(step))
            copier.post([_submit(copier, other, step, out)])
            await deliveries.until(5 + step)
            got = deliveries.batches[-1][0].data
            assert got is not None and torch.equal(got, out)
    assert all(torch.equal(k, torch.full((LARGE,), float(i))) for i, k in enumerate(kept, 1))


async def test_a_request_that_ended_gets_no_frame_and_its_buffer_still_waits_for_the_copy(
    anyio_backend, sim: _GatedSim
) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    deliveries = _Deliveries()
    r = _request()
    async with _running(copier, deliveries):
        t = _submit(copier, r, 1, torch.zeros(LARGE))
        r.finalized = True  # cancelled or timed out while its copy is in flight
        copier.post([t])
        await anyio.sleep(0.05)
        assert deliveries.steps == [] and pool.statistics().buffers_in_flight == 1
        sim.gate.set()
        await deliveries.until(1)
    assert t.data is None and t.lease is None
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_lent, stats.buffers_total) == (0, 0, 1)  # back, for the next


@pytest.mark.parametrize("in_flight", [True, False], ids=["still-in-flight", "landed"])
async def test_a_copy_that_fails_to_complete_fails_only_its_own_frame(anyio_backend, in_flight: bool) -> None:
    device = CpuDevice()
    pool = _pool(device)
    copier = Copier(device, pool)
    deliveries = _Deliveries()
    r = _request()
    good = _leased(pool, r, 1, _Event(landed=True))
    # synchronize() raises, with the copy finished or not.
    bad_event = _Event(landed=not in_flight, fails=True)
    bad_event.release.set()
    bad_event.landed = not in_flight
    bad = _leased(pool, r, 2, bad_event)
    bad_event.synchronize = lambda: (_ for _ in ()).throw(RuntimeError("the copy failed"))  # type: ignore[method-assign]
    async with _running(copier, deliveries):
        copier.post([good, bad])
        await deliveries.until(2)
    assert good.data is not None and torch.equal(good.data, torch.full((2,), 1.0)) and good.error is None
    assert bad.data is None and isinstance(bad.error, RuntimeError)
    stats = pool.statistics()
    assert stats.buffers_in_use == 0
    # A buffer the copy may still write into leaves the pool for good; a landed one is reused.
    assert stats.buffers_total == (1 if in_flight else 2)


# -- failures and shutdown ----------------------------------------------------------


async def test_a_failed_hand_over_is_raised_from_the_copiers_task(anyio_backend) -> None:
    copier = Copier(CpuDevice(), _pool(CpuDevice()))

    def deliver(batch: list[CopyTicket]) -> None:
        raise RuntimeError("injected hand-over failure")

    with (
        pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="injected")),
        anyio.fail_after(5),
    ):
        async with _running(copier, deliver):
            copier.post([_plain(_request(), 1)])
            await anyio.sleep_forever()


async def test_a_failure_of_the_waiting_thread_is_raised_from_the_copiers_task(
    anyio_backend, sim: _GatedSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))

    def broken(t: CopyTicket) -> None:
        raise RuntimeError("injected waiting-thread failure")

    monkeypatch.setattr(copier, "_complete", broken)
    with (
        pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="injected")),
        anyio.fail_after(5),
    ):
        async with _running(copier, _Deliveries()):
            copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
            await anyio.sleep_forever()


async def test_nothing_is_handed_on_after_a_failed_hand_over(anyio_backend) -> None:
    copier = Copier(CpuDevice(), _pool(CpuDevice()))
    handed: list[int] = []

    def deliver(batch: list[CopyTicket]) -> None:
        handed.extend(t.step for t in batch)
        if batch[0].step == 1:
            raise RuntimeError("injected hand-over failure")

    r = _request()
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="injected")), anyio.fail_after(5):
        async with _running(copier, deliver):
            copier._receive([_plain(r, 1)])
            copier._receive([_plain(r, 2)])  # behind a gap: must not be delivered
            await anyio.sleep_forever()
    assert handed == [1]


async def test_cancelling_the_copier_never_waits_on_a_wedged_device(anyio_backend, sim: _GatedSim) -> None:
    copier = Copier(sim, _pool(sim))
    with anyio.fail_after(10):
        async with _running(copier, _Deliveries()):
            copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
            while copier.waiting_since is None:
                await anyio.sleep(0.001)
    # The copier's task ended while its waiting thread (a daemon) still waits on the wedged copy.
    assert copier.waiting_since is not None
    assert copier._waiter is not None and copier._waiter.daemon and copier._waiter.is_alive()


async def test_drain_gives_back_landed_buffers_and_counts_the_copies_still_in_flight(anyio_backend) -> None:
    device = CpuDevice()
    pool = _pool(device)
    copier = Copier(device, pool)
    copier.loop = _backend.running_loop()
    r = _request()
    landed = _leased(pool, r, 1, _Event(landed=True))
    stuck = _leased(pool, r, 2, _Event(landed=False))
    copier._receive([landed])  # before the copier task runs: completed, queued for it
    copier._handover.post([stuck, _plain(r, 3)])  # posted, not yet received
    assert copier.drain() == 1
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == (0, 1)  # the in-flight buffer is abandoned
    assert all(t.lease is None and t.src is None for t in (landed, stuck))
    assert copier.drain() == 0


async def test_drain_counts_the_copies_the_waiting_thread_had_not_finished(anyio_backend, sim: _GatedSim) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    r = _request()
    async with _running(copier, _Deliveries()):
        copier.post([_submit(copier, r, 1, torch.zeros(4)), _submit(copier, r, 2, torch.zeros(4))])
        copier.post([_submit(copier, r, 3, torch.zeros(4))])  # queued behind, never picked up
        while copier.waiting_since is None:
            await anyio.sleep(0.001)
    # Engine.aclose: the task group cancelled, then drain; the device never finished the copies.
    assert copier.drain() == 3
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == (0, 0)  # forgotten, never handed out again


def _completions(copier: Copier) -> threading.Event:
    """Set once the copier's ``_complete`` returned (on its waiting thread)."""
    done = threading.Event()
    complete = copier._complete

    def noted(t: CopyTicket) -> None:
        complete(t)
        done.set()

    copier._complete = noted  # type: ignore[method-assign]
    return done


@pytest.mark.parametrize("first", ["drain", "waiter"])
async def test_the_waiting_thread_and_drain_give_a_lease_back_once(
    anyio_backend, sim: _GatedSim, first: str
) -> None:
    # At shutdown the waiting thread is not stopped while it waits: it may complete its
    # ticket while or after drain runs. Whichever takes a lease first gives it back; the
    # other leaves it alone; and the thread hands nothing on once drained.
    pool = _pool(sim)
    copier = Copier(sim, pool)
    completed = _completions(copier)
    deliveries = _Deliveries()
    async with _running(copier, deliveries):
        copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
        while copier.waiting_since is None:
            await anyio.sleep(0.001)
        if first == "waiter":
            sim.gate.set()
            await deliveries.until(1)  # landed, given back, handed on
    if first == "drain":
        assert copier.drain() == 1  # in flight: forgotten
        sim.gate.set()
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(completed.wait)
        expected = (0, 0)
    else:
        assert completed.is_set()
        assert copier.drain() == 0
        expected = (0, 1)
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == expected
    assert copier._waiter is not None
    copier._waiter.join(5)
    assert not copier._waiter.is_alive()  # told to stop by drain, once it looked again
