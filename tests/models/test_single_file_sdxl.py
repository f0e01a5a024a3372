"""Single-file SDXL: a tiny SDXL pipeline written as its original checkpoint, loaded bit for bit.

An SDXL checkpoint holds the UNet (``model.diffusion_model...``, its added
embedding as ``label_emb``), the VAE (``first_stage_model...``), CLIP-L in
transformers' layout (``conditioner.embedders.0.transformer...``) and
OpenCLIP-G in OpenCLIP's (``conditioner.embedders.1.model...``: one
``in_proj`` for q, k and v, ``c_fc``/``c_proj``, ``text_projection``
transposed). ``write_sdxl_file`` writes that layout, reusing the SD test's
UNet and VAE writers; the saved folder is the config.

diffusers reads sizes as well as names here, so the tiny encoders are shaped
to match: SDXL is detected by OpenCLIP-G's tenth layer
(``resblocks.9.mlp.c_proj.bias``), so G has 10 layers; and each encoder is
told from the other by the width of its position embedding, so L and G have
different widths (4 and 12, 16 together: the UNet's cross-attention width).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from .conftest import letter_vocab  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.single_file import detect, load_pipeline  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from .test_single_file import ldm_unet, ldm_vae, weights_equal  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

L_WIDTH, G_WIDTH = 4, 12  # CLIP-L's and OpenCLIP-G's hidden sizes; their sum is sd.EMBED_DIM
G_LAYERS = 10  # diffusers detects SDXL by G's resblocks.9

# transformers' names in a CLIP encoder layer -> OpenCLIP's.
_OPEN_CLIP_LAYER = {
    "self_attn.out_proj.": "attn.out_proj.",
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
}


def sdxl_ldm_unet(unet: Any) -> dict[str, torch.Tensor]:
    """The SDXL UNet under the LDM names: the SD UNet's, and its added (text and time)
    embedding as ``label_emb.0``, the Sequential it is in the original."""
    state = unet.state_dict()
    added = {k: v for k, v in state.items() if k.startswith("add_embedding.")}
    rest = types.SimpleNamespace(config=unet.config, state_dict=lambda: {
        k: v for k, v in state.items() if k not in added
    })
    out = ldm_unet(rest)
    for key, value in added.items():
        layer = {"linear_1": "0", "linear_2": "2"}[key.split(".")[1]]
        out[f"model.diffusion_model.label_emb.0.{layer}.{key.rsplit('.', 1)[1]}"] = value
    return out


def open_clip(encoder: Any, prefix: str) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection's weights in OpenCLIP's layout under ``prefix``."""
    state = {k.removeprefix("text_model."): v for k, v in encoder.state_dict().items()}
    out = {
        "token_embedding.weight": state.pop("embeddings.token_embedding.weight"),
        "positional_embedding": state.pop("embeddings.position_embedding.weight"),
        "ln_final.weight": state.pop("final_layer_norm.weight"),
        "ln_final.bias": state.pop("final_layer_norm.bias"),
        # OpenCLIP multiplies by it (x @ P), transformers' Linear by its transpose.
        "text_projection": state.pop("text_projection.weight").T,
    }
    state.pop("embeddings.position_ids", None)
    for i in range(encoder.config.num_hidden_layers):
        at, to = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{to}attn.in_proj_{kind}"] = torch.cat(
                [state.pop(f"{at}self_attn.{x}_proj.{kind}") for x in "qkv"]
            )
        for key in [k for k in state if k.startswith(at)]:
            rest = key[len(at) :]
            old = next(n for n in _OPEN_CLIP_LAYER if rest.startswith(n))
            out[to + _OPEN_CLIP_LAYER[old] + rest[len(old) :]] = state.pop(key)
    assert not state, sorted(state)
    return {prefix + k: v for k, v in out.items()}


def write_sdxl_file(pipe: Any, path: Path, *, text_encoders: bool = True) -> Path:
    """``pipe``'s UNet, VAE and (``text_encoders``) CLIP-L and OpenCLIP-G in one file, as
    SDXL's original checkpoints hold them."""
    from safetensors.torch import save_file

    weights = {**sdxl_ldm_unet(pipe.unet), **ldm_vae(pipe.vae)}
    if text_encoders:
        weights |= {
            "conditioner.embedders.0.transformer.text_model." + k.removeprefix("text_model."): v
            for k, v in pipe.text_encoder.state_dict().items()
            if not k.endswith("position_ids")
        }
        weights |= open_clip(pipe.text_encoder_2, "conditioner.embedders.1.model.")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return path


