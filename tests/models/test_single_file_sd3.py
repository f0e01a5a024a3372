"""Single-file SD3: a tiny SD3 pipeline written as Stability's original file, loaded bit for bit.

Stability's ``sd3_medium.safetensors`` and ``sd3.5_*.safetensors`` hold the
MMDiT under ``model.diffusion_model.`` (``joint_blocks.N.x_block`` for the
image stream and ``.context_block`` for the text's, each with one
``attn.qkv``, ``adaLN_modulation.1`` and ``mlp.fc1``/``fc2``; ``x_embedder``,
``pos_embed``, ``t_embedder``, ``y_embedder``, ``context_embedder``,
``final_layer``) and the VAE under ``first_stage_model.``; the ``_incl_clips``
files add CLIP-L and CLIP-G in transformers' layout under
``text_encoders.clip_l.transformer.`` and ``.clip_g.transformer.``.
``sai_transformer`` writes a tiny transformer in that layout: the inverse of
diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers``, which reads
every size from the keys (no full-size constant), so it runs unchanged. The
VAE goes through the SD test's ``ldm_vae``. The saved folder is the config and
holds the parts the file lacks (single_file.py loads them from it). The
pipeline has no T5, as the SD3 adapter's tests: its folder's model_index.json
says ``text_encoder_3: [null, null]``, and diffusers loads such a folder
(``from_pretrained`` and ``from_single_file`` alike) only when told
``text_encoder_3=None, tokenizer_3=None`` (``NO_T5``), as when T5 is dropped
from a full SD3 folder.

Detection reads sizes: diffusers takes a file for SD3 medium or SD3.5 medium
when ``joint_blocks.0.context_block.adaLN_modulation.1.bias`` (bare or under
``model.diffusion_model.``) has 9216 entries (six times their width, 1536),
then tells them apart by ``pos_embed``'s positions (36864 = 192², SD3
medium; 147456 = 384², SD3.5 medium); SD3.5 large by a 38th block
(``joint_blocks.37.x_block.mlp.fc1.weight``) alone. The tiny transformers
have the real positional embeddings (2.4 MB and 9.4 MB at width 16), not the
width: the ``tiny_width`` fixture runs diffusers' detection, its bytecode,
with 9216 set to six times the tiny width, and
``test_detection_reads_these_keys_and_sizes`` checks full-size headers with
diffusers' detection untouched.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.single_file import detect, load_pipeline  # noqa: E402

from . import test_diffusers_sd3 as sd3  # noqa: E402
from .test_single_file import ldm_vae, weights_equal  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

WIDTH = 16  # 2 heads of 8: the tiny transformer's inner width
L_WIDTH, G_WIDTH = 4, 12  # CLIP-L's and CLIP-G's; their sum is sd3.EMBED_DIM (no T5 to pad to)
POSITIONS = {"sd3": 192, "sd35_medium": 384}  # pos_embed_max_size: 192² and 384² positions
PREFIX = "model.diffusion_model."
NO_T5 = dict(text_encoder_3=None, tokenizer_3=None)

# diffusers' name -> Stability's, for the parts that are renamed only.
_FIXED = {
    "pos_embed.pos_embed": "pos_embed",
    "pos_embed.proj.": "x_embedder.proj.",
    "time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
    "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
    "time_text_embed.text_embedder.linear_1.": "y_embedder.mlp.0.",
    "time_text_embed.text_embedder.linear_2.": "y_embedder.mlp.2.",
    "context_embedder.": "context_embedder.",
    "proj_out.": "final_layer.linear.",
}
_JOINT = {
    "attn.norm_q.": "x_block.attn.ln_q.",
    "attn.norm_k.": "x_block.attn.ln_k.",
    "attn.norm_added_q.": "context_block.attn.ln_q.",
    "attn.norm_added_k.": "context_block.attn.ln_k.",
    "attn.to_out.0.": "x_block.attn.proj.",
    "attn.to_add_out.": "context_block.attn.proj.",
    "attn2.norm_q.": "x_block.attn2.ln_q.",
    "attn2.norm_k.": "x_block.attn2.ln_k.",
    "attn2.to_out.0.": "x_block.attn2.proj.",
    "norm1.linear.": "x_block.adaLN_modulation.1.",
    "norm1_context.linear.": "context_block.adaLN_modulation.1.",
    "ff.net.0.proj.": "x_block.mlp.fc1.",
    "ff.net.2.": "x_block.mlp.fc2.",
    "ff_context.net.0.proj.": "context_block.mlp.fc1.",
    "ff_context.net.2.": "context_block.mlp.fc2.",
}
# Each fused qkv: Stability's name -> diffusers' (q, k, v) projections.
_QKV = {
    "x_block.attn.qkv.": ("attn.to_q.", "attn.to_k.", "attn.to_v."),
    "context_block.attn.qkv.": ("attn.add_q_proj.", "attn.add_k_proj.", "attn.add_v_proj."),
    "x_block.attn2.qkv.": ("attn2.to_q.", "attn2.to_k.", "attn2.to_v."),
}


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    # Stability's final norms project to (shift, scale), diffusers' to (scale, shift).
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def sai_transformer(transformer: Any, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """The transformer's weights under Stability's names; ``prefix`` as the full checkpoints
    write it, none as a bare transformer file does."""
    state = transformer.state_dict()
    last = transformer.config.num_layers - 1
    out: dict[str, torch.Tensor] = {}
    for i in range(last + 1):
        at, to = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for fused, parts in _QKV.items():
            for kind in ("weight", "bias"):
                names = [f"{at}{p}{kind}" for p in parts]
                if names[0] in state:
                    out[f"{to}{fused}{kind}"] = torch.cat([state.pop(n) for n in names])
        if i == last:  # the last text block's norm is a final norm: (shift, scale)
            for kind in ("weight", "bias"):
                key = f"{at}norm1_context.linear.{kind}"
                out[f"{to}context_block.adaLN_modulation.1.{kind}"] = _swap_halves(state.pop(key))
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap_halves(state.pop(f"norm_out.linear.{kind}"))
    for key, value in state.items():
        if key.startswith("transformer_blocks."):
            index, _, rest = key.removeprefix("transformer_blocks.").partition(".")
            head, names = f"joint_blocks.{index}.", _JOINT
        else:
            rest, head, names = key, "", _FIXED
        old = next((n for n in names if rest.startswith(n)), None)
        assert old is not None, f"no Stability name for {key}"
        out[head + names[old] + rest[len(old) :]] = value
    return {prefix + k: v.contiguous() for k, v in out.items()}


def tiny_transformer(model_type: str = "sd3") -> Any:
    """sd3.tiny_transformer's sizes with two blocks (the last is a text block without its own
    output, as in the real ones) and the real positional embedding; SD3.5 medium's QK norms
    and second image attention for ``sd35_medium``."""
    from diffusers import SD3Transformer2DModel

    extra: dict[str, Any] = {}
    if model_type == "sd35_medium":
        extra = {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=sd3.CHANNELS, out_channels=sd3.CHANNELS, num_layers=2,
        attention_head_dim=8, num_attention_heads=WIDTH // 8, joint_attention_dim=sd3.EMBED_DIM,
        caption_projection_dim=WIDTH, pooled_projection_dim=sd3.POOLED_DIM,
        pos_embed_max_size=POSITIONS[model_type], **extra,
    )


@pytest.fixture
def tiny_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' detection with SD3's width check (9216 adaLN outputs) set to the tiny one's."""
    from diffusers.loaders import single_file_utils

    def tiny(code: types.CodeType) -> types.CodeType:
        consts = tuple(
            tiny(c) if isinstance(c, types.CodeType) else 6 * WIDTH if type(c) is int and c == 9216 else c
            for c in code.co_consts
        )
        return code.replace(co_consts=consts)

    infer = single_file_utils.infer_diffusers_model_type
    patched = types.FunctionType(tiny(infer.__code__), infer.__globals__, infer.__name__)
    # detect() imports it from the module on each call; diffusers' loaders only call it
    # without a config.
    monkeypatch.setattr(single_file_utils, "infer_diffusers_model_type", patched)


