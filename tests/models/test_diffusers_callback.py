"""Callback mode on tiny random pipelines built from configs (no downloads).

Each request's frames are compared with what diffusers' own step callback
sees in a reference ``pipe(...)`` call with the same seed: the adapter runs
that very call, so intermediate latents must match bit for bit (one torch
thread; CPU kernels are deterministic for a fixed shape). Decoded outputs
go through ``x * 2 - 1`` and are compared with a tolerance.
"""

from __future__ import annotations

import base64
import io

import anyio
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    AutoencoderKL,
    AutoencoderKLWan,
    DDIMScheduler,
    EulerAncestralDiscreteScheduler,
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    HeunDiscreteScheduler,
    AutoencoderKLQwenImage,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    PNDMScheduler,
    StableDiffusionImg2ImgPipeline,
    UNet2DConditionModel,
    WanPipeline,
    WanTransformer3DModel,
)
from PIL import Image  # noqa: E402

import omni_stream as om  # noqa: E402
from .conftest import letter_vocab  # noqa: E402
from omni_stream.model import RequestStopped  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.callback import CallbackDiffusers  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    # diffusers' schedulers call np.array(tensor, copy=False) (numpy 2 deprecation); not ours.
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

EMBED_DIM = 16
WAN_TEXT_DIM = 32
SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)




# -- tiny pipelines ----------------------------------------------------------------


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
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


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory):
    return make_text_encoder(tmp_path_factory.mktemp("clip"))


def make_text_encoder(folder):
    """A CLIP tokenizer from a vocabulary written in ``folder`` (letters, no merges) and a tiny encoder."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_size, files = letter_vocab(folder)
    tokenizer = CLIPTokenizer(*files,
                              model_max_length=12)
    torch.manual_seed(2)
    encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=EMBED_DIM, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=2, max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )).eval()
    return tokenizer, encoder


def img2img_pipe(text_encoder, scheduler=None) -> StableDiffusionImg2ImgPipeline:
    tokenizer, encoder = text_encoder
    pipe = StableDiffusionImg2ImgPipeline(
        vae=tiny_vae(),
        text_encoder=encoder,
        tokenizer=tokenizer,
        unet=tiny_unet(),
        scheduler=scheduler or DDIMScheduler(**SCHEDULE, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_pipe() -> WanPipeline:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=WAN_TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_pipe() -> FluxPipeline:
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=(4, 4), in_channels=3, out_channels=3, layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
        scaling_factor=1.5035, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
    )
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ltx_pipe() -> LTXPipeline:
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
        decoder_causal=False,
    )
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
        attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
                       text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def qwen_pipe() -> QwenImagePipeline:
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
                             text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_embeddings() -> dict[str, torch.Tensor]:
    """Stands in for Wan's UMT5 encoder: fixed text conditioning, passed as call_kwargs."""
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_embeds": torch.randn(1, 8, WAN_TEXT_DIM, generator=g),
        "negative_prompt_embeds": torch.randn(1, 8, WAN_TEXT_DIM, generator=g),
    }


