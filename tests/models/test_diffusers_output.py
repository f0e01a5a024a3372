"""A diffusers request's result is the pipeline's image; previews by a tiny autoencoder.

The UNet pipelines here are the tiny random ones of test_diffusers.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import AutoencoderTiny  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402

from .test_diffusers import fixed_embeddings, sd_pipe  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

RAW = dict(prompt="a cat", steps=3, seed=5, height=16, width=16)




def tiny_taesd(latent_channels: int = 4, **config) -> AutoencoderTiny:
    torch.manual_seed(2)
    return AutoencoderTiny(
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        num_encoder_blocks=(1, 1),
        num_decoder_blocks=(1, 1),
        latent_channels=latent_channels,
        **config,
    )


def pipe_image(pipe, raw: dict) -> torch.Tensor:
    emb = fixed_embeddings(raw["prompt"], "")
    return pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        num_inference_steps=raw["steps"], height=raw["height"], width=raw["width"],
        generator=torch.Generator().manual_seed(raw["seed"]), output_type="pt",
    ).images[0]


@pytest.mark.asyncio
async def test_the_result_is_the_pipelines_image_at_full_size():
    pipe = sd_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(RAW)]
        latent = await engine.generate({**RAW, "output": "latent"})
    final = frames[-1]
    assert final.decoded and final.data.shape == (3, 16, 16) and final.data.dtype == torch.float32
    assert [f.data.shape for f in frames[:-1]] == [(4, 8, 8)] * 2
    torch.testing.assert_close(final.data * 0.5 + 0.5, pipe_image(pipe, RAW), rtol=0, atol=1e-6)
    assert not latent.decoded and latent.data.shape == (4, 8, 8)
    torch.testing.assert_close(model.decode_latents(latent.data), final.data, rtol=0, atol=0)
    assert final.timings.decode_s > 0


@pytest.mark.asyncio
async def test_a_tiny_autoencoder_decodes_the_previewed_steps(tmp_path):
    pipe = sd_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    taesd = tiny_taesd()
    taesd.save_pretrained(tmp_path / "taesd")
    model.use_preview_vae(str(tmp_path / "taesd"))  # from a folder, as --preview-vae takes it
    raw = {**RAW, "steps": 5, "output": "latent"}
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(raw, preview_every=2)]
        plain = [f async for f in engine.stream(raw)]
    assert [f.decoded for f in frames] == [False, True, False, True, False]
    for f, p in zip(frames, plain, strict=True):
        if not f.decoded:
            assert torch.equal(f.data, p.data)
            continue
        assert f.data.shape == (3, 16, 16) and f.timings.decode_s > 0
        with torch.no_grad():
            expected = taesd.decode(p.data[None]).sample[0].clamp(-1, 1)
        torch.testing.assert_close(f.data, expected, rtol=0, atol=1e-6)


def test_a_preview_vae_that_does_not_fit_is_refused():
    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)
    with pytest.raises(ValueError, match="16 latent channels.*have 4"):
        model.use_preview_vae(tiny_taesd(latent_channels=16))
    with pytest.raises(ValueError, match="AutoencoderTiny"):
        model.use_preview_vae(object())


def test_an_sdxl_vae_in_float16_decodes_in_float32_as_the_pipeline_does():
    from .test_diffusers import sdxl_pipe

    pipe = sdxl_pipe()
    model = Diffusers(pipe, encode_prompt=fixed_embeddings)
    latents = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0))
    reference = model.decode_latents(latents)  # a float32 VAE
    pipe.vae.to(torch.float16)
    pipe.vae.register_to_config(force_upcast=True)
    seen: list[torch.dtype] = []
    decode = pipe.vae.decode

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return decode(x, *args, **kwargs)

    pipe.vae.decode = spy
    image = model.decode_latents(latents)
    # Decoded in float32 (the SDXL VAE overflows in float16), then cast back.
    assert seen == [torch.float32] and pipe.vae.dtype == torch.float16
    assert image.dtype == torch.float32
    # The weights went through float16 once: close, not equal.
    torch.testing.assert_close(image, reference, rtol=0, atol=5e-2)
