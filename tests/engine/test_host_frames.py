"""Frames that already live in host memory (the CPU device): one copy, no pool, no copier hop."""

from __future__ import annotations

import pytest
import torch

import omni_stream as om
from omni_stream._wakeup import Wakeup
from omni_stream.model import StepModel
from omni_stream.params import Param

from .conftest import wait_for


class _InPlace(StepModel):
    """Returns the same tensor every step, updated in place: the copy must snapshot it."""

    name = "in-place"
    params = (Param("steps", "int", 5, "frames", minimum=1),)

    def total_steps(self, params):
        return int(params["steps"])

    def start(self, params, device):
        return {"x": torch.zeros(4, 8, 8), "n": 0}

    def step(self, states):
        outs = []
        for s in states:
            s["n"] += 1
            s["x"].fill_(float(s["n"]))
            outs.append(s["x"])
        return outs


@pytest.mark.asyncio
async def test_cpu_frames_are_snapshots_of_a_model_output_reused_in_place():
    async with om.Engine(_InPlace(), device="cpu", queue_size=16) as engine:
        stream = engine.stream({"steps": 6})
        # Let the producer run ahead before reading, so a frame that aliased
        # the model's tensor would already show a later step's value.
        frames = [f async for f in stream]
    assert [float(f.data.max()) for f in frames] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert len({f.data.data_ptr() for f in frames}) == 6


class _Grad(_InPlace):
    """Outputs in an autograd graph (a model run without torch.no_grad)."""

    name = "grad"

    def start(self, params, device):
        return {"w": torch.ones(4, 8, 8, requires_grad=True), "n": 0}

    def step(self, states):
        outs = []
        for s in states:
            s["n"] += 1
            outs.append(s["w"] * float(s["n"]))
        return outs


@pytest.mark.asyncio
async def test_a_frame_of_an_output_in_an_autograd_graph_is_plain_data():
    async with om.Engine(_Grad(), device="cpu") as engine:
        frames = [f async for f in engine.stream({"steps": 3})]
    assert [float(f.data.max()) for f in frames] == [1.0, 2.0, 3.0]
    assert not any(f.data.requires_grad or f.data.grad_fn is not None for f in frames)


@pytest.mark.asyncio
async def test_cpu_frames_take_no_pool_buffer_and_skip_the_copier_task(monkeypatch):
    model = om.models.Synthetic()
    async with om.Engine(model, device="cpu") as engine:
        woken = 0
        copier_wakeup = engine._copier._wakeup
        original_wake = Wakeup.wake

        def counting_wake(self: Wakeup) -> None:
            nonlocal woken
            woken += self is copier_wakeup
            original_wake(self)

        monkeypatch.setattr(Wakeup, "wake", counting_wake)
        p = {"steps": 8, "seed": 4}
        frames = [f.data async for f in engine.stream(p)]
        stats = engine.statistics()
    assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
    # Host-resident frames are copied once on the producer thread: no staging
    # buffer, and the loop hands them on without waking the copier task.
    assert stats.buffers_total == 0
    assert woken == 0


@pytest.mark.asyncio
async def test_sim_frames_still_go_through_pool_buffers_and_the_copier():
    model = om.models.Synthetic()
    device = om.device.SimDevice(compute_s=0.0, copy_s=0.002)
    async with om.Engine(model, device=device) as engine:
        p = {"steps": 5, "seed": 2}
        frames = [f.data async for f in engine.stream(p)]
        stats = engine.statistics()
    assert all(torch.equal(a, b) for a, b in zip(frames, model.expected_frames(p), strict=True))
    assert stats.buffers_total >= 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["cpu", "sim"])
async def test_start_releases_the_loop_threads_idle_openmp_team(kind, monkeypatch):
    import threading

    from omni_stream.engine import engine as engine_module

    calls: list[int] = []
    monkeypatch.setattr(engine_module, "release_idle_team", lambda: calls.append(threading.get_ident()) or True)
    device = "cpu" if kind == "cpu" else om.device.SimDevice(compute_s=0.0, copy_s=0.0)
    async with om.Engine(om.models.Synthetic(), device=device) as engine:
        await engine.generate({"steps": 2})
    assert calls == [threading.get_ident()]


@pytest.mark.asyncio
async def test_poll_returns_the_newest_frame_without_waiting_and_leaves_the_end_to_anext():
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        stream = engine.stream({"steps": 4}, policy="latest")
        first = await stream.__anext__()
        # Let the request finish computing: "latest" keeps only the newest frame.
        await wait_for(lambda: engine.statistics().steps >= 4, what="all steps")
        await wait_for(lambda: engine.statistics().completed == 1, what="the final frame delivered")
        newest = stream.poll()
        assert newest is not None and newest.final and newest.step == 4 and first.step < 4
        assert stream.poll() is None  # nothing after the final frame
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


@pytest.mark.asyncio
async def test_poll_leaves_a_failure_for_anext():
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        stream = engine.stream({"steps": 5, "fail_at": 1})
        await wait_for(lambda: engine.statistics().failed == 1, what="the failure")
        assert stream.poll() is None
        with pytest.raises(om.StepFailedError):
            await stream.__anext__()


def test_cpu_device_copies_only_dense_cpu_tensors_itself():
    device = om.device.CpuDevice()
    src = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    owned = device.copy_owned(src)
    assert owned is not None and torch.equal(owned, src) and owned.is_contiguous()
    src.add_(1)
    assert not torch.equal(owned, src)  # a copy, not a view
    assert device.copy_owned(torch.eye(3).to_sparse()) is None
    assert device.copy_owned(torch.empty(2, device="meta")) is None


@pytest.mark.asyncio
async def test_the_producers_torch_threads_do_not_change_the_process_default():
    import threading

    before = torch.get_num_threads()
    seen: list[int] = []
    async with om.Engine(om.models.Synthetic(), device="cpu", torch_threads=1) as engine:
        await engine.generate({"steps": 2})
        # A thread the user starts after the engine: torch's default count,
        # not the producer's one thread.
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
    assert seen == [before]
