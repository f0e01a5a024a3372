"""The diffusers adapter on tiny random pipelines built from configs (no downloads).

Bitwise (torch.equal) wherever a request's steps run alone in their UNet
call: the adapter then runs the very operations diffusers' own loop runs, on
the same inputs, and CPU kernels are deterministic for a fixed shape, so any
difference is a bug (a shared scheduler, a misdrawn generator, an off-by-one
step). Only batched UNet calls are compared with a tolerance: a batch of 4
rows may round differently from a batch of 2.
"""

from __future__ import annotations

import sys

import anyio
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

import omni_stream as om  # noqa: E402
from omni_stream.models.diffusers import Diffusers, PromptEmbeddings  # noqa: E402
from omni_stream.models.diffusers.native import DEFAULT_MAX_BATCH  # noqa: E402
from omni_stream.models.diffusers.unet import UNetDiffusers  # noqa: E402

from .conftest import letter_vocab, check_size_param  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    # diffusers' schedulers call np.array(tensor, copy=False) (numpy 2 deprecation); not ours.
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

CPU = torch.device("cpu")
EMBED_DIM = 16
POOLED_DIM = 8
SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)




def tiny_unet(*, sdxl: bool = False, time_cond_proj_dim: int | None = None) -> UNet2DConditionModel:
    torch.manual_seed(0)
    extra = {}
    if sdxl:
        extra = dict(
            addition_embed_type="text_time",
            addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=6 * 4 + POOLED_DIM,
        )
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=EMBED_DIM,
        norm_num_groups=4,
        attention_head_dim=2,
        time_cond_proj_dim=time_cond_proj_dim,
        **extra,
    )


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(
        block_out_channels=[8, 8],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=4,
    )


def sd_pipe(scheduler=None, *, time_cond_proj_dim=None, tokenizer=None, text_encoder=None):
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=tiny_unet(time_cond_proj_dim=time_cond_proj_dim),
        scheduler=scheduler or DDIMScheduler(**SCHEDULE, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sdxl_pipe():
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(),
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=tiny_unet(sdxl=True),
        scheduler=EulerDiscreteScheduler(**SCHEDULE),
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fixed_embeddings(prompt: str, negative_prompt: str) -> PromptEmbeddings:
    """Stands in for a text encoder: each prompt maps to its own fixed random embeddings."""

    def draw(text: str, *shape: int) -> torch.Tensor:
        seed = int.from_bytes(text.encode()[:8].ljust(8, b"\0"), "little") % 2**63
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + len(shape)))

    return PromptEmbeddings(
        prompt_embeds=draw(prompt, 1, 7, EMBED_DIM),
        negative_prompt_embeds=draw("neg:" + negative_prompt, 1, 7, EMBED_DIM),
        pooled_prompt_embeds=draw(prompt, 1, POOLED_DIM),
        negative_pooled_prompt_embeds=draw("neg:" + negative_prompt, 1, POOLED_DIM),
    )


def run(model: Diffusers, raw: dict) -> list[torch.Tensor]:
    """One request alone, straight through the model interface."""
    params = model.validate(raw)
    state = model.start(params, CPU)
    try:
        return [model.step([state])[0] for _ in range(model.total_steps(params))]
    finally:
        model.close(state)


