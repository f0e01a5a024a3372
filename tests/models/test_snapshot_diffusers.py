"""Snapshot and restore on the native diffusers loops (tiny random pipelines, no downloads).

SD with each kind of sampler (deterministic, stochastic, multistep, second
order, PNDM), SDXL, SD3, Flux, several images, LoRAs: a request resumed from
a checkpoint's bytes at step k, on the same model or on a new one built the
same way, gives every frame of the uninterrupted run bit for bit (one torch
thread: the models conftest). Callback mode and schedulers whose noise lies
outside the request's generator decline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from omni_stream.checkpoint import Checkpoint  # noqa: E402
from omni_stream.errors import CheckpointError  # noqa: E402
from omni_stream.models.diffusers import Diffusers, samplers  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from . import test_diffusers_callback as cb  # noqa: E402
from . import test_diffusers_flux as flux  # noqa: E402
from . import test_diffusers_sd3 as sd3  # noqa: E402
from .test_snapshot import CPU, check_resume, run_all, run_resumed  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    # diffusers' schedulers call np.array(tensor, copy=False) (numpy 2 deprecation); not ours.
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


def sd_model() -> Any:
    return Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)


SD_RAW = dict(prompt="a cat", negative_prompt="blur", steps=4, seed=5, height=16, width=16)

#: Deterministic ones; stochastic ones (euler_a, dpm_2_a, dpmpp_2m_sde, ddpm, lcm: the
#: generator matters); multistep ones (dpmpp_2m_karras, unipc, deis, lms: earlier outputs);
#: second order (heun, dpm_2: a half step); PNDM (ets, counter); the pipeline's own (DDIM).
SD_SAMPLERS = ["euler", "euler_a", "dpmpp_2m_karras", "heun", "ddim", "pndm", "unipc",
               "dpmpp_2m_sde", "lms_karras", "dpm_2", "dpm_2_a", "ddpm", "deis", "lcm", "default"]


@pytest.mark.parametrize("sampler", SD_SAMPLERS)
def test_sd_resumes_bit_for_bit(sampler: str) -> None:
    # A new model (a process restart) for a few: building one takes longer than the run.
    check_resume(sd_model, dict(SD_RAW, sampler=sampler),
                 new_model=sampler in ("euler_a", "dpmpp_2m_karras", "pndm", "heun"))


@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m_karras"])
def test_sd_with_two_images_resumes_bit_for_bit(sampler: str) -> None:
    check_resume(sd_model, dict(SD_RAW, sampler=sampler, num_images=2), ks=[2])


def test_sd_with_eta_and_guidance_rescale_resumes_bit_for_bit() -> None:
    check_resume(sd_model, dict(SD_RAW, sampler="ddim", eta=0.7, guidance_rescale=0.5), ks=[1, 3],
                 new_model=False)


def test_sdxl_resumes_bit_for_bit() -> None:
    check_resume(lambda: Diffusers(sd.sdxl_pipe(), encode_prompt=sd.fixed_embeddings),
                 dict(SD_RAW, sampler="euler_a"))


@pytest.mark.parametrize("sampler", ["default", "euler_karras", "heun"])
def test_sd3_resumes_bit_for_bit(sampler: str) -> None:
    check_resume(lambda: Diffusers(sd3.sd3_pipe(), encode_prompt=sd3.fixed_embeddings),
                 dict(SD_RAW, steps=3, width=24, sampler=sampler), new_model=sampler == "default")


@pytest.mark.parametrize("images", [1, 2])
def test_flux_resumes_bit_for_bit(images: int) -> None:
    check_resume(lambda: Diffusers(flux.flux_pipe(), encode_prompt=flux.fixed_embeddings),
                 dict(prompt="a cat", steps=3, seed=5, height=16, width=32, num_images=images))


def test_the_decoded_result_of_a_resumed_request_is_the_uninterrupted_ones() -> None:
    model = sd_model()
    params = model.validate(dict(SD_RAW, sampler="euler_a"))
    got, _, _ = run_resumed(model, params, 2)
    want = run_all(model, params)
    state = model.start(params, CPU)
    try:
        assert torch.equal(model.decode(state, got[-1]), model.decode(state, want[-1]))
    finally:
        model.close(state)


@pytest.mark.parametrize("sampler", ["dpmpp_2m_karras", "euler_a"])
def test_without_what_the_snapshot_captured_the_rest_would_differ(sampler: str) -> None:
    """The multistep solver's earlier outputs, the generator's state: restored without them,
    the request goes elsewhere. So the equalities above test the capture, not a restart that
    happens to agree."""
    model = sd_model()
    params = model.validate(dict(SD_RAW, sampler=sampler))
    want = run_all(model, params)
    state = model.start(params, CPU)
    frames = [model.step([state])[0].clone() for _ in range(2)]
    checkpoint = model.snapshot(state)
    model.close(state)
    values, tensors = dict(checkpoint.values), dict(checkpoint.tensors)
    if sampler == "euler_a":
        tensors["generator"] = torch.Generator().manual_seed(0).get_state()
    else:  # keep the step index, lose the earlier outputs
        changed = checkpoint.values["scheduler"]["changed"]
        values["scheduler"] = {"changed": {"_step_index": changed["_step_index"]}, "removed": []}
    restored = model.restore(dataclasses.replace(checkpoint, values=values, tensors=tensors), CPU)
    frames += [model.step([restored])[0].clone() for _ in range(2)]
    assert not torch.equal(frames[-1], want[-1])


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("peft")
    from . import test_diffusers_loras as lora_tests

    root = tmp_path_factory.mktemp("loras")
    return {"ink": lora_tests.make_lora(root / "ink", 7), "pastel": lora_tests.make_lora(root / "pastel", 8)}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")  # two LoRAs on one UNet
def test_loras_survive_a_snapshot(loras: dict[str, Any]) -> None:
    def make() -> Any:
        model = sd_model()
        model.load_loras(loras)
        return model

    chosen = [{"name": "pastel", "scale": 0.7}, {"name": "ink", "scale": 0.4}]
    data = check_resume(make, dict(SD_RAW, sampler="euler_a", loras=chosen), ks=[2])
    checkpoint = Checkpoint.from_bytes(data)
    assert checkpoint.params["loras"] == [["ink", 0.4], ["pastel", 0.7]]
    assert make().restored_params(checkpoint)["loras"] == (("ink", 0.4), ("pastel", 0.7))
    # A model without those LoRAs loaded refuses the checkpoint before building anything.
    with pytest.raises(CheckpointError, match="loras"):
        sd_model().restore(checkpoint, CPU)


# -- what declines and what is refused ------------------------------------------------------


def test_callback_mode_cannot_snapshot() -> None:
    model = Diffusers(cb.flux_pipe(), mode="callback")
    assert model.mode == "callback"
    assert model.can_snapshot(model.validate({})) is False
    with pytest.raises(CheckpointError):
        model.snapshot(object())
    with pytest.raises(CheckpointError):
        model.restore(Checkpoint(model="CallbackDiffusers", format=1, step=0, total=1, params={}), CPU)


def test_a_scheduler_with_noise_outside_the_generator_is_declined() -> None:
    model = sd_model()
    params = model.validate(dict(SD_RAW, sampler="euler"))
    state = model.start(params, CPU)
    try:
        model.step([state])
        # What DPMSolverSDEScheduler keeps: a torchsde Brownian tree, an object no checkpoint holds.
        state.scheduler.noise_sampler = object()
        with pytest.raises(CheckpointError, match="noise_sampler"):
            model.snapshot(state)
    finally:
        model.close(state)
    # DPMSolverSDEScheduler itself is declined up front, whether or not torchsde is here to offer it.
    assert "DPMSolverSDEScheduler" in samplers.UNCAPTURED_NOISE
    assert model._scheduler_class_name("dpmpp_sde") in samplers.UNCAPTURED_NOISE or (
        "dpmpp_sde" not in model.sampler_names
    )
    if "dpmpp_sde" in model.sampler_names:
        assert not model.can_snapshot(model.validate(dict(SD_RAW, sampler="dpmpp_sde")))


def test_a_closed_request_cannot_be_snapshot() -> None:
    model = sd_model()
    state = model.start(model.validate(SD_RAW), CPU)
    model.close(state)
    with pytest.raises(CheckpointError, match="closed"):
        model.snapshot(state)


def test_an_sdxl_checkpoint_is_refused_by_an_sd_model() -> None:
    sdxl = Diffusers(sd.sdxl_pipe(), encode_prompt=sd.fixed_embeddings)
    state = sdxl.start(sdxl.validate(SD_RAW), CPU)
    checkpoint = sdxl.snapshot(state)
    sdxl.close(state)
    assert checkpoint.model == "UNetDiffusers/sdxl"
    with pytest.raises(CheckpointError, match="sdxl"):
        sd_model().restore(checkpoint, CPU)
