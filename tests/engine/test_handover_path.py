"""The per-frame hand-over: producer batches to the copier, the copier's wake-up of the loop, dispatch.

Issue #23: one wake-up of the loop for every ticket posted before it came
round, dispatch in the call that receives the batch (no consumer task
switch), and tickets posted no later than the next step begins.
"""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream import _backend
from omni_stream.device import PinnedBufferPool
from omni_stream.device.cpu import CpuDevice
from omni_stream.engine.copier import Copier, CopyTicket
from omni_stream.engine.delivery import Delivery
from omni_stream.engine.request import Request

pytestmark = pytest.mark.anyio


def _request(request_id: str = "r", total: int = 100) -> Request:
    return Request(
        request_id=request_id, params={}, total=total, batch_key=None, policy="all",
        timeout=None, arrival=1, delivery=Delivery("all"),
    )


def _copier() -> Copier:
    device = CpuDevice()
    return Copier(device, PinnedBufferPool(device.host_buffer, max_buffers=4))


async def test_tickets_posted_before_the_loop_runs_are_delivered_in_order_with_one_wake_up(
    anyio_backend,
) -> None:
    copier = _copier()
    copier.loop = _backend.running_loop()
    delivered: list[list[CopyTicket]] = []
    r = _request()
    tickets = [CopyTicket(request=r, step=n, data=torch.full((2,), float(n))) for n in range(1, 51)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, delivered.append)
        await anyio.wait_all_tasks_blocked()
        for t in tickets:  # the loop cannot run while these are posted
            copier.post([t])
        with anyio.fail_after(5):
            while sum(map(len, delivered)) < 50:
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    assert copier.wakeups == 1
    assert [t.step for batch in delivered for t in batch] == list(range(1, 51))
    assert len(delivered) == 1  # handed on from the receiving callback, as one batch


async def test_posted_tickets_the_loop_never_received_are_drained_at_shutdown(anyio_backend) -> None:
    copier = _copier()
    copier.loop = _backend.running_loop()
    pool_lease = copier._pool.acquire((2,), torch.float32)
    r = _request()
    copier.post([CopyTicket(request=r, step=1, lease=pool_lease)])
    # Engine.aclose drains after the producer stopped, before the drain callback ran.
    assert copier._pool.statistics().buffers_in_use == 1
    assert copier.drain() == 0
    assert copier._pool.statistics().buffers_in_use == 0  # the buffer went back to the pool


async def test_a_frame_reaches_its_reader_without_the_consumer_task(anyio_backend) -> None:
    # Engine.start still starts OutputProcessor.consume, but the frames must
    # not depend on it: dispatch runs in the copier's receiving callback.
    from omni_stream.engine.output_processor import OutputProcessor
    from omni_stream.engine.table import Limits, RequestTable

    class Activity:
        busy_since: float | None = None
        busy_with: tuple[str, ...] = ()

    table = RequestTable(Limits(max_batch_size=1, max_run_ahead=3, queue_size=8))
    out = OutputProcessor(table, Activity(), om.models.Synthetic())
    r = _request(total=2)
    r.issued = 2
    out.by_id[r.id] = r
    copier = _copier()
    copier.loop = _backend.running_loop()
    async with anyio.create_task_group() as tg:
        tg.start_soon(copier.run, out.deliver)
        await anyio.wait_all_tasks_blocked()
        threading.Thread(
            target=copier.post,
            args=([CopyTicket(request=r, step=n, data=torch.full((2,), float(n))) for n in (1, 2)],),
        ).start()
        with anyio.fail_after(5):
            first = await r.delivery.get()
            second = await r.delivery.get()
        tg.cancel_scope.cancel()
    assert (first.step, second.step, second.final) == (1, 2, True)


async def test_a_cancel_while_frames_wait_to_be_posted_stops_the_request_within_a_step(anyio_backend) -> None:
    # The producer holds a batch's tickets until the next step begins: a
    # reader that leaves meanwhile must still end its request, and the
    # frames already computed must not stall the next request.
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        async with engine.stream({"steps": 1000, "work": 0, "shape": [4, 8, 8]}) as stream:
            async for frame in stream:
                if frame.step == 3:
                    break
        with anyio.fail_after(30):
            final = await engine.generate({"steps": 5, "work": 0, "shape": [4, 8, 8], "seed": 2})
        assert final.step == 5
        assert engine.statistics().cancelled == 1


class _StagedCpu(CpuDevice):
    """The CPU, but through a pool buffer and a copy event: the path of a real accelerator."""

    def copy_owned(self, src: torch.Tensor) -> torch.Tensor | None:
        return None


@pytest.mark.parametrize("device", [CpuDevice, _StagedCpu], ids=["host-resident", "staged"])
def test_a_submitted_ticket_carries_every_field_it_was_given(device: type[CpuDevice]) -> None:
    # submit builds its ticket positionally (cheaper, once a frame): a field added to
    # CopyTicket or moved would shift the others silently, so each is checked here.
    dev = device()
    copier = Copier(dev, PinnedBufferPool(dev.host_buffer, max_buffers=4))
    r = _request()
    out = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = copier.submit(r, 3, out, queued_s=0.25, compute_s=0.5, batch_size=7, decoded=True, decode_s=0.125)
    assert (t.request, t.step, t.queued_s, t.compute_s, t.batch_size) == (r, 3, 0.25, 0.5, 7)
    assert (t.decoded, t.decode_s, t.error) == (True, 0.125, None)
    assert 0 < t.issued_at <= time.monotonic()
    if device is CpuDevice:
        assert t.src is None and t.lease is None and t.copy_s >= 0
        assert t.data is not None and torch.equal(t.data, out) and t.data.data_ptr() != out.data_ptr()
    else:
        assert t.src is out and t.lease is not None and t.data is None and t.copy_s == 0.0
        copier._complete(t)
        assert t.data is not None and torch.equal(t.data, out) and t.lease is None
