"""Snapshot and restore: a request stopped at step k, written to bytes and restored goes on bit for bit.

For Synthetic and Mixture here (the native diffusers loops in
test_snapshot_diffusers.py, the bytes in tests/test_checkpoint.py): run k
steps, ``snapshot``, ``to_bytes``, ``from_bytes``, ``restore`` into a fresh
state (and into a new model built the same way, as after a process restart)
and run the rest. Every later frame and the final one must equal the
uninterrupted run's (``torch.equal``, one torch thread: the models
conftest). A restore refuses another model's checkpoint; models that cannot
snapshot say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import omni_stream as om
from omni_stream.checkpoint import Checkpoint
from omni_stream.errors import CheckpointError
from omni_stream.models import Mixture, Synthetic

CPU = torch.device("cpu")


def run_all(model: om.StepModel, params: dict[str, Any]) -> list[torch.Tensor]:
    """The uninterrupted request: every frame (cloned: a model may hand out views of its state)."""
    state = model.start(params, CPU)
    try:
        return [model.step([state])[0].clone() for _ in range(model.total_steps(params))]
    finally:
        model.close(state)


def run_resumed(
    model: om.StepModel, params: dict[str, Any], k: int, restorer: om.StepModel | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], bytes]:
    """k steps, a snapshot through bytes, the rest on a restored state (``restorer``'s, default
    ``model``'s). Also the frames of the original state, which goes on after its snapshot."""
    restorer = restorer or model
    total = model.total_steps(params)
    state = model.start(params, CPU)
    try:
        frames = [model.step([state])[0].clone() for _ in range(k)]
        data = model.snapshot(state).to_bytes()
        # The snapshot took nothing from the state: it goes on as if none was taken.
        original = frames + [model.step([state])[0].clone() for _ in range(total - k)]
    finally:
        model.close(state)
    checkpoint = Checkpoint.from_bytes(data)
    assert (checkpoint.step, checkpoint.total) == (k, total)
    restored = restorer.restore(checkpoint, CPU)
    try:
        frames += [restorer.step([restored])[0].clone() for _ in range(total - k)]
    finally:
        restorer.close(restored)
    return frames, original, data


def assert_frames_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"frame {i + 1} of {len(want)} differs"


def check_resume(
    make: Callable[[], om.StepModel], raw: dict[str, Any], ks: list[int] | None = None,
    *, new_model: bool = True,
) -> bytes:
    """Resume at each k equals the uninterrupted run; at the middle k also on a second model."""
    model = make()
    params = model.validate(raw)
    assert model.can_snapshot(params)
    want = run_all(model, params)
    total = len(want)
    ks = ks if ks is not None else sorted({0, total // 2, total - 1})
    data = b""
    for k in ks:
        got, original, data = run_resumed(model, params, k)
        assert_frames_equal(got, want)
        assert_frames_equal(original, want)
    if new_model:
        got, _, data = run_resumed(model, params, total // 2, make())
        assert_frames_equal(got, want)
    return data


# -- Synthetic and Mixture -------------------------------------------------------------


def test_synthetic_resumes_bit_for_bit() -> None:
    check_resume(Synthetic, dict(steps=6, shape=[2, 8, 8], work=2, seed=3))


@pytest.mark.parametrize("sampler, images", [("ddim", 1), ("euler_a", 1), ("dpmpp_2m", 1), ("euler_a", 3),
                                             ("dpmpp_2m", 2)])
def test_mixture_resumes_bit_for_bit(sampler: str, images: int) -> None:
    check_resume(lambda: Mixture(cache_sizes=2), dict(prompt="red circle", steps=6, size=32, seed=4,
                                                      sampler=sampler, num_images=images))


def test_a_restored_request_batched_with_another_gives_its_solo_frames() -> None:
    for model, raw in ((Synthetic(), dict(steps=5, shape=[4, 4], seed=1)),
                       (Mixture(), dict(prompt="stripes", steps=5, size=32, seed=2, sampler="euler_a"))):
        params = model.validate(raw)
        other = model.validate(dict(raw, seed=9))
        want, want_other = run_all(model, params), run_all(model, other)
        state = model.start(params, CPU)
        head = [model.step([state])[0].clone() for _ in range(2)]
        restored = model.restore(Checkpoint.from_bytes(model.snapshot(state).to_bytes()), CPU)
        model.close(state)
        partner = model.start(other, CPU)
        got, got_other = list(head), []
        for _ in range(3):
            a, b = model.step([restored, partner])
            got.append(a.clone())
            got_other.append(b.clone())
        assert_frames_equal(got, want)
        assert_frames_equal(got_other, want_other[:3])


def test_a_generator_model_cannot_snapshot() -> None:
    model = om.from_generator(lambda p: iter([torch.zeros(1)]), total=1)
    assert model.can_snapshot({}) is False
    with pytest.raises(CheckpointError):
        model.snapshot(iter([]))
    with pytest.raises(CheckpointError):
        model.restore(Checkpoint(model="generator", format=1, step=0, total=1, params={}), CPU)


def synthetic_checkpoint() -> Checkpoint:
    model = Synthetic()
    state = model.start(model.validate(dict(steps=4, shape=[2, 2], seed=1)), CPU)
    model.step([state])
    return model.snapshot(state)


def test_a_checkpoint_of_another_model_or_state_format_is_refused() -> None:
    checkpoint = synthetic_checkpoint()
    with pytest.raises(CheckpointError, match="Synthetic"):
        Mixture().restore(checkpoint, CPU)
    with pytest.raises(CheckpointError, match="state format 99"):
        Synthetic().restore(dataclasses.replace(checkpoint, format=99), CPU)
    with pytest.raises(CheckpointError, match="refused"):
        Synthetic().restore(dataclasses.replace(checkpoint, params={**checkpoint.params, "steps": 0}), CPU)
    with pytest.raises(CheckpointError, match="4 steps"):
        Synthetic().restore(
            dataclasses.replace(checkpoint, total=4, params={**checkpoint.params, "steps": 5}), CPU
        )
    with pytest.raises(CheckpointError, match="do not fit"):
        Synthetic(dtype=torch.float64).restore(checkpoint, CPU)


def test_the_output_param_the_engine_adds_survives() -> None:
    model = Synthetic()
    params = model.validate(dict(steps=3, shape=[2], seed=1))
    params["output"] = "latent"  # added by the engine
    state = model.start(params, CPU)
    checkpoint = model.snapshot(state)
    assert model.restored_params(checkpoint)["output"] == "latent"
    assert model.restore(checkpoint, CPU).params["output"] == "latent"
