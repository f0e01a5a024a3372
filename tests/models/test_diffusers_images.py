"""``num_images`` per request: equal to ``pipe(num_images_per_prompt=n)`` with the same generator.

The reference is diffusers' own call with ``num_images_per_prompt``; the
engine side is one request through the model interface, whose frames hold
all ``n`` images along a leading dimension (``Frame.image_count``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import omni_stream as om  # noqa: E402
from omni_stream.errors import ParamsError  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from . import test_diffusers_callback as cb  # noqa: E402
from . import test_diffusers_flux as flux  # noqa: E402
from . import test_diffusers_sd3 as sd3  # noqa: E402


def run(model: Any, raw: dict) -> list[torch.Tensor]:
    params = model.validate(raw)
    state = model.start(params, sd.CPU)
    try:
        return [model.step([state])[0] for _ in range(model.total_steps(params))]
    finally:
        model.close(state)


def sd_reference(pipe: Any, raw: dict, n: int, *, sdxl: bool = False) -> torch.Tensor:
    emb = sd.fixed_embeddings(raw.get("prompt", ""), raw.get("negative_prompt", ""))
    kwargs: dict[str, Any] = dict(prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds)
    if sdxl:
        kwargs.update(pooled_prompt_embeds=emb.pooled_prompt_embeds,
                      negative_pooled_prompt_embeds=emb.negative_pooled_prompt_embeds)
    out = pipe(
        **kwargs,
        num_inference_steps=raw["steps"],
        guidance_scale=raw.get("guidance_scale", 5.0 if sdxl else 7.5),
        generator=torch.Generator("cpu").manual_seed(raw["seed"]),
        height=raw["height"],
        width=raw["width"],
        num_images_per_prompt=n,
        output_type="latent",
    )
    return out.images


def repeated(kwargs: dict, n: int) -> dict:
    """``kwargs`` with each embedding once per image. SD3's and Flux's ``encode_prompt`` repeat
    embeddings they compute, not ones given: a batch of ``n`` given embeddings is how
    ``num_images_per_prompt=n`` reaches them (the noise is one draw of ``n`` either way)."""
    return {k: v.repeat_interleave(n, dim=0) if k.endswith("embeds") else v for k, v in kwargs.items()}


@pytest.mark.parametrize("sampler", ["default", "euler_a"])
@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_sd_num_images_equals_num_images_per_prompt(sampler: str, guidance: float) -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=7, height=16, width=24,
               guidance_scale=guidance, num_images=3, sampler=sampler)
    frames = run(model, raw)
    switched = pipe
    if sampler != "default":
        from . import test_diffusers_samplers as samplers

        switched = samplers.with_sampler(pipe, sampler, samplers.table.NOISE)
    expected = sd_reference(switched, raw, 3)
    assert frames[-1].shape == (3, 4, 8, 12)
    assert torch.equal(frames[-1], expected)
    # The images differ from each other (each its own noise), and the first is not one image's run.
    assert not torch.equal(frames[-1][0], frames[-1][1])
    single = run(model, dict(raw, num_images=1))[-1]
    assert single.shape == (4, 8, 12)


def test_sdxl_num_images_equals_num_images_per_prompt() -> None:
    pipe = sd.sdxl_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    raw = dict(prompt="a cat", steps=2, seed=4, height=16, width=16, num_images=2)
    frames = run(model, raw)
    assert torch.equal(frames[-1], sd_reference(pipe, raw, 2, sdxl=True))


def test_sd3_num_images_equals_num_images_per_prompt() -> None:
    pipe = sd3.sd3_pipe()
    model = Diffusers(pipe, encode_prompt=sd3.fixed_embeddings)
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=2, height=16, width=16, num_images=2)
    frames = run(model, raw)
    out = pipe(**repeated(sd3.pipe_kwargs(raw), 2), output_type="latent")
    assert frames[-1].shape[0] == 2
    assert torch.equal(frames[-1], out.images)


@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_flux_num_images_equals_num_images_per_prompt(guidance_embeds: bool) -> None:
    pipe = flux.flux_pipe(flux.dev_scheduler(), guidance_embeds=guidance_embeds)
    model = Diffusers(pipe, encode_prompt=flux.fixed_embeddings)
    raw = dict(prompt="a cat", steps=3, seed=2, height=16, width=16, num_images=2)
    frames = run(model, raw)
    out = pipe(**repeated(flux.pipe_kwargs(raw), 2), output_type="latent")
    expected = type(pipe)._unpack_latents(out.images, 16, 16, 2)
    assert frames[-1].shape == expected.shape == (2, 16, 8, 8)
    assert torch.equal(frames[-1], expected)


def test_decode_gives_each_image_as_the_pipeline_decodes_it() -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    raw = dict(prompt="a cat", steps=2, seed=1, height=16, width=16, num_images=2)
    params = model.validate(raw)
    state = model.start(params, sd.CPU)
    final = [model.step([state])[0] for _ in range(2)][-1]
    images = model.decode(state, final)
    model.close(state)
    assert images.shape == (2, 3, 16, 16)
    emb = sd.fixed_embeddings("a cat", "")
    out = pipe(prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
               num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(1), height=16, width=16,
               num_images_per_prompt=2, output_type="pt")
    # diffusers decodes the batch in one VAE call, this one image at a time: equal up to rounding.
    torch.testing.assert_close(images, out.images * 2 - 1, rtol=0, atol=1e-5)


def test_requests_with_different_image_counts_batch_together_and_match_their_solo_runs() -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings, max_batch_size=4)
    a = model.validate(dict(prompt="a cat", steps=3, seed=1, height=16, width=16, num_images=2))
    b = model.validate(dict(prompt="a dog", steps=3, seed=2, height=16, width=16))
    assert model.batch_key(a) == model.batch_key(b)
    sa, sb = model.start(a, sd.CPU), model.start(b, sd.CPU)
    for _ in range(3):
        fa, fb = model.step([sa, sb])
    torch.testing.assert_close(fa, run(model, a)[-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(fb, run(model, b)[-1], rtol=0, atol=1e-4)
    assert fa.shape == (2, 4, 8, 8) and fb.shape == (4, 8, 8)


def test_num_images_is_bounded_and_the_bound_can_be_set() -> None:
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings, max_images=2)
    with pytest.raises(ParamsError) as info:
        model.validate(dict(num_images=3))
    assert info.value.field == "num_images"
    with pytest.raises(ParamsError):
        model.validate(dict(num_images=0))
    model.set_max_images(6)
    assert model.validate(dict(num_images=6))["num_images"] == 6
    with pytest.raises(ParamsError) as info:
        model.set_max_images(0)
    assert info.value.field == "max_images"
    with pytest.raises(ParamsError):
        Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings, max_images=1000)


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cb.make_text_encoder(tmp_path_factory.mktemp("clip"))


def test_callback_mode_num_images_equals_num_images_per_prompt(text_encoder: Any) -> None:
    pipe = cb.img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    image = cb.picture()
    raw = dict(cb.IMG2IMG, image=cb.data_url(image), num_images=2)
    got = cb.run_direct(model, raw)
    seen: list[torch.Tensor] = []

    def on_step_end(pipe: Any, i: int, t: Any, tensors: dict) -> dict:
        seen.append(tensors["latents"].clone())
        return tensors

    out = pipe(prompt="a red cat", negative_prompt="dog", image=image, strength=0.6, num_inference_steps=5,
               guidance_scale=6.0, generator=torch.Generator().manual_seed(3), output_type="pt",
               num_images_per_prompt=2, callback_on_step_end=on_step_end)
    assert got.frames[0].shape == (2, 4, 8, 8) and torch.equal(got.frames[0], seen[0])
    assert got.frames[-1].shape == (2, 3, 16, 16)
    torch.testing.assert_close(got.frames[-1], out.images * 2 - 1, rtol=0, atol=1e-5)


@pytest.mark.asyncio
async def test_the_engine_hands_out_frames_of_n_images_that_split_and_save(tmp_path: Any) -> None:
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    async with om.Engine(model, device="cpu") as engine:
        raw = dict(prompt="a cat", steps=2, seed=3, height=16, width=16, num_images=3)
        frames = [f async for f in engine.stream(raw)]
    final = frames[-1]
    assert final.image_count == 3 and not final.is_video and final.data.shape == (3, 3, 16, 16)
    parts = final.split()
    assert [p.image_count for p in parts] == [1, 1, 1]
    assert all(torch.equal(p.data, final.data[i]) for i, p in enumerate(parts))
    assert len(final.images()) == 3
    grid = final.image()
    assert grid.size == (32, 32)  # 3 images: 2 columns, 2 rows
    saved = [p.save(tmp_path / f"out-{i}.png") for i, p in enumerate(parts)]
    assert all(path.exists() for path in saved)
    # A step's frame holds the three latents too, and previews as a grid.
    assert frames[0].image_count == 3 and frames[0].data.shape == (3, 4, 8, 8)
