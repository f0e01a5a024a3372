"""AUTOMATIC1111's answers from ours: ``txt2img`` / ``img2img``, ``info``, the lists (pure).

An A1111 generation answers ``{"images": [base64 PNG, ...], "parameters":
{the request's fields}, "info": "<JSON text>"}``; ``info`` is A1111's
``Processed.js()``: the prompt, the seeds, the size, the sampler, and each
image's infotext (the ``parameters`` text of its PNG, as written there).
Each image of a batch (one request of ``batch_size`` images) is made from
its request's one seed (diffusers' ``num_images_per_prompt``: one noise
draw for the batch), so ``all_seeds`` repeats it for every image of the
batch, where A1111 gives each image a seed of its own.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .generation import Generation

__all__ = ["Made", "generation_answer", "info_text", "lora_list", "model_list", "scripts"]

#: What ``info.version`` says: the server, not an A1111 release.
VERSION = "omni_stream"


@dataclass(frozen=True, slots=True)
class Made:
    """One image a call made: its PNG, the seed its request ran with, its size, its infotext
    (an image ``/interrupt`` or ``/skip`` stopped too: its latest preview, ``a1111/unfinished.py``)."""

    png: bytes
    seed: int
    width: int
    height: int
    infotext: str


def info_text(
    gen: Generation,
    made: Sequence[Made],
    *,
    model: str,
    sampler: str,
    schedule: str,
    seed: int,
    timestamp: str,
    steps: int | None,
    cfg_scale: float | None,
    extra_params: Mapping[str, Any] | None = None,
) -> str:
    """The ``info`` JSON text (A1111's ``Processed.js()``) of a call; ``seed``: its first
    request's, ``sampler`` / ``schedule``: A1111's names of what ran; ``extra_params``: more of
    its ``extra_generation_params`` (``Inpaint area``, ..., ``a1111/inpaint_area.py``'s)."""
    count = len(made)
    extra: dict[str, Any] = {"Schedule type": schedule}
    if gen.mask is not None and (gen.mask_blur_x > 0 or gen.mask_blur_y > 0):
        # A1111's ``mask_blur`` property: the blur when both are one, else None.
        extra["Mask blur"] = gen.mask_blur_x if gen.mask_blur_x == gen.mask_blur_y else None
    extra.update(extra_params or {})
    width = made[0].width if made else gen.width
    height = made[0].height if made else gen.height
    info = {
        "prompt": gen.prompt,
        "all_prompts": [gen.prompt] * count,
        "negative_prompt": gen.negative_prompt,
        "all_negative_prompts": [gen.negative_prompt] * count,
        "seed": seed,
        "all_seeds": [m.seed for m in made],
        "subseed": -1,
        "all_subseeds": [-1] * count,
        "subseed_strength": 0,
        "width": width,
        "height": height,
        "sampler_name": sampler,
        "cfg_scale": cfg_scale,
        "steps": steps,
        "batch_size": gen.batch_size,
        "restore_faces": False,
        "face_restoration_model": None,
        "sd_model_name": model,
        "sd_model_hash": None,
        "sd_vae_name": None,
        "sd_vae_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": gen.denoising_strength if gen.kind == "img2img" else None,
        "extra_generation_params": extra,
        "index_of_first_image": 0,
        "infotexts": [m.infotext for m in made],
        "styles": [],
        "job_timestamp": timestamp,
        "clip_skip": 1,
        "is_using_inpainting_conditioning": False,
        "version": VERSION,
    }
    return json.dumps(info, ensure_ascii=False)


def generation_answer(gen: Generation, made: Sequence[Made], info: str) -> dict[str, Any]:
    """``{"images", "parameters", "info"}``; no images when the request said ``send_images: false``."""
    images = [base64.b64encode(m.png).decode("ascii") for m in made] if gen.send_images else []
    return {"images": images, "parameters": gen.echo, "info": info}


def model_list(names: Iterable[str]) -> list[dict[str, Any]]:
    """``GET /sdapi/v1/sd-models``: each served model, its name as ``title`` (what
    ``sd_model_checkpoint`` takes); no file or hash is said (nothing of the disk is shown)."""
    return [
        {"title": name, "model_name": name, "hash": None, "sha256": None, "filename": name, "config": None}
        for name in names
    ]


def lora_list(names: Iterable[str]) -> list[dict[str, Any]]:
    """``GET /sdapi/v1/loras``: the LoRAs a prompt's ``<lora:NAME:WEIGHT>`` may name."""
    return [{"name": name, "alias": name, "path": None, "metadata": {}} for name in names]


def scripts() -> dict[str, list[str]]:
    """``GET /sdapi/v1/scripts``: none (clients ask to learn which extensions to drive)."""
    return {"txt2img": [], "img2img": []}