def reference(pipe, raw: dict, *, sdxl: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """diffusers' own loop: the final latents, and the latents after each step."""
    emb = fixed_embeddings(raw.get("prompt", ""), raw.get("negative_prompt", ""))
    kwargs = dict(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds
    )
    if sdxl:
        kwargs.update(
            pooled_prompt_embeds=emb.pooled_prompt_embeds,
            negative_pooled_prompt_embeds=emb.negative_pooled_prompt_embeds,
        )
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"][0])
        return tensors

    out = pipe(
        **kwargs,
        num_inference_steps=raw["steps"],
        guidance_scale=raw.get("guidance_scale", 5.0 if sdxl else 7.5),
        guidance_rescale=raw.get("guidance_rescale", 0.0),
        generator=torch.Generator("cpu").manual_seed(raw.get("seed", 0)),
        height=raw["height"],
        width=raw["width"],
        output_type="latent",
        callback_on_step_end=on_step_end,
    )
    return out.images[0], seen


# -- the loop is diffusers' loop ------------------------------------------------

CASES = {
    # scheduler, UNet extras, whether the step output carries an x0 prediction
    # SD 1.5's DDIM config: the last step does not land exactly on x0, so
    # the final frame must be the latents, not the x0 prediction.
    "ddim": (lambda: DDIMScheduler(**SCHEDULE, clip_sample=False, set_alpha_to_one=False), {}, True),
    "euler-ancestral": (lambda: EulerAncestralDiscreteScheduler(**SCHEDULE), {}, True),
    "pndm": (lambda: PNDMScheduler(**SCHEDULE, skip_prk_steps=True), {}, False),
    "heun": (lambda: HeunDiscreteScheduler(**SCHEDULE), {}, True),
    "sde-dpm++": (
        lambda: DPMSolverMultistepScheduler(**SCHEDULE, algorithm_type="sde-dpmsolver++"), {}, True
    ),
    "guidance-embedding": (
        lambda: DDIMScheduler(**SCHEDULE, clip_sample=False), {"time_cond_proj_dim": 8}, True
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sd_matches_the_pipeline_bit_for_bit(case):
    make_scheduler, extra, has_x0 = CASES[case]
    pipe = sd_pipe(make_scheduler(), **extra)
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=5, height=16, width=24,
               guidance_rescale=0.3)
    frames = run(model, raw)
    final, per_step = reference(pipe, raw)

    # One frame per UNet evaluation (PNDM: steps + 1, Heun: 2 * steps - 1).
    assert len(frames) == len(per_step) == model.total_steps(model.validate(raw))
    assert all(f.shape == (4, 8, 12) and f.dtype == torch.float32 for f in frames)
    assert torch.equal(frames[-1], final)
    for frame, latents in zip(frames[:-1], per_step[:-1], strict=True):
        # Intermediate frames are the x0 prediction where the scheduler has
        # one, else exactly the latents diffusers' callback sees at that step.
        assert torch.equal(frame, latents) is not has_x0


def test_sdxl_matches_the_pipeline_bit_for_bit():
    pipe = sdxl_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    assert model.family == "sdxl" and model.preview_decoder == "sdxl"
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=2, height=24, width=16)
    frames = run(model, raw)
    final, _ = reference(pipe, raw, sdxl=True)
    assert len(frames) == 3 and torch.equal(frames[-1], final)


def test_ddim_frames_are_the_x0_prediction():
    # Deterministic DDIM moves along x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps with
    # one (x0, eps) per step, so the latents before and after a step pin x0
    # down; the frame must be that x0, not either latent.
    pipe = sd_pipe(DDIMScheduler(**SCHEDULE, clip_sample=False, set_alpha_to_one=True))
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="x", steps=4, seed=1, height=16, width=16)
    frames = run(model, raw)
    _, after = reference(pipe, raw)
    scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(4)
    alphas = scheduler.alphas_cumprod
    before = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(1))[0]
    for i, t in enumerate(scheduler.timesteps[:-1].tolist()):
        prev_t = t - scheduler.config.num_train_timesteps // 4
        a_t, a_prev = alphas[t], alphas[prev_t]
        x0 = ((1 - a_prev).sqrt() * before - (1 - a_t).sqrt() * after[i]) / (
            (1 - a_prev).sqrt() * a_t.sqrt() - (1 - a_t).sqrt() * a_prev.sqrt()
        )
        torch.testing.assert_close(frames[i], x0, rtol=1e-4, atol=1e-4)
        before = after[i]


