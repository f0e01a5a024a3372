"""The request's output: the final decode on the producer, and whole-request models."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.model import RequestStopped

from .conftest import make_device, settled, wait_busy_with, wait_for


class Latents(om.StepModel):
    """Frames are [4, 2, 2] latents; decode makes a [3, 4, 4] image on the producer thread."""

    name = "latents"
    params = (om.Param("steps", "int", 3, minimum=1),)

    def __init__(self, *, fail_decode: bool = False) -> None:
        self.fail_decode = fail_decode
        self.decode_threads: list[str] = []
        self.decoded_steps: list[int] = []

    def total_steps(self, params: Mapping[str, Any]) -> int:
        return params["steps"]

    def start(self, params: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
        return {"done": 0}

    def step(self, states: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
        out = []
        for s in states:
            s["done"] += 1
            out.append(torch.full((4, 2, 2), float(s["done"])))
        return out

    def decode(self, state: dict[str, Any], frame: torch.Tensor) -> torch.Tensor:
        self.decode_threads.append(threading.current_thread().name)
        self.decoded_steps.append(state["done"])
        if self.fail_decode:
            raise RuntimeError("the VAE ran out of memory")
        return torch.full((3, 4, 4), frame[0, 0, 0].item() / 10)


@pytest.mark.asyncio
async def test_the_final_frame_is_the_decoded_output_made_on_the_producer(device_kind):
    model = Latents()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        frames = [f async for f in engine.stream({"steps": 3})]
        assert [f.data.shape for f in frames] == [(4, 2, 2), (4, 2, 2), (3, 4, 4)]
        assert [f.decoded for f in frames] == [False, False, True]
        assert torch.equal(frames[-1].data, torch.full((3, 4, 4), 0.3))
        assert model.decode_threads == ["omni-stream-producer"]
        assert model.decoded_steps == [3]
        assert frames[-1].timings.decode_s > 0
        assert frames[-1].timings.compute_s >= frames[-1].timings.decode_s
        await settled(engine)


@pytest.mark.asyncio
async def test_output_latent_keeps_the_final_latent(device_kind):
    model = Latents()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        final = await engine.generate({"steps": 2, "output": "latent"})
        assert final.data.shape == (4, 2, 2) and not final.decoded
        assert torch.equal(final.data, torch.full((4, 2, 2), 2.0))
        assert model.decode_threads == []


@pytest.mark.asyncio
async def test_a_bad_output_is_a_params_error_naming_it():
    async with om.Engine(Latents(), device="cpu") as engine:
        with pytest.raises(om.ParamsError, match="output") as info:
            engine.stream({"output": "jpeg"}, request_id="r1")
        assert info.value.field == "output" and info.value.request_id == "r1"


@pytest.mark.asyncio
async def test_the_model_sees_the_output_param_unless_it_declares_its_own():
    seen: list[Mapping[str, Any]] = []

    class Seeing(Latents):
        def start(self, params, device):
            seen.append(dict(params))
            return super().start(params, device)

    class Declaring(Seeing):
        params = (*Latents.params, om.Param("output", "str", "pixels", choices=("pixels", "latent")))

    async with om.Engine(Seeing(), device="cpu") as engine:
        await engine.generate({"steps": 1})
        await engine.generate({"steps": 1, "output": "latent"})
    async with om.Engine(Declaring(), device="cpu") as engine:
        await engine.generate({"steps": 1})
        with pytest.raises(om.ParamsError, match="pixels"):
            engine.stream({"output": "image"})
    assert [p["output"] for p in seen] == ["image", "latent", "pixels"]


@pytest.mark.asyncio
async def test_a_failing_decode_fails_only_its_request(device_kind):
    model = Latents(fail_decode=True)
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        with pytest.raises(om.StepFailedError, match="out of memory") as info:
            [f async for f in engine.stream({"steps": 2}, request_id="vae")]
        assert info.value.request_id == "vae" and info.value.step == 2
        model.fail_decode = False
        assert (await engine.generate({"steps": 2})).decoded
        engine.check_health()


@pytest.mark.asyncio
async def test_a_model_whose_frames_are_pictures_is_not_marked_decoded():
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        final = await engine.generate({"steps": 2, "shape": [3, 4, 4], "work": 0})
        assert not final.decoded and final.data.shape == (3, 4, 4)


# -- whole-request models --------------------------------------------------------------


class Pipeline(om.StepModel):
    """A library-style loop in one call: emits from a per-step callback."""

    name = "pipeline"
    runs_whole_requests = True
    params = (
        om.Param("steps", "int", 4, minimum=1),
        om.Param("short_by", "int", 0, minimum=0),
        om.Param("extra", "int", 0, minimum=0),
        om.Param("fail_at", "int", 0, minimum=0),
    )

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.stopped: list[str] = []
        self.threads: set[str] = set()

    def total_steps(self, params):
        return params["steps"]

    def start(self, params, device):
        return {"params": params, "id": object()}

    def step(self, states):
        raise AssertionError("a whole-request model is never stepped")

    def run(self, state, emit):
        p = state["params"]
        key = p.get("tag", "")
        self.threads.add(threading.current_thread().name)
        n = p["steps"] - p["short_by"] + p["extra"]
        try:
            for i in range(1, n + 1):
                if self.gate is not None:
                    self.gate.wait(5)
                if p["fail_at"] == i:
                    raise ValueError(f"the scheduler broke at {i}")
                self.computed[key] = self.computed.get(key, 0) + 1
                last = i == p["steps"]
                frame = torch.full((3, 2, 2), float(i))
                emit(torch.zeros(3, 5, 5) if last else frame, decoded=last)
        except RequestStopped:
            self.stopped.append(key)
            raise


@pytest.mark.asyncio
async def test_a_whole_request_model_streams_every_step_from_the_producer(device_kind):
    model = Pipeline()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        frames = [f async for f in engine.stream({"steps": 4})]
        assert [f.step for f in frames] == [1, 2, 3, 4]
        assert [f.decoded for f in frames] == [False, False, False, True]
        assert frames[-1].data.shape == (3, 5, 5)
        assert torch.equal(frames[1].data, torch.full((3, 2, 2), 2.0))
        assert model.threads == {"omni-stream-producer"}
        await settled(engine)


@pytest.mark.asyncio
async def test_cancelling_a_whole_request_stops_its_loop_within_one_step(device_kind):
    model = Pipeline()
    model.gate = threading.Event()
    model.gate.set()
    async with om.Engine(model, device=make_device(device_kind), queue_size=1) as engine:
        stream = engine.stream({"steps": 50}, request_id="long")
        async with stream:
            first = await stream.__anext__()
            assert first.step == 1
            # Policy "all" with queue_size 1: the loop waits in emit for this reader.
            await anyio.sleep(0.05)
            assert model.computed[""] <= 3
        # Leaving the stream cancelled the request; emit raised out of the loop.
        await wait_for(lambda: model.stopped == [""], what="the loop to stop")
        assert model.computed[""] <= 3
        stats = await settled(engine)
        assert stats.cancelled == 1
        # The engine serves the next request in full.
        assert len([f async for f in engine.stream({"steps": 3})]) == 3
        engine.check_health()


@pytest.mark.asyncio
async def test_a_whole_request_timeout_stops_the_loop_and_the_engine_goes_on():
    model = Pipeline()
    model.gate = threading.Event()  # closed: the loop blocks before its first step
    async with om.Engine(model, device="cpu") as engine:
        with pytest.raises(om.StepTimeoutError):
            await engine.generate({"steps": 5}, timeout=0.1)
        model.gate.set()
        await wait_for(lambda: model.stopped == [""], what="the loop to stop")
        assert model.computed[""] == 1
        assert (await engine.generate({"steps": 2})).step == 2
        engine.check_health()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"steps": 4, "short_by": 1}, "returned after 3 of 4 frames"),
        ({"steps": 3, "extra": 1}, "emitted frame 4 of a request with 3 steps"),
        ({"steps": 4, "fail_at": 2}, "the scheduler broke at 2"),
    ],
)
@pytest.mark.asyncio
async def test_a_misbehaving_whole_request_fails_alone(params, message):
    model = Pipeline()
    async with om.Engine(model, device="cpu") as engine:
        with pytest.raises(om.StepFailedError, match=message):
            [f async for f in engine.stream(params, request_id="bad")]
        assert len([f async for f in engine.stream({"steps": 2})]) == 2
        await settled(engine)
        engine.check_health()


@pytest.mark.asyncio
async def test_whole_requests_run_one_at_a_time_and_queue_behind_each_other():
    model = Pipeline()
    async with om.Engine(model, device="cpu", max_batch_size=8) as engine:
        results: dict[str, list[int]] = {}

        async def one(name: str) -> None:
            results[name] = [f.step async for f in engine.stream({"steps": 3}, request_id=name)]

        async with anyio.create_task_group() as tg:
            for name in ("a", "b", "c"):
                tg.start_soon(one, name)
        assert results == {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2, 3]}
        assert engine._producer.batch_sizes == {1: 9}


# -- preview decoder networks ----------------------------------------------------------


class Previewing(Latents):
    """Has a decoder network for previews: [4, 2, 2] -> [3, 2, 2] pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.preview_steps: list[int] = []

    def decode_preview(self, state, frame):
        self.preview_steps.append(state["done"])
        assert threading.current_thread().name == "omni-stream-producer"
        return frame[:3].clone() / 10