def sd3_file_pipe(root: Path) -> Any:
    """The tiny SD3 pipeline with CLIP-L and CLIP-G, no T5, and SD3's VAE layout (no quant
    convs). CLIP-L's projection is the identity: diffusers sets that when it loads CLIP-L from
    a file, whatever the file holds."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    tok, clip_l = sd3.clip_parts(root, hidden=L_WIDTH, projection=L_WIDTH, seed=2)
    tok_2, clip_g = sd3.clip_parts(root, hidden=G_WIDTH, projection=sd3.POOLED_DIM - L_WIDTH, seed=3)
    with torch.no_grad():
        clip_l.text_projection.weight.copy_(torch.eye(L_WIDTH))
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=[8, 8], in_channels=3, out_channels=3, latent_channels=sd3.CHANNELS,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        norm_num_groups=4, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_transformer(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip_l, tokenizer=tok, text_encoder_2=clip_g, tokenizer_2=tok_2,
        text_encoder_3=None, tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_sd3_file(
    pipe: Any, path: Path, *, clips: bool = False, vae: bool = True, prefix: str = PREFIX
) -> Path:
    """``pipe``'s transformer, (``vae``) VAE and (``clips``) CLIP-L and CLIP-G in one file, as
    ``sd3_medium.safetensors`` (and ``sd3_medium_incl_clips.safetensors``) hold them."""
    from safetensors.torch import save_file

    weights = sai_transformer(pipe.transformer, prefix)
    if vae:
        weights |= ldm_vae(pipe.vae)
    if clips:
        # CLIP-L without its projection (diffusers does not read it), CLIP-G with it.
        for name, encoder, skip in (
            ("clip_l", pipe.text_encoder, ("position_ids", "text_projection.weight")),
            ("clip_g", pipe.text_encoder_2, ("position_ids",)),
        ):
            weights |= {
                f"text_encoders.{name}.transformer.{k}": v
                for k, v in encoder.state_dict().items()
                if not k.endswith(skip)
            }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny SD3 pipeline saved as a folder (the config, with every part's weights) and its
    transformer and VAE as one file, as ``sd3_medium.safetensors`` holds them."""
    root = tmp_path_factory.mktemp("sd3-single")
    pipe = sd3_file_pipe(root)
    pipe.save_pretrained(root / "folder")
    return root / "folder", write_sd3_file(pipe, root / "sd3-tiny.safetensors")


PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


def _weights_equal(a: Any, b: Any) -> None:
    weights_equal(a, b, PARTS)


RAW = dict(prompt="a red cat", negative_prompt="dog", steps=2, seed=4, height=16, width=16)


def test_an_sd3_medium_file_loads_as_the_folder_pipeline_bit_for_bit(
    saved: tuple[Path, Path], tiny_width: None
) -> None:
    folder, file = saved
    assert detect(file).model_type == "sd3"
    single = Diffusers.from_single_file(file, config=folder, **NO_T5)
    folder_model = Diffusers.from_pretrained(str(folder), **NO_T5)
    assert type(single._pipe) is type(folder_model._pipe) and single.mode == "native"
    # Transformer and VAE from the file; CLIP-L and CLIP-G from the config (single_file.py step 3).
    _weights_equal(single._pipe, folder_model._pipe)
    assert single._pipe.text_encoder_3 is None
    assert single._pipe.scheduler.config == folder_model._pipe.scheduler.config
    # The pipeline's own prompt encoders, T5's zeros, the shifted flow schedule: the same latents.
    (frames, latents), (expected, expected_latents) = sd3.run(single, RAW), sd3.run(folder_model, RAW)
    assert all(torch.equal(a, b) for a, b in zip(latents, expected_latents, strict=True))
    assert torch.equal(frames[-1], expected[-1])
    assert not torch.equal(sd3.run(single, dict(RAW, prompt="a blue cat"))[0][-1], frames[-1])
    state = single.start(single.validate(RAW), sd3.CPU)
    try:
        assert torch.equal(single.decode(state, frames[-1]), folder_model.decode(state, expected[-1]))
    finally:
        single.close(state)


