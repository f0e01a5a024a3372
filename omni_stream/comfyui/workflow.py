"""A checked workflow mapped onto one of our requests: :func:`plan_workflow` (pure).

A workflow of the accepted nodes (nodes.py) is one sampling: its output
nodes (``SaveImage``, ``PreviewImage``) read a ``VAEDecode`` of one
``KSampler`` or ``KSamplerAdvanced``, whose inputs come from the
checkpoint, its LoRAs, the two prompts and the latent. That is one
``generate``:

==========================================  ===========================================
ComfyUI                                     ours
==========================================  ===========================================
``CheckpointLoaderSimple.ckpt_name``        the served model (its name; a file suffix
                                            such as ``.safetensors`` is dropped)
``CLIPTextEncode.text`` (positive)          ``prompt``
``CLIPTextEncode.text`` (negative)          ``negative_prompt``
``EmptyLatentImage`` width, height,         ``width``, ``height``, ``num_images`` (1:
batch_size                                  left out)
``seed`` / ``noise_seed``                   ``seed`` (modulo 2**63)
``steps``, ``cfg``                          ``steps``, ``guidance_scale``
``sampler_name`` + ``scheduler``            ``sampler`` (samplers.canonical)
``LoadImage`` -> ``VAEEncode``              ``image`` (an upload), image-to-image
``denoise`` (img2img)                       ``strength``; ``steps`` becomes
                                            ``round(steps / denoise)``: ComfyUI runs
                                            ``steps`` steps of a longer schedule,
                                            diffusers runs ``steps * strength``
``start_at_step`` (Advanced, img2img)       ``strength = (steps - start) / steps``
``LoraLoader`` (each, in the chain)         ``loras``: ``{"name", "scale":
                                            strength_model}``
==========================================  ===========================================

Refused, each naming the node and the input: a second sampler (hires fix,
refiner), an output that is not a decode of the sampler, a prompt whose
``clip`` does not come through the sampler's own LoRAs, ``strength_clip``
other than ``strength_model`` (our LoRAs have one scale), ``denoise`` below
1 or ``start_at_step`` without an input image, ``add_noise: disable``,
``end_at_step`` before the last step, ``return_with_leftover_noise``, an
unknown checkpoint, LoRA, sampler, scheduler or upload (naming what there
is), and a value the model has no param for (a negative prompt, a cfg
other than 1, a batch for a model of one image).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any, Final

from ..errors import ParamsError
from ..models.diffusers import samplers
from .errors import NodeError, WorkflowError
from .graph import INVALID, Graph, GraphNode
from .nodes import SCHEDULERS
from .plan import ModelCard, Output, Plan, comfy_samplers

__all__ = ["plan_workflow"]

#: Suffixes a ckpt_name or lora_name may carry: ComfyUI names files, we name models.
_FILE_SUFFIXES: Final = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
#: The largest seed a request takes (a torch generator's 63 bits; params.py's SEED_MAX).
_SEED_MODULUS: Final = 2**63
_SAMPLERS: Final = ("KSampler", "KSamplerAdvanced")


class _Faults:
    """The faults found so far; :meth:`raise_any` raises them as one WorkflowError."""

    def __init__(self) -> None:
        self.found: list[NodeError] = []

    def add(self, node: GraphNode, input_name: str, message: str, type: str = "not_supported") -> None:
        self.found.append(node.error(type, message, input_name))

    def raise_any(self) -> None:
        if self.found:
            raise WorkflowError(INVALID, nodes=self.found)


def plan_workflow(graph: Graph, models: Mapping[str, ModelCard], uploads: Collection[str]) -> Plan:
    """The request ``graph`` makes (see the module docstring) on one of ``models`` (by served
    name), its ``LoadImage`` one of ``uploads``. Raises WorkflowError: ``prompt_no_outputs``,
    or ``prompt_outputs_failed_validation`` naming every node input at fault."""
    faults = _Faults()
    outputs = graph.of_class("SaveImage", "PreviewImage")
    if not outputs:
        raise WorkflowError("Prompt has no outputs", type="prompt_no_outputs")
    decoders: dict[str, GraphNode] = {}
    for out in outputs:
        source, _ = graph.source(out, "images")
        if source.class_type != "VAEDecode":
            faults.add(
                out, "images", f"images must be a VAEDecode of the sampler here, not {source.class_type}"
            )
        else:
            decoders[source.id] = source
    faults.raise_any()
    found: dict[str, GraphNode] = {}
    for decoder in decoders.values():
        source, _ = graph.source(decoder, "samples")
        if source.class_type not in _SAMPLERS:
            faults.add(decoder, "samples", f"samples must come from a KSampler here, not {source.class_type}")
        else:
            found[source.id] = source
    faults.raise_any()
    if len(found) > 1:
        for other in list(found.values())[1:]:
            faults.add(
                other,
                "model",
                f"a workflow runs one sampler here; its outputs read samplers {', '.join(found)} "
                "(a second pass, hires fix or refiner, is not run)",
            )
        faults.raise_any()
    sampler = next(iter(found.values()))
    return _Planner(graph, sampler, models, uploads, faults).plan(outputs, tuple(decoders))


class _Planner:
    """One workflow's mapping, from its one sampler outward."""

    def __init__(
        self,
        graph: Graph,
        sampler: GraphNode,
        models: Mapping[str, ModelCard],
        uploads: Collection[str],
        faults: _Faults,
    ) -> None:
        self.graph = graph
        self.sampler = sampler
        self.models = models
        self.uploads = uploads
        self.faults = faults
        self.params: dict[str, Any] = {}
        self.sources: dict[str, tuple[str, str, str]] = {}
        self.cached: dict[str, None] = {}

    def put(self, name: str, value: Any, node: GraphNode, input_name: str) -> None:
        self.params[name] = value
        self.sources[name] = (node.id, node.class_type, input_name)

    def plan(self, outputs: list[GraphNode], decoders: tuple[str, ...]) -> Plan:
        graph, sampler, faults = self.graph, self.sampler, self.faults
        ckpt, loras = self.chain(sampler, "model")
        card = self.card(ckpt)
        for decoder_id in decoders:
            self.same_checkpoint(graph.nodes[decoder_id], "vae", ckpt)
        for which, ours in (("positive", "prompt"), ("negative", "negative_prompt")):
            encoder, _ = graph.source(sampler, which)
            self.cached[encoder.id] = None
            clip_ckpt, clip_loras = self.chain(encoder, "clip")
            if clip_ckpt.inputs["ckpt_name"] != ckpt.inputs["ckpt_name"] or [n.id for n in clip_loras] != [
                n.id for n in loras
            ]:
                faults.add(
                    encoder,
                    "clip",
                    "the prompt's clip must come from the sampler's own checkpoint through the same "
                    "LoRAs as its model (our LoRAs apply to the model and its text encoder together)",
                )
            self.put(ours, encoder.inputs["text"], encoder, "text")
        self.cached[ckpt.id] = None
        self.loras(loras, card)
        image = self.latent(ckpt)
        faults.raise_any()
        assert card is not None  # a fault above otherwise
        self.sampling(card, img2img=image is not None)
        self.fit(card, img2img=image is not None)
        faults.raise_any()
        self.sources.setdefault("model", (ckpt.id, ckpt.class_type, "ckpt_name"))
        return Plan(
            card.name,
            self.params,
            sampler,
            tuple(_output(node) for node in outputs),
            decoders,
            tuple(self.cached),
            upload=image,
            sources=self.sources,
        )

    # -- the graph around the sampler ------------------------------------------------

    def chain(self, node: GraphNode, input_name: str) -> tuple[GraphNode, list[GraphNode]]:
        """The checkpoint a MODEL or CLIP input comes from, and the LoRA loaders on the way
        (checkpoint side first). Links were type-checked: only those two classes give either."""
        loras: list[GraphNode] = []
        source, _ = self.graph.source(node, input_name)
        while source.class_type == "LoraLoader":
            if any(n.id == source.id for n in loras):
                self.faults.add(source, input_name, "the LoRA loaders link in a circle")
                self.faults.raise_any()
            loras.insert(0, source)
            source, _ = self.graph.source(source, input_name)
        return source, loras

    def card(self, ckpt: GraphNode) -> ModelCard | None:
        name = str(ckpt.inputs["ckpt_name"])
        card = self.models.get(name) or self.models.get(_stem(name))
        if card is None:
            self.faults.add(
                ckpt,
                "ckpt_name",
                f"Value not in list: ckpt_name: {name[:80]!r} not in {list(self.models)} (the served models)",
                "value_not_in_list",
            )
        return card

    def same_checkpoint(self, node: GraphNode, input_name: str, ckpt: GraphNode) -> None:
        source, _ = self.graph.source(node, input_name)
        if source.inputs.get("ckpt_name") != ckpt.inputs["ckpt_name"]:
            self.faults.add(node, input_name, "the VAE must be the sampler's own checkpoint's")

    def loras(self, loaders: list[GraphNode], card: ModelCard | None) -> None:
        chosen = []
        for i, loader in enumerate(loaders):
            self.cached[loader.id] = None
            name = str(loader.inputs["lora_name"])
            known = () if card is None else card.loras
            ours = name if name in known else _stem(name)
            if card is not None and ours not in known:
                there = f"{list(known)}" if known else f"none: model {card.name} has no LoRAs (serve --lora)"
                self.faults.add(
                    loader,
                    "lora_name",
                    f"Value not in list: lora_name: {name[:80]!r} not in {there}",
                    "value_not_in_list",
                )
            model, clip = loader.inputs["strength_model"], loader.inputs["strength_clip"]
            if clip != model:
                self.faults.add(
                    loader,
                    "strength_clip",
                    f"strength_clip {clip:g} differs from strength_model {model:g}: a LoRA here has one "
                    "scale, for the model and its text encoder together",
                )
            chosen.append({"name": ours, "scale": model})
            self.sources[f"loras[{i}]"] = (loader.id, loader.class_type, "lora_name")
            self.sources[f"loras[{i}].name"] = (loader.id, loader.class_type, "lora_name")
            self.sources[f"loras[{i}].scale"] = (loader.id, loader.class_type, "strength_model")
        if chosen:
            self.params["loras"] = chosen
            self.sources["loras"] = (loaders[0].id, loaders[0].class_type, "lora_name")

    def latent(self, ckpt: GraphNode) -> str | None:
        """The sampler's latent: a size (text-to-image), or an upload's name (image-to-image)."""
        sampler, faults = self.sampler, self.faults
        source, _ = self.graph.source(sampler, "latent_image")
        self.cached[source.id] = None
        if source.class_type == "EmptyLatentImage":
            self.put("width", source.inputs["width"], source, "width")
            self.put("height", source.inputs["height"], source, "height")
            if source.inputs["batch_size"] != 1:
                self.put("num_images", source.inputs["batch_size"], source, "batch_size")
            return None
        if source.class_type != "VAEEncode":
            faults.add(
                sampler,
                "latent_image",
                f"the latent must be an EmptyLatentImage or a VAEEncode, not "
                f"{source.class_type} (a second sampling pass is not run here)",
            )
            return None
        self.same_checkpoint(source, "vae", ckpt)
        pixels, _ = self.graph.source(source, "pixels")
        if pixels.class_type != "LoadImage":
            faults.add(source, "pixels", f"pixels must come from a LoadImage here, not {pixels.class_type}")
            return None
        self.cached[pixels.id] = None
        name = str(pixels.inputs["image"])
        # ComfyUI's annotated names ("x.png [input]") name the folder too: uploads are inputs.
        name = name[: -len(" [input]")] if name.endswith(" [input]") else name
        if name not in self.uploads:
            faults.add(
                pixels,
                "image",
                f"Invalid image file: {name[:80]!r}: upload it first (POST /upload/image); yours are "
                f"{sorted(self.uploads)[:20]}",
                "value_not_in_list",
            )
            return None
        self.sources["image"] = (pixels.id, pixels.class_type, "image")
        return name

    # -- the sampler's own inputs -------------------------------------------------------

    def sampling(self, card: ModelCard, *, img2img: bool) -> None:
        sampler, faults, inputs = self.sampler, self.faults, self.sampler.inputs
        advanced = sampler.class_type == "KSamplerAdvanced"
        seed_input = "noise_seed" if advanced else "seed"
        self.put("seed", int(inputs[seed_input]) % _SEED_MODULUS, sampler, seed_input)
        steps = int(inputs["steps"])
        self.put("steps", steps, sampler, "steps")
        self.sampler_name(card)
        if advanced:
            start, end = int(inputs["start_at_step"]), int(inputs["end_at_step"])
            if inputs["add_noise"] != "enable":
                faults.add(
                    sampler,
                    "add_noise",
                    "add_noise disable has no equivalent here: a request draws its noise from its seed",
                )
            if inputs["return_with_leftover_noise"] != "disable":
                faults.add(
                    sampler,
                    "return_with_leftover_noise",
                    "a request runs to its end here and returns the finished image",
                )
            if end < steps:
                faults.add(
                    sampler,
                    "end_at_step",
                    f"end_at_step {end} stops before the last of {steps} "
                    f"steps: a request runs to its end here; set it to {steps} or more",
                )
            if start >= steps:
                faults.add(sampler, "start_at_step", f"start_at_step {start} leaves none of {steps} steps")
            elif start > 0 and not img2img:
                faults.add(
                    sampler,
                    "start_at_step",
                    "start_at_step above 0 needs an input image (LoadImage -> VAEEncode -> latent_image)",
                )
            elif img2img:
                self.put("strength", (steps - start) / steps, sampler, "start_at_step")
            return
        denoise = float(inputs["denoise"])
        if not img2img:
            if denoise != 1.0:
                faults.add(
                    sampler,
                    "denoise",
                    f"denoise {denoise:g} below 1 needs an input image "
                    "(LoadImage -> VAEEncode -> latent_image)",
                )
            return
        if denoise <= 0.0:
            faults.add(sampler, "denoise", "denoise 0 leaves nothing to run")
            return
        # ComfyUI runs `steps` steps of a schedule of steps / denoise; diffusers runs
        # steps * strength of its `steps`: the same schedule needs steps / denoise here.
        self.put("steps", max(steps, round(steps / denoise)), sampler, "steps")
        self.put("strength", denoise, sampler, "denoise")

    def sampler_name(self, card: ModelCard) -> None:
        sampler, inputs = self.sampler, self.sampler.inputs
        name, schedule = str(inputs["sampler_name"]), str(inputs["scheduler"])
        if schedule not in SCHEDULERS:
            self.faults.add(
                sampler,
                "scheduler",
                f"Value not in list: scheduler: {schedule[:40]!r} not in {list(SCHEDULERS)}",
                "value_not_in_list",
            )
            return
        try:
            ours = samplers.canonical(name, schedule)
        except ParamsError as exc:  # karras for a sampler without a Karras twin
            self.faults.add(sampler, "scheduler", exc.message, "value_not_in_list")
            return
        offered = card.samplers
        if not offered:
            self.faults.add(sampler, "sampler_name", f"model {card.name} does not choose its sampler")
        elif ours not in offered:
            self.faults.add(
                sampler,
                "sampler_name",
                f"Value not in list: sampler_name: {name[:40]!r} with scheduler {schedule[:40]!r} not "
                f"among model {card.name}'s: {list(comfy_samplers(offered))}",
                "value_not_in_list",
            )
        else:
            self.put("sampler", ours, sampler, "sampler_name")

    def fit(self, card: ModelCard, *, img2img: bool) -> None:
        """Each param to the model's own: one it has no param for must be the value that means
        nothing (an empty negative prompt, cfg 1), else it is refused naming its input."""
        declared, params = card.params, self.params
        cfg = float(self.sampler.inputs["cfg"])
        if "guidance_scale" in declared:
            self.put("guidance_scale", cfg, self.sampler, "cfg")
        elif cfg != 1.0:
            self.faults.add(self.sampler, "cfg", f"model {card.name} takes no guidance scale: set cfg to 1")
        if img2img and not {"image", "strength"} <= set(declared):
            node_id, class_type, _ = self.sources["image"]
            self.faults.found.append(
                NodeError(
                    node_id,
                    class_type,
                    "not_supported",
                    f"model {card.name} takes no input image: image-to-image needs a model whose pipeline "
                    "takes image and strength (an img2img pipeline)",
                    "image",
                )
            )
        # (strength is the image's: refused with it above.)
        for name in [
            n for n in params if n not in declared and n not in ("loras", "seed", "prompt", "strength")
        ]:
            value = params[name]
            if (name, value) == ("negative_prompt", ""):
                del params[name]
                continue
            node_id, class_type, input_name = self.sources[name]
            self.faults.found.append(
                NodeError(
                    node_id,
                    class_type,
                    "not_supported",
                    f"model {card.name} has no {name} param for {input_name}={value!r:.40}",
                    input_name,
                )
            )


def _output(node: GraphNode) -> Output:
    if node.class_type == "PreviewImage":
        return Output(node.id, node.class_type, "temp", "ComfyUI_temp")
    return Output(node.id, node.class_type, "output", _prefix(str(node.inputs["filename_prefix"])))


def _prefix(text: str) -> str:
    """A SaveImage ``filename_prefix`` as a file name's start: its last path part, plain
    characters only (ComfyUI's subfolders and %date% tokens are not kept: names are virtual)."""
    last = text.replace("\\", "/").rsplit("/", 1)[-1]
    plain = re.sub(r"[^A-Za-z0-9._-]", "", last).lstrip(".")[:64]
    return plain or "ComfyUI"


def _stem(name: str) -> str:
    lower = name.lower()
    for suffix in _FILE_SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name
