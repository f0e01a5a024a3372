"""Single-file checkpoints: the ``.safetensors`` files of AUTOMATIC1111 and ComfyUI folders.

Such a file holds a pipeline's weights in the original (LDM) layout and
nothing else: not the shapes of its parts, not its scheduler, not its
tokenizer's vocabulary. diffusers' ``from_single_file`` converts the weights
and takes the rest from a diffusers folder of the same architecture, its
*config*. How one loads here:

1. :func:`detect` reads the file's header only (names and shapes, no
   weights) and asks diffusers' own ``infer_diffusers_model_type`` which
   architecture it is (an SDXL UNet without its text encoders, which
   diffusers takes for SD 1.x, is told by its added embedding);
   :data:`ARCHITECTURES` are the ones the adapters stream (SD 1.x/2.x,
   SDXL, SD3/3.5, Flux.1). Anything else (an inpainting or refiner
   checkpoint, a LoRA or a VAE given as a model) is refused, naming the
   file and what diffusers took it for.
2. The config: the folder the caller names (``config=DIR``, or by
   architecture, ``config={"v1": DIR}``), read with ``local_files_only``:
   no network. Without one, offline (``HF_HUB_OFFLINE=1``), diffusers'
   default repo for that architecture must be in the hub cache, else the
   error says which option to give and where such a folder comes from;
   online, diffusers fetches that repo's config files (kilobytes, no weights).
3. A part the file lacks (a Flux file with the transformer only, an SD3
   file without T5, an SDXL file without its text encoders) is loaded from
   the config folder, which must then hold its weights; diffusers alone
   would refuse it.

``.ckpt`` (and ``.pt``, ``.pth``, ``.bin``) files are Python pickles:
loading one runs whatever code it holds. They are refused, with how to
convert them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

__all__ = [
    "ARCHITECTURES",
    "PICKLE_SUFFIXES",
    "SINGLE_FILE_SUFFIX",
    "Architecture",
    "ConfigSource",
    "SingleFile",
    "detect",
    "is_single_file",
    "load_pipeline",
    "pickle_refusal",
]

#: The suffix of the checkpoints loaded (safetensors: tensors and a JSON header, no code).
SINGLE_FILE_SUFFIX: Final = ".safetensors"
#: Checkpoint suffixes that are Python pickles, refused.
PICKLE_SUFFIXES: Final = (".ckpt", ".pt", ".pth", ".bin")

#: The config a single file is loaded with: a diffusers folder, or such folders by
#: architecture (diffusers' model type; the key ``""`` for any other).
ConfigSource = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]

# The LDM UNet's first convolution: diffusers calls any file it does not recognise "v1",
# so a "v1" without it is no UNet checkpoint at all.
_LDM_UNET_KEY: Final = "model.diffusion_model.input_blocks.0.0.weight"
# SDXL's added (pooled text and image size) embedding, which no SD 1.x UNet has. diffusers
# tells SDXL by its OpenCLIP-G weights alone, so an SDXL file without its text encoders
# (they come from the config folder then) would otherwise be read as "v1".
_LDM_ADDED_EMBEDDING_KEY: Final = "model.diffusion_model.label_emb.0.0.weight"
# Its inputs: the refiner's 2560 (G's 1280 and five 256-wide size and score embeddings);
# the base's 2816 has six.
_XL_REFINER_ADDED_INPUTS: Final = 2560


@dataclass(frozen=True, slots=True)
class Architecture:
    """What a diffusers model type loads as."""

    #: The diffusers pipeline class whose ``from_single_file`` builds it.
    pipeline: str
    #: What an operator calls it.
    label: str


#: diffusers' model types (``infer_diffusers_model_type``) the adapters stream.
ARCHITECTURES: Final[Mapping[str, Architecture]] = {
    "v1": Architecture("StableDiffusionPipeline", "SD 1.x"),
    "v2": Architecture("StableDiffusionPipeline", "SD 2.x"),
    "xl_base": Architecture("StableDiffusionXLPipeline", "SDXL"),
    "sd3": Architecture("StableDiffusion3Pipeline", "SD3 medium"),
    "sd35_medium": Architecture("StableDiffusion3Pipeline", "SD3.5 medium"),
    "sd35_large": Architecture("StableDiffusion3Pipeline", "SD3.5 large"),
    "flux-dev": Architecture("FluxPipeline", "Flux.1 dev"),
    "flux-schnell": Architecture("FluxPipeline", "Flux.1 schnell"),
}


@dataclass(frozen=True, slots=True)
class SingleFile:
    """A checkpoint file and the architecture its header says it is."""

    path: Path
    #: diffusers' model type: a key of :data:`ARCHITECTURES`.
    model_type: str

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.model_type]

    def describe(self) -> str:
        return f"{self.path.name} ({self.architecture.label}, diffusers' model type {self.model_type!r})"


def is_single_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a checkpoint file by its suffix (``.safetensors``, or a pickle's)."""
    suffix = Path(path).suffix.lower()
    return suffix == SINGLE_FILE_SUFFIX or suffix in PICKLE_SUFFIXES