def text_sd_pipe(tmp_path):
    """A tiny SD pipeline with its own tokenizer and text encoder (a vocabulary written here)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_size, files = letter_vocab(tmp_path)
    tokenizer = CLIPTokenizer(*files,
                              model_max_length=12)
    torch.manual_seed(2)
    encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=EMBED_DIM, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=2, max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )).eval()
    return sd_pipe(tokenizer=tokenizer, text_encoder=encoder)


def test_the_pipelines_own_prompt_encoder_is_used_without_encode_prompt(tmp_path):
    pipe = text_sd_pipe(tmp_path)
    model = Diffusers(pipe)
    raw = dict(prompt="a red cat", negative_prompt="dog", steps=2, seed=4, height=16, width=16)
    frames = run(model, raw)
    expected = pipe(prompt="a red cat", negative_prompt="dog", num_inference_steps=2, height=16,
                    width=16, generator=torch.Generator().manual_seed(4), output_type="latent").images
    assert torch.equal(frames[-1], expected[0])
    assert not torch.equal(run(model, dict(raw, prompt="a blue cat"))[-1], frames[-1])


# -- per-request state ----------------------------------------------------------

REQUEST_A = dict(prompt="a cat", negative_prompt="blur", steps=5, seed=1, height=16, width=16,
                 guidance_scale=7.0)
REQUEST_B = dict(prompt="a dog", steps=3, seed=2, height=24, width=16, guidance_scale=4.0)


def interleaved(model: Diffusers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A and B started together, their steps alternating through one adapter."""
    pa, pb = model.validate(REQUEST_A), model.validate(REQUEST_B)
    a, b = model.start(pa, CPU), model.start(pb, CPU)
    frames_a, frames_b = [], []
    for i in range(max(model.total_steps(pa), model.total_steps(pb))):
        if i < model.total_steps(pa):
            frames_a.append(model.step([a])[0])
        if i < model.total_steps(pb):
            frames_b.append(model.step([b])[0])
    model.close(a)
    model.close(b)
    return frames_a, frames_b


def sde_dpm_pipe():
    # A multistep solver (keeps earlier model outputs) that also draws noise
    # each step: the kind of scheduler state sharing corrupts most.
    return sd_pipe(DPMSolverMultistepScheduler(**SCHEDULE, algorithm_type="sde-dpmsolver++"))


def test_interleaved_requests_match_their_solo_runs_bit_for_bit():
    model = Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings)
    solo_a, solo_b = run(model, REQUEST_A), run(model, REQUEST_B)
    frames_a, frames_b = interleaved(model)
    assert all(torch.equal(x, y) for x, y in zip(frames_a, solo_a, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(frames_b, solo_b, strict=True))


def test_a_shared_scheduler_would_corrupt_interleaved_requests():
    # The control for the test above: share one scheduler, as calling the
    # pipeline from two threads does (diffusers #1606), and B's very first
    # step silently runs at A's step index: the wrong noise level.
    pipe = sde_dpm_pipe()
    same_size = dict(REQUEST_B, height=16, steps=5)
    solo_b = run(Diffusers(pipe, encode_prompt=fixed_embeddings), same_size)

    class SharedScheduler(UNetDiffusers):
        def start(self, params, device):
            state = super().start(params, device)
            shared = pipe.scheduler
            shared.set_timesteps(params["steps"], device=device)
            shared.set_begin_index(0)
            state.scheduler = shared
            return state

    model = SharedScheduler(pipe, encode_prompt=fixed_embeddings)
    a = model.start(model.validate(REQUEST_A), CPU)
    b = model.start(model.validate(same_size), CPU)
    model.step([a])
    assert not torch.equal(model.step([b])[0], solo_b[0])


def test_the_pipelines_scheduler_is_never_touched():
    pipe = sde_dpm_pipe()
    before = dict(vars(pipe.scheduler))
    run(Diffusers(pipe, encode_prompt=fixed_embeddings), REQUEST_A)
    assert vars(pipe.scheduler).keys() == before.keys()
    assert all(vars(pipe.scheduler)[k] is v for k, v in before.items())


def test_a_failed_batched_step_leaves_every_state_as_it_was():
    model = Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
    pa, pb = model.validate(REQUEST_A), model.validate(dict(REQUEST_B, height=16))
    solo_a = run(model, REQUEST_A)
    a, b = model.start(pa, CPU), model.start(pb, CPU)
    first = model.step([a])[0]

    real_step = b.scheduler.step

    def fail_once(*args, **kwargs):
        b.scheduler.step = real_step
        raise RuntimeError("CUDA out of memory (simulated)")

    # A's scheduler steps first and succeeds; B's then raises. A must be
    # rolled back (its multistep history and its noise generator included).
    b.scheduler.step = fail_once
    with pytest.raises(RuntimeError, match="simulated"):
        model.step([a, b])
    assert a.done == 1 and b.done == 0
    # The engine retries each request alone.
    rest = [model.step([a])[0] for _ in range(model.total_steps(pa) - 1)]
    assert all(torch.equal(x, y) for x, y in zip([first, *rest], solo_a, strict=True))


def test_batched_steps_match_solo_runs_closely():
    model = Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
    unguided = dict(REQUEST_B, height=16, guidance_scale=1.0)
    pa, pb = model.validate(REQUEST_A), model.validate(unguided)
    assert model.batch_key(pa) == model.batch_key(pb) == (16, 16, "default", ())
    # Batching is on by default (DEFAULT_MAX_BATCH); batch=False runs each request alone.
    assert Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings).max_batch_size == DEFAULT_MAX_BATCH
    assert Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings, batch=False).batch_key(pa) is None
    solo_a, solo_b = run(model, REQUEST_A), run(model, unguided)

    calls = []
    handle = model._unet.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    try:
        a = model.start(pa, CPU)
        frames_a = [model.step([a])[0]]  # a runs one step ahead of b
        b = model.start(pb, CPU)
        frames_b = []
        while b.done < b.total:
            fa, fb = model.step([a, b])
            frames_a.append(fa)
            frames_b.append(fb)
        while a.done < a.total:
            frames_a.append(model.step([a])[0])
    finally:
        handle.remove()
    # A guided request sends two rows, an unguided one one; one call per step.
    assert calls == [2, 3, 3, 3, 2]
    # Not bitwise: a 4-row UNet call may round differently from a 2-row one.
    for got, want in zip(frames_a + frames_b, solo_a + solo_b, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# -- the engine ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_frames_arrive_per_step_through_the_engine():
    model = Diffusers(sde_dpm_pipe(), encode_prompt=fixed_embeddings)
    raw = dict(REQUEST_A)
    solo = run(model, raw)
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream({**raw, "output": "latent"})]
        image = await engine.generate(raw)
    assert [f.step for f in frames] == list(range(1, len(solo) + 1))
    assert all(f.total == len(solo) for f in frames) and frames[-1].final
    assert all(torch.equal(f.data, s) for f, s in zip(frames, solo, strict=True))
    # By default the result is the VAE's image of that final latent.
    assert image.decoded and torch.equal(image.data, model.decode_latents(solo[-1]))


