"""The CUDA path: pinned buffers, stream ordering, events, the source kept alive, frames lent.

Every test runs twice: on a real GPU (``cuda``, skipped without one;
``scripts/gpu_check.sh`` runs them there) and on the simulated GPU (``sim``:
``CudaDevice``'s same code driving ``device/simcuda.py``, torch.cuda's API on
the CPU), so none of them can rot where no GPU runs. Each test takes the API
it drives (``torch.cuda`` or ``simcuda``) from its device. Written without
pytest-asyncio (``asyncio.run`` inside each test) because the GPU machine
has only pytest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import omni_stream as om
from omni_stream.device import SimDevice, simcuda
from omni_stream.device.cuda import CudaDevice

pytestmark = pytest.mark.gpu

# ~ tens of milliseconds of GPU time on current parts (50 ms on the simulated GPU); only
# ordering matters.
_SLEEP_CYCLES = 50_000_000


@pytest.fixture
def kind(gpu_kind: str) -> str:
    return gpu_kind


def _new_device(kind: str) -> CudaDevice:
    return CudaDevice() if kind == "cuda" else SimDevice()


@pytest.fixture
def dev(kind: str) -> Iterator[CudaDevice]:
    device = _new_device(kind)
    device.prepare_thread()
    yield device
    device.close()


def _kernel(dev: CudaDevice, fn: Any) -> None:
    """``fn`` as a kernel of the current stream: launched (cuda), or queued in the stream's order
    (sim, whose tensor ops otherwise run at once on the calling thread)."""
    if dev.kind == "sim":
        simcuda.current_stream()._enqueue(fn)
    else:
        fn()


def _is_pinned(dev: CudaDevice, buf: torch.Tensor) -> bool:
    return bool(buf.is_pinned()) if dev.kind == "cuda" else simcuda.is_pinned(buf)


def test_host_buffers_are_pinned(dev: CudaDevice) -> None:
    buf = dev.host_buffer((4, 64, 64), torch.float16)
    assert _is_pinned(dev, buf)
    assert buf.device.type == "cpu"


def test_the_copy_waits_for_the_compute_stream_and_its_event_tells_when_it_landed(dev: CudaDevice) -> None:
    cuda = dev.cuda
    src = torch.zeros(1 << 20, device=dev.torch_device)
    dst = dev.host_buffer((1 << 20,), torch.float32)
    cuda._sleep(_SLEEP_CYCLES)  # compute stream busy...
    _kernel(dev, lambda: src.fill_(7.0))  # ...and only then is the output written
    event = dev.copy_to_host(src, dst)
    assert isinstance(event, cuda.Event)
    assert not event.query(), "the copy did not wait for the compute stream"
    event.synchronize()
    assert event.query()
    assert bool((dst == 7.0).all()), "the copy read the output before the step wrote it"


def test_the_copy_does_not_block_the_host(dev: CudaDevice) -> None:
    cuda = dev.cuda
    src = torch.ones(1 << 20, device=dev.torch_device)
    dst = dev.host_buffer((1 << 20,), torch.float32)
    cuda._sleep(_SLEEP_CYCLES)
    event = dev.copy_to_host(src, dst)
    # Issue returned while the device was still sleeping.
    assert not event.query()
    event.synchronize()


def test_an_event_given_back_is_recorded_again_and_is_pending_until_its_new_copy_lands(dev: CudaDevice) -> None:
    cuda = dev.cuda
    src = torch.full((1 << 16,), 3.0, device=dev.torch_device)
    dst = dev.host_buffer((1 << 16,), torch.float32)
    event = dev.copy_to_host(src, dst)
    event.synchronize()
    cuda._sleep(_SLEEP_CYCLES)
    src2 = torch.full((1 << 16,), 5.0, device=dev.torch_device)
    again = dev.copy_to_host(src2, dst, event)
    assert again is event and not again.query()
    again.synchronize()
    assert bool((dst == 5.0).all())


def test_a_host_never_waits_on_an_event_with_event_wait(dev: CudaDevice) -> None:
    # Event.wait(stream) makes a *stream* wait; a timeout in its place is refused, on the
    # GPU and on the simulator alike (the engine once died of this on its first GPU).
    cuda = dev.cuda
    src = torch.ones(8, device=dev.torch_device)
    dst = dev.host_buffer((8,), torch.float32)
    cuda._sleep(_SLEEP_CYCLES)
    event = dev.copy_to_host(src, dst)
    with pytest.raises((RuntimeError, TypeError)):
        event.wait(0.25)
    event.synchronize()


class _Recycler(om.StepModel):
    """Frees each step's output at once and refills same-size memory, with a slow copy stream.

    Without the copier holding the source until its event completes, the
    caching allocator hands the freed block to the next step and the
    delayed copy reads the next step's values (on the simulator: garbage).
    """

    name = "recycler"
    params = (om.Param("steps", "int", 12, minimum=1),)

    def __init__(self, holder: Any) -> None:
        self._holder = holder

    def total_steps(self, params: Any) -> int:
        return int(params["steps"])

    def start(self, params: Any, device: torch.device) -> Any:
        return {"i": 0, "device": device}

    def step(self, states: list[Any]) -> list[torch.Tensor]:
        out = []
        dev = self._holder.device
        for s in states:
            s["i"] += 1
            copy_stream = dev._copy_stream
            if copy_stream is not None:
                with dev.cuda.stream(copy_stream):
                    dev.cuda._sleep(_SLEEP_CYCLES // 5)  # delay the copy of this step
            out.append(torch.full((1 << 18,), float(s["i"]), device=s["device"]))
        return out


def test_engine_keeps_the_source_alive_until_its_copy_completes(kind: str) -> None:
    async def main() -> list[om.Frame]:
        holder = type("H", (), {})()
        model = _Recycler(holder)
        device = _new_device(kind)
        holder.device = device
        async with om.Engine(model, device=device) as engine:
            return [f async for f in engine.stream({"steps": 12})]

    frames = asyncio.run(main())
    assert len(frames) == 12
    for i, frame in enumerate(frames, 1):
        assert frame.data.device.type == "cpu"
        assert bool((frame.data == float(i)).all()), f"step {i} shows another step's data"


def test_engine_frames_on_cuda_match_the_cpu_model_and_cast_on_device(kind: str) -> None:
    p = {"steps": 6, "seed": 3, "shape": [4, 64, 64]}

    async def main() -> tuple[list[om.Frame], om.EngineStatistics]:
        model = om.models.Synthetic(dtype=torch.bfloat16)
        async with om.Engine(model, device=_new_device(kind), frame_dtype=torch.float32) as engine:
            frames = [f async for f in engine.stream(p)]
            stats = engine.statistics()
        return frames, stats

    frames, stats = asyncio.run(main())
    cpu = om.models.Synthetic(dtype=torch.bfloat16).expected_frames(p)
    for got, want in zip(frames, cpu, strict=True):
        assert got.data.dtype == torch.float32
        torch.testing.assert_close(got.data, want.float(), rtol=1e-2, atol=1e-2)
    assert stats.buffers_in_use == 0 and stats.buffers_total >= 1


def test_large_frames_are_lent_pinned_buffers_copied_once_and_stay_intact(kind: str) -> None:
    # A 1 MiB frame: the device's copy is the only one; the reader holds the pinned buffer
    # itself, which no later step overwrites while the frame is held.
    p = {"steps": 6, "seed": 4, "shape": [4, 256, 256]}

    async def main() -> tuple[list[om.Frame], Any, om.EngineStatistics]:
        async with om.Engine(om.models.Synthetic(), device=_new_device(kind)) as engine:
            frames = [f async for f in engine.stream(p)]
            copier = engine._copier
            return frames, (copier.frames_lent, copier.frames_cloned, copier.host_copy_bytes), engine.statistics()

    frames, (lent, cloned, host_bytes), stats = asyncio.run(main())
    expected = om.models.Synthetic().expected_frames(p)
    assert all(torch.equal(f.data, e) for f, e in zip(frames, expected, strict=True))
    # The reader kept every frame: its share was lent, the rest copied, nothing corrupted.
    assert lent >= 1 and lent + cloned == 6
    assert host_bytes == cloned * 4 * 256 * 256 * 4
    assert stats.buffers_in_use == 0


class _DeviceLatents(om.StepModel):
    """Latent frames on the device; decode makes a larger image there, slowly (a VAE's shape of work)."""

    name = "device-latents"
    params = (om.Param("steps", "int", 3, minimum=1),)

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.decode_devices: list[str] = []

    def total_steps(self, params: Any) -> int:
        return int(params["steps"])

    def start(self, params: Any, device: torch.device) -> Any:
        return {"x": torch.zeros(4, 8, 8, device=device), "device": device}

    def step(self, states: list[Any]) -> list[torch.Tensor]:
        out = []
        for s in states:
            s["x"] = s["x"] + 1
            out.append(s["x"].clone())
        return out

    def decode(self, state: Any, frame: torch.Tensor) -> torch.Tensor:
        self.decode_devices.append(frame.device.type)
        self.cuda._sleep(_SLEEP_CYCLES)  # the copy must wait for this on the compute stream
        return frame[:3].repeat_interleave(8, 1).repeat_interleave(8, 2) / 10


class _DevicePipeline(_DeviceLatents):
    """A whole-request model emitting device tensors from inside its own loop."""

    runs_whole_requests = True
    params = (om.Param("steps", "int", 4, minimum=1),)

    def run(self, state: Any, emit: Any) -> None:
        x = state["x"]
        for i in range(1, 5):
            x = x + 1
            self.cuda._sleep(_SLEEP_CYCLES // 4)
            emit(x.clone() if i < 4 else self.decode(state, x), decoded=i == 4)


def test_the_result_is_decoded_on_the_device_and_copied_after_the_decode(kind: str) -> None:
    async def main() -> None:
        device = _new_device(kind)
        model = _DeviceLatents(device.cuda)
        async with om.Engine(model, device=device) as engine:
            frames = [f async for f in engine.stream({"steps": 3})]
            assert model.decode_devices == [device.torch_device.type]
            assert [f.decoded for f in frames] == [False, False, True]
            final = frames[-1].data
            assert final.device.type == "cpu" and final.shape == (3, 64, 64)
            assert bool((final == 0.3).all()), "the copy read the image before the decode wrote it"

    asyncio.run(main())


def test_a_whole_request_model_streams_device_frames(kind: str) -> None:
    async def main() -> None:
        device = _new_device(kind)
        model = _DevicePipeline(device.cuda)
        async with om.Engine(model, device=device) as engine:
            frames = [f async for f in engine.stream({"steps": 4})]
            assert [float(f.data.flatten()[0]) for f in frames[:3]] == [1.0, 2.0, 3.0]
            assert frames[-1].decoded and frames[-1].data.shape == (3, 64, 64)
            assert bool((frames[-1].data == 0.4).all())
            engine.check_health()

    asyncio.run(main())


def test_a_preview_decode_runs_beside_the_next_step_and_its_copy_waits_for_it(dev: CudaDevice) -> None:
    cuda = dev.cuda
    frame = torch.zeros(4, 8, 8, device=dev.torch_device)
    pixels = torch.zeros(3, 8, 8, device=dev.torch_device)

    def decode(state: Any, latents: torch.Tensor) -> torch.Tensor:
        cuda._sleep(_SLEEP_CYCLES * 2)  # a slow decoder network...
        _kernel(dev, lambda: pixels.fill_(0.5))  # ...whose output comes last
        return pixels

    out = dev.decode_aside(decode, None, frame)
    assert out is pixels
    # The next step, on the compute stream, does not wait for the decode.
    step_done = cuda.Event()
    cuda._sleep(_SLEEP_CYCLES // 10)
    step_done.record()
    step_done.synchronize()
    dst = dev.host_buffer((3, 8, 8), torch.float32)
    copied = dev.copy_to_host(out, dst)
    assert not copied.query(), "the preview's copy did not wait for its decode"
    copied.synchronize()
    assert bool((dst == 0.5).all()), "the copy read the preview before the decode wrote it"


class _Previewed(om.StepModel):
    """Latents whose previews a slow decoder network makes on the device."""

    name = "previewed"
    params = (om.Param("steps", "int", 4, minimum=1),)

    def __init__(self, dev: CudaDevice) -> None:
        self.dev = dev

    def total_steps(self, params: Any) -> int:
        return int(params["steps"])

    def start(self, params: Any, device: torch.device) -> Any:
        return {"i": 0, "device": device}

    def step(self, states: list[Any]) -> list[torch.Tensor]:
        for s in states:
            s["i"] += 1
        return [torch.full((4, 8, 8), float(s["i"]), device=s["device"]) for s in states]

    def decode_preview(self, state: Any, frame: torch.Tensor) -> torch.Tensor:
        pixels = torch.zeros(3, 16, 16, device=frame.device)
        self.dev.cuda._sleep(_SLEEP_CYCLES // 5)
        value = float(state["i"]) / 10
        _kernel(self.dev, lambda: pixels.fill_(value))
        return pixels


def test_previews_decoded_aside_reach_the_reader_whole(kind: str) -> None:
    async def main() -> list[om.Frame]:
        device = _new_device(kind)
        async with om.Engine(_Previewed(device), device=device) as engine:
            return [f async for f in engine.stream({"steps": 4}, preview_every=1)]

    frames = asyncio.run(main())
    assert [f.decoded for f in frames] == [True, True, True, False]  # the final frame is not previewed
    for i, frame in enumerate(frames[:3], 1):
        assert bool((frame.data == i / 10).all()), f"step {i}'s preview was copied before its decode ended"
