"""copier.py: device-to-host copies issued on the producer thread and awaited off the loop.

The promises of the module's docstring, one by one: the cast happens on the
device and never for decoded pixels; a frame is handed on only after its copy
landed, in issue order, as a tensor of its own; a buffer goes back to the pool
only after its copy completed (even for a request that ended); waiting never
blocks the loop nor borrows anyio's shared threads; a failed hand-over kills the
copier's task; shutdown drains what was posted. The simulated device stands in
for an accelerator, its copy stream held shut by a gate for as long as a test
needs a copy in flight.

Covered elsewhere and not repeated here: one wake-up per batch of posts and a
submitted ticket's fields (test_handover_path.py), the CPU path end to end
(test_host_frames.py), the engine dying of a copier failure (test_failures.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from omni_stream import _backend
from omni_stream.device import PinnedBufferPool, SimDevice
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

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        assert self._copy is not None
        self._copy.enqueue(self.gate.wait)
        return super().copy_to_host(src, dst)


@pytest.fixture
def sim() -> Iterator[_GatedSim]:
    device = _GatedSim()
    device.prepare_thread()
    yield device
    device.gate.set()  # never leave the stream's thread parked
    device.close()


class _Event:
    """A copy event told what to answer: ``waits`` answers of its timed wait, then ``landed``."""

    def __init__(self, *, landed: bool, waits: tuple[bool, ...] = (), fails: bool = False) -> None:
        self.landed = landed
        self.waits = list(waits)
        self.fails = fails
        self.timed_waits = 0

    def query(self) -> bool:
        return self.landed

    def wait(self, timeout: float) -> bool:
        self.timed_waits += 1
        if self.waits:
            return self.waits.pop(0)
        return self.landed

    def synchronize(self) -> None:
        if self.fails:
            raise RuntimeError("the copy failed on the device")


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


def _request(request_id: str = "r") -> Request:
    return Request(
        request_id=request_id, params={}, total=100, batch_key=None, policy="all",
        timeout=None, arrival=1, delivery=Delivery("all"),
    )


def _pool(device: Any) -> PinnedBufferPool:
    return PinnedBufferPool(device.host_buffer, max_buffers=4)


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


@asynccontextmanager
async def _running(copier: Copier, deliver: Callable[[list[CopyTicket]], Any]) -> AsyncIterator[None]:
    copier.loop = _backend.running_loop()
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, deliver)
        await anyio.wait_all_tasks_blocked()
        yield
        tg.cancel_scope.cancel()


# -- submit (the producer thread) ---------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "sim"])
def test_frames_are_cast_to_the_frame_dtype_before_the_copy(kind: str, sim: _GatedSim) -> None:
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
        copier._complete([t])
    assert t.data is not None and torch.equal(t.data, out.to(torch.float16))


@pytest.mark.parametrize("kind", ["cpu", "sim"])
def test_decoded_pixels_are_never_cast_to_the_frame_dtype(kind: str, sim: _GatedSim) -> None:
    device = CpuDevice() if kind == "cpu" else sim
    sim.gate.set()
    copier = Copier(device, _pool(device), frame_dtype=torch.float16)
    pixels = torch.arange(12, dtype=torch.uint8).reshape(2, 2, 3)
    t = _submit(copier, _request(), 1, pixels, decoded=True)
    if t.data is None:
        copier._complete([t])
    assert t.data is not None and t.data.dtype == torch.uint8 and torch.equal(t.data, pixels)


def test_a_staged_output_in_an_autograd_graph_is_copied_as_plain_data(sim: _GatedSim) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))
    out = torch.ones(2, 3, requires_grad=True) * 3
    t = _submit(copier, _request(), 1, out)
    assert t.src is not None and not t.src.requires_grad
    copier._complete([t])
    assert t.data is not None and not t.data.requires_grad and torch.equal(t.data, out.detach())


def test_a_copy_that_cannot_be_issued_gives_its_buffer_back_and_raises(sim: _GatedSim) -> None:
    # A pool whose buffers the simulator did not allocate: its copy_to_host refuses them.
    pool = PinnedBufferPool(lambda shape, dtype: torch.empty(shape, dtype=dtype), max_buffers=1)
    copier = Copier(sim, pool)
    with pytest.raises(RuntimeError, match="host_buffer"):
        _submit(copier, _request(), 1, torch.zeros(4))
    assert pool.statistics().buffers_in_use == 0


# -- the loop: receiving, waiting, handing on ------------------------------------------


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
        await anyio.wait_all_tasks_blocked()
        assert deliveries.steps == []
        assert pool.statistics().buffers_in_flight == 1
        assert t.src is out  # kept referenced while the copy may still read it
        assert copier.waiting_since == t.issued_at
        sim.gate.set()
        await deliveries.until(1)
    assert t.data is not None and torch.equal(t.data, out)
    assert t.lease is None and t.src is None
    assert pool.statistics().buffers_in_use == 0
    assert copier.waiting_since is None


async def test_waiting_for_a_copy_borrows_no_token_from_anyios_shared_thread_limiter(
    anyio_backend, sim: _GatedSim
) -> None:
    copier = Copier(sim, _pool(sim))
    deliveries = _Deliveries()
    async with _running(copier, deliveries):
        copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
        await anyio.wait_all_tasks_blocked()  # the loop runs on while the copier waits
        assert copier._limiter.borrowed_tokens == 1
        assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
        sim.gate.set()
        await deliveries.until(1)


async def test_a_frame_with_nothing_to_wait_for_never_overtakes_a_copy_in_flight(
    anyio_backend, sim: _GatedSim
) -> None:
    copier = Copier(sim, _pool(sim))
    deliveries = _Deliveries()
    r = _request()
    async with _running(copier, deliveries):
        copier.post([_submit(copier, r, 1, torch.zeros(4))])
        await anyio.wait_all_tasks_blocked()  # the copier task is waiting for step 1
        copier.post([_plain(r, 2)])
        await anyio.wait_all_tasks_blocked()
        assert deliveries.steps == []
        sim.gate.set()
        await deliveries.until(2)
    assert deliveries.steps == [1, 2]


async def test_tickets_received_behind_a_queued_copy_wait_their_turn(anyio_backend) -> None:
    pool = _pool(CpuDevice())
    copier = Copier(CpuDevice(), pool)
    deliveries = _Deliveries()
    r = _request()
    async with _running(copier, deliveries):
        # Two receptions before the copier task runs: the first is still queued.
        copier._receive([_leased(pool, r, 1, _Event(landed=True))])
        copier._receive([_plain(r, 2)])
        await deliveries.until(2)
    assert deliveries.steps == [1, 2]


async def test_tickets_received_before_the_copier_runs_are_handed_on_once_it_does(
    anyio_backend, sim: _GatedSim
) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))
    copier.loop = _backend.running_loop()
    deliveries = _Deliveries()
    r = _request()
    out = torch.arange(4, dtype=torch.float32)
    # trio may run the producer's task before the copier's: its posts must wait for it,
    # even those with nothing to wait for.
    copier.post([_plain(r, 1)])
    await anyio.wait_all_tasks_blocked()
    copier.post([_submit(copier, r, 2, out), _plain(r, 3)])
    await anyio.wait_all_tasks_blocked()
    assert [t.step for t in copier._inbox] == [1, 2, 3]  # received: queued for the task to come
    copier.post([_plain(r, 4)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, deliveries)
        await deliveries.until(4)
        tg.cancel_scope.cancel()
    assert deliveries.steps == [1, 2, 3, 4]
    staged = deliveries.batches[0][1]
    assert staged.data is not None and torch.equal(staged.data, out)


@pytest.mark.parametrize(
    ("numel", "on_the_loop"),
    [(16, True), ((copier_module._INLINE_MAX_BYTES // 4) + 1, False)],
    ids=["few-bytes", "many-bytes"],
)
async def test_landed_copies_are_finished_on_the_loop_only_when_their_bytes_are_few(
    anyio_backend, sim: _GatedSim, numel: int, on_the_loop: bool
) -> None:
    sim.gate.set()
    copier = Copier(sim, _pool(sim))
    deliveries = _Deliveries()
    threads: list[int] = []
    complete = copier._complete

    def recording(batch: list[CopyTicket]) -> None:
        threads.append(threading.get_ident())
        complete(batch)

    copier._complete = recording  # type: ignore[method-assign]
    out = torch.rand(numel)
    t = _submit(copier, _request(), 1, out)
    assert t.lease is not None and t.lease.event is not None
    t.lease.event.synchronize()  # landed before the loop sees it
    async with _running(copier, deliveries):
        copier.post([t])
        await deliveries.until(1)
    assert (threads == [threading.get_ident()]) is on_the_loop and len(threads) == 1
    assert t.data is not None and torch.equal(t.data, out)


async def test_a_copy_slower_than_one_bounded_wait_is_waited_for_again(anyio_backend) -> None:
    pool = _pool(CpuDevice())
    copier = Copier(CpuDevice(), pool)
    deliveries = _Deliveries()
    event = _Event(landed=False, waits=(False, False, True))
    t = _leased(pool, _request(), 1, event)
    async with _running(copier, deliveries):
        copier.post([t])
        await deliveries.until(1)
    assert event.timed_waits == 3
    assert t.data is not None and torch.equal(t.data, torch.full((2,), 1.0))
    assert pool.statistics().buffers_in_use == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("numel", [64, copier_module._PARALLEL_GRAIN * 2], ids=["small", "large"])
async def test_a_delivered_frame_is_a_tensor_of_its_own_not_the_pool_buffer_reused_next(
    anyio_backend, sim: _GatedSim, dtype: torch.dtype, numel: int
) -> None:
    sim.gate.set()
    pool = _pool(sim)
    copier = Copier(sim, pool)
    deliveries = _Deliveries()
    out = torch.arange(numel).reshape(2, -1).to(dtype)
    async with _running(copier, deliveries):
        copier.post([_submit(copier, _request(), 1, out)])
        await deliveries.until(1)
    frame = deliveries.batches[0][0].data
    assert frame is not None and frame.dtype == dtype and torch.equal(frame, out)
    reused = pool.acquire(tuple(out.shape), dtype)  # the same buffer, handed to the next step
    reused.buffer.fill_(7)
    assert torch.equal(frame, out)


async def test_a_request_that_ended_gets_no_frame_and_its_buffer_still_waits_for_the_copy(
    anyio_backend, sim: _GatedSim
) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    deliveries = _Deliveries()
    r = _request()
    async with _running(copier, deliveries):
        t = _submit(copier, r, 1, torch.zeros(4))
        r.finalized = True  # cancelled or timed out while its copy is in flight
        copier.post([t])
        await anyio.wait_all_tasks_blocked()
        assert deliveries.steps == [] and pool.statistics().buffers_in_flight == 1
        sim.gate.set()
        await deliveries.until(1)
    assert t.data is None and t.lease is None
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == (0, 1)  # back, for the next request


@pytest.mark.parametrize("in_flight", [True, False], ids=["still-in-flight", "landed"])
async def test_a_copy_that_fails_to_complete_fails_only_its_own_frame(anyio_backend, in_flight: bool) -> None:
    pool = _pool(CpuDevice())
    copier = Copier(CpuDevice(), pool)
    deliveries = _Deliveries()
    r = _request()
    good = _leased(pool, r, 1, _Event(landed=True))
    # waits=(True,): the wait returns, then synchronize() raises with the copy still unfinished.
    bad = _leased(pool, r, 2, _Event(landed=not in_flight, waits=(True,), fails=True))
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


async def test_cancelling_the_copier_never_waits_on_a_wedged_device(
    anyio_backend, sim: _GatedSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slice long enough that a cancel waiting for the worker would be seen waiting.
    monkeypatch.setattr(copier_module, "_WAIT_SLICE_S", 2.0)
    copier = Copier(sim, _pool(sim))
    returned: list[bool] = []
    wait_and_complete = copier._wait_and_complete

    def recording(batch: list[CopyTicket]) -> bool:
        done = wait_and_complete(batch)
        returned.append(done)
        return done

    copier._wait_and_complete = recording  # type: ignore[method-assign]
    with anyio.fail_after(10):
        async with _running(copier, _Deliveries()):
            copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
            await anyio.wait_all_tasks_blocked()
            assert copier.waiting_since is not None
    # The copier's task ended while its worker still waits on the wedged copy.
    assert returned == []
    assert copier.waiting_since is None


async def test_drain_gives_back_landed_buffers_and_counts_the_copies_still_in_flight(
    anyio_backend, sim: _GatedSim
) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    copier.loop = _backend.running_loop()
    r = _request()
    landed = _leased(pool, r, 1, _Event(landed=True))
    copier.post([landed])
    await anyio.wait_all_tasks_blocked()
    assert list(copier._inbox) == [landed]  # received on the loop: queued, no copier task runs
    stuck = _submit(copier, r, 2, torch.zeros(4))  # gate shut: in flight
    copier.post([stuck, _plain(r, 3)])  # posted, not yet received
    assert copier.drain() == 1
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == (0, 1)  # the in-flight buffer is abandoned
    assert all(t.lease is None and t.src is None for t in (landed, stuck))
    assert copier.drain() == 0


async def test_drain_counts_the_copy_the_cancelled_copier_was_waiting_on(
    anyio_backend, sim: _GatedSim
) -> None:
    pool = _pool(sim)
    copier = Copier(sim, pool)
    async with _running(copier, _Deliveries()):
        copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
        await anyio.wait_all_tasks_blocked()
    # Engine.aclose: the task group cancelled, then drain; the device never finished the copy.
    assert copier.drain() == 1
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == (0, 0)  # forgotten, never handed out again


def _completions(copier: Copier) -> threading.Event:
    """Set once the copier's ``_complete`` returned (on its worker thread)."""
    done = threading.Event()
    complete = copier._complete

    def noted(batch: list[CopyTicket]) -> None:
        complete(batch)
        done.set()

    copier._complete = noted  # type: ignore[method-assign]
    return done


@pytest.mark.parametrize("first", ["drain", "worker"])
async def test_the_abandoned_worker_and_drain_give_a_waited_lease_back_once(
    anyio_backend, sim: _GatedSim, first: str
) -> None:
    # At shutdown the worker waiting on a batch is abandoned, not stopped: it finishes its
    # bounded wait and may complete the batch while or after drain runs. Whichever takes
    # a lease first gives it back; the other leaves it alone.
    pool = _pool(sim)
    copier = Copier(sim, pool)
    completed = _completions(copier)
    async with _running(copier, _Deliveries()):
        copier.post([_submit(copier, _request(), 1, torch.zeros(4))])
        await anyio.wait_all_tasks_blocked()
    if first == "drain":
        assert copier.drain() == 1  # in flight: forgotten
        sim.gate.set()
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(completed.wait)
        expected = (0, 0)
    else:
        sim.gate.set()
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(completed.wait)  # the worker landed it and gave it back
        assert copier.drain() == 0
        expected = (0, 1)
    stats = pool.statistics()
    assert (stats.buffers_in_use, stats.buffers_total) == expected
