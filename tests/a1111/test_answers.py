"""A1111's answers from ours (a1111/answers.py)."""

from __future__ import annotations

import base64
import json

from omni_stream.a1111.answers import Made, generation_answer, info_text, lora_list, model_list, scripts
from omni_stream.a1111.generation import parse_generation


def test_a_generation_answers_its_images_its_fields_and_a1111s_info() -> None:
    gen = parse_generation({"prompt": "a cat", "negative_prompt": "dog", "batch_size": 2, "n_iter": 2},
                           kind="txt2img")
    made = [Made(b"png%d" % i, seed, 24, 16, f"text {i}") for i, seed in enumerate([5, 6, 7, 8])]
    info = json.loads(info_text(gen, made, model="sd", sampler="DPM++ 2M", schedule="Karras", seed=5,
                                timestamp="20260101000000", steps=2, cfg_scale=7.5))
    assert (info["seed"], info["all_seeds"], info["all_prompts"]) == (5, [5, 6, 7, 8], ["a cat"] * 4)
    assert (info["width"], info["height"], info["batch_size"], info["sd_model_name"]) == (24, 16, 2, "sd")
    assert info["sampler_name"] == "DPM++ 2M" and info["extra_generation_params"] == {"Schedule type": "Karras"}
    assert info["infotexts"] == ["text 0", "text 1", "text 2", "text 3"] and info["denoising_strength"] is None
    answer = generation_answer(gen, made, "{}")
    assert [base64.b64decode(i) for i in answer["images"]] == [m.png for m in made]
    assert answer["parameters"] == gen.echo and answer["info"] == "{}"
    unsent = parse_generation({"send_images": False}, kind="txt2img")
    assert generation_answer(unsent, made, "{}")["images"] == []


def test_a_blurred_masks_info_says_its_blur_as_a1111s_does() -> None:
    def extra(**fields: object) -> dict[str, object]:
        gen = parse_generation({"init_images": ["AAAA"], "mask": "BBBB", **fields}, kind="img2img")
        text = info_text(gen, [], model="sd", sampler="Euler", schedule="Automatic", seed=1, timestamp="t",
                         steps=2, cfg_scale=7.0)
        return json.loads(text)["extra_generation_params"]  # type: ignore[no-any-return]

    assert extra() == {"Schedule type": "Automatic", "Mask blur": 4}
    assert extra(mask_blur_x=2, mask_blur_y=3)["Mask blur"] is None  # A1111's mask_blur: None when they differ
    assert "Mask blur" not in extra(mask_blur=0)
    gen = parse_generation({"init_images": ["AAAA"], "mask": "BBBB"}, kind="img2img")
    only_masked = {"Inpaint area": "Only masked", "Masked area padding": 32, "Masked content": "fill"}
    text = info_text(gen, [], model="sd", sampler="Euler", schedule="Automatic", seed=1, timestamp="t", steps=2,
                     cfg_scale=7.0, extra_params=only_masked)
    assert json.loads(text)["extra_generation_params"] == {"Schedule type": "Automatic", "Mask blur": 4,
                                                           **only_masked}  # in A1111's order


def test_the_lists_say_names_and_nothing_of_the_disk() -> None:
    assert model_list(["sd"]) == [
        {"title": "sd", "model_name": "sd", "hash": None, "sha256": None, "filename": "sd", "config": None}]
    assert lora_list(["ink"]) == [{"name": "ink", "alias": "ink", "path": None, "metadata": {}}]
    assert scripts() == {"txt2img": [], "img2img": []}