@pytest.mark.asyncio
async def test_cancelling_stops_the_denoise_loop():
    unet_calls: list[int] = []
    calls_at_close: list[int] = []

    class Recorded(UNetDiffusers):
        def close(self, state):
            calls_at_close.append(len(unet_calls))
            super().close(state)

    model = Recorded(sd_pipe(), encode_prompt=fixed_embeddings)
    model._unet.register_forward_pre_hook(lambda m, args: unet_calls.append(1))
    # queue_size=1: no step starts before the reader took the previous frame.
    async with om.Engine(model, device="cpu", max_run_ahead=1, queue_size=1) as engine:
        stream = engine.stream(dict(steps=40, height=16, width=16), request_id="doomed")
        async for frame in stream:
            if frame.step == 2:
                assert engine.cancel("doomed") is True
                break
        with pytest.raises(om.RequestCancelledError):
            await stream.__anext__()
        with anyio.fail_after(10):  # generous: only "does not hang"
            while not calls_at_close:
                await anyio.sleep(0.005)
        # Two frames read, at most one more computed meanwhile; none after.
        assert calls_at_close[0] <= 3
        final = await engine.generate(dict(steps=2, height=16, width=16))
        assert final.step == 2
    assert len(unet_calls) == calls_at_close[0] + 2


# -- params and construction ----------------------------------------------------


