"""The SD3 adapter on tiny random pipelines built from configs (no downloads).

Bitwise (torch.equal) wherever a request's steps run alone in their
transformer call: the adapter then runs the very operations diffusers' own
loop runs, on the same inputs, and CPU kernels are deterministic for a fixed
shape, so any difference is a bug (a shared scheduler, a misdrawn generator,
a wrong mu, an off-by-one step). Only batched calls use a tolerance.
"""

from __future__ import annotations


import anyio
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3Pipeline,
)

import omni_stream as om  # noqa: E402
from omni_stream.models.diffusers import Diffusers, PromptEmbeddings  # noqa: E402
from omni_stream.models.diffusers.native import DEFAULT_MAX_BATCH  # noqa: E402
from omni_stream.models.diffusers.sd3 import SD3Diffusers  # noqa: E402

from .conftest import letter_vocab, check_size_param  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    # diffusers' schedulers call np.array(tensor, copy=False) (numpy 2 deprecation); not ours.
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

CPU = torch.device("cpu")
EMBED_DIM = 16  # joint_attention_dim
POOLED_DIM = 8  # pooled_projection_dim
CHANNELS = 16




def tiny_transformer() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=EMBED_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        pos_embed_max_size=16,
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
        scaling_factor=1.5305,  # SD3's
        shift_factor=0.0609,
    )


def sd3_pipe(scheduler=None, **encoders) -> StableDiffusion3Pipeline:
    parts = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    parts.update(encoders)
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_transformer(),
        scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's config
        vae=tiny_vae(),
        text_encoder_3=None,
        tokenizer_3=None,
        **parts,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fixed_embeddings(prompt: str, negative_prompt: str) -> PromptEmbeddings:
    """Stands in for the text encoders: each prompt maps to its own fixed random embeddings."""

    def draw(text: str, *shape: int) -> torch.Tensor:
        seed = int.from_bytes(text.encode()[:8].ljust(8, b"\0"), "little") % 2**63
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + len(shape)))

    return PromptEmbeddings(
        prompt_embeds=draw(prompt, 1, 7, EMBED_DIM),
        negative_prompt_embeds=draw("neg:" + negative_prompt, 1, 7, EMBED_DIM),
        pooled_prompt_embeds=draw(prompt, 1, POOLED_DIM),
        negative_pooled_prompt_embeds=draw("neg:" + negative_prompt, 1, POOLED_DIM),
    )


def run(model: SD3Diffusers, raw: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One request alone through the model interface: its frames, and its latents after each step."""
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
    emb = fixed_embeddings(raw.get("prompt", ""), raw.get("negative_prompt", ""))
    return dict(
        prompt_embeds=emb.prompt_embeds,
        negative_prompt_embeds=emb.negative_prompt_embeds,
        pooled_prompt_embeds=emb.pooled_prompt_embeds,
        negative_pooled_prompt_embeds=emb.negative_pooled_prompt_embeds,
        num_inference_steps=raw["steps"],
        guidance_scale=raw.get("guidance_scale", 7.0),
        generator=torch.Generator("cpu").manual_seed(raw.get("seed", 0)),
        height=raw["height"],
        width=raw["width"],
    )


def reference(pipe, raw: dict) -> list[torch.Tensor]:
    """diffusers' own loop: the latents after each step (the last are its output)."""
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, tensors):
        seen.append(tensors["latents"][0])
        return tensors

    out = pipe(**pipe_kwargs(raw), output_type="latent", callback_on_step_end=on_step_end)
    assert torch.equal(seen[-1], out.images[0])
    return seen


# -- the loop is diffusers' loop ------------------------------------------------

SCHEDULERS = {
    "shift": lambda: FlowMatchEulerDiscreteScheduler(shift=3.0),
    # The pipeline then computes mu from the latent size (calculate_shift).
    "dynamic-shift": lambda: FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64
    ),
}