def picture(width: int = 16, height: int = 16, seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


class Recorder:
    """A stand-in for the engine's emit: keeps every frame; stops after ``stop_after`` frames."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.frames: list[torch.Tensor] = []
        self.decoded: list[bool] = []
        self.stop_after = stop_after

    def __call__(self, frame: torch.Tensor, *, decoded: bool = False) -> None:
        if self.stop_after is not None and len(self.frames) >= self.stop_after:
            raise RequestStopped("stopped by the test")
        self.frames.append(frame)
        self.decoded.append(decoded)


def run_direct(model: CallbackDiffusers, raw: dict, *, output: str = "image", emit=None) -> Recorder:
    """One request straight through the model interface, as the engine's producer drives it."""
    params = model.validate(raw)
    params["output"] = output  # the engine adds it
    emit = emit or Recorder()
    state = model.start(params, torch.device("cpu"))
    try:
        model.run(state, emit)
    finally:
        model.close(state)
    return emit


IMG2IMG = dict(prompt="a red cat", negative_prompt="dog", steps=5, strength=0.6, seed=3,
               guidance_scale=6.0)


def img2img_reference(pipe, raw: dict, image: Image.Image, output_type: str):
    """diffusers' own call: its output, and the latents its callback sees after each step."""
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"][0].clone())
        return tensors

    out = pipe(
        prompt=raw.get("prompt", ""),
        negative_prompt=raw.get("negative_prompt") or None,
        image=image,
        strength=raw.get("strength", 0.8),
        num_inference_steps=raw.get("steps", 50),
        guidance_scale=raw.get("guidance_scale", 7.5),
        generator=torch.Generator().manual_seed(raw.get("seed", 0)),
        output_type=output_type,
        callback_on_step_end=on_step_end,
    )
    return out, seen


# -- img2img: the pipeline's own call, streamed ----------------------------------------


def test_img2img_frames_are_the_latents_the_pipelines_callback_sees(text_encoder):
    pipe = img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    assert isinstance(model, CallbackDiffusers) and model.mode == "callback"
    assert model.runs_whole_requests and model.max_batch_size == 1 and not model.produces_video
    assert model.preview_decoder == "sd15"
    image = picture()
    raw = dict(IMG2IMG, image=data_url(image))
    got = run_direct(model, raw)
    expected, seen = img2img_reference(pipe, IMG2IMG, image, "pt")

    # int(5 * 0.6) = 3 of the 5 steps run.
    assert model.total_steps(model.validate(raw)) == len(seen) == len(got.frames) == 3
    assert got.decoded == [False, False, True]
    for frame, latents in zip(got.frames[:-1], seen[:-1], strict=True):
        assert frame.shape == (4, 8, 8) and torch.equal(frame, latents)
    final = got.frames[-1]
    assert final.shape == (3, 16, 16) and final.dtype == torch.float32
    torch.testing.assert_close(final, expected.images[0] * 2 - 1, rtol=0, atol=1e-5)


def test_latent_output_is_the_last_steps_latents(text_encoder):
    pipe = img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    image = picture(seed=1)
    got = run_direct(model, dict(IMG2IMG, image=image), output="latent")  # a PIL image from Python
    expected, seen = img2img_reference(pipe, IMG2IMG, image, "latent")
    assert got.decoded == [False, False, False]
    assert all(torch.equal(f, s) for f, s in zip(got.frames, seen, strict=True))
    assert torch.equal(got.frames[-1], expected.images[0])


@pytest.mark.parametrize(
    ("scheduler", "steps", "strength"),
    [
        (lambda: DDIMScheduler(**SCHEDULE, clip_sample=False), 10, 0.75),  # int(7.5) = 7
        (lambda: DDIMScheduler(**SCHEDULE, clip_sample=False), 4, 1.0),
        (lambda: PNDMScheduler(**SCHEDULE, skip_prk_steps=True), 4, 0.5),  # PNDM: one extra timestep
        (lambda: HeunDiscreteScheduler(**SCHEDULE), 3, 0.7),  # Heun: two evaluations a step
        (lambda: EulerAncestralDiscreteScheduler(**SCHEDULE), 6, 0.34),
    ],
    ids=["ddim-truncates", "ddim-full", "pndm", "heun", "euler-a"],
)
def test_total_steps_is_how_often_the_callback_fires(text_encoder, scheduler, steps, strength):
    pipe = img2img_pipe(text_encoder, scheduler())
    model = Diffusers(pipe, mode="callback")
    raw = dict(steps=steps, strength=strength, guidance_scale=1.0, image=picture())
    _, seen = img2img_reference(pipe, raw, raw["image"], "latent")
    assert model.total_steps(model.validate(raw)) == len(seen)


def test_a_scheduler_swapped_after_wrapping_is_the_one_counted(text_encoder):
    pipe = img2img_pipe(text_encoder, DDIMScheduler(**SCHEDULE, clip_sample=False))
    model = Diffusers(pipe, mode="callback")
    raw = dict(steps=3, strength=1.0, guidance_scale=1.0, image=picture())
    assert model.total_steps(model.validate(raw)) == 3
    pipe.scheduler = HeunDiscreteScheduler(**SCHEDULE)  # two evaluations a step
    _, seen = img2img_reference(pipe, raw, raw["image"], "latent")
    assert model.total_steps(model.validate(raw)) == len(seen) == 5


def test_steps_the_scheduler_cannot_run_are_refused_before_the_pipeline_runs(text_encoder):
    # DDIM with steps_offset=1 sets timesteps 1..40 for 40 of its 40 training
    # steps and the pipeline would raise IndexError at its first step.
    short = DDIMScheduler(**SCHEDULE, clip_sample=False, num_train_timesteps=40)
    model = Diffusers(img2img_pipe(text_encoder, short), mode="callback")
    raw = dict(steps=40, strength=1.0, guidance_scale=1.0, image=picture())
    with pytest.raises(om.ParamsError) as err:
        model.total_steps(model.validate(raw))
    assert err.value.field == "steps" and "at most 39 for DDIMScheduler" in err.value.message
    assert model.total_steps(model.validate(dict(raw, steps=39))) == 39


def test_strength_that_leaves_no_step_is_a_params_error(text_encoder):
    model = Diffusers(img2img_pipe(text_encoder), mode="callback")
    with pytest.raises(om.ParamsError) as err:
        model.validate(dict(steps=4, strength=0.2, image=picture()))  # int(0.8) = 0 steps
    assert err.value.field == "strength"


def test_a_stopped_request_ends_the_pipelines_loop_within_one_step(text_encoder):
    pipe = img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    unet_calls: list[int] = []
    pipe.unet.register_forward_pre_hook(lambda m, args: unet_calls.append(1))
    freed: list[int] = []
    real_free = pipe.maybe_free_model_hooks

    def free():
        freed.append(1)
        real_free()

    pipe.maybe_free_model_hooks = free
    with pytest.raises(RequestStopped):
        run_direct(model, dict(steps=20, strength=1.0, image=picture()), emit=Recorder(stop_after=2))
    # Steps 1 and 2 emitted; step 3's emit raised inside the callback: no 4th UNet call.
    assert len(unet_calls) == 3
    # What the end of __call__ would have done: stateful hooks reset, offload re-armed.
    assert freed == [1] and pipe._interrupt is False
    # The pipeline serves the next call as if nothing happened.
    raw = dict(IMG2IMG, image=picture())
    got = run_direct(model, raw, output="latent")
    expected, _ = img2img_reference(pipe, IMG2IMG, raw["image"], "latent")
    assert torch.equal(got.frames[-1], expected.images[0])


def test_a_miscounted_step_total_fails_the_request(text_encoder):
    pipe = img2img_pipe(text_encoder)

    class Miscounting(CallbackDiffusers):
        off_by = -1

        def total_steps(self, params):
            return super().total_steps(params) + self.off_by

    model = Miscounting(pipe)
    with pytest.raises(RuntimeError, match="more than the 2 steps"):
        run_direct(model, dict(IMG2IMG, image=picture()))
    model.off_by = 1
    with pytest.raises(RuntimeError, match="ran 3 steps, total_steps predicted 4"):
        run_direct(model, dict(IMG2IMG, image=picture()), output="latent")


# -- through the engine -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_img2img_streams_through_the_engine(text_encoder):
    pipe = img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    image = picture()
    expected, seen = img2img_reference(pipe, IMG2IMG, image, "pt")
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(dict(IMG2IMG, image=data_url(image)))]
        latent = await engine.generate(dict(IMG2IMG, image=image, output="latent"))
    assert [f.step for f in frames] == [1, 2, 3] and all(f.total == 3 for f in frames)
    assert [f.decoded for f in frames] == [False, False, True]
    for frame, latents in zip(frames[:-1], seen[:-1], strict=True):
        assert torch.equal(frame.data, latents)
    torch.testing.assert_close(frames[-1].data, expected.images[0] * 2 - 1, rtol=0, atol=1e-5)
    assert not latent.decoded and torch.equal(latent.data, seen[-1])


