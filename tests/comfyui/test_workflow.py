"""workflow.py and plan.py: a checked workflow as one request, or refused naming the node input."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omni_stream.comfyui import ModelCard, Plan, WorkflowError, comfy_samplers, plan_workflow, read_workflow
from omni_stream.params import Param, seed_param

from .workflows import advanced, img2img, node, txt2img, with_lora

SAMPLERS = ("default", "euler", "euler_karras", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "ddim")
TEXT = (
    Param("prompt", "str", ""),
    Param("negative_prompt", "str", ""),
    Param("steps", "int", 50),
    Param("guidance_scale", "float", 7.5),
    seed_param(),
    Param("num_images", "int", 1),
    Param("sampler", "str", "default", choices=SAMPLERS),
)
SD = ModelCard(
    "sd",
    {p.name: p for p in (*TEXT, Param("width", "int", 16), Param("height", "int", 16))},
    ("ink", "pastel"),
)
IMG = ModelCard(
    "img", {p.name: p for p in (*TEXT, Param("strength", "float", 0.8), Param("image", "str", None))}
)
PLAIN = ModelCard(
    "plain",
    {
        p.name: p
        for p in (
            Param("prompt", "str", ""),
            Param("steps", "int", 4),
            seed_param(),
            Param("width", "int", 16),
            Param("height", "int", 16),
            Param("sampler", "str", "euler", choices=("euler",)),
        )
    },
)
MODELS = {"sd": SD, "img": IMG, "plain": PLAIN}


def plan(workflow: dict[str, Any], uploads: tuple[str, ...] = ("in.png",)) -> Plan:
    return plan_workflow(read_workflow(workflow), MODELS, uploads)


def refused(workflow: dict[str, Any], uploads: tuple[str, ...] = ("in.png",)) -> list[tuple[str, str, str]]:
    """``(node id, input, message)`` of each fault."""
    with pytest.raises(WorkflowError) as info:
        plan(workflow, uploads)
    return [(n.node_id, n.input_name or "", n.message) for n in info.value.nodes]


def test_comfyuis_default_workflow_is_one_text_to_image_request() -> None:
    made = plan(
        txt2img(seed=2**64 - 1, batch=2, sampler="dpmpp_2m", scheduler="karras", ckpt="sd.safetensors")
    )
    assert made.model == "sd"
    assert made.params == {
        "prompt": "a cat",
        "negative_prompt": "blur",
        "width": 16,
        "height": 16,
        "num_images": 2,
        "seed": (2**64 - 1) % 2**63,
        "steps": 3,
        "sampler": "dpmpp_2m_karras",
        "guidance_scale": 7.0,
    }
    assert (made.sampler.id, made.decoders, made.upload) == ("3", ("8",), None)
    assert sorted(made.cached) == ["4", "5", "6", "7"] and made.output_ids == ["9"]
    msg = made.to_generate("p-1")
    assert (msg.id, msg.model, msg.detach, msg.preview, msg.output) == (
        "p-1",
        "sd",
        True,
        {"format": "jpeg", "every": 1},
        {"format": "png"},
    )
    assert made.outputs[0].filename("p-1", 0, "png") == "ComfyUI_p-1_00001_.png"


def test_the_cores_refusal_of_a_param_names_the_node_input_it_came_from() -> None:
    made = plan(with_lora(txt2img()))
    assert made.params["loras"] == [{"name": "ink", "scale": 0.5}]
    for field, where in [
        ("width", ("5", "width")),
        ("steps", ("3", "steps")),
        ("sampler", ("3", "sampler_name")),
        ("loras[0].scale", ("10", "strength_model")),
        ("loras[0].name", ("10", "lora_name")),
        ("negative_prompt", ("7", "text")),
        ("model", ("4", "ckpt_name")),
    ]:
        fault = made.node_error(field, "no")
        assert fault is not None and (fault.node_id, fault.input_name) == where, field
    assert made.node_error("preview.format", "no") is None and made.node_error(None, "no") is None


def test_image_to_image_takes_the_upload_with_comfyuis_steps_and_denoise() -> None:
    made = plan(img2img("in.png [input]", denoise=0.25, steps=5))
    assert made.model == "img" and made.upload == "in.png"
    # ComfyUI runs 5 steps of a 20-step schedule; diffusers runs steps * strength of its steps.
    assert (made.params["steps"], made.params["strength"]) == (20, 0.25)
    assert "width" not in made.params and made.to_generate("p", "data:x").params["image"] == "data:x"
    assert made.node_error("image", "bad").node_id == "10"  # type: ignore[union-attr]
    adv = plan(advanced(img2img("in.png", steps=10), start_at_step=4))
    assert (adv.params["steps"], adv.params["strength"]) == (10, 0.6)


def test_ksampler_advanced_from_the_start_to_the_end_is_a_ksampler() -> None:
    assert plan(advanced(txt2img())).params == plan(txt2img()).params


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        (
            lambda w: w["4"]["inputs"].update(ckpt_name="sdxl.safetensors"),
            ("4", "ckpt_name"),
            "['sd', 'img', 'plain']",
        ),
        (
            lambda w: w["3"]["inputs"].update(sampler_name="res_multistep"),
            ("3", "sampler_name"),
            "'euler', 'euler_ancestral', 'dpmpp_2m', 'ddim'",
        ),
        (
            lambda w: w["3"]["inputs"].update(scheduler="exponential"),
            ("3", "scheduler"),
            "['normal', 'karras', 'simple', 'sgm_uniform']",
        ),
        (
            lambda w: w["3"]["inputs"].update(sampler_name="euler_ancestral", scheduler="karras"),
            ("3", "scheduler"),
            "no Karras schedule",
        ),
        (lambda w: w["3"]["inputs"].update(denoise=0.5), ("3", "denoise"), "needs an input image"),
        (lambda w: w["9"]["inputs"].update(images=["3", 0]), ("9", "images"), "IMAGE"),
    ],
)
def test_what_has_no_mapping_is_refused_naming_the_node_input(
    change: Any, where: tuple[str, str], words: str
) -> None:
    workflow = txt2img()
    change(workflow)
    found = refused(workflow)
    assert [f[:2] for f in found] == [where] and words in found[0][2], found


def test_what_a_plain_graph_check_lets_through_but_we_cannot_run() -> None:
    two = copy.deepcopy(txt2img())
    two["13"] = node("KSampler", "Hires", **{**two["3"]["inputs"], "latent_image": ["3", 0], "denoise": 0.5})
    two["14"] = node("VAEDecode", "D2", samples=["13", 0], vae=["4", 2])
    two["15"] = node("SaveImage", "S2", filename_prefix="hires", images=["14", 0])
    assert {f[0] for f in refused(two)} == {"13"}  # a second pass, named
    loaded = txt2img()
    loaded["10"] = node("LoadImage", "Load Image", image="in.png", upload="image")
    loaded["9"]["inputs"]["images"] = ["10", 0]
    assert [f[:2] for f in refused(loaded)] == [("9", "images")]
    with pytest.raises(WorkflowError, match="Prompt has no outputs") as none:
        plan({"1": node("CheckpointLoaderSimple", "c", ckpt_name="sd")})
    assert none.value.type == "prompt_no_outputs"


def test_loras_map_by_name_at_strength_model_and_clip_through_the_same_loaders() -> None:
    assert refused(with_lora(txt2img(), "oil")) == [
        ("10", "lora_name", "Value not in list: lora_name: 'oil' not in ['ink', 'pastel']")
    ]
    assert [f[:2] for f in refused(with_lora(txt2img(), clip_strength=1.0))] == [("10", "strength_clip")]
    half = with_lora(txt2img())
    half["6"]["inputs"]["clip"] = ["4", 1]  # the positive prompt bypasses the LoRA
    assert [f[:2] for f in refused(half)] == [("6", "clip")]
    assert "has no LoRAs" in refused(with_lora(txt2img(ckpt="plain", negative="", cfg=1.0)))[0][2]
    chained = with_lora(txt2img())  # checkpoint -> ink (10) -> pastel (11) -> the sampler and prompts
    chained["11"] = node(
        "LoraLoader",
        "Load LoRA 2",
        lora_name="pastel",
        strength_model=0.25,
        strength_clip=0.25,
        model=["10", 0],
        clip=["10", 1],
    )
    chained["3"]["inputs"]["model"] = ["11", 0]
    chained["6"]["inputs"]["clip"] = chained["7"]["inputs"]["clip"] = ["11", 1]
    made = plan(chained)
    assert made.params["loras"] == [{"name": "ink", "scale": 0.5}, {"name": "pastel", "scale": 0.25}]
    assert made.node_error("loras[1].scale", "no").node_id == "11"  # type: ignore[union-attr]


def test_a_value_the_model_has_no_param_for_is_refused_unless_it_means_nothing() -> None:
    made = plan(txt2img(ckpt="plain", negative="", cfg=1.0))
    assert "negative_prompt" not in made.params and "guidance_scale" not in made.params
    found = refused(txt2img(ckpt="plain", batch=2))
    assert {f[:2] for f in found} == {("3", "cfg"), ("7", "text"), ("5", "batch_size")}
    assert [f[:2] for f in refused(img2img("in.png", ckpt="sd"))] == [("10", "image")]
    assert [f[:2] for f in refused(img2img("gone.png"))] == [("10", "image")]
    assert [f[:2] for f in refused(advanced(txt2img(), start_at_step=1))] == [("3", "start_at_step")]
    bad = advanced(txt2img(), add_noise="disable", end_at_step=2, return_with_leftover_noise="enable")
    assert {f[1] for f in refused(bad)} == {"add_noise", "end_at_step", "return_with_leftover_noise"}


def test_object_info_lists_comfyuis_names_for_the_samplers_offered() -> None:
    assert comfy_samplers(SAMPLERS) == ("euler", "euler_ancestral", "dpmpp_2m", "ddim")
    assert comfy_samplers(("unipc_karras",)) == ("uni_pc",)


def test_each_output_node_lists_the_images_under_its_own_name_and_type() -> None:
    workflow = txt2img()
    workflow["9"]["inputs"]["filename_prefix"] = "renders/../%date%/my cat%"  # its last part, plain
    workflow["10"] = node("PreviewImage", "Preview Image", images=["8", 0])
    saved, shown = plan(workflow).outputs
    assert (saved.kind, saved.filename("p", 1, "jpeg")) == ("output", "mycat_p_00002_.jpg")
    assert (shown.kind, shown.filename("p", 0, "png")) == ("temp", "ComfyUI_temp_p_00001_.png")


def test_lora_loaders_in_a_circle_are_refused() -> None:
    circle = with_lora(txt2img())
    circle["10"]["inputs"]["model"] = ["10", 0]
    assert refused(circle) == [("10", "model", "the LoRA loaders link in a circle")]