@pytest.mark.asyncio
async def test_only_the_steps_a_reader_previews_are_decoded_on_the_producer(device_kind):
    model = Previewing()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        frames = [f async for f in engine.stream({"steps": 7}, preview_every=3)]
        assert model.preview_steps == [3, 6]  # not the final: that gets the full decode
        assert [f.decoded for f in frames] == [False, False, True, False, False, True, True]
        assert frames[2].data.shape == (3, 2, 2) and frames[1].data.shape == (4, 2, 2)
        assert frames[2].timings.decode_s > 0 and frames[1].timings.decode_s == 0
        model.preview_steps.clear()
        await engine.generate({"steps": 4})  # no preview_every: no preview decodes
        assert model.preview_steps == []
        with pytest.raises(om.ParamsError, match="preview_every") as info:
            engine.stream({"steps": 2}, preview_every=0)
        assert info.value.field == "preview_every"


@pytest.mark.asyncio
async def test_whole_request_models_get_preview_decodes_too():
    class PreviewingPipeline(Pipeline):
        def decode_preview(self, state, frame):
            return torch.ones(3, 1, 1)

    async with om.Engine(PreviewingPipeline(), device="cpu") as engine:
        frames = [f async for f in engine.stream({"steps": 4}, preview_every=2)]
        assert [f.decoded for f in frames] == [False, True, False, True]
        assert frames[1].data.shape == (3, 1, 1)


