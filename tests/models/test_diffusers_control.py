"""Mask and control images in callback mode: inpaint and ControlNet pipelines, equal to ``pipe()``.

Tiny random-weight pipelines built from configs (the callback tests'
UNet, VAE and CLIP), each request's images as PNG data URLs, checked from
their header by the server's core and decoded by the model's ``validate``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    ControlNetModel,
    DDIMScheduler,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
)

import omni_stream as om  # noqa: E402
from omni_stream.core.inputs import image_params  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402

from . import test_diffusers_callback as cb  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cb.make_text_encoder(tmp_path_factory.mktemp("clip"))


def inpaint_pipe(text_encoder: Any) -> StableDiffusionInpaintPipeline:
    tokenizer, encoder = text_encoder
    pipe = StableDiffusionInpaintPipeline(
        vae=cb.tiny_vae(), text_encoder=encoder, tokenizer=tokenizer, unet=cb.tiny_unet(),
        scheduler=DDIMScheduler(**cb.SCHEDULE, clip_sample=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def controlnet_pipe(text_encoder: Any) -> StableDiffusionControlNetImg2ImgPipeline:
    tokenizer, encoder = text_encoder
    torch.manual_seed(4)
    controlnet = ControlNetModel(
        block_out_channels=(8, 16), layers_per_block=1, in_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=cb.EMBED_DIM,
        norm_num_groups=4, attention_head_dim=2, conditioning_embedding_out_channels=(4, 8),
    )
    pipe = StableDiffusionControlNetImg2ImgPipeline(
        vae=cb.tiny_vae(), text_encoder=encoder, tokenizer=tokenizer, unet=cb.tiny_unet(),
        controlnet=controlnet, scheduler=DDIMScheduler(**cb.SCHEDULE, clip_sample=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def mask(width: int = 16, height: int = 16) -> Any:
    """White (paint) on the right half, black (keep) on the left."""
    from PIL import Image

    image = Image.new("RGB", (width, height), (0, 0, 0))
    image.paste((255, 255, 255), (width // 2, 0, width, height))
    return image


RAW = dict(prompt="a red cat", negative_prompt="dog", steps=4, strength=1.0, seed=3, guidance_scale=6.0)


def call(pipe: Any, **images: Any) -> torch.Tensor:
    out = pipe(
        prompt=RAW["prompt"], negative_prompt=RAW["negative_prompt"], num_inference_steps=RAW["steps"],
        strength=RAW["strength"], guidance_scale=RAW["guidance_scale"],
        generator=torch.Generator().manual_seed(RAW["seed"]), output_type="latent", **images,
    )
    return out.images[0]


def test_an_inpaint_request_with_a_mask_equals_the_pipeline(text_encoder: Any) -> None:
    pipe = inpaint_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    assert model.mode == "callback" and model.image_params == ("image", "mask_image")
    assert image_params(model) == ("image", "mask_image")  # what the server's core checks first
    image, paint = cb.picture(), mask()
    raw = dict(RAW, image=cb.data_url(image), mask_image=cb.data_url(paint))
    got = cb.run_direct(model, raw, output="latent").frames[-1]
    assert torch.equal(got, call(pipe, image=image, mask_image=paint))
    # Another mask, another picture: the mask is used.
    flipped = mask().transpose(0)  # white on the left
    other = cb.run_direct(model, dict(raw, mask_image=cb.data_url(flipped)), output="latent").frames[-1]
    assert not torch.equal(got, other)


def test_an_inpaint_request_without_its_mask_names_it(text_encoder: Any) -> None:
    model = Diffusers(inpaint_pipe(text_encoder), mode="callback")
    with pytest.raises(om.ParamsError) as info:
        model.validate(dict(RAW, image=cb.data_url(cb.picture())))
    assert info.value.field == "mask_image" and "inpaint mask" in info.value.message
    with pytest.raises(om.ParamsError) as info:
        model.validate(dict(RAW, image=cb.data_url(cb.picture()), mask_image="data:image/png;base64,AAAA"))
    assert info.value.field == "mask_image"


def test_a_controlnet_img2img_request_equals_the_pipeline(text_encoder: Any) -> None:
    pipe = controlnet_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    assert model.image_params == ("image", "control_image")
    image, control = cb.picture(seed=1), cb.picture(seed=2)
    raw = dict(RAW, strength=0.75, image=cb.data_url(image), control_image=cb.data_url(control))
    got = cb.run_direct(model, raw, output="latent").frames[-1]
    expected = pipe(
        prompt=RAW["prompt"], negative_prompt=RAW["negative_prompt"], num_inference_steps=RAW["steps"],
        strength=0.75, guidance_scale=RAW["guidance_scale"], image=image, control_image=control,
        generator=torch.Generator().manual_seed(RAW["seed"]), output_type="latent",
    ).images[0]
    assert torch.equal(got, expected)
    with pytest.raises(om.ParamsError) as info:
        model.validate(dict(RAW, image=cb.data_url(image)))
    assert info.value.field == "control_image"