def text_sdxl_pipe(tmp_path: Path) -> Any:
    """A tiny SDXL pipeline with its own tokenizers and both text encoders."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    vocab_size, files = letter_vocab(tmp_path)

    def tokenizer() -> Any:
        return CLIPTokenizer(*files, model_max_length=12)

    def config(width: int, layers: int) -> Any:
        return CLIPTextConfig(
            vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_attention_heads=2,
            num_hidden_layers=layers, max_position_embeddings=12, projection_dim=sd.POOLED_DIM,
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )

    torch.manual_seed(3)
    clip_l = CLIPTextModel(config(L_WIDTH, 2)).eval()
    clip_g = CLIPTextModelWithProjection(config(G_WIDTH, G_LAYERS)).eval()
    pipe = StableDiffusionXLPipeline(
        vae=sd.tiny_vae(),
        text_encoder=clip_l,
        text_encoder_2=clip_g,
        tokenizer=tokenizer(),
        tokenizer_2=tokenizer(),
        unet=sd.tiny_unet(sdxl=True),
        scheduler=EulerDiscreteScheduler(**sd.SCHEDULE),
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny SDXL pipeline saved as a folder (the config) and as one checkpoint file."""
    root = tmp_path_factory.mktemp("sdxl-single")
    pipe = text_sdxl_pipe(root)
    pipe.save_pretrained(root / "folder")
    return root / "folder", write_sdxl_file(pipe, root / "tiny-sdxl.safetensors")


PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def _weights_equal(a: Any, b: Any) -> None:
    weights_equal(a, b, PARTS)


RAW = dict(prompt="a red cat", negative_prompt="dog", steps=2, seed=4, height=16, width=16)


def test_an_sdxl_checkpoint_loads_as_the_folder_pipeline_bit_for_bit(saved: tuple[Path, Path]) -> None:
    folder, file = saved
    assert detect(file).model_type == "xl_base"
    single = Diffusers.from_single_file(file, config=folder)
    folder_model = Diffusers.from_pretrained(str(folder))
    assert type(single._pipe) is type(folder_model._pipe) and single.mode == "native"
    assert single.family == "sdxl"
    # Every part from the file, each converted by diffusers: the folder's weights exactly.
    _weights_equal(single._pipe, folder_model._pipe)
    assert single._pipe.scheduler.config == folder_model._pipe.scheduler.config
    # Both prompt encoders, the pooled projection, the time ids: the same picture, bit for bit.
    frames, expected = sd.run(single, RAW), sd.run(folder_model, RAW)
    assert torch.equal(frames[-1], expected[-1])
    assert not torch.equal(sd.run(single, dict(RAW, prompt="a blue cat"))[-1], frames[-1])
    state = single.start(single.validate(RAW), sd.CPU)
    try:
        assert torch.equal(single.decode(state, frames[-1]), folder_model.decode(state, expected[-1]))
    finally:
        single.close(state)


def test_an_sdxl_unet_and_vae_file_takes_its_text_encoders_from_the_config(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    # Without its text encoders nothing in diffusers' detection says SDXL (it reads the
    # OpenCLIP-G key): the UNet's added embedding (label_emb) does.
    folder, _ = saved
    from diffusers import StableDiffusionXLPipeline

    reference = StableDiffusionXLPipeline.from_pretrained(folder)
    unet_only = write_sdxl_file(reference, tmp_path / "no-clip.safetensors", text_encoders=False)
    assert detect(unet_only).model_type == "xl_base"
    _weights_equal(load_pipeline(unet_only, config=folder), reference)


def test_an_sdxl_refiner_unet_is_refused_by_its_added_embeddings_width(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    def unet_only(name: str, added_inputs: int) -> Path:
        shapes = {
            "model.diffusion_model.input_blocks.0.0.weight": (8, 4, 1, 1),
            "model.diffusion_model.label_emb.0.0.weight": (8, added_inputs),
        }
        save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(tmp_path / name))
        return tmp_path / name

    assert detect(unet_only("base.safetensors", 2816)).model_type == "xl_base"
    # The refiner's: pooled G and five size/score embeddings of 256 (the base has six).
    with pytest.raises(ValueError, match=r"refiner\.safetensors.*reads it as 'xl_refiner'"):
        detect(unet_only("refiner.safetensors", 2560))
