"""Single-file checkpoints: a tiny SD pipeline written as A1111 writes one, loaded bit for bit.

``write_single_file`` lays the tiny pipeline's weights out as the original
(LDM) checkpoints hold them (``model.diffusion_model.input_blocks...``,
``first_stage_model...``, ``cond_stage_model.transformer...``): the inverse
of what diffusers' ``from_single_file`` converts, written for any block
count, so that the file goes through diffusers' real conversion. The folder
the pipeline was saved to (``save_pretrained``) is the config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.single_file import detect, load_pipeline, pickle_refusal  # noqa: E402

from . import test_diffusers as sd  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_VAE_ATTENTION = {
    "group_norm.": "norm.",
    "to_q.": "q.",
    "to_k.": "k.",
    "to_v.": "v.",
    "to_out.0.": "proj_out.",
}


def _rename(key: str, prefixes: dict[str, str]) -> str | None:
    for old, new in prefixes.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def ldm_unet(unet: Any) -> dict[str, torch.Tensor]:
    """The UNet's weights under the LDM names (``input_blocks.N.M``, ``middle_block``, ``output_blocks``)."""
    config = unet.config
    per, blocks = config.layers_per_block, len(config.block_out_channels)
    prefixes = {f"{k}.": f"{v}." for k, v in _UNET_FIXED.items()}
    for i in range(blocks):
        for j in range(per):
            prefixes[f"down_blocks.{i}.resnets.{j}."] = f"input_blocks.{1 + i * (per + 1) + j}.0."
            prefixes[f"down_blocks.{i}.attentions.{j}."] = f"input_blocks.{1 + i * (per + 1) + j}.1."
        for j in range(per + 1):
            prefixes[f"up_blocks.{i}.resnets.{j}."] = f"output_blocks.{i * (per + 1) + j}.0."
            prefixes[f"up_blocks.{i}.attentions.{j}."] = f"output_blocks.{i * (per + 1) + j}.1."
        if i < blocks - 1:
            prefixes[f"down_blocks.{i}.downsamplers.0.conv."] = f"input_blocks.{(i + 1) * (per + 1)}.0.op."
            # The upsampler follows the block's last resnet, after its attention where it has one.
            slot = 2 if "CrossAttn" in config.up_block_types[i] else 1
            prefixes[f"up_blocks.{i}.upsamplers.0."] = f"output_blocks.{i * (per + 1) + per}.{slot}."
    prefixes |= {
        "mid_block.resnets.0.": "middle_block.0.",
        "mid_block.attentions.0.": "middle_block.1.",
        "mid_block.resnets.1.": "middle_block.2.",
    }
    out = {}
    for key, value in unet.state_dict().items():
        old = next((p for p in prefixes if key.startswith(p)), None)
        assert old is not None, key
        rest = key[len(old) :]
        if ".resnets." in old:  # LDM's ResBlock names its layers by position
            head, _, tail = rest.partition(".")
            rest = f"{_RESNET.get(head, head)}.{tail}"
        out["model.diffusion_model." + prefixes[old] + rest] = value
    return out


def ldm_vae(vae: Any) -> dict[str, torch.Tensor]:
    """The VAE's weights under the LDM names (``encoder.down.N.block.M``, ``mid.attn_1.q`` as 1x1 convs)."""
    config = vae.config
    per, blocks = config.layers_per_block, len(config.block_out_channels)
    prefixes: dict[str, str] = {}
    for i in range(blocks):
        for j in range(per):
            prefixes[f"encoder.down_blocks.{i}.resnets.{j}."] = f"encoder.down.{i}.block.{j}."
        for j in range(per + 1):
            prefixes[f"decoder.up_blocks.{i}.resnets.{j}."] = f"decoder.up.{blocks - 1 - i}.block.{j}."
        if i < blocks - 1:
            prefixes[f"encoder.down_blocks.{i}.downsamplers.0."] = f"encoder.down.{i}.downsample."
            prefixes[f"decoder.up_blocks.{i}.upsamplers.0."] = f"decoder.up.{blocks - 1 - i}.upsample."
    for part in ("encoder", "decoder"):
        prefixes |= {
            f"{part}.mid_block.resnets.0.": f"{part}.mid.block_1.",
            f"{part}.mid_block.resnets.1.": f"{part}.mid.block_2.",
            f"{part}.mid_block.attentions.0.": f"{part}.mid.attn_1.",
            f"{part}.conv_norm_out.": f"{part}.norm_out.",
        }
    out = {}
    for key, value in vae.state_dict().items():
        name = _rename(key, prefixes) or key
        if ".attn_1." in name:
            head, _, rest = name.partition(".attn_1.")
            name = f"{head}.attn_1.{_rename(rest, _VAE_ATTENTION) or rest}"
            if value.dim() == 2:  # LDM's attention projections are 1x1 convolutions
                value = value.reshape(*value.shape, 1, 1)
        out["first_stage_model." + name.replace("conv_shortcut", "nin_shortcut")] = value
    return out