@pytest.mark.asyncio
async def test_a_model_that_raises_request_stopped_itself_fails_once():
    class Quitter(Pipeline):
        runs = 0

        def run(self, state, emit):
            Quitter.runs += 1
            emit(torch.zeros(3, 2, 2))
            raise RequestStopped("the model gave up on its own")

    async with om.Engine(Quitter(), device="cpu") as engine:
        with pytest.raises(om.StepFailedError, match="gave up"):
            [f async for f in engine.stream({"steps": 3}, request_id="q")]
        stats = await settled(engine)
        assert Quitter.runs == 1 and stats.failed == 1  # never run again from a used state
        engine.check_health()


@pytest.mark.asyncio
async def test_requests_queued_behind_a_whole_request_do_not_time_out_while_they_wait():
    class Slow(Pipeline):
        def run(self, state, emit):
            for i in range(1, state["params"]["steps"] + 1):
                threading.Event().wait(0.05)
                emit(torch.full((3, 2, 2), float(i)))

    async with om.Engine(Slow(), device="cpu") as engine:
        done: dict[str, int] = {}

        async def one(name: str) -> None:
            # 0.3 s per step is plenty; a whole run of 10 steps takes 0.5 s.
            frames = [f async for f in engine.stream({"steps": 10}, request_id=name, timeout=0.3)]
            done[name] = len(frames)

        async with anyio.create_task_group() as tg:
            for name in ("a", "b", "c"):
                tg.start_soon(one, name)
        assert done == {"a": 10, "b": 10, "c": 10}


class HandClock:
    """The engine's step clock (``RequestTable.clock``), moved by hand; counts the loop's reads.

    Only the bound's arithmetic runs on it: the reader's timer is real, so
    while this clock stands still a waiting reader keeps looking again.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.loop_thread = threading.get_ident()
        self.loop_reads = 0

    def __call__(self) -> float:
        if threading.get_ident() == self.loop_thread:
            self.loop_reads += 1
        return self.now


class Gated(Pipeline):
    """Each run waits for its own gate (the n-th run for ``gates[n]``) before it emits."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = [threading.Event(), threading.Event()]
        self.runs = 0

    def run(self, state, emit):
        gate = self.gates[self.runs]
        self.runs += 1
        gate.wait(20)
        for i in range(1, state["params"]["steps"] + 1):
            emit(torch.full((3, 2, 2), float(i)))