@pytest.mark.asyncio
async def test_cancelling_stops_the_pipeline_and_the_engine_serves_the_next_request(text_encoder):
    pipe = img2img_pipe(text_encoder)
    unet_calls: list[int] = []
    calls_at_close: list[int] = []

    class Recorded(CallbackDiffusers):
        def close(self, state):
            calls_at_close.append(len(unet_calls))
            super().close(state)

    model = Recorded(pipe)
    pipe.unet.register_forward_pre_hook(lambda m, args: unet_calls.append(1))
    image = picture()
    # queue_size=1: no step starts before the reader took the previous frame.
    async with om.Engine(model, device="cpu", max_run_ahead=1, queue_size=1) as engine:
        stream = engine.stream(dict(steps=40, strength=1.0, image=image), request_id="doomed")
        async for frame in stream:
            if frame.step == 2:
                assert engine.cancel("doomed") is True
                break
        with pytest.raises(om.RequestCancelledError):
            await stream.__anext__()
        with anyio.fail_after(10):  # generous: only "does not hang"
            while not calls_at_close:
                await anyio.sleep(0.005)
        # Two frames read, at most one more step computed meanwhile; none after.
        assert calls_at_close[0] <= 3
        final = await engine.generate(dict(IMG2IMG, image=image, output="latent"))
        assert engine.health().status == "ok"
    assert final.step == final.total == 3
    assert len(unet_calls) == calls_at_close[0] + 3
    _, seen = img2img_reference(pipe, IMG2IMG, image, "latent")
    assert torch.equal(final.data, seen[-1])