def write_single_file(pipe: Any, path: Path, *, text_encoder: bool = True) -> Path:
    """``pipe``'s UNet, VAE and (``text_encoder``) CLIP in one .safetensors file, LDM layout."""
    from safetensors.torch import save_file

    weights = {**ldm_unet(pipe.unet), **ldm_vae(pipe.vae)}
    if text_encoder:
        weights |= {
            "cond_stage_model.transformer.text_model." + k.removeprefix("text_model."): v
            for k, v in pipe.text_encoder.state_dict().items()
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny SD pipeline saved as a folder (the config) and as one checkpoint file."""
    root = tmp_path_factory.mktemp("single")
    pipe = sd.text_sd_pipe(root)
    pipe.save_pretrained(root / "folder")
    return root / "folder", write_single_file(pipe, root / "tiny-sd.safetensors")


def weights_equal(a: Any, b: Any, parts: tuple[str, ...] = ("unet", "vae", "text_encoder")) -> None:
    """Pipelines ``a`` and ``b`` hold the same weights, bit for bit, in each of ``parts``."""
    for part in parts:
        left, right = getattr(a, part).state_dict(), getattr(b, part).state_dict()
        assert left.keys() == right.keys(), part
        assert all(torch.equal(left[k], right[k]) for k in left), part


RAW = dict(prompt="a red cat", negative_prompt="dog", steps=2, seed=4, height=16, width=16)


def test_a_single_file_loads_as_the_folder_pipeline_bit_for_bit(saved: tuple[Path, Path]) -> None:
    folder, file = saved
    assert detect(file).model_type == "v1"
    single = Diffusers.from_single_file(file, config=folder)
    folder_model = Diffusers.from_pretrained(str(folder))
    assert type(single._pipe) is type(folder_model._pipe) and single.mode == "native"
    weights_equal(single._pipe, folder_model._pipe)
    assert single._pipe.scheduler.config == folder_model._pipe.scheduler.config
    # Same weights, same config: the same latents and the same picture, bit for bit.
    frames, expected = sd.run(single, RAW), sd.run(folder_model, RAW)
    assert torch.equal(frames[-1], expected[-1])
    state = single.start(single.validate(RAW), sd.CPU)
    assert torch.equal(single.decode(state, frames[-1]), folder_model.decode(state, expected[-1]))
    # A1111's Model hash: the first 10 hex digits of the file's sha256.
    assert single.model_hash == hashlib.sha256(file.read_bytes()).hexdigest()[:10]
    assert folder_model.model_hash is None
    assert single.weight_hashes(single.validate(RAW)) == {"model": single.model_hash}


def test_the_config_is_chosen_by_architecture(saved: tuple[Path, Path]) -> None:
    folder, file = saved
    pipe = load_pipeline(file, config={"xl_base": "/nowhere", "v1": str(folder)})
    weights_equal(pipe, load_pipeline(file, config={"": str(folder)}))


def test_a_part_the_file_lacks_comes_from_the_config_folder(saved: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = saved
    from diffusers import StableDiffusionPipeline

    reference = StableDiffusionPipeline.from_pretrained(folder)
    unet_only = write_single_file(reference, tmp_path / "no-clip.safetensors", text_encoder=False)
    weights_equal(load_pipeline(unet_only, config=folder), reference)
    # Neither the file nor the folder: said, naming the part.
    bare = tmp_path / "bare"
    (bare / "text_encoder").mkdir(parents=True)
    for name in ("model_index.json",):
        (bare / name).write_text((folder / name).read_text())
    with pytest.raises(ValueError, match="holds no text_encoder"):
        load_pipeline(unet_only, config=bare)


def test_offline_without_a_config_says_which_option_to_give(
    saved: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    _, file = saved
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty hub cache
    for config in (None, {"xl_base": str(tmp_path)}):
        with pytest.raises(ValueError) as err:
            load_pipeline(file, config=config)
        message = str(err.value)
        assert "tiny-sd.safetensors (SD 1.x, diffusers' model type 'v1')" in message
        assert "--model-config v1=DIR" in message and "tiny-sd.safetensors?config=DIR" in message
        assert "hf download stable-diffusion-v1-5/stable-diffusion-v1-5" in message


def test_a_config_folder_of_another_architecture_is_refused(saved: tuple[Path, Path], tmp_path: Path) -> None:
    _, file = saved
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(
        ValueError, match="is a StableDiffusionXLPipeline's; .* loads as a StableDiffusionPipeline"
    ):
        load_pipeline(file, config=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model_index.json"):
        load_pipeline(file, config=tmp_path / "empty")
    with pytest.raises(ValueError, match="is not a folder"):
        load_pipeline(file, config=tmp_path / "nowhere")


def _header_only(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    from safetensors.torch import save_file

    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(path))
    return path


def test_unknown_architectures_and_pickles_are_refused_naming_the_file(tmp_path: Path) -> None:
    # An inpainting UNet (9 input channels): diffusers knows it, the adapters do not stream it.
    inpaint = _header_only(
        tmp_path / "inpaint.safetensors", {"model.diffusion_model.input_blocks.0.0.weight": (4, 9, 1, 1)}
    )
    with pytest.raises(ValueError, match=r"inpaint\.safetensors.*reads it as 'inpainting'"):
        detect(inpaint)
    # A LoRA given as a model: no denoiser at all.
    lora = _header_only(tmp_path / "ink.safetensors", {"lora_unet_down_blocks_0.lora_down.weight": (4, 8)})
    with pytest.raises(ValueError, match=r"ink\.safetensors.*holds no denoiser"):
        detect(lora)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable .safetensors file"):
        detect(tmp_path / "junk.safetensors")
    (tmp_path / "old.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match="Python pickle"):
        detect(tmp_path / "old.ckpt")
    assert pickle_refusal("x.safetensors") is None and "runs whatever code" in (
        pickle_refusal("x.CKPT") or ""
    )
