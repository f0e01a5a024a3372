"""nodes.py: /object_info is exactly the nodes we run, in ComfyUI's shape, with our lists."""

from __future__ import annotations

from omni_stream.comfyui import ACCEPTED, NODES, Choices, object_info


def test_object_info_is_comfyuis_shape_for_exactly_our_nodes() -> None:
    choices = Choices(checkpoints=("sd",), samplers=("euler",), loras=("ink",), uploads=("in.png",))
    info = object_info(choices)
    assert tuple(info) == ACCEPTED == tuple(NODES)
    sampler = info["KSampler"]
    assert sampler["input"]["required"]["sampler_name"] == [["euler"]]
    assert sampler["input"]["required"]["scheduler"] == [["normal", "karras", "simple", "sgm_uniform"]]
    assert sampler["input"]["required"]["model"] == ["MODEL"]
    assert sampler["input"]["required"]["seed"][1]["max"] == 2**64 - 1
    assert sampler["input_order"]["required"][:3] == ["model", "seed", "steps"]
    assert (sampler["output"], sampler["output_name"], sampler["output_is_list"]) == (
        ["LATENT"],
        ["LATENT"],
        [False],
    )
    assert info["CheckpointLoaderSimple"]["output"] == ["MODEL", "CLIP", "VAE"]
    assert info["LoadImage"]["input"]["required"]["image"] == [["in.png"], {"image_upload": True}]
    assert info["LoraLoader"]["input"]["required"]["lora_name"] == [["ink"]]
    assert info["SaveImage"]["output_node"] and "hidden" in info["SaveImage"]["input"]
    assert object_info(choices, ["KSampler", "Nope"]).keys() == {"KSampler"}
