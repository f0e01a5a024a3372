"""The Flux adapter on tiny random pipelines built from configs (no downloads).

Bitwise (torch.equal) wherever a request's steps run alone in their
transformer call: the adapter then runs the very operations diffusers' own
loop runs (packing, position ids, sigmas and mu, guidance embedding), on the
same inputs, and CPU kernels are deterministic for a fixed shape, so any
difference is a bug. Only batched calls use a tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxImg2ImgPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)

import omni_stream as om  # noqa: E402
from omni_stream.models.diffusers import Diffusers, PromptEmbeddings  # noqa: E402
from omni_stream.models.diffusers.native import DEFAULT_MAX_BATCH  # noqa: E402
from omni_stream.models.diffusers.flux import FluxDiffusers  # noqa: E402

from .conftest import letter_vocab, check_size_param  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    # diffusers' schedulers call np.array(tensor, copy=False) (numpy 2 deprecation); not ours.
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

CPU = torch.device("cpu")
EMBED_DIM = 16  # joint_attention_dim (T5's width)
POOLED_DIM = 8  # pooled_projection_dim (CLIP's width)
CHANNELS = 16




def tiny_transformer(*, guidance_embeds: bool = True) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * CHANNELS,  # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=EMBED_DIM,
        pooled_projection_dim=POOLED_DIM,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),
    )


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(
        block_out_channels=[8, 8],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=CHANNELS,
        norm_num_groups=4,
        scaling_factor=0.3611,  # Flux's
        shift_factor=0.1159,
    )


def dev_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Flux.1 dev's config, with sequence bounds that fit tiny latents.
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=4, max_image_seq_len=64,
    )


def flux_pipe(scheduler=None, *, guidance_embeds: bool = True, **encoders) -> FluxPipeline:
    parts = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    parts.update(encoders)
    pipe = FluxPipeline(
        scheduler=scheduler or dev_scheduler(),
        vae=tiny_vae(),
        transformer=tiny_transformer(guidance_embeds=guidance_embeds),
        **parts,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fixed_embeddings(prompt: str, negative_prompt: str) -> PromptEmbeddings:
    """Stands in for T5 and CLIP: each prompt maps to its own fixed random embeddings."""

    def draw(text: str, *shape: int) -> torch.Tensor:
        seed = int.from_bytes(text.encode()[:8].ljust(8, b"\0"), "little") % 2**63
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + len(shape)))

    return PromptEmbeddings(
        prompt_embeds=draw(prompt, 1, 7, EMBED_DIM),
        pooled_prompt_embeds=draw(prompt, 1, POOLED_DIM),
    )


def run(model: FluxDiffusers, raw: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One request alone: its frames, and its packed latents after each step."""
    params = model.validate(raw)
    state = model.start(params, CPU)
    frames, latents = [], []
    try:
        for _ in range(model.total_steps(params)):
            frames.append(model.step([state])[0])
            latents.append(state.latents[0])
    finally:
        model.close(state)
    return frames, latents


def pipe_kwargs(raw: dict) -> dict:
    emb = fixed_embeddings(raw.get("prompt", ""), "")
    return dict(
        prompt_embeds=emb.prompt_embeds,
        pooled_prompt_embeds=emb.pooled_prompt_embeds,
        num_inference_steps=raw["steps"],
        guidance_scale=raw.get("guidance_scale", 3.5),
        generator=torch.Generator("cpu").manual_seed(raw.get("seed", 0)),
        height=raw["height"],
        width=raw["width"],
    )


def reference(pipe, raw: dict) -> list[torch.Tensor]:
    """diffusers' own loop: the packed latents after each step (the last are its output)."""
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"][0])
        return tensors

    out = pipe(**pipe_kwargs(raw), output_type="latent", callback_on_step_end=on_step_end)
    assert torch.equal(seen[-1], out.images[0])
    return seen


def unpack(packed: torch.Tensor, raw: dict) -> torch.Tensor:
    return FluxPipeline._unpack_latents(packed[None], raw["height"], raw["width"], 2)[0]


# -- the loop is diffusers' loop ------------------------------------------------

