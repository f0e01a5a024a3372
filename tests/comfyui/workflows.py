"""ComfyUI workflows in API format, as ComfyUI's "Export (API)" writes them (test data)."""

from __future__ import annotations

import copy
from typing import Any


def node(class_type: str, title: str, **inputs: Any) -> dict[str, Any]:
    return {"inputs": inputs, "class_type": class_type, "_meta": {"title": title}}


def txt2img(
    *,
    ckpt: str = "sd",
    prompt: str = "a cat",
    negative: str = "blur",
    seed: int = 5,
    steps: int = 3,
    cfg: float = 7.0,
    sampler: str = "euler",
    scheduler: str = "normal",
    width: int = 16,
    height: int = 16,
    batch: int = 1,
) -> dict[str, Any]:
    """ComfyUI's default workflow (its node ids too), at a tiny size."""
    return {
        "3": node(
            "KSampler",
            "KSampler",
            seed=seed,
            steps=steps,
            cfg=cfg,
            sampler_name=sampler,
            scheduler=scheduler,
            denoise=1.0,
            model=["4", 0],
            positive=["6", 0],
            negative=["7", 0],
            latent_image=["5", 0],
        ),
        "4": node("CheckpointLoaderSimple", "Load Checkpoint", ckpt_name=ckpt),
        "5": node("EmptyLatentImage", "Empty Latent Image", width=width, height=height, batch_size=batch),
        "6": node("CLIPTextEncode", "CLIP Text Encode (Prompt)", text=prompt, clip=["4", 1]),
        "7": node("CLIPTextEncode", "CLIP Text Encode (Negative)", text=negative, clip=["4", 1]),
        "8": node("VAEDecode", "VAE Decode", samples=["3", 0], vae=["4", 2]),
        "9": node("SaveImage", "Save Image", filename_prefix="ComfyUI", images=["8", 0]),
    }


def with_lora(
    workflow: dict[str, Any], name: str = "ink", strength: float = 0.5, clip_strength: float | None = None
) -> dict[str, Any]:
    """``workflow`` with a LoraLoader between the checkpoint and the sampler and prompts."""
    out = copy.deepcopy(workflow)
    out["10"] = node(
        "LoraLoader",
        "Load LoRA",
        lora_name=name,
        strength_model=strength,
        strength_clip=strength if clip_strength is None else clip_strength,
        model=["4", 0],
        clip=["4", 1],
    )
    out["3"]["inputs"]["model"] = ["10", 0]
    out["6"]["inputs"]["clip"] = ["10", 1]
    out["7"]["inputs"]["clip"] = ["10", 1]
    return out


def img2img(
    image: str, *, ckpt: str = "img", denoise: float = 0.5, steps: int = 2, **options: Any
) -> dict[str, Any]:
    """``txt2img`` with its latent a VAEEncode of an uploaded image."""
    out = txt2img(ckpt=ckpt, steps=steps, **options)
    del out["5"]
    out["10"] = node("LoadImage", "Load Image", image=image, upload="image")
    out["11"] = node("VAEEncode", "VAE Encode", pixels=["10", 0], vae=["4", 2])
    out["3"]["inputs"]["latent_image"] = ["11", 0]
    out["3"]["inputs"]["denoise"] = denoise
    return out


def advanced(workflow: dict[str, Any], **inputs: Any) -> dict[str, Any]:
    """``workflow`` with its KSampler a KSamplerAdvanced (``inputs`` over ComfyUI's defaults)."""
    out = copy.deepcopy(workflow)
    plain = out["3"]["inputs"]
    values = {
        "add_noise": "enable",
        "noise_seed": plain["seed"],
        "start_at_step": 0,
        "end_at_step": 10000,
        "return_with_leftover_noise": "disable",
        **inputs,
    }
    kept = {k: v for k, v in plain.items() if k not in ("seed", "denoise")}
    out["3"] = node("KSamplerAdvanced", "KSampler (Advanced)", **kept, **values)
    return out
