"""The ComfyUI nodes this server runs, as ComfyUI declares them (pure).

Exactly these classes are accepted in a workflow, and exactly these are
what ``/object_info`` lists: a client that builds its workflows from
``/object_info`` (SillyTavern, Open WebUI, a bot) offers nothing we would
refuse. Their inputs, types and defaults are ComfyUI's own (``nodes.py``
of ComfyUI), so a workflow exported from ComfyUI in API format reads
unchanged; the lists a client picks from (checkpoints, samplers,
schedulers, LoRAs, uploaded images) are this server's (:class:`Choices`).

The ranges are ComfyUI's too: a served model's own bounds (its largest
``steps``, its sizes) are checked when a prompt is posted, and a refusal
names the node input it came from (docs/comfyui.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "ACCEPTED",
    "LINK_TYPES",
    "NODES",
    "SCHEDULERS",
    "Choices",
    "Input",
    "Node",
    "object_info",
]

#: The types that travel along links (everything else is a widget value).
LINK_TYPES: Final = frozenset({"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK"})
#: ComfyUI's ``scheduler`` names we run (models/diffusers/samplers.py's SCHEDULES that ComfyUI
#: has): ``karras`` is a sampler's Karras twin, the others its own noise levels. ComfyUI's
#: exponential, beta, ddim_uniform, linear_quadratic and kl_optimal have no diffusers twin here.
SCHEDULERS: Final = ("normal", "karras", "simple", "sgm_uniform")
#: The largest seed ComfyUI's widgets take (a 64-bit unsigned int).
SEED_MAX: Final = 0xFFFFFFFFFFFFFFFF
_STEPS_MAX: Final = 10000


@dataclass(frozen=True, slots=True)
class Input:
    """One input of a node: a link of ``type`` (``MODEL``, ``LATENT``, ...) or a widget value
    (``INT``, ``FLOAT``, ``STRING``, ``BOOLEAN``, or ``COMBO``: one of ``choices``, a fixed
    tuple or the name of a :class:`Choices` list)."""

    name: str
    type: str
    options: Mapping[str, Any] = field(default_factory=dict)
    choices: tuple[str, ...] | str | None = None

    @property
    def linked(self) -> bool:
        return self.type in LINK_TYPES


@dataclass(frozen=True, slots=True)
class Node:
    """One node class: its inputs, its outputs (``(type, name)``), whether it is an output node."""

    name: str
    display_name: str
    category: str
    description: str
    required: tuple[Input, ...]
    outputs: tuple[tuple[str, str], ...] = ()
    output_node: bool = False

    def input(self, name: str) -> Input | None:
        return next((i for i in self.required if i.name == name), None)


@dataclass(frozen=True, slots=True)
class Choices:
    """The lists a client picks from, as this server has them (``/object_info``'s combos)."""

    checkpoints: tuple[str, ...] = ()
    samplers: tuple[str, ...] = ()
    schedulers: tuple[str, ...] = SCHEDULERS
    loras: tuple[str, ...] = ()
    uploads: tuple[str, ...] = ()

    def of(self, name: str) -> tuple[str, ...]:
        found: tuple[str, ...] = getattr(self, name)
        return found


def _int(default: int, low: int, high: int, **extra: Any) -> dict[str, Any]:
    return {"default": default, "min": low, "max": high, **extra}


def _float(default: float, low: float, high: float, step: float, **extra: Any) -> dict[str, Any]:
    return {"default": default, "min": low, "max": high, "step": step, **extra}


_SEED = _int(0, 0, SEED_MAX, control_after_generate=True)
_STEPS = _int(20, 1, _STEPS_MAX)
_CFG = _float(8.0, 0.0, 100.0, 0.1, round=0.01)
_STRENGTH = _float(1.0, -100.0, 100.0, 0.01)
_SIZE = _int(512, 16, 16384, step=8)
_SAMPLING = (
    Input("sampler_name", "COMBO", choices="samplers"),
    Input("scheduler", "COMBO", choices="schedulers"),
    Input("positive", "CONDITIONING"),
    Input("negative", "CONDITIONING"),
    Input("latent_image", "LATENT"),
)

NODES: Final[Mapping[str, Node]] = {
    node.name: node
    for node in (
        Node(
            "CheckpointLoaderSimple",
            "Load Checkpoint",
            "loaders",
            "A served model: its denoiser, text encoder and VAE.",
            (Input("ckpt_name", "COMBO", choices="checkpoints"),),
            (("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")),
        ),
        Node(
            "LoraLoader",
            "Load LoRA",
            "loaders",
            "One of the server's LoRAs, at one scale for the model and its text encoder.",
            (
                Input("model", "MODEL"),
                Input("clip", "CLIP"),
                Input("lora_name", "COMBO", choices="loras"),
                Input("strength_model", "FLOAT", _STRENGTH),
                Input("strength_clip", "FLOAT", _STRENGTH),
            ),
            (("MODEL", "MODEL"), ("CLIP", "CLIP")),
        ),
        Node(
            "CLIPTextEncode",
            "CLIP Text Encode (Prompt)",
            "conditioning",
            "A prompt, encoded by the model's text encoder.",
            (
                Input("text", "STRING", {"multiline": True, "dynamicPrompts": True}),
                Input("clip", "CLIP"),
            ),
            (("CONDITIONING", "CONDITIONING"),),
        ),
        Node(
            "EmptyLatentImage",
            "Empty Latent Image",
            "latent",
            "The size and the number of images of a text-to-image request.",
            (
                Input("width", "INT", _SIZE),
                Input("height", "INT", _SIZE),
                Input("batch_size", "INT", _int(1, 1, 4096)),
            ),
            (("LATENT", "LATENT"),),
        ),
        Node(
            "KSampler",
            "KSampler",
            "sampling",
            "The denoising loop, streamed step by step.",
            (
                Input("model", "MODEL"),
                Input("seed", "INT", _SEED),
                Input("steps", "INT", _STEPS),
                Input("cfg", "FLOAT", _CFG),
                *_SAMPLING,
                Input("denoise", "FLOAT", _float(1.0, 0.0, 1.0, 0.01)),
            ),
            (("LATENT", "LATENT"),),
        ),
        Node(
            "KSamplerAdvanced",
            "KSampler (Advanced)",
            "sampling",
            "The denoising loop from start_at_step to the end.",
            (
                Input("model", "MODEL"),
                Input("add_noise", "COMBO", choices=("enable", "disable")),
                Input("noise_seed", "INT", _SEED),
                Input("steps", "INT", _STEPS),
                Input("cfg", "FLOAT", _CFG),
                *_SAMPLING,
                Input("start_at_step", "INT", _int(0, 0, _STEPS_MAX)),
                Input("end_at_step", "INT", _int(_STEPS_MAX, 0, _STEPS_MAX)),
                Input("return_with_leftover_noise", "COMBO", choices=("disable", "enable")),
            ),
            (("LATENT", "LATENT"),),
        ),
        Node(
            "VAEDecode",
            "VAE Decode",
            "latent",
            "The request's result, decoded by the model's VAE.",
            (Input("samples", "LATENT"), Input("vae", "VAE")),
            (("IMAGE", "IMAGE"),),
        ),
        Node(
            "VAEEncode",
            "VAE Encode",
            "latent",
            "An input image for image-to-image (its strength is the sampler's denoise).",
            (Input("pixels", "IMAGE"), Input("vae", "VAE")),
            (("LATENT", "LATENT"),),
        ),
        Node(
            "LoadImage",
            "Load Image",
            "image",
            "An image uploaded with POST /upload/image.",
            (Input("image", "COMBO", {"image_upload": True}, choices="uploads"),),
            (("IMAGE", "IMAGE"), ("MASK", "MASK")),
        ),
        Node(
            "SaveImage",
            "Save Image",
            "image",
            "The result, kept for /history and /view (type output).",
            (Input("images", "IMAGE"), Input("filename_prefix", "STRING", {"default": "ComfyUI"})),
            output_node=True,
        ),
        Node(
            "PreviewImage",
            "Preview Image",
            "image",
            "The result, kept for /history and /view (type temp).",
            (Input("images", "IMAGE"),),
            output_node=True,
        ),
    )
}

#: The accepted class names, as a refusal lists them.
ACCEPTED: Final = tuple(NODES)


def object_info(choices: Choices, only: Sequence[str] | None = None) -> dict[str, Any]:
    """``/object_info``: each accepted node (or those of ``only`` that are) in ComfyUI's shape."""
    names = ACCEPTED if only is None else [n for n in only if n in NODES]
    return {name: _info(NODES[name], choices) for name in names}


def _info(node: Node, choices: Choices) -> dict[str, Any]:
    required: dict[str, list[Any]] = {}
    for spec in node.required:
        if spec.type == "COMBO":
            listed = spec.choices if isinstance(spec.choices, tuple) else choices.of(spec.choices or "")
            required[spec.name] = [list(listed), dict(spec.options)] if spec.options else [list(listed)]
        else:
            required[spec.name] = [spec.type, dict(spec.options)] if spec.options else [spec.type]
    info: dict[str, Any] = {
        "input": {"required": required},
        "input_order": {"required": list(required)},
        "output": [kind for kind, _ in node.outputs],
        "output_is_list": [False] * len(node.outputs),
        "output_name": [name for _, name in node.outputs],
        "name": node.name,
        "display_name": node.display_name,
        "description": node.description,
        "python_module": "nodes",
        "category": node.category,
        "output_node": node.output_node,
    }
    if node.name == "SaveImage":
        info["input"]["hidden"] = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}
    return info