@pytest.mark.asyncio
async def test_a_video_pipeline_streams_its_latents_and_its_video():
    pipe = wan_pipe()
    embeds = wan_embeddings()
    model = Diffusers(pipe, mode="callback", call_kwargs=embeds)
    assert model.preview_decoder is None and model.produces_video
    raw = dict(size=16, num_frames=5, steps=3, seed=1)
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"][0].clone())
        return tensors

    expected = pipe(**embeds, height=16, width=16, num_frames=5, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(1), output_type="pt",
                    callback_on_step_end=on_step_end).frames
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(raw)]
    assert len(frames) == len(seen) == model.total_steps(model.validate(raw)) == 3
    for frame, latents in zip(frames[:-1], seen[:-1], strict=True):
        # [C, T, h, w]: 5 frames are 2 latent frames, 16 px are 2 latent px.
        assert frame.data.shape == (16, 2, 2, 2) and torch.equal(frame.data, latents)
    video = frames[-1].data
    assert frames[-1].decoded and video.shape == (5, 3, 16, 16)  # [T, 3, H, W]
    torch.testing.assert_close(video, expected[0] * 2 - 1, rtol=0, atol=1e-5)


# -- packed latents ------------------------------------------------------------------------


def latents_seen(pipe, **kwargs) -> tuple[object, list[torch.Tensor]]:
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"].clone())
        return tensors

    return pipe(**kwargs, callback_on_step_end=on_step_end), seen


def test_flux_latents_are_unpacked_with_the_pipelines_own_rule():
    pipe = flux_pipe()
    g = torch.Generator().manual_seed(0)
    embeds = dict(prompt_embeds=torch.randn(1, 8, 32, generator=g),
                  pooled_prompt_embeds=torch.randn(1, 32, generator=g))
    model = CallbackDiffusers(pipe, call_kwargs=embeds)
    assert model.preview_decoder == "flux"
    raw = dict(height=16, width=24, steps=3, seed=1)
    got = run_direct(model, raw, output="latent")
    out, seen = latents_seen(pipe, **embeds, height=16, width=24, num_inference_steps=3,
                             generator=torch.Generator().manual_seed(1), output_type="latent")
    assert seen[0].shape == (1, 24, 16)  # packed: [1, seq, 4 * C]
    # [C, h, w]: 16 x 24 px at a VAE factor of 2 is 8 x 12 latent px.
    assert [f.shape for f in got.frames] == [(4, 8, 12)] * 3
    for frame, packed in zip(got.frames, seen, strict=True):
        assert torch.equal(frame, FluxPipeline._unpack_latents(packed, 16, 24, 2)[0])
    assert torch.equal(got.frames[-1], FluxPipeline._unpack_latents(out.images, 16, 24, 2)[0])