@pytest.mark.parametrize("guidance", [7.0, 1.0], ids=["guided", "unguided"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
def test_every_step_matches_the_pipeline_bit_for_bit(schedule, guidance):
    pipe = sd3_pipe(SCHEDULERS[schedule]())
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=5, height=16, width=24,
               guidance_scale=guidance)
    frames, latents = run(model, raw)
    expected = reference(pipe, raw)
    assert len(frames) == len(expected) == 3
    assert all(f.shape == (CHANNELS, 8, 12) and f.dtype == torch.float32 for f in frames)
    assert all(torch.equal(got, want) for got, want in zip(latents, expected, strict=True))
    assert torch.equal(frames[-1], expected[-1])
    # Intermediate frames are x0 estimates, not the noisy latents.
    assert not any(torch.equal(f, x) for f, x in zip(frames[:-1], expected[:-1], strict=True))


def test_frames_are_the_flow_matching_x0_estimate():
    # Euler on a flow: x_next = x + (sigma_next - sigma) * v, so the latents
    # before and after a step give v, and x0 = x - sigma * v.
    pipe = sd3_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    raw = dict(prompt="x", steps=4, seed=1, height=16, width=16)
    frames, _ = run(model, raw)
    after = reference(pipe, raw)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(4)
    sigmas = scheduler.sigmas
    before = torch.randn((1, CHANNELS, 8, 8), generator=torch.Generator().manual_seed(1))[0]
    for i in range(3):
        v = (after[i] - before) / (sigmas[i + 1] - sigmas[i])
        torch.testing.assert_close(frames[i], before - sigmas[i] * v, rtol=1e-4, atol=1e-4)
        before = after[i]


def test_decode_matches_the_pipelines_image():
    pipe = sd3_pipe()
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
        model.decode_latents(torch.zeros(4, 8, 8))


def clip_parts(tmp_path, hidden: int, projection: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    vocab_size, files = letter_vocab(tmp_path)
    tokenizer = CLIPTokenizer(*files,
                              model_max_length=12)
    torch.manual_seed(seed)
    encoder = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=16, num_attention_heads=2,
        num_hidden_layers=2, max_position_embeddings=12, projection_dim=projection, bos_token_id=0,
        eos_token_id=1, pad_token_id=1,
    )).eval()
    return tokenizer, encoder


def test_the_pipelines_own_prompt_encoder_is_used_without_encode_prompt(tmp_path):
    # CLIP-L and CLIP-G (their widths add up to the transformer's), no T5:
    # the pipeline then uses zeros for the T5 part.
    tok, enc = clip_parts(tmp_path, hidden=8, projection=POOLED_DIM // 2, seed=2)
    tok_2, enc_2 = clip_parts(tmp_path, hidden=8, projection=POOLED_DIM // 2, seed=3)
    pipe = sd3_pipe(tokenizer=tok, text_encoder=enc, tokenizer_2=tok_2, text_encoder_2=enc_2)
    model = Diffusers(pipe)
    raw = dict(prompt="a red cat", negative_prompt="dog", steps=2, seed=4, height=16, width=16)
    frames, _ = run(model, raw)
    expected = pipe(prompt="a red cat", negative_prompt="dog", num_inference_steps=2, height=16,
                    width=16, generator=torch.Generator().manual_seed(4), output_type="latent").images
    assert torch.equal(frames[-1], expected[0])
    assert not torch.equal(run(model, dict(raw, prompt="a blue cat"))[0][-1], frames[-1])


# -- per-request state ----------------------------------------------------------

REQUEST_A = dict(prompt="a cat", negative_prompt="blur", steps=5, seed=1, height=16, width=16,
                 guidance_scale=7.0)
REQUEST_B = dict(prompt="a dog", steps=3, seed=2, height=24, width=16, guidance_scale=4.0)


def test_interleaved_requests_match_their_solo_runs_bit_for_bit():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings)
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
    pipe = sd3_pipe()
    before = dict(vars(pipe.scheduler))
    run(Diffusers(pipe, encode_prompt=fixed_embeddings), REQUEST_A)
    assert vars(pipe.scheduler).keys() == before.keys()
    assert all(vars(pipe.scheduler)[k] is v for k, v in before.items())


def test_a_failed_batched_step_leaves_every_state_as_it_was():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
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
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, max_batch_size=4)
    unguided = dict(REQUEST_B, height=16, guidance_scale=1.0)
    pa, pb = model.validate(REQUEST_A), model.validate(unguided)
    assert model.batch_key(pa) == model.batch_key(pb) == (16, 16, "default", ())
    # Batching is on by default (DEFAULT_MAX_BATCH); batch=False runs each request alone.
    assert Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings).max_batch_size == DEFAULT_MAX_BATCH
    assert Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, batch=False).batch_key(pa) is None
    solo_a, solo_b = run(model, REQUEST_A)[0], run(model, unguided)[0]

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
    # A guided request sends two rows, an unguided one one; one call per step.
    assert rows == [2, 3, 3, 3, 2]
    for got, want in zip(frames_a + frames_b, solo_a + solo_b, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_closed_request_cannot_step():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings)
    state = model.start(model.validate({"steps": 3}), CPU)
    model.step([state])
    model.close(state)
    with pytest.raises(RuntimeError, match="closed"):
        model.step([state])


# -- the engine ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_streams_every_step_and_decodes_the_last():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings)
    raw = dict(REQUEST_B)
    solo, _ = run(model, raw)
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(raw)]
        latent = await engine.generate(dict(raw, output="latent"))
    assert [f.step for f in frames] == [1, 2, 3] and frames[-1].final
    assert all(torch.equal(f.data, s) for f, s in zip(frames[:-1], solo[:-1], strict=True))
    image = frames[-1]
    assert image.decoded and image.data.shape == (3, 24, 16) and image.data.dtype == torch.float32
    expected = model.decode_latents(solo[-1])
    torch.testing.assert_close(image.data, expected, rtol=0, atol=1e-6)
    assert not latent.decoded and torch.equal(latent.data, solo[-1])


