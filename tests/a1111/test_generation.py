"""A1111's txt2img / img2img bodies checked and mapped to a model's params (a1111/generation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from omni_stream.a1111.generation import (
    MAX_BATCH_SIZE,
    MAX_N_ITER,
    Generation,
    model_params,
    parse_generation,
)
from omni_stream.errors import MessageError
from omni_stream.params import Param, images_param, seed_param

#: A text-to-image model's params, as the diffusers models declare them.
TXT2IMG = [
    Param("prompt", "str", ""),
    Param("negative_prompt", "str", ""),
    Param("steps", "int", 20),
    Param("guidance_scale", "float", 7.5),
    seed_param(),
    images_param(4),
    Param("height", "int", 512),
    Param("width", "int", 512),
    Param("sampler", "str", "default", choices=("default", "euler_a", "dpmpp_2m", "dpmpp_2m_karras")),
]
#: An img2img pipeline's: no sides (its images are the init image's size), a strength.
IMG2IMG = [p for p in TXT2IMG if p.name not in ("height", "width")] + [
    Param("strength", "float", 0.8),
    Param("image", "str", None),
]
#: What webuiapi sends for txt2img when only a prompt is given.
WEBUIAPI = {
    "enable_hr": False, "denoising_strength": 0.7, "firstphase_width": 0, "hr_scale": 2, "hr_upscaler": "Latent",
    "prompt": "a cat", "styles": [], "seed": -1, "subseed": -1, "subseed_strength": 0.0, "seed_resize_from_h": 0,
    "seed_resize_from_w": 0, "batch_size": 1, "n_iter": 1, "steps": 20, "cfg_scale": 7.0, "width": 512,
    "height": 512, "restore_faces": False, "tiling": False, "do_not_save_samples": False, "negative_prompt": "",
    "eta": 1.0, "s_churn": 0, "s_tmax": 0, "s_tmin": 0, "s_noise": 1, "override_settings": {},
    "override_settings_restore_afterwards": True, "sampler_name": "Euler a", "scheduler": "automatic",
    "sampler_index": "Euler a", "script_name": None, "script_args": [], "send_images": True, "save_images": False,
    "alwayson_scripts": {},
}


def refused(body: dict[str, Any], kind: str = "txt2img", declared: list[Param] = TXT2IMG, **kw: Any) -> MessageError:
    with pytest.raises(MessageError) as info:
        model_params(parse_generation(body, kind=kind), declared, model="sd", **kw)
    assert info.value.message.startswith(f"{info.value.field}: "), info.value.message
    return info.value


def test_what_webuiapi_sends_by_default_maps_to_our_params() -> None:
    gen = parse_generation(WEBUIAPI, kind="txt2img")
    assert model_params(gen, TXT2IMG, model="sd") == {
        "prompt": "a cat", "steps": 20, "guidance_scale": 7.0, "sampler": "euler_a", "width": 512, "height": 512,
    }
    assert (gen.seed, gen.n_iter, gen.batch_size, gen.model, gen.send_images) == (-1, 1, 1, None, True)
    assert gen.echo == WEBUIAPI  # the answer's parameters


def test_a_batch_its_iterations_seeds_sampler_schedule_and_model_override() -> None:
    body = {"prompt": "a", "negative_prompt": "b", "seed": 40, "batch_size": 2, "n_iter": 3, "cfg_scale": 5,
            "sampler_name": "DPM++ 2M", "scheduler": "Karras", "override_settings": {"sd_model_checkpoint": "xl"},
            "width": 768.0, "send_images": False}
    gen = parse_generation(body, kind="txt2img")
    # Each image is a request of one image (no num_images), of its own seed.
    assert model_params(gen, TXT2IMG, model="sd") == {
        "prompt": "a", "negative_prompt": "b", "guidance_scale": 5.0, "sampler": "dpmpp_2m_karras",
        "width": 768,
    }
    # A1111's all_seeds: image j of iteration i is seed + i * batch_size + j.
    assert [gen.seed_of(i * 2 + j, 40) for i in range(3) for j in range(2)] == [40, 41, 42, 43, 44, 45]
    assert (gen.model, gen.send_images, gen.overrides) == ("xl", False, {})
    # sampler_index when sampler_name is absent (A1111's older field).
    assert model_params(parse_generation({"sampler_index": "Euler a"}, kind="txt2img"), TXT2IMG, model="sd") == {
        "prompt": "", "sampler": "euler_a"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enable_hr", True), ("restore_faces", True), ("tiling", True), ("subseed_strength", 0.5),
        ("seed_resize_from_h", 256), ("script_name", "X/Y/Z plot"), ("save_images", True),
        ("refiner_checkpoint", "sdxl_refiner"), ("eta", 0.5), ("eta", True), ("s_churn", 1.0), ("s_noise", 0.9),
        ("styles", ["anime"]),
    ],
)
def test_what_a1111_does_and_we_do_not_is_refused_naming_the_field(field: str, value: Any) -> None:
    error = refused({**WEBUIAPI, field: value})
    assert (error.code, error.field) == ("unsupported", field)


def test_bad_values_and_what_the_model_cannot_take_name_the_a1111_field() -> None:
    assert refused({"steps": "ten"}).field == "steps"
    assert refused({"seed": -2}).field == "seed"
    assert refused({"n_iter": MAX_N_ITER + 1}).field == "n_iter"
    assert refused({"alwayson_scripts": {"ControlNet": {"args": []}}}).field == "alwayson_scripts.ControlNet"
    assert refused({"override_settings": {"sd_model_checkpoint": 3}}).field == "override_settings.sd_model_checkpoint"
    assert refused({"sampler_name": "Euler a", "scheduler": "karras"}).field == "scheduler"  # no Karras twin
    assert refused({"scheduler": "karras"}).field == "scheduler"  # a schedule of no sampler
    assert refused({"batch_size": MAX_BATCH_SIZE + 1}).field == "batch_size"
    assert refused({"seed": 2**63 - 2, "batch_size": 2, "n_iter": 2}).field == "seed"  # its last image's: over
    # A model of one image a request makes a batch too: each image is a request of its own.
    one_image = [p for p in TXT2IMG if p.name != "num_images"]
    assert "num_images" not in model_params(parse_generation({"batch_size": 2}, kind="txt2img"), one_image,
                                            model="sd")
    square = [p for p in TXT2IMG if p.name not in ("height", "width")] + [Param("size", "int", None)]
    assert refused({"width": 512, "height": 768}, declared=square).field == "width"
    assert model_params(parse_generation({"width": 64, "height": 64}, kind="txt2img"), square, model="sd") == {
        "prompt": "", "size": 64}
    fixed = [p for p in TXT2IMG if p.name != "sampler"]
    assert refused({"sampler_name": "Euler a"}, declared=fixed).field == "sampler_name"
    unguided = [p for p in TXT2IMG if p.name != "guidance_scale"]
    assert refused({"cfg_scale": 3}, declared=unguided).field == "cfg_scale"
    assert "guidance_scale" not in model_params(parse_generation({"cfg_scale": 7}, kind="txt2img"), unguided,
                                                model="sd")
    # A model whose guidance is ``guidance`` (the embedded mixture; the infotext's CFG scale too).
    mixture = [*unguided, Param("guidance", "float", 1.0)]
    assert model_params(parse_generation({"cfg_scale": 3}, kind="txt2img"), mixture, model="m")["guidance"] == 3.0


def test_img2img_takes_one_init_image_a_mask_and_the_denoising_strength() -> None:
    body = {**WEBUIAPI, "init_images": ["data:image/png;base64,AAAA"], "mask": "BBBB", "denoising_strength": 0.5,
            "resize_mode": 0, "mask_blur": 4, "inpainting_fill": 0, "inpaint_full_res": True,
            "image_cfg_scale": 1.5, "width": 16, "height": 16}
    gen = parse_generation(body, kind="img2img")
    assert (gen.init_image, gen.mask, gen.denoising_strength) == ("AAAA", "BBBB", 0.5)
    assert (gen.mask_blur_x, gen.mask_blur_y) == (4, 4)
    assert "init_images" not in gen.echo and "mask" not in gen.echo
    inpaint = [*TXT2IMG, Param("strength", "float", 0.8), Param("image", "str", None), Param("mask_image", "str", None)]
    assert model_params(gen, inpaint, model="sd")["strength"] == 0.5
    assert refused(body, "img2img", IMG2IMG, image_size=(16, 16)).field == "mask"  # img2img: no mask_image
    unmasked = {**body, "mask": None}
    # A model without sides makes the init image's size: width and height must say it.
    assert "width" not in model_params(parse_generation(unmasked, kind="img2img"), IMG2IMG, model="sd",
                                       image_size=(16, 16))
    assert "16x16" in refused(unmasked, "img2img", IMG2IMG, image_size=(16, 24)).message
    assert refused(unmasked, "img2img", TXT2IMG).field == "init_images"  # a text-to-image model
    assert refused({**body, "init_images": []}, "img2img", inpaint).field == "init_images"
    assert refused({**body, "init_images": ["A", "B"]}, "img2img", inpaint).field == "init_images"
    assert refused({**body, "init_images": ["https://x/y.png"]}, "img2img", inpaint).field == "init_images"
    assert refused({**body, "resize_mode": 1}, "img2img", inpaint).field == "resize_mode"
    assert refused({**body, "inpainting_mask_invert": 1}, "img2img", inpaint).field == "inpainting_mask_invert"
    with_images = parse_generation({**body, "include_init_images": True}, kind="img2img")
    assert with_images.echo["init_images"] == body["init_images"]


def test_a_generation_defaults_to_one_image_of_a_random_seed() -> None:
    gen = Generation(kind="txt2img")
    assert (gen.seed, gen.n_iter, gen.batch_size, gen.seed_of(0, 7)) == (-1, 1, 1, 7)


def test_the_mask_blur_is_a1111s_mask_blur_x_and_y_which_mask_blur_sets_both() -> None:
    body = {"init_images": ["AAAA"], "mask": "BBBB"}

    def blur(**fields: Any) -> tuple[int, int]:
        gen = parse_generation({**body, **fields}, kind="img2img")
        return gen.mask_blur_x, gen.mask_blur_y

    assert blur() == (4, 4)  # A1111's default, when a client sends none
    assert blur(mask_blur_x=2, mask_blur_y=0) == (2, 0)
    assert blur(mask_blur=0, mask_blur_x=2, mask_blur_y=6) == (0, 0)  # mask_blur, sent, wins
    assert blur(mask_blur=8.0) == (8, 8)
    for field, value in (("mask_blur", -1), ("mask_blur_x", 65), ("mask_blur_y", "4"), ("mask_blur", True)):
        with pytest.raises(MessageError) as info:
            parse_generation({**body, field: value}, kind="img2img")
        assert info.value.field == field


def test_only_masked_and_the_fill_default_to_a1111s_api_and_are_checked() -> None:
    body = {"init_images": ["AAAA"], "mask": "BBBB"}

    def area(**fields: Any) -> tuple[bool, int, int]:
        gen = parse_generation({**body, **fields}, kind="img2img")
        return gen.inpaint_full_res, gen.inpaint_full_res_padding, gen.inpainting_fill

    assert area() == (True, 0, 0)  # StableDiffusionProcessingImg2Img's defaults, which its API takes
    assert area(inpaint_full_res=False, inpaint_full_res_padding=32, inpainting_fill=1) == (False, 32, 1)
    assert area(inpaint_full_res=0)[0] is False and area(inpaint_full_res=1)[0] is True  # the UI radio's index
    for field, value in (("inpaint_full_res", "yes"), ("inpaint_full_res", 2), ("inpaint_full_res_padding", -1),
                         ("inpainting_fill", 4), ("inpainting_fill", "fill")):
        with pytest.raises(MessageError) as info:
            parse_generation({**body, field: value}, kind="img2img")
        assert info.value.field == field