VARIANTS = {
    # (scheduler, guidance embedding): dev is guidance-distilled with dynamic
    # shifting; schnell has neither.
    "dev": (dev_scheduler, True),
    "schnell": (lambda: FlowMatchEulerDiscreteScheduler(shift=1.0), False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_step_matches_the_pipeline_bit_for_bit(variant):
    make_scheduler, guidance_embeds = VARIANTS[variant]
    pipe = flux_pipe(make_scheduler(), guidance_embeds=guidance_embeds)
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", steps=3, seed=5, height=16, width=24, guidance_scale=4.0)
    frames, latents = run(model, raw)
    expected = reference(pipe, raw)
    assert len(frames) == len(expected) == 3
    # Frames are unpacked: [16, h, w], not the pipeline's [seq, 64].
    assert expected[0].shape == (4 * 6, 4 * CHANNELS)
    assert all(f.shape == (CHANNELS, 8, 12) and f.dtype == torch.float32 for f in frames)
    assert all(torch.equal(got, want) for got, want in zip(latents, expected, strict=True))
    assert torch.equal(frames[-1], unpack(expected[-1], raw))
    assert not any(
        torch.equal(f, unpack(x, raw)) for f, x in zip(frames[:-1], expected[:-1], strict=True)
    )


def test_the_guidance_scale_reaches_the_guidance_embedding():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", steps=2, seed=5, height=16, width=16)
    low, high = run(model, dict(raw, guidance_scale=1.0))[0], run(model, dict(raw, guidance_scale=6.0))[0]
    assert not torch.equal(low[-1], high[-1])
    schnell = Diffusers(flux_pipe(guidance_embeds=False), encode_prompt=fixed_embeddings)
    low, high = run(schnell, dict(raw, guidance_scale=1.0))[0], run(schnell, dict(raw, guidance_scale=6.0))[0]
    assert torch.equal(low[-1], high[-1])


def test_frames_are_the_flow_matching_x0_estimate():
    # Euler on a flow: x_next = x + (sigma_next - sigma) * v, so the latents
    # before and after a step give v, and x0 = x - sigma * v.
    pipe = flux_pipe(FlowMatchEulerDiscreteScheduler(shift=1.0))
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="x", steps=4, seed=1, height=16, width=16)
    frames, _ = run(model, raw)
    after = [unpack(x, raw) for x in reference(pipe, raw)]
    sigmas = torch.linspace(1.0, 1 / 4, 4).tolist() + [0.0]  # FluxPipeline's, unshifted
    before = torch.randn((1, CHANNELS, 8, 8), generator=torch.Generator().manual_seed(1))[0]
    for i in range(3):
        v = (after[i] - before) / (sigmas[i + 1] - sigmas[i])
        torch.testing.assert_close(frames[i], before - sigmas[i] * v, rtol=1e-4, atol=1e-4)
        before = after[i]


def test_decode_matches_the_pipelines_image():
    pipe = flux_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", steps=2, seed=3, height=16, width=24)
    params = model.validate(raw)
    state = model.start(params, CPU)
    frame = [model.step([state])[0] for _ in range(2)][-1]
    image = model.decode(state, frame)
    expected = pipe(**pipe_kwargs(raw), output_type="pt").images[0] * 2 - 1
    assert image.shape == (3, 16, 24) and image.dtype == torch.float32
    torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.decode_latents(frame), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="latents"):
        model.decode_latents(torch.zeros(24, 64))  # packed: unpack first


