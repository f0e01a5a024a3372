"""Single-file Flux: a tiny transformer written as BFL's original file, loaded bit for bit.

The Flux file most people download (ComfyUI's ``models/unet`` or
``models/diffusion_models``) holds the transformer alone, in Black Forest
Labs' layout (``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``,
``img_in``, ``time_in.in_layer``, ``guidance_in`` ...). ``bfl_transformer``
writes a tiny transformer in that layout: the inverse of diffusers'
``convert_flux_transformer_checkpoint_to_diffusers``. The folder the pipeline
was saved to is the config and holds the parts the file lacks (VAE, CLIP,
T5): single_file.py loads those from it.

diffusers' converter hard-codes Flux.1's width (``inner_dim = 3072``: it
splits ``single_blocks.N.linear1`` by that size), so a tiny transformer cannot
go through it unchanged and one of Flux.1's width is gigabytes. The
``tiny_width`` fixture runs the very same converter, its bytecode, with that one
constant set to the tiny width; everything else (names, the q/k/v splits, the
final norm's scale/shift swap) is diffusers' own.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.single_file import detect, load_pipeline  # noqa: E402

from . import test_diffusers_flux as flux  # noqa: E402
from .test_single_file import weights_equal  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

# diffusers' name -> BFL's, for the parts that are renamed only.
_FIXED = {
    "time_text_embed.timestep_embedder.linear_1.": "time_in.in_layer.",
    "time_text_embed.timestep_embedder.linear_2.": "time_in.out_layer.",
    "time_text_embed.text_embedder.linear_1.": "vector_in.in_layer.",
    "time_text_embed.text_embedder.linear_2.": "vector_in.out_layer.",
    "time_text_embed.guidance_embedder.linear_1.": "guidance_in.in_layer.",
    "time_text_embed.guidance_embedder.linear_2.": "guidance_in.out_layer.",
    "context_embedder.": "txt_in.",
    "x_embedder.": "img_in.",
    "proj_out.": "final_layer.linear.",
}
_DOUBLE = {
    "norm1.linear.": "img_mod.lin.",
    "norm1_context.linear.": "txt_mod.lin.",
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "ff.net.0.proj.": "img_mlp.0.",
    "ff.net.2.": "img_mlp.2.",
    "ff_context.net.0.proj.": "txt_mlp.0.",
    "ff_context.net.2.": "txt_mlp.2.",
    "attn.to_out.0.": "img_attn.proj.",
    "attn.to_add_out.": "txt_attn.proj.",
}
_SINGLE = {
    "norm.linear.": "modulation.lin.",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "proj_out.": "linear2.",
}


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    # BFL's final norm projects to (shift, scale), diffusers' to (scale, shift).
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def bfl_transformer(transformer: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The transformer's weights under BFL's names; ``prefix`` as ComfyUI's full checkpoints
    write it (``model.diffusion_model.``), none as the transformer-only downloads do."""
    state = transformer.state_dict()
    out: dict[str, torch.Tensor] = {}
    for i in range(transformer.config.num_layers):
        at, to = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{to}img_attn.qkv.{kind}"] = torch.cat([state.pop(f"{at}attn.to_{x}.{kind}") for x in "qkv"])
            out[f"{to}txt_attn.qkv.{kind}"] = torch.cat(
                [state.pop(f"{at}attn.add_{x}_proj.{kind}") for x in "qkv"]
            )
    for i in range(transformer.config.num_single_layers):
        at, to = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            names = [f"{at}attn.to_{x}.{kind}" for x in "qkv"] + [f"{at}proj_mlp.{kind}"]
            out[f"{to}linear1.{kind}"] = torch.cat([state.pop(n) for n in names])
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap_halves(state.pop(f"norm_out.linear.{kind}"))
    for key, value in state.items():
        for at, to, names in (
            ("transformer_blocks.", "double_blocks.", _DOUBLE),
            ("single_transformer_blocks.", "single_blocks.", _SINGLE),
            ("", "", _FIXED),
        ):
            if not key.startswith(at):
                continue
            index, _, rest = key[len(at) :].partition(".") if at else ("", "", key)
            old = next((n for n in names if rest.startswith(n)), None)
            if old is not None:
                head = f"{to}{index}." if at else ""
                out[head + names[old] + rest[len(old) :]] = value
                break
        else:
            raise AssertionError(f"no BFL name for {key}")
    return {prefix + k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_width() -> Iterator[None]:
    """diffusers' Flux converter with its hard-coded width (3072) set to the tiny transformer's."""
    from diffusers.loaders import single_file_model, single_file_utils

    converter = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    code = converter.__code__
    config = flux.tiny_transformer().config
    width = config.num_attention_heads * config.attention_head_dim
    consts = tuple(width if type(c) is int and c == 3072 else c for c in code.co_consts)
    tiny = types.FunctionType(code.replace(co_consts=consts), converter.__globals__, converter.__name__)
    entry = single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]
    entry["checkpoint_mapping_fn"] = tiny
    try:
        yield
    finally:
        entry["checkpoint_mapping_fn"] = converter


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_width: None) -> tuple[Path, Path]:
    """The tiny Flux dev pipeline saved as a folder (the config, with every part's weights) and
    its transformer alone as one BFL-layout file."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("flux-single")
    pipe = flux.flux_pipe(**flux.text_encoders(root))
    pipe.save_pretrained(root / "folder")
    file = root / "flux1-tiny-dev.safetensors"
    save_file(bfl_transformer(pipe.transformer), str(file))
    return root / "folder", file


RAW = dict(prompt="a red cat", steps=2, seed=4, height=16, width=16, guidance_scale=4.0)


def test_a_transformer_only_file_loads_as_the_folder_pipeline_bit_for_bit(saved: tuple[Path, Path]) -> None:
    folder, file = saved
    assert detect(file).model_type == "flux-dev"
    single = Diffusers.from_single_file(file, config=folder)
    folder_model = Diffusers.from_pretrained(str(folder))
    assert type(single._pipe) is type(folder_model._pipe) and single.mode == "native"
    # The transformer from the file; VAE, CLIP and T5 from the config folder (single_file.py step 3).
    weights_equal(single._pipe, folder_model._pipe, ("transformer", "vae", "text_encoder", "text_encoder_2"))
    assert single._pipe.scheduler.config == folder_model._pipe.scheduler.config
    # The pipeline's own prompt encoders, the guidance embedding, the packing: the same latents.
    (frames, latents), (expected, expected_latents) = flux.run(single, RAW), flux.run(folder_model, RAW)
    assert all(torch.equal(a, b) for a, b in zip(latents, expected_latents, strict=True))
    assert torch.equal(frames[-1], expected[-1])
    state = single.start(single.validate(RAW), flux.CPU)
    try:
        assert torch.equal(single.decode(state, frames[-1]), folder_model.decode(state, expected[-1]))
    finally:
        single.close(state)


def test_comfyuis_prefixed_layout_loads_the_same_weights(saved: tuple[Path, Path], tmp_path: Path) -> None:
    # ComfyUI's own full checkpoints put the transformer under model.diffusion_model.
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    folder, _ = saved
    reference = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    file = tmp_path / "prefixed.safetensors"
    save_file(bfl_transformer(reference, "model.diffusion_model."), str(file))
    assert detect(file).model_type == "flux-dev"
    loaded = load_pipeline(file, config=folder).transformer.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())


def test_detection_tells_dev_from_schnell_by_the_guidance_embedding(tmp_path: Path) -> None:
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from safetensors.torch import save_file

    for guidance, want in ((True, "flux-dev"), (False, "flux-schnell")):
        weights = bfl_transformer(flux.tiny_transformer(guidance_embeds=guidance))
        assert any(k.startswith("guidance_in.") for k in weights) is guidance
        assert infer_diffusers_model_type(weights) == want
        # The header alone (names and shapes) says the same.
        save_file(weights, str(tmp_path / f"{want}.safetensors"))
        assert detect(tmp_path / f"{want}.safetensors").model_type == want
