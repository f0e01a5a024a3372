"""Engine.pause / resume, resuming from a checkpoint, periodic checkpoints (issue #22)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.checkpoint import Checkpoint
from omni_stream.engine.intake import check_request
from omni_stream.models import Mixture, Synthetic

from .conftest import params, wait_for

ASYNC = pytest.mark.asyncio


class Gated(Synthetic):
    """Synthetic whose steps wait for a gate to open once ``hold_at`` steps are done, so a test
    can act between two steps deterministically; counts snapshots, restores and closes."""

    def __init__(self, hold_at: int = 2) -> None:
        super().__init__()
        self.hold_at = hold_at
        self.gate = threading.Event()
        self.snapshots = self.restores = self.closes = 0

    def step(self, states: Any) -> list[torch.Tensor]:
        if any(s.step >= self.hold_at for s in states):
            self.gate.wait(10)
        return super().step(states)

    def snapshot(self, state: Any) -> Checkpoint:
        self.snapshots += 1
        return super().snapshot(state)

    def restore(self, checkpoint: Checkpoint, device: torch.device) -> Any:
        self.restores += 1
        return super().restore(checkpoint, device)

    def close(self, state: Any) -> None:
        self.closes += 1
        super().close(state)


P = params(steps=6, seed=3)


@ASYNC
@pytest.mark.parametrize("to_host", [False, True])
async def test_a_paused_request_holds_no_place_and_resumed_equals_an_uninterrupted_run(to_host: bool) -> None:
    model = Gated(hold_at=2)
    expected = Synthetic().expected_frames(P)  # (the gated model would wait at its gate)
    async with om.Engine(model, device="cpu", max_batch_size=1) as engine:
        stream = engine.stream(P, request_id="long")
        frames = [await stream.__anext__(), await stream.__anext__()]  # steps 1, 2; step 3 waits at the gate
        assert engine.pause("long", to_host=to_host) and engine.is_paused("long")
        assert not engine.pause("long")  # already paused
        model.gate.set()  # the step in progress completes; no next one starts
        frames.append(await stream.__anext__())
        # Paused: another request runs to its end meanwhile (it holds the only batch place).
        other = await engine.generate(params(steps=3, seed=9))
        assert other.final
        if to_host:
            # Its state went to the host: snapshot, then its device state closed.
            await wait_for(lambda: model.snapshots == 1 and model.closes >= 1, what="the state moved")
        await anyio.sleep(0.2)
        assert stream.poll() is None  # nothing comes while it is paused
        assert engine.resume("long") and not engine.resume("long")
        frames += [f async for f in stream]
    assert [f.step for f in frames] == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(f.data, e) for f, e in zip(frames, expected, strict=True))
    assert model.restores == (1 if to_host else 0)


@ASYNC
async def test_paused_time_does_not_count_against_the_step_timeout() -> None:
    model = Gated(hold_at=1)
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream(P, request_id="slow", timeout=0.3)
        await stream.__anext__()
        engine.pause("slow")
        model.gate.set()
        await stream.__anext__()  # the step in progress
        await anyio.sleep(0.6)  # twice the timeout, paused
        engine.resume("slow")
        rest = [f async for f in stream]
    assert [f.step for f in rest] == [3, 4, 5, 6]


@ASYNC
@pytest.mark.parametrize("make", [Synthetic, Mixture])
async def test_a_request_resumed_from_a_checkpoint_continues_to_the_same_result(make: Any) -> None:
    # What a restart does: checkpoints every 2 steps, then a new engine (a new model
    # instance) resumes from the last one; its frames continue and end where an
    # uninterrupted run ends.
    raw = params(steps=7, seed=5) if make is Synthetic else {"prompt": "red circle", "steps": 7, "size": 32, "seed": 5}
    got: list[tuple[str, Checkpoint]] = []
    async with om.Engine(make(), device="cpu") as engine:
        whole = [f async for f in engine.stream(raw, request_id="r", checkpoint_every=2,
                                                on_checkpoint=lambda rid, c: got.append((rid, c)))]
    assert [(rid, c.step) for rid, c in got] == [("r", 2), ("r", 4), ("r", 6)]
    last = Checkpoint.from_bytes(got[1][1].to_bytes())  # step 4, through its bytes
    async with om.Engine(make(), device="cpu") as engine:
        resumed = engine.stream(None, request_id="r", resume=last)
        assert resumed.total == 7
        rest = [f async for f in resumed]
    assert [f.step for f in rest] == [5, 6, 7]
    assert all(torch.equal(a.data, b.data) for a, b in zip(rest, whole[4:], strict=True))


@ASYNC
async def test_checkpoints_need_a_model_that_can_snapshot_and_a_checkpoint_of_this_model() -> None:
    async with om.Engine(Synthetic(), device="cpu") as engine:
        got: list[Checkpoint] = []
        [f async for f in engine.stream(params(steps=3), checkpoint_every=1, on_checkpoint=lambda r, c: got.append(c))]
        assert [c.step for c in got] == [1, 2]
        with pytest.raises(om.ParamsError):
            engine.stream(params(steps=3), checkpoint_every=0, on_checkpoint=lambda r, c: None)
    mixture_checkpoint = None
    async with om.Engine(Mixture(), device="cpu") as engine:
        def keep(rid: str, c: Checkpoint) -> None:
            nonlocal mixture_checkpoint
            mixture_checkpoint = c

        [f async for f in engine.stream({"steps": 3, "size": 32}, checkpoint_every=1, on_checkpoint=keep)]
    assert mixture_checkpoint is not None
    async with om.Engine(Synthetic(), device="cpu") as engine:
        with pytest.raises(om.CheckpointError):
            engine.stream(None, resume=mixture_checkpoint)  # another model's
    generator = om.from_generator(lambda params: (torch.zeros(2) for _ in range(3)), total=3)
    async with om.Engine(generator, device="cpu") as engine:
        with pytest.raises(om.CheckpointError):
            engine.stream({}, checkpoint_every=1, on_checkpoint=lambda r, c: None)


@ASYNC
async def test_pause_and_resume_of_unknown_or_ended_requests_say_false() -> None:
    async with om.Engine(Synthetic(), device="cpu") as engine:
        assert not engine.pause("nobody") and not engine.resume("nobody")
        await engine.generate(params(steps=2), request_id="done")
        assert not engine.pause("done") and not engine.is_paused("done")


# -- models that cannot stop between steps: refused (issue #34) ------------------------------


class WholeRun(om.StepModel):
    """A library-style loop in one call (callback mode): emits from its per-step callback; its
    second step waits at a gate, so a test acts while the loop holds the device."""

    name = "whole_run"
    runs_whole_requests = True
    params = (om.Param("steps", "int", 4, minimum=1),)

    def __init__(self) -> None:
        self.gate = threading.Event()

    def total_steps(self, params: Any) -> int:
        return int(params["steps"])

    def start(self, params: Any, device: torch.device) -> Any:
        return dict(params)

    def step(self, states: Any) -> list[torch.Tensor]:
        raise AssertionError("a whole-request model is never stepped")

    def can_snapshot(self, params: Any) -> bool:
        return True  # said, but a run inside the library's loop still cannot stop there

    def run(self, state: Any, emit: om.Emit) -> None:
        for i in range(1, state["steps"] + 1):
            if i == 2:
                self.gate.wait(10)
            emit(torch.full((2,), float(i)))


def gated_generator() -> tuple[om.GeneratorModel, threading.Event]:
    gate = threading.Event()

    def loop(params: Any) -> Any:
        for i in range(1, 5):
            if i == 2:
                gate.wait(10)
            yield torch.full((2,), float(i))

    return om.from_generator(loop, total=4, name="loop"), gate


@ASYNC
async def test_a_request_of_a_model_that_cannot_snapshot_is_not_paused_and_runs_on() -> None:
    model, gate = gated_generator()
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream({}, request_id="g")
        assert (await stream.__anext__()).step == 1  # step 2 waits at the gate: it is running
        assert not engine.pause("g") and not engine.pause("g", to_host=True) and not engine.is_paused("g")
        why = engine.pause_refusal("g")
        assert why is not None and "request g" in why and "loop cannot snapshot" in why
        gate.set()
        assert [f.step async for f in stream] == [2, 3, 4]
        assert engine.pause_refusal("g") is None  # ended: nothing to say of it


@ASYNC
async def test_a_whole_request_is_not_paused_and_ends_without_a_timeout_blaming_its_reader() -> None:
    # Paused, the run waited inside the library's loop until its step bound ran out, then
    # failed with a StepTimeoutError saying the reader took no frame.
    model = WholeRun()
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream({"steps": 4}, request_id="w", timeout=0.3)
        assert (await stream.__anext__()).step == 1
        assert not engine.pause("w") and not engine.is_paused("w")
        why = engine.pause_refusal("w")
        assert why is not None and "request w" in why and "runs_whole_requests" in why
        await anyio.sleep(0.5)  # longer than its bound: it was never paused, its reader waits
        model.gate.set()
        assert [f.step async for f in stream] == [2, 3, 4]


@ASYNC
async def test_a_model_whose_can_snapshot_raises_refuses_the_pause_and_fails_nothing() -> None:
    class Broken(Gated):
        def can_snapshot(self, params: Any) -> bool:
            raise RuntimeError("cannot tell")

    model = Broken(hold_at=1)
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream(params(steps=3), request_id="b")
        assert (await stream.__anext__()).step == 1  # step 2 waits at the gate
        assert not engine.pause("b")
        assert "can_snapshot raised RuntimeError('cannot tell')" in (engine.pause_refusal("b") or "")
        model.gate.set()
        assert [f.step async for f in stream] == [2, 3]


@ASYNC
async def test_a_request_handed_over_goes_on_in_another_engine_as_an_uninterrupted_run() -> None:
    # Issue #39, attack 6: what a model router does to unload a model in use. offload() moves
    # the state to the host; hand_over() takes it out once it is there and every frame made
    # has reached the stream (which yields those, then ends), not counted as cancelled.
    model = Gated(hold_at=2)
    expected = Synthetic().expected_frames(P)
    async with om.Engine(model, device="cpu") as first:
        stream = first.stream(P, request_id="moved", policy="all")
        frames = [await stream.__anext__(), await stream.__anext__()]  # step 3 waits at the gate
        assert first.offload("moved")
        assert first.hand_over("moved") is None  # its state is still on the device
        model.gate.set()
        handed = None
        while handed is None:
            await anyio.sleep(0.005)
            handed = first.hand_over("moved")
        assert handed.step == 3 and handed.checkpoint is not None and handed.checkpoint.step == 3
        frames.append(await stream.__anext__())  # the frame made before it left
        with pytest.raises(om.RequestCancelledError, match="handed over"):
            await stream.__anext__()
        assert first.statistics().cancelled == 0
        with pytest.raises(om.RequestCancelledError, match="not in this engine"):
            first.hand_over("moved")
        assert not first.offload("moved")
    async with om.Engine(model, device="cpu") as second:  # the same model, loaded again (a router's)
        request = check_request(model, P, request_id="moved", policy="all")
        frames += [f async for f in second.submit(request, resume=handed.checkpoint)]
    assert [f.step for f in frames] == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(f.data, e) for f, e in zip(frames, expected, strict=True))


@ASYNC
async def test_a_request_that_never_started_is_handed_over_without_a_checkpoint() -> None:
    model = Gated(hold_at=1)
    async with om.Engine(model, device="cpu", max_batch_size=1) as engine:
        first = engine.stream(P, request_id="runs")
        await first.__anext__()  # step 2 waits at the gate, holding the only batch place
        waiting = engine.stream(P, request_id="waits")
        assert engine.offload("waits")
        handed = engine.hand_over("waits")
        assert handed is not None and handed.checkpoint is None and handed.step == 0
        with pytest.raises(om.RequestCancelledError):
            await waiting.__anext__()
        model.gate.set()
        assert [f.step async for f in first][-1] == 6