@pytest.mark.asyncio
async def test_cancelling_stops_the_denoise_loop():
    calls: list[int] = []
    calls_at_close: list[int] = []

    class Recorded(SD3Diffusers):
        def close(self, state):
            calls_at_close.append(len(calls))
            super().close(state)

    model = Recorded(sd3_pipe(), encode_prompt=fixed_embeddings)
    model._transformer.register_forward_pre_hook(lambda m, args: calls.append(1))
    # queue_size=1: no step starts before the reader took the previous frame.
    async with om.Engine(model, device="cpu", max_run_ahead=1, queue_size=1) as engine:
        stream = engine.stream(dict(steps=40), request_id="doomed")
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
        final = await engine.generate(dict(steps=2))
        assert final.step == 2 and final.data.shape == (3, 16, 16)
    assert len(calls) == calls_at_close[0] + 2


# -- params and construction ----------------------------------------------------


def test_diffusers_picks_this_adapter():
    pipe = sd3_pipe()
    for model in (Diffusers(pipe, encode_prompt=fixed_embeddings),
                  Diffusers(pipe, mode="native", encode_prompt=fixed_embeddings)):
        assert type(model) is SD3Diffusers and model.mode == "native"
        assert model.preview_decoder == "sd3"
        assert "StableDiffusion3Pipeline" in model.describe()
    # Pipelines with loops of their own on the same transformer are not
    # replaced by a text-to-image loop.
    img2img = StableDiffusion3Img2ImgPipeline(**pipe.components)
    assert SD3Diffusers.fits(pipe) and not SD3Diffusers.fits(img2img)
    with pytest.raises(ValueError, match="no native adapter"):
        Diffusers(img2img, mode="native", encode_prompt=fixed_embeddings)


def test_params_are_declared_and_checked():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings)
    assert [p.name for p in model.params] == [
        "prompt", "negative_prompt", "steps", "guidance_scale", "seed", "num_images", "height", "width", "size", "sampler", "cache"
    ]
    params = model.validate({})
    # The pipeline's defaults: 28 steps, guidance 7, sample_size * vae scale.
    assert (params["steps"], params["guidance_scale"], params["height"], params["width"]) == (
        28, 7.0, 16, 16
    )
    assert model.total_steps(params) == 28
    bad = [
        ({"height": 18}, "height", "multiple of 4"),  # vae scale 2 x patch 2
        ({"width": 68}, "width", "64"),  # past the positional embedding (16 patches)
        ({"guidance_scale": "high"}, "guidance_scale", "number"),
        ({"steps": 0}, "steps", None),
        ({"prompt_embeds": [0.1]}, "prompt_embeds", None),
    ]
    for raw, field, words in bad:
        with pytest.raises(om.ParamsError, match=words) as err:
            model.validate(raw)
        assert err.value.field == field


def test_size_sets_both_sides_and_a_different_side_is_refused():
    check_size_param(Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings), 24, 32, 18)


def test_defaults_can_be_overridden_and_are_checked():
    model = Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings,
                      defaults={"steps": 4, "guidance_scale": 1.0})
    assert model.validate({})["steps"] == 4
    with pytest.raises(ValueError, match="unknown"):
        Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, defaults={"stpes": 4})
    with pytest.raises(ValueError, match="steps"):
        Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, defaults={"steps": 0})


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="encode_prompt="):
        Diffusers(sd3_pipe())
    with pytest.raises(ValueError, match="max_batch_size"):
        Diffusers(sd3_pipe(), encode_prompt=fixed_embeddings, max_batch_size=0)

    class NotSD3:
        transformer = object()

    with pytest.raises(ValueError, match="SD3Transformer2DModel"):
        SD3Diffusers(NotSD3(), encode_prompt=fixed_embeddings)


def _without(field: str):
    def encode(prompt, negative_prompt):
        emb = fixed_embeddings(prompt, negative_prompt)
        return PromptEmbeddings(**{**{k: getattr(emb, k) for k in (
            "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
            "negative_pooled_prompt_embeds")}, field: None})
    return encode


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM + 1)), "joint_attention_dim"),
        (_without("pooled_prompt_embeds"), "pooled_prompt_embeds"),
        (_without("negative_pooled_prompt_embeds"), "negative_pooled_prompt_embeds"),
        (lambda p, n: PromptEmbeddings(torch.zeros(1, 7, EMBED_DIM), torch.zeros(1, 7, EMBED_DIM),
                                       torch.zeros(1, POOLED_DIM + 1)), "pooled_projection_dim"),
        (lambda p, n: PromptEmbeddings(torch.zeros(2, 7, EMBED_DIM)), r"\[1, seq, dim\]"),
        (lambda p, n: torch.zeros(1, 7, EMBED_DIM), "PromptEmbeddings"),
    ],
)
def test_embeddings_that_do_not_fit_are_refused_at_start(encode, message):
    model = Diffusers(sd3_pipe(), encode_prompt=encode)
    with pytest.raises(ValueError, match=message):
        model.start(model.validate({}), CPU)