def test_params_are_declared_and_checked():
    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)
    names = [p.name for p in model.params]
    assert names == ["prompt", "negative_prompt", "steps", "guidance_scale", "guidance_rescale",
                     "seed", "num_images", "height", "width", "size", "sampler", "eta",  # eta: DDIM takes it
                     "cache"]  # none only: a UNet has no blocks to skip (test_step_cache.py)
    params = model.validate({})
    assert (params["height"], params["width"], params["steps"]) == (16, 16, 50)
    with pytest.raises(om.ParamsError) as err:
        model.validate({"height": 20})
    assert err.value.field == "height" and "multiple of 8" in str(err.value)
    with pytest.raises(om.ParamsError) as err:
        model.validate({"prompt_embeds": [0.1]})
    assert err.value.field == "prompt_embeds"
    with pytest.raises(om.ParamsError) as err:
        model.validate({"guidance_scale": "high"})
    assert err.value.field == "guidance_scale"
    # eta is declared for the samplers that take it (ddim): not for Euler, the pipeline's own here.
    euler = Diffusers(sd_pipe(EulerDiscreteScheduler(**SCHEDULE)), encode_prompt=fixed_embeddings)
    assert euler.validate({"sampler": "ddim", "eta": 0.3})["eta"] == 0.3
    with pytest.raises(om.ParamsError) as err:
        euler.validate({"eta": 0.3})
    assert err.value.field == "eta" and "ddim" in err.value.message


def test_steps_the_scheduler_rejects_are_a_params_error():
    short = DDIMScheduler(**SCHEDULE, clip_sample=False, num_train_timesteps=100)
    model = Diffusers(sd_pipe(short), encode_prompt=fixed_embeddings)
    assert model.total_steps(model.validate({"steps": 99})) == 99
    with pytest.raises(om.ParamsError) as err:
        model.validate({"steps": 101})
    assert err.value.field == "steps"


# Found by running every step count of each scheduler (1-1000 of 1000
# training steps, the spacings and offsets): with steps_offset=1 and
# "leading" spacing, DDIM, PNDM and DDPM set timesteps 1..num_train at
# steps == num_train and index alphas_cumprod[num_train]; every lower count
# runs. DPM-Solver++ with "leading" spacing repeats timestep 0 there, which
# fails only when the step index is looked up by value: the adapter sets
# begin_index 0, so it runs (below).
FAILS_AT_TRAIN_STEPS = {
    "ddim": lambda n: DDIMScheduler(**SCHEDULE, clip_sample=False, num_train_timesteps=n),
    "pndm": lambda n: PNDMScheduler(**SCHEDULE, skip_prk_steps=True, num_train_timesteps=n),
    "ddpm": lambda n: DDPMScheduler(**SCHEDULE, num_train_timesteps=n),
}


@pytest.mark.parametrize("case", sorted(FAILS_AT_TRAIN_STEPS))
def test_steps_the_scheduler_accepts_but_cannot_run_are_refused_at_admission(case):
    model = Diffusers(sd_pipe(FAILS_AT_TRAIN_STEPS[case](40)), encode_prompt=fixed_embeddings)
    with pytest.raises(om.ParamsError) as err:
        model.validate({"steps": 40})
    assert err.value.field == "steps"
    name = model._scheduler_cls.__name__
    assert "at most 39" in err.value.message and name in err.value.message
    assert "40 training timesteps" in err.value.message
    # The bound is real: the largest count it names runs to its last step.
    assert len(run(model, dict(steps=39, height=16, width=16))) == model.total_steps(
        model.validate({"steps": 39}))


@pytest.mark.parametrize("scheduler", [
    lambda: EulerDiscreteScheduler(**SCHEDULE, num_train_timesteps=40),
    lambda: DPMSolverMultistepScheduler(**SCHEDULE, timestep_spacing="leading", num_train_timesteps=40),
], ids=["euler", "dpm++-leading"])
def test_a_count_the_scheduler_runs_is_not_refused(scheduler):
    model = Diffusers(sd_pipe(scheduler()), encode_prompt=fixed_embeddings)
    assert len(run(model, dict(steps=40, height=16, width=16))) == 40


def test_a_dry_run_leaves_the_global_rng_alone():
    ancestral = EulerAncestralDiscreteScheduler(**SCHEDULE)
    model = Diffusers(sd_pipe(ancestral), encode_prompt=fixed_embeddings)
    torch.manual_seed(3)
    want = torch.rand(1)
    torch.manual_seed(3)
    model.validate({"steps": 7})
    assert torch.equal(torch.rand(1), want)


