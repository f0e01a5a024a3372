"""The real CUDA path: pinned buffers, stream ordering, events, the source kept alive.

Skipped without CUDA; ``scripts/gpu_check.sh`` runs them. Written without
pytest-asyncio (``asyncio.run`` inside each test) because the GPU machine
has only pytest.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import omni_stream as om

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# ~ tens of milliseconds of GPU time on current parts; only ordering matters.
_SLEEP_CYCLES = 50_000_000


def _device():
    from omni_stream.device.cuda import CudaDevice

    dev = CudaDevice()
    dev.prepare_thread()
    return dev


def test_host_buffers_are_pinned():
    dev = _device()
    buf = dev.host_buffer((4, 64, 64), torch.float16)
    assert buf.is_pinned()
    assert buf.device.type == "cpu"


def test_the_copy_waits_for_the_compute_stream_and_its_event_tells_when_it_landed():
    dev = _device()
    src = torch.zeros(1 << 20, device=dev.torch_device)
    dst = dev.host_buffer((1 << 20,), torch.float32)
    torch.cuda._sleep(_SLEEP_CYCLES)  # compute stream busy...
    src.fill_(7.0)  # ...and only then is the output written
    event = dev.copy_to_host(src, dst)
    assert isinstance(event, torch.cuda.Event)
    assert not event.query(), "the copy did not wait for the compute stream"
    event.synchronize()
    assert event.query()
    assert bool((dst == 7.0).all()), "the copy read the output before the step wrote it"


def test_the_copy_does_not_block_the_host():
    dev = _device()
    src = torch.ones(1 << 20, device=dev.torch_device)
    dst = dev.host_buffer((1 << 20,), torch.float32)
    torch.cuda._sleep(_SLEEP_CYCLES)
    event = dev.copy_to_host(src, dst)
    # Issue returned while the device was still sleeping.
    assert not event.query()
    event.synchronize()


class _Recycler(om.StepModel):
    """Frees each step's output at once and refills same-size memory, with a slow copy stream.

    Without the copier holding the source until its event completes, the
    caching allocator hands the freed block to the next step and the
    delayed copy reads the next step's values.
    """

    name = "recycler"

    def __init__(self, device_holder):
        self._holder = device_holder

    def total_steps(self, params):
        return int(params["steps"])

    def start(self, params, device):
        return {"i": 0, "device": device}

    def step(self, states):
        out = []
        for s in states:
            s["i"] += 1
            copy_stream = self._holder.device._copy_stream
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    torch.cuda._sleep(_SLEEP_CYCLES // 5)  # delay the copy of this step
            out.append(torch.full((1 << 18,), float(s["i"]), device=s["device"]))
        return out


def test_engine_keeps_the_source_alive_until_its_copy_completes():
    async def main():
        holder = type("H", (), {})()
        model = _Recycler(holder)
        async with om.Engine(model, device="cuda") as engine:
            holder.device = engine.device
            frames = [f async for f in engine.stream({"steps": 12})]
        return frames

    frames = asyncio.run(main())
    for i, frame in enumerate(frames, 1):
        assert frame.data.device.type == "cpu"
        assert bool((frame.data == float(i)).all()), f"step {i} shows another step's data"


def test_engine_frames_on_cuda_match_the_cpu_model_and_cast_on_device():
    async def main():
        model = om.models.Synthetic(dtype=torch.bfloat16)
        async with om.Engine(model, device="cuda", frame_dtype=torch.float32) as engine:
            frames = [f async for f in engine.stream({"steps": 6, "seed": 3, "shape": [4, 64, 64]})]
            stats = engine.statistics()
        return frames, stats

    frames, stats = asyncio.run(main())
    cpu = om.models.Synthetic(dtype=torch.bfloat16).expected_frames({"steps": 6, "seed": 3, "shape": [4, 64, 64]})
    for got, want in zip(frames, cpu, strict=True):
        assert got.data.dtype == torch.float32
        torch.testing.assert_close(got.data, want.float(), rtol=1e-2, atol=1e-2)
    assert stats.buffers_in_use == 0 and stats.buffers_total >= 1


class _CudaLatents(om.StepModel):
    """Latent frames on the GPU; decode makes a larger image there, slowly (a VAE's shape of work)."""

    name = "cuda-latents"
    params = (om.Param("steps", "int", 3, minimum=1),)

    def __init__(self) -> None:
        self.decode_devices: list[str] = []

    def total_steps(self, params):
        return params["steps"]

    def start(self, params, device):
        return {"x": torch.zeros(4, 8, 8, device=device), "device": device}

    def step(self, states):
        out = []
        for s in states:
            s["x"] = s["x"] + 1
            out.append(s["x"].clone())
        return out

    def decode(self, state, frame):
        self.decode_devices.append(frame.device.type)
        torch.cuda._sleep(_SLEEP_CYCLES)  # the copy must wait for this on the compute stream
        return frame[:3].repeat_interleave(8, 1).repeat_interleave(8, 2) / 10


class _CudaPipeline(_CudaLatents):
    """A whole-request model emitting GPU tensors from inside its own loop."""

    runs_whole_requests = True

    def run(self, state, emit):
        x = state["x"]
        for i in range(1, 5):
            x = x + 1
            torch.cuda._sleep(_SLEEP_CYCLES // 4)
            emit(x.clone() if i < 4 else self.decode(state, x), decoded=i == 4)


def test_the_result_is_decoded_on_the_gpu_and_copied_after_the_decode():
    async def main():
        model = _CudaLatents()
        async with om.Engine(model, device="cuda") as engine:
            frames = [f async for f in engine.stream({"steps": 3})]
            assert model.decode_devices == ["cuda"]
            assert [f.decoded for f in frames] == [False, False, True]
            final = frames[-1].data
            assert final.device.type == "cpu" and final.shape == (3, 64, 64)
            assert bool((final == 0.3).all()), "the copy read the image before the decode wrote it"

    asyncio.run(main())


def test_a_whole_request_model_streams_gpu_frames():
    async def main():
        model = _CudaPipeline()
        model.params = (om.Param("steps", "int", 4, minimum=1),)
        async with om.Engine(model, device="cuda") as engine:
            frames = [f async for f in engine.stream({"steps": 4})]
            assert [float(f.data.flatten()[0]) for f in frames[:3]] == [1.0, 2.0, 3.0]
            assert frames[-1].decoded and frames[-1].data.shape == (3, 64, 64)
            assert bool((frames[-1].data == 0.4).all())
            engine.check_health()

    asyncio.run(main())