def pickle_refusal(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not loaded when it is a pickled checkpoint (``.ckpt`` ...), else None."""
    if Path(path).suffix.lower() not in PICKLE_SUFFIXES:
        return None
    return (
        f"{str(path)!r} is a Python pickle, and loading one runs whatever code it holds; "
        "omni_stream loads .safetensors checkpoints only. Convert it once where you trust it "
        "(torch.load, then safetensors.torch.save_file of its state_dict), or download the "
        ".safetensors release of that model"
    )


class _Header(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors by name, each an empty tensor on the meta device with the
    stored shape: what diffusers' architecture detection reads (names and shapes), for the
    cost of the header alone."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            self._shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118 - a safe_open handle, not a dict

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.empty(self._shapes[key], device="meta")

    def __contains__(self, key: object) -> bool:
        return key in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _header(path: Path) -> _Header:
    refusal = pickle_refusal(path)
    if refusal is not None:
        raise ValueError(refusal)
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file")
    try:
        return _Header(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a bad file
        raise ValueError(f"{str(path)!r} is not a readable .safetensors file: {exc}") from exc


def detect(path: str | os.PathLike[str]) -> SingleFile:
    """The architecture of the checkpoint at ``path``, from its header alone (diffusers' own
    detection). Raises ValueError naming the file: not a ``.safetensors`` file, a pickle, or an
    architecture the adapters do not stream; ImportError without diffusers."""
    try:
        from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    except ImportError as exc:
        from .base import INSTALL_HINT

        raise ImportError(INSTALL_HINT) from exc
    file = Path(path)
    header = _header(file)
    try:
        model_type = str(infer_diffusers_model_type(header))
    except Exception:  # noqa: BLE001 - a rule of diffusers' that reads values, not shapes
        model_type = "unknown"
    if model_type == "v1" and _LDM_UNET_KEY not in header:
        # diffusers' answer when nothing else matched: no UNet, no model.
        raise ValueError(
            f"{str(file)!r} holds no denoiser diffusers knows (no SD UNet, SDXL, SD3 or Flux "
            "weights): is it a LoRA (--lora), a VAE or an embedding? A model checkpoint is needed"
        )
    if model_type == "v1" and _LDM_ADDED_EMBEDDING_KEY in header:
        refiner = header[_LDM_ADDED_EMBEDDING_KEY].shape[-1] == _XL_REFINER_ADDED_INPUTS
        model_type = "xl_refiner" if refiner else "xl_base"
    if model_type not in ARCHITECTURES:
        known = ", ".join(f"{t} ({a.label})" for t, a in ARCHITECTURES.items())
        raise ValueError(
            f"{str(file)!r} is a checkpoint of an architecture omni_stream does not stream: diffusers "
            f"reads it as {model_type!r}; single files of these load: {known}"
        )
    return SingleFile(file, model_type)


def _default_repo(info: SingleFile) -> str:
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    return str(DIFFUSERS_DEFAULT_PIPELINE_PATHS[info.model_type]["pretrained_model_name_or_path"])


def _how_to_get_config(info: SingleFile, repo: str) -> str:
    return (
        f"give the folder of a diffusers pipeline of that architecture as its config: "
        f"config=DIR (command line: --model-config {info.model_type}=DIR for every such file, "
        f"or {info.path.name}?config=DIR for this one). Such a folder is what "
        f"`hf download {repo} --include '*.json' --include '*.txt' --include '*.model'` writes "
        "on a machine online (its configs and tokenizer files, no weights; then offline, the "
        "hub cache is found without an option), "
        "or any pipeline of that architecture saved with save_pretrained"
    )


def _chosen_config(info: SingleFile, config: ConfigSource | None) -> str | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        chosen = config.get(info.model_type) or config.get("")
        return None if chosen is None else str(chosen)
    return str(config)


def _folder_index(folder: str, info: SingleFile) -> dict[str, Any]:
    """The config folder's ``model_index.json``; ValueError when it is not one for ``info``."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"config folder {folder!r} for {info.describe()} has no model_index.json: it must be "
            "a diffusers pipeline's folder (save_pretrained writes one)"
        )
    try:
        loaded = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"config folder {folder!r}: model_index.json cannot be read: {exc}") from exc
    data: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
    kind = data.get("_class_name")
    want = info.architecture.pipeline
    if kind != want:
        raise ValueError(
            f"config folder {folder!r} is a {kind}'s; {info.describe()} loads as a {want}: give "
            f"a folder of that architecture (--model-config {info.model_type}=DIR)"
        )
    return data