def test_size_sets_both_sides_and_a_different_side_is_refused():
    check_size_param(Diffusers(sd_pipe(), encode_prompt=fixed_embeddings), 24, 32, 20)


def test_defaults_can_be_overridden_and_are_checked():
    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings,
                      defaults={"steps": 4, "guidance_scale": 0.0})
    assert model.validate({})["steps"] == 4
    with pytest.raises(ValueError, match="unknown"):
        Diffusers(sd_pipe(), encode_prompt=fixed_embeddings, defaults={"stpes": 4})
    with pytest.raises(ValueError, match="steps"):
        Diffusers(sd_pipe(), encode_prompt=fixed_embeddings, defaults={"steps": 0})


def test_without_guidance_one_row_per_request_reaches_the_unet():
    model = Diffusers(sd_pipe(), encode_prompt=lambda p, n: PromptEmbeddings(
        fixed_embeddings(p, n).prompt_embeds))  # no negative needed without guidance
    rows = []
    model._unet.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    frames = run(model, dict(steps=2, guidance_scale=1.0, height=16, width=16))
    assert rows == [1, 1] and len(frames) == 2


def test_without_diffusers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion", None
    )
    with pytest.raises(ImportError, match=r"pip install \"omni-stream\[diffusers\]\""):
        Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)


def test_a_pipeline_without_a_prompt_encoder_needs_encode_prompt():
    with pytest.raises(ValueError, match="encode_prompt="):
        Diffusers(sd_pipe())


def test_unsupported_pipelines_are_refused():
    class TransformerPipeline:
        transformer = object()

    with pytest.raises(ValueError, match="no UNet"):
        UNetDiffusers(TransformerPipeline())
    with pytest.raises(ValueError, match="callback_on_step_end"):
        Diffusers(TransformerPipeline())
    pipe = sd_pipe()
    pipe.unet.register_to_config(in_channels=9)  # an inpainting UNet's channel count
    with pytest.raises(ValueError, match="text-to-image"):
        Diffusers(pipe, encode_prompt=fixed_embeddings)
    with pytest.raises(ValueError, match="max_batch_size"):
        Diffusers(sd_pipe(), encode_prompt=fixed_embeddings, max_batch_size=0)


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM + 1)), "cross_attention_dim"),
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM)), "negative_prompt_embeds"),
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM), torch.zeros(1, 5, EMBED_DIM)),
         "same shape"),
        (lambda p, n: PromptEmbeddings(torch.zeros(2, 7, EMBED_DIM)), r"\[1, seq, dim\]"),
        (lambda p, n: torch.zeros(1, 7, EMBED_DIM), "PromptEmbeddings"),
    ],
)
def test_embeddings_that_do_not_fit_are_refused_at_start(encode, message):
    model = Diffusers(sd_pipe(), encode_prompt=encode)
    with pytest.raises(ValueError, match=message):
        model.start(model.validate({"height": 16, "width": 16}), CPU)


def test_sdxl_needs_pooled_embeddings():
    def without_pooled(prompt, negative_prompt):
        emb = fixed_embeddings(prompt, negative_prompt)
        return PromptEmbeddings(emb.prompt_embeds, emb.negative_prompt_embeds)

    model = Diffusers(sdxl_pipe(), encode_prompt=without_pooled)
    with pytest.raises(ValueError, match="pooled_prompt_embeds"):
        model.start(model.validate({"height": 16, "width": 16}), CPU)


def test_a_closed_request_cannot_step():
    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)
    state = model.start(model.validate({"steps": 3, "height": 16, "width": 16}), CPU)
    model.step([state])
    model.close(state)
    with pytest.raises(RuntimeError, match="closed"):
        model.step([state])


def test_decode_matches_the_pipelines_image():
    pipe = sd_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", steps=2, seed=3, height=16, width=16)
    image = model.decode_latents(run(model, raw)[-1])
    emb = fixed_embeddings("a cat", "")
    expected = pipe(prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
                    num_inference_steps=2, height=16, width=16,
                    generator=torch.Generator().manual_seed(3), output_type="pt").images[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    torch.testing.assert_close(image * 0.5 + 0.5, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="latents"):
        model.decode_latents(torch.zeros(3, 8, 8))