async def queue_b_behind_a(engine: om.Engine, clock: HandClock, tg, outcome: dict[str, Any]) -> None:
    """Run "a" (held at its gate), queue "b" (timeout 0.2) behind it for 50 s, then hand "b" the device."""
    model = engine.model
    assert isinstance(model, Gated)
    a = engine.stream({"steps": 1}, request_id="a")
    await wait_busy_with(engine, "a")

    async def read_b() -> None:
        try:
            b = engine.stream({"steps": 2}, request_id="b", timeout=0.2)
            outcome["frames"] = [f.step async for f in b]
        except om.StepTimeoutError as exc:
            outcome["error"] = exc

    tg.start_soon(read_b)
    await anyio.wait_all_tasks_blocked()  # b's reader is waiting, since 0.0
    clock.now = 50.0  # b has waited far longer than its bound, queued
    model.gates[0].set()
    assert [f.step async for f in a] == [1]
    await wait_busy_with(engine, "b")  # handed the device at 50.0, held at its gate


@pytest.mark.asyncio
async def test_a_request_queued_behind_a_whole_run_gets_its_full_bound_once_handed_the_device():
    async with om.Engine(Gated(), device="cpu") as engine:
        clock = HandClock()
        engine._table.clock = clock
        outcome: dict[str, Any] = {}
        try:
            async with anyio.create_task_group() as tg:
                await queue_b_behind_a(engine, clock, tg, outcome)
                clock.now = 50.1  # half its bound into its first step
                reads = clock.loop_reads
                # Its reader looks again (its timer fires) while the step runs: no timeout yet.
                await wait_for(lambda: clock.loop_reads > reads or outcome, what="b's reader looking again")
                assert outcome == {}
                engine.model.gates[1].set()
        finally:
            engine.model.gates[1].set()
        assert outcome == {"frames": [1, 2]}


@pytest.mark.asyncio
async def test_a_request_handed_the_device_behind_a_whole_run_times_out_one_bound_later():
    async with om.Engine(Gated(), device="cpu") as engine:
        clock = HandClock()
        engine._table.clock = clock
        outcome: dict[str, Any] = {}
        try:
            async with anyio.create_task_group() as tg:
                await queue_b_behind_a(engine, clock, tg, outcome)
                clock.now = 50.3  # past 50.0 + 0.2
        finally:
            engine.model.gates[1].set()
        err = outcome["error"]
        assert (err.request_id, err.step, err.bound_s) == ("b", 1, 0.2)
        assert "it was computing step 1/2" in str(err)


@pytest.mark.asyncio
async def test_a_stalled_reader_of_a_whole_request_fails_it_instead_of_blocking_everyone():
    async with om.Engine(Pipeline(), device="cpu", queue_size=1) as engine:
        stalled = engine.stream({"steps": 20}, request_id="stalled", timeout=0.3)
        async with stalled:
            assert (await stalled.__anext__()).step == 1
            # This reader now stops reading (without closing its stream)...
            await anyio.sleep(0)
            # ...and another request still runs to its end.
            frames = [f async for f in engine.stream({"steps": 3}, request_id="next", timeout=5)]
            assert len(frames) == 3
            with pytest.raises(om.StepTimeoutError, match="reader took no frame") as info:
                [f async for f in stalled]
            assert info.value.request_id == "stalled"
        engine.check_health()


@pytest.mark.asyncio
async def test_whole_request_models_are_never_batched_even_with_a_batch_key():
    events: list[str] = []

    class Keyed(Pipeline):
        def batch_key(self, params):
            return "same"

        def start(self, params, device):
            events.append("start")
            return super().start(params, device)

        def run(self, state, emit):
            super().run(state, emit)
            events.append("end")

    async with om.Engine(Keyed(), device="cpu", max_batch_size=8) as engine:
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(engine.generate, {"steps": 3})
    # A batch of two would have started the second request before the first ran.
    assert events == ["start", "end", "start", "end"]