def _missing_parts(
    info: SingleFile, header: Mapping[str, torch.Tensor], folder: str, index: Mapping[str, Any], dtype: Any
) -> dict[str, Any]:
    """The text encoders and VAE the file lacks, loaded from the config folder (diffusers would
    refuse them: its own fallback does not find a transformers model's weights there)."""
    import importlib

    from diffusers.loaders.single_file_utils import (
        LDM_VAE_KEYS,
        is_clip_model_in_single_file,
        is_t5_in_single_file,
    )

    parts: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        library, class_name = entry
        if class_name in ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel"):
            cls = getattr(importlib.import_module(library), class_name)
            inside = (
                is_t5_in_single_file(header)
                if class_name == "T5EncoderModel"
                else bool(is_clip_model_in_single_file(cls, header))
            )
        elif name == "vae":
            cls = getattr(importlib.import_module(library), class_name)
            inside = any(key.startswith(tuple(LDM_VAE_KEYS)) for key in header)
        else:
            continue
        if inside:
            continue
        sub = Path(folder) / name
        if not any(sub.glob("*.safetensors")) and not any(sub.glob("*.bin")):
            raise ValueError(
                f"{info.describe()} holds no {name} ({class_name}); it is taken from the config "
                f"folder then, but {str(sub)!r} has no weights: give a config folder that holds "
                f"them (a full download of {_default_repo(info)}, or a saved pipeline)"
            )
        options: dict[str, Any] = {"subfolder": name, "local_files_only": True}
        if dtype is not None:
            options["torch_dtype"] = dtype
        parts[name] = cls.from_pretrained(folder, **options)
    return parts


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_config(repo: str) -> str | None:
    """The hub cache's folder of ``repo`` when its model_index.json is there (offline use)."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo, "model_index.json", cache_dir=constants.HF_HUB_CACHE)
    return os.path.dirname(found) if isinstance(found, str) else None


def load_pipeline(
    path: str | os.PathLike[str],
    *,
    config: ConfigSource | None = None,
    torch_dtype: torch.dtype | None = None,
    **pipeline_kwargs: Any,
) -> Any:
    """The diffusers pipeline of the checkpoint at ``path`` (see the module docstring).

    ``config``: a diffusers folder of the file's architecture, or such folders by
    diffusers' model type (``{"v1": DIR, "": DIR_FOR_THE_REST}``). Raises ValueError
    naming the file (see :func:`detect`; a config folder of another architecture or
    without a part the file lacks; offline without a config, saying what to give),
    ImportError without diffusers, and what diffusers raises for weights it cannot
    convert.
    """
    import diffusers

    info = detect(path)
    cls = getattr(diffusers, info.architecture.pipeline)
    if torch_dtype is not None:
        pipeline_kwargs["torch_dtype"] = torch_dtype
    folder = _chosen_config(info, config)
    repo = _default_repo(info)
    if folder is None and _offline():
        folder = _cached_config(repo)
        if folder is None:
            raise ValueError(
                f"{info.describe()} cannot be loaded offline (HF_HUB_OFFLINE) without a config, and "
                f"the hub cache holds none of {repo}: {_how_to_get_config(info, repo)}"
            )
    if folder is None:
        # Online: diffusers fetches the config of its default repo for this architecture.
        try:
            return cls.from_single_file(str(info.path), **pipeline_kwargs)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{info.describe()} could not be loaded with the config of {repo} "
                f"({type(exc).__name__}: {exc}); if that repo cannot be reached, "
                f"{_how_to_get_config(info, repo)}"
            ) from exc
    if not Path(folder).is_dir():
        raise ValueError(f"config folder {folder!r} for {info.describe()} is not a folder")
    index = _folder_index(folder, info)
    parts = _missing_parts(info, _header(info.path), folder, index, torch_dtype)
    return cls.from_single_file(
        str(info.path), config=folder, local_files_only=True, **{**parts, **pipeline_kwargs}
    )