def test_the_clips_from_the_file_and_a_bare_transformer_load_the_same_weights(
    saved: tuple[Path, Path], tmp_path: Path, tiny_width: None
) -> None:
    from diffusers import StableDiffusion3Pipeline

    folder, _ = saved
    reference = StableDiffusion3Pipeline.from_pretrained(folder, **NO_T5)
    # sd3_medium_incl_clips: CLIP-L and CLIP-G converted from the file (told apart by width).
    with_clips = write_sd3_file(reference, tmp_path / "incl-clips.safetensors", clips=True)
    assert detect(with_clips).model_type == "sd3"
    _weights_equal(load_pipeline(with_clips, config=folder, **NO_T5), reference)
    # The MMDiT alone, its keys bare (diffusers detects and converts SD3's with or without
    # model.diffusion_model.): the VAE and both CLIPs come from the config.
    bare = write_sd3_file(reference, tmp_path / "bare.safetensors", vae=False, prefix="")
    assert detect(bare).model_type == "sd3"
    _weights_equal(load_pipeline(bare, config=folder, **NO_T5), reference)


def test_sd35_mediums_qk_norms_and_second_attention_convert(tmp_path: Path, tiny_width: None) -> None:
    # The transformer alone, through diffusers' model loader (which the pipeline loader calls
    # for it): what SD3 medium's blocks lack, ln_q/ln_k and x_block.attn2, converted back.
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file

    reference = tiny_transformer("sd35_medium")
    reference.save_config(tmp_path)
    weights = sai_transformer(reference)
    extra = ("joint_blocks.0.x_block.attn2.qkv.weight", "joint_blocks.1.context_block.attn.ln_q.weight")
    assert {PREFIX + k for k in extra} <= weights.keys()
    save_file(weights, str(tmp_path / "sd35m.safetensors"))
    assert detect(tmp_path / "sd35m.safetensors").model_type == "sd35_medium"
    loaded = SD3Transformer2DModel.from_single_file(
        str(tmp_path / "sd35m.safetensors"), config=str(tmp_path), local_files_only=True
    ).state_dict()
    assert loaded.keys() == reference.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())


def _header_only(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    from safetensors.torch import save_file

    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(path))
    return path


def test_detection_reads_these_keys_and_sizes(tmp_path: Path) -> None:
    # diffusers' detection untouched: the keys and sizes it reads, at the real models' sizes.
    ada = "joint_blocks.0.context_block.adaLN_modulation.1.bias"
    cases = {
        "sd3": {ada: (9216,), "pos_embed": (1, 192 * 192, 1)},
        "sd35_medium": {ada: (9216,), "pos_embed": (1, 384 * 384, 1)},
        # SD3.5 large is 2432 wide (6 x 2432 adaLN outputs): told by its 38th block.
        "sd35_large": {ada: (6 * 2432,), "joint_blocks.37.x_block.mlp.fc1.weight": (1, 1)},
    }
    for want, shapes in cases.items():
        for prefix in (PREFIX, ""):
            file = _header_only(tmp_path / f"{want}.safetensors", {prefix + k: s for k, s in shapes.items()})
            assert detect(file).model_type == want, (want, prefix)
    # A tiny width is not SD3 to diffusers (hence tiny_width above): nothing else matches.
    tiny = {PREFIX + ada: (6 * WIDTH,), PREFIX + "pos_embed": (1, 192 * 192, 1)}
    tiny_file = _header_only(tmp_path / "tiny.safetensors", tiny)
    with pytest.raises(ValueError, match=r"tiny\.safetensors. holds no denoiser"):
        detect(tiny_file)