def text_encoders(tmp_path: Path) -> dict[str, Any]:
    """Tiny CLIP and T5 and their tokenizers, as ``flux_pipe`` keywords: one vocabulary written
    to ``tmp_path`` (letters, no merges) serves both tokenizers."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    vocab_size, files = letter_vocab(tmp_path)
    torch.manual_seed(2)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=POOLED_DIM, intermediate_size=16, num_attention_heads=2,
        num_hidden_layers=1, max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )).eval()
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab_size, d_model=EMBED_DIM, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
    )).eval()
    return dict(
        tokenizer=CLIPTokenizer(*files, model_max_length=12), text_encoder=clip,
        tokenizer_2=CLIPTokenizer(*files, model_max_length=512), text_encoder_2=t5,
    )


def test_the_pipelines_own_prompt_encoders_are_used_without_encode_prompt(tmp_path):
    pipe = flux_pipe(**text_encoders(tmp_path))
    model = Diffusers(pipe)
    raw = dict(prompt="a red cat", steps=2, seed=4, height=16, width=16)
    frames, _ = run(model, raw)
    expected = pipe(prompt="a red cat", num_inference_steps=2, height=16, width=16,
                    generator=torch.Generator().manual_seed(4), output_type="latent").images[0]
    assert torch.equal(frames[-1], unpack(expected, raw))
    assert not torch.equal(run(model, dict(raw, prompt="a blue cat"))[0][-1], frames[-1])


# -- per-request state ----------------------------------------------------------

REQUEST_A = dict(prompt="a cat", steps=5, seed=1, height=16, width=16, guidance_scale=7.0)
REQUEST_B = dict(prompt="a dog", steps=3, seed=2, height=24, width=16, guidance_scale=2.0)


def test_interleaved_requests_match_their_solo_runs_bit_for_bit():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings)
    solo_a, solo_b = run(model, REQUEST_A)[0], run(model, REQUEST_B)[0]
    pa, pb = model.validate(REQUEST_A), model.validate(REQUEST_B)
    a, b = model.start(pa, CPU), model.start(pb, CPU)
    frames_a, frames_b = [], []
    for i in range(5):
        frames_a.append(model.step([a])[0])
        if i < 3:
            frames_b.append(model.step([b])[0])
    model.close(a)
    model.close(b)
    assert all(torch.equal(x, y) for x, y in zip(frames_a, solo_a, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(frames_b, solo_b, strict=True))


def test_the_pipelines_scheduler_is_never_touched():
    pipe = flux_pipe()
    before = dict(vars(pipe.scheduler))
    run(Diffusers(pipe, encode_prompt=fixed_embeddings), REQUEST_A)
    assert vars(pipe.scheduler).keys() == before.keys()
    assert all(vars(pipe.scheduler)[k] is v for k, v in before.items())


def test_a_failed_batched_step_leaves_every_state_as_it_was():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
    pa, pb = model.validate(REQUEST_A), model.validate(dict(REQUEST_B, height=16))
    solo_a = run(model, REQUEST_A)[0]
    a, b = model.start(pa, CPU), model.start(pb, CPU)
    first = model.step([a])[0]
    real_step = b.scheduler.step

    def fail_once(*args, **kwargs):
        b.scheduler.step = real_step
        raise RuntimeError("CUDA out of memory (simulated)")

    # A's scheduler steps first and succeeds; B's then raises: A must be rolled back.
    b.scheduler.step = fail_once
    with pytest.raises(RuntimeError, match="simulated"):
        model.step([a, b])
    assert a.done == 1 and b.done == 0 and a.scheduler.step_index == 1
    rest = [model.step([a])[0] for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip([first, *rest], solo_a, strict=True))


def test_batched_steps_match_solo_runs_closely():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
    same_size = dict(REQUEST_B, height=16)
    pa, pb = model.validate(REQUEST_A), model.validate(same_size)
    assert model.batch_key(pa) == model.batch_key(pb) == (16, 16, "default", ())
    assert model.batch_key(model.validate(REQUEST_B)) == (24, 16, "default", ())
    # Batching is on by default (DEFAULT_MAX_BATCH); batch=False runs each request alone.
    assert Diffusers(flux_pipe(), encode_prompt=fixed_embeddings).max_batch_size == DEFAULT_MAX_BATCH
    assert Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, batch=False).batch_key(pa) is None
    solo_a, solo_b = run(model, REQUEST_A)[0], run(model, same_size)[0]

    rows = []
    handle = model._transformer.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
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
    # One row per request (no CFG), one call per step; each row keeps its
    # own timestep and guidance.
    assert rows == [1, 2, 2, 2, 1]
    for got, want in zip(frames_a + frames_b, solo_a + solo_b, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_closed_request_cannot_step():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings)
    state = model.start(model.validate({"steps": 3, "height": 16, "width": 16}), CPU)
    model.step([state])
    model.close(state)
    with pytest.raises(RuntimeError, match="closed"):
        model.step([state])


# -- the engine ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_streams_every_step_and_decodes_the_last():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings)
    raw = dict(REQUEST_B)
    solo, _ = run(model, raw)
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(raw)]
        latent = await engine.generate(dict(raw, output="latent"))
    assert [f.step for f in frames] == [1, 2, 3] and frames[-1].final
    assert all(torch.equal(f.data, s) for f, s in zip(frames[:-1], solo[:-1], strict=True))
    image = frames[-1]
    assert image.decoded and image.data.shape == (3, 24, 16) and image.data.dtype == torch.float32
    torch.testing.assert_close(image.data, model.decode_latents(solo[-1]), rtol=0, atol=1e-6)
    assert not latent.decoded and torch.equal(latent.data, solo[-1])


@pytest.mark.asyncio
async def test_cancelling_stops_the_denoise_loop():
    calls: list[int] = []
    calls_at_close: list[int] = []

    class Recorded(FluxDiffusers):
        def close(self, state):
            calls_at_close.append(len(calls))
            super().close(state)

    model = Recorded(flux_pipe(), encode_prompt=fixed_embeddings)
    model._transformer.register_forward_pre_hook(lambda m, args: calls.append(1))
    size = dict(height=16, width=16)
    # queue_size=1: no step starts before the reader took the previous frame.
    async with om.Engine(model, device="cpu", max_run_ahead=1, queue_size=1) as engine:
        stream = engine.stream(dict(size, steps=40), request_id="doomed")
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
        final = await engine.generate(dict(size, steps=2))
        assert final.step == 2 and final.data.shape == (3, 16, 16)
    assert len(calls) == calls_at_close[0] + 2


# -- params and construction ----------------------------------------------------


def test_diffusers_picks_this_adapter():
    pipe = flux_pipe()
    for model in (Diffusers(pipe, encode_prompt=fixed_embeddings),
                  Diffusers(pipe, mode="native", encode_prompt=fixed_embeddings)):
        assert type(model) is FluxDiffusers and model.mode == "native"
        assert model.preview_decoder == "flux"
        assert "FluxPipeline" in model.describe()
    # Pipelines with loops of their own on the same transformer are not
    # replaced by a text-to-image loop.
    img2img = FluxImg2ImgPipeline(**pipe.components)
    assert FluxDiffusers.fits(pipe) and not FluxDiffusers.fits(img2img)
    with pytest.raises(ValueError, match="no native adapter"):
        Diffusers(img2img, mode="native", encode_prompt=fixed_embeddings)


def test_params_are_declared_and_checked():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings)
    assert [p.name for p in model.params] == [
        "prompt", "steps", "guidance_scale", "seed", "num_images", "height", "width", "size", "sampler", "cache"
    ]
    params = model.validate({})
    # The pipeline's defaults: 28 steps, guidance 3.5, 128 latents * vae scale.
    assert (params["steps"], params["guidance_scale"], params["height"], params["width"]) == (
        28, 3.5, 256, 256
    )
    assert model.total_steps(params) == 28
    bad = [
        ({"height": 18}, "height", "multiple of 4"),  # vae scale 2 x 2x2 packing
        ({"width": 0}, "width", None),
        ({"guidance_scale": "high"}, "guidance_scale", "number"),
        ({"steps": 1001}, "steps", None),
        ({"negative_prompt": "blur"}, "negative_prompt", None),  # no CFG in FluxPipeline's loop
    ]
    for raw, field, words in bad:
        with pytest.raises(om.ParamsError, match=words) as err:
            model.validate(raw)
        assert err.value.field == field


def test_size_sets_both_sides_and_a_different_side_is_refused():
    check_size_param(Diffusers(flux_pipe(), encode_prompt=fixed_embeddings), 32, 48, 18)


def test_defaults_can_be_overridden_and_are_checked():
    model = Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, defaults={"steps": 4})
    assert model.validate({})["steps"] == 4
    with pytest.raises(ValueError, match="unknown"):
        Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, defaults={"stpes": 4})
    with pytest.raises(ValueError, match="height"):
        Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, defaults={"height": -1})


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="encode_prompt="):
        Diffusers(flux_pipe())
    with pytest.raises(ValueError, match="max_batch_size"):
        Diffusers(flux_pipe(), encode_prompt=fixed_embeddings, max_batch_size=0)

    class NotFlux:
        transformer = object()

    with pytest.raises(ValueError, match="FluxTransformer2DModel"):
        FluxDiffusers(NotFlux(), encode_prompt=fixed_embeddings)
    pipe = flux_pipe()
    pipe.transformer.register_to_config(in_channels=384)  # a Fill transformer's channel count
    with pytest.raises(ValueError, match="text-to-image"):
        FluxDiffusers(pipe, encode_prompt=fixed_embeddings)


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM + 1)), "joint_attention_dim"),
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM)), "pooled_prompt_embeds"),
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM),
                                       pooled_prompt_embeds=torch.zeros(1, POOLED_DIM + 1)),
         "pooled_projection_dim"),
        (lambda p, n: PromptEmbeddings(torch.zeros(2, 7, EMBED_DIM)), r"\[1, seq, dim\]"),
        (lambda p, n: torch.zeros(1, 7, EMBED_DIM), "PromptEmbeddings"),
    ],
)
def test_embeddings_that_do_not_fit_are_refused_at_start(encode, message):
    model = Diffusers(flux_pipe(), encode_prompt=encode)
    with pytest.raises(ValueError, match=message):
        model.start(model.validate({"height": 16, "width": 16}), CPU)
