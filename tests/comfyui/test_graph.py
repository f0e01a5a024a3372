"""graph.py: a workflow read and checked node by node, every fault in ComfyUI's words at once."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omni_stream.comfyui import ACCEPTED, WorkflowError, read_workflow
from omni_stream.comfyui.graph import MAX_NODES, Link
from omni_stream.errors import ParamsError

from .workflows import node, txt2img


def refused(workflow: Any) -> WorkflowError:
    with pytest.raises(WorkflowError) as info:
        read_workflow(workflow)
    return info.value


def faults(error: WorkflowError) -> list[tuple[str, str, str | None]]:
    return [(n.node_id, n.type, n.input_name) for n in error.nodes]


def test_a_workflow_reads_as_nodes_with_links_and_values() -> None:
    graph = read_workflow(txt2img())
    sampler = graph.nodes["3"]
    assert sampler.class_type == "KSampler" and sampler.title == "KSampler"
    assert sampler.inputs["steps"] == 3 and sampler.link("model") == Link("4", 0)
    source, output = graph.source(sampler, "positive")
    assert (source.id, output) == ("6", 0)
    assert [n.id for n in graph.of_class("CLIPTextEncode")] == ["6", "7"]


def test_a_class_we_do_not_run_is_refused_by_name_with_the_classes_we_run() -> None:
    workflow = txt2img()
    workflow["12"] = node("UpscaleModelLoader", "Load Upscale Model", model_name="x.pth")
    workflow["13"] = node("ImageScaleBy", "Upscale", image=["8", 0], scale_by=2.0)
    error = refused(workflow)
    assert error.type == "invalid_prompt" and isinstance(error, ParamsError)
    assert "UpscaleModelLoader, ImageScaleBy" in error.message
    assert all(name in error.message for name in ACCEPTED)
    body = error.body()
    assert body["node_errors"]["12"]["class_type"] == "UpscaleModelLoader"
    assert body["node_errors"]["13"]["errors"][0]["type"] == "node_not_accepted"


@pytest.mark.parametrize(
    ("workflow", "words"),
    [
        (None, "got null"),
        ([], "got list"),
        ({}, "no nodes"),
        ({"nodes": [], "links": []}, "UI format"),
        ({"3": "KSampler"}, "must be an object with a class_type"),
        ({str(i): node("PreviewImage", "P") for i in range(MAX_NODES + 1)}, f"at most {MAX_NODES}"),
    ],
)
def test_what_is_not_a_workflow_is_refused_saying_what_it_is(workflow: Any, words: str) -> None:
    error = refused(workflow)
    assert error.type == "invalid_prompt" and words in error.message


def test_every_fault_of_every_node_is_named_at_once() -> None:
    workflow = txt2img()
    del workflow["6"]["inputs"]["text"]  # missing
    workflow["3"]["inputs"]["model"] = ["4", 1]  # a CLIP where a MODEL goes
    workflow["3"]["inputs"]["positive"] = ["99", 0]  # no such node
    workflow["3"]["inputs"]["negative"] = ["7", 3]  # no such output
    workflow["3"]["inputs"]["steps"] = "20"  # a string
    workflow["3"]["inputs"]["cfg"] = 1000.0  # over its max
    workflow["5"]["inputs"]["width"] = 0  # under its min
    workflow["5"]["inputs"]["height"] = 16.5  # not an integer
    workflow["8"]["inputs"]["samples"] = "3"  # a value where a link goes
    workflow["9"]["inputs"]["filename_prefix"] = ["4", 0]  # a link where a value goes
    error = refused(workflow)
    assert error.type == "prompt_outputs_failed_validation"
    assert sorted(faults(error)) == sorted(
        [
            ("6", "required_input_missing", "text"),
            ("3", "return_type_mismatch", "model"),
            ("3", "bad_linked_input", "positive"),
            ("3", "bad_linked_input", "negative"),
            ("3", "invalid_input_type", "steps"),
            ("3", "value_bigger_than_max", "cfg"),
            ("5", "value_smaller_than_min", "width"),
            ("5", "invalid_input_type", "height"),
            ("8", "invalid_input_type", "samples"),
            ("9", "invalid_input_type", "filename_prefix"),
        ]
    )
    mismatch = next(n for n in error.nodes if n.type == "return_type_mismatch")
    assert "received_type(CLIP) mismatch input_type(MODEL)" in mismatch.message
    body = error.body(["9"])
    assert body["node_errors"]["3"]["dependent_outputs"] == ["9"]
    assert body["node_errors"]["5"]["errors"][0]["extra_info"] == {"input_name": "width"}
    assert error.field == "3.model"  # the first node input at fault


def test_fixed_choices_are_checked_and_integral_floats_and_int_ids_are_taken() -> None:
    workflow = txt2img()
    workflow["3"]["inputs"]["steps"] = 3.0
    workflow["3"]["inputs"]["model"] = [4, 0]
    graph = read_workflow(workflow)
    assert graph.nodes["3"].inputs["steps"] == 3 and graph.nodes["3"].link("model") == Link("4", 0)
    advanced = copy.deepcopy(workflow)
    advanced["3"] = node(
        "KSamplerAdvanced",
        "A",
        add_noise="maybe",
        noise_seed=1,
        steps=3,
        cfg=7.0,
        sampler_name="euler",
        scheduler="normal",
        start_at_step=0,
        end_at_step=3,
        return_with_leftover_noise="disable",
        model=["4", 0],
        positive=["6", 0],
        negative=["7", 0],
        latent_image=["5", 0],
    )
    error = refused(advanced)
    assert faults(error) == [("3", "value_not_in_list", "add_noise")]
    assert "['enable', 'disable']" in error.nodes[0].message


def test_a_workflow_error_survives_a_pickle() -> None:
    import pickle

    error = refused({"1": node("Nope", "n")})
    again = pickle.loads(pickle.dumps(error))
    assert (again.message, again.type, again.nodes, again.status) == (
        error.message,
        error.type,
        error.nodes,
        400,
    )