def test_qwen_image_latents_are_unpacked_to_image_latents():
    pipe = qwen_pipe()
    g = torch.Generator().manual_seed(0)
    embeds = dict(prompt_embeds=torch.randn(1, 7, 16, generator=g),
                  prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long))
    model = CallbackDiffusers(pipe, call_kwargs=embeds)
    assert "true_cfg_scale" in [p.name for p in model.params]
    got = run_direct(model, dict(size=32, steps=2, seed=1))
    out, seen = latents_seen(pipe, **embeds, height=32, width=32, num_inference_steps=2,
                             generator=torch.Generator().manual_seed(1), output_type="pt")
    # Qwen-Image unpacks to a one-frame video latent [1, C, 1, h, w]; the frame drops both 1s.
    assert got.frames[0].shape == (4, 8, 8)
    assert torch.equal(got.frames[0], QwenImagePipeline._unpack_latents(seen[0], 32, 32, 4)[0, :, 0])
    assert got.decoded == [False, True]
    torch.testing.assert_close(got.frames[-1], out.images[0] * 2 - 1, rtol=0, atol=1e-5)


def test_ltx_video_latents_are_unpacked_to_frames():
    pipe = ltx_pipe()
    g = torch.Generator().manual_seed(0)
    embeds = dict(prompt_embeds=torch.randn(1, 8, 32, generator=g), prompt_attention_mask=torch.ones(1, 8),
                  negative_prompt_embeds=torch.randn(1, 8, 32, generator=g),
                  negative_prompt_attention_mask=torch.ones(1, 8))
    model = CallbackDiffusers(pipe, call_kwargs=embeds)
    raw = dict(height=32, width=64, num_frames=9, steps=2, seed=1)
    got = run_direct(model, raw)
    out, seen = latents_seen(pipe, **embeds, height=32, width=64, num_frames=9, num_inference_steps=2,
                             generator=torch.Generator().manual_seed(1), output_type="pt")
    # [C, T, h, w]: 9 frames are 3 latent frames; 32 x 64 px are 8 x 16 latent px.
    assert got.frames[0].shape == (8, 3, 8, 16)
    assert torch.equal(got.frames[0], LTXPipeline._unpack_latents(seen[0], 3, 8, 16, 1, 1)[0])
    assert got.decoded == [False, True] and got.frames[-1].shape == (9, 3, 32, 64)
    torch.testing.assert_close(got.frames[-1], out.frames[0] * 2 - 1, rtol=0, atol=1e-5)


# -- params -------------------------------------------------------------------------------


def test_params_come_from_the_pipelines_signature(text_encoder):
    img2img = Diffusers(img2img_pipe(text_encoder), mode="callback")
    assert [p.name for p in img2img.params] == [
        "prompt", "negative_prompt", "steps", "guidance_scale", "seed", "num_images", "sampler", "strength",
        "image"]
    params = img2img.validate({"image": picture()})
    # StableDiffusionImg2ImgPipeline.__call__'s own defaults.
    assert (params["steps"], params["guidance_scale"], params["strength"]) == (50, 7.5, 0.8)
    assert img2img.total_steps(params) == 40

    # prompt_embeds fixed in call_kwargs replace the prompt params.
    wan = Diffusers(wan_pipe(), mode="callback", call_kwargs=wan_embeddings())
    assert [p.name for p in wan.params] == [
        "steps", "guidance_scale", "seed", "sampler", "height", "width", "size", "num_frames"]
    # Wan's UniPC runs flow sigmas: it is offered the flow-matching samplers.
    assert "euler" in wan.sampler_names and "ddim" not in wan.sampler_names
    params = wan.validate({})
    assert (params["height"], params["width"], params["num_frames"]) == (480, 832, 81)
    assert wan.validate({"size": 32})["height"] == wan.validate({"size": 32})["width"] == 32
    with pytest.raises(om.ParamsError) as err:
        wan.validate({"size": 32, "height": 16})
    assert err.value.field == "size"
    with pytest.raises(om.ParamsError) as err:
        wan.validate({"prompt": "a cat"})
    assert err.value.field == "prompt"
    assert Diffusers(wan_pipe(), mode="callback", call_kwargs=wan_embeddings(),
                     defaults={"steps": 4}).validate({})["steps"] == 4


def test_bad_call_kwargs_and_defaults_are_refused(text_encoder):
    pipe = img2img_pipe(text_encoder)
    with pytest.raises(ValueError, match="generator"):
        CallbackDiffusers(pipe, call_kwargs={"generator": torch.Generator()})
    with pytest.raises(ValueError, match="output_type"):
        CallbackDiffusers(pipe, call_kwargs={"output_type": "pil"})
    with pytest.raises(ValueError, match="takes no"):
        CallbackDiffusers(pipe, call_kwargs={"num_frames": 9})
    with pytest.raises(ValueError, match="unknown"):
        CallbackDiffusers(pipe, defaults={"num_frames": 9})
    with pytest.raises(ValueError, match="strength"):
        CallbackDiffusers(pipe, defaults={"strength": 2.0})

    class NoCallback:
        def __call__(self, prompt=None, output_type="pil"):
            pass

    with pytest.raises(ValueError, match="callback_on_step_end"):
        CallbackDiffusers(NoCallback())


def test_step_is_never_the_way_in(text_encoder):
    model = Diffusers(img2img_pipe(text_encoder), mode="callback")
    assert model.batch_key(model.validate({"image": picture()})) is None
    with pytest.raises(RuntimeError, match="run"):
        model.step([])


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (None, "required"),
        ("data:image/png;base64,not base64!", "base64"),
        ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "image/png or image/jpeg"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a" + bytes(32)).decode(), "neither"),
        ("data:image/png," + "x" * 10, "base64"),
        (data_url(Image.new("RGB", (40, 40))), "at most 1024"),
        ("data:image/png;base64," + "A" * 3000, "larger than 2000 bytes"),
        ("/nonexistent/picture.png", "cannot read"),
        (12, "got int"),
    ],
    ids=["missing", "not-base64", "gif-type", "gif-data", "not-base64-url", "too-many-pixels",
         "too-many-bytes", "no-file", "not-a-string"],
)
def test_bad_images_are_params_errors_naming_the_field(text_encoder, image, message):
    model = CallbackDiffusers(img2img_pipe(text_encoder), max_image_pixels=32 * 32,
                              max_image_bytes=2000)
    raw = {} if image is None else {"image": image}
    with pytest.raises(om.ParamsError, match=message) as err:
        model.validate(raw)
    assert err.value.field == "image"


def test_images_come_as_png_or_jpeg_urls_files_or_pil(text_encoder, tmp_path):
    model = Diffusers(img2img_pipe(text_encoder), mode="callback")
    image = picture(24, 16)
    path = tmp_path / "in.png"
    image.save(path)
    for given in (data_url(image), str(path), image, image.convert("RGBA")):
        got = model.validate({"image": given})["image"]
        assert got.mode == "RGB" and got.size == (24, 16)
        assert got.tobytes() == image.tobytes()
    jpeg = model.validate({"image": data_url(image, "JPEG")})["image"]
    assert jpeg.size == (24, 16)
    no_paths = CallbackDiffusers(img2img_pipe(text_encoder), image_paths=False)
    with pytest.raises(om.ParamsError, match="not accepted") as err:
        no_paths.validate({"image": str(path)})
    assert err.value.field == "image"


def test_auto_mode_streams_img2img_through_callbacks(text_encoder):
    # The native UNet adapter runs a text-to-image loop: it must not take an
    # img2img pipeline, which would silently ignore the input image.
    assert isinstance(Diffusers(img2img_pipe(text_encoder)), CallbackDiffusers)
