"""Stream every denoise step of a diffusers pipeline through the engine.

    python examples/diffusers_stream.py                        # tiny random pipeline, no downloads
    python examples/diffusers_stream.py --out steps/           # also save a preview per step
    python examples/diffusers_stream.py --model-id stable-diffusion-v1-5/stable-diffusion-v1-5 \\
        --prompt "a lighthouse at dusk" --steps 25 --out steps/

Needs the extra: ``pip install "omni-stream[diffusers]"``. By default it
builds a Stable Diffusion pipeline from configs with random weights (its
"images" are noise, but every step streams exactly as a real model's would)
and encodes prompts with a stand-in, because a real tokenizer needs files.
``--model-id`` loads real weights with ``from_pretrained`` instead (a Hub id
or a local folder; fp16 on a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from pathlib import Path

import torch

import omni_stream as om
from omni_stream.models.diffusers import Diffusers, PromptEmbeddings
from omni_stream.preview import Previewer, PreviewSpec

_TINY_EMBED_DIM = 32


def tiny_pipeline() -> Diffusers:
    """A Stable Diffusion pipeline built from configs, random weights, no tokenizer."""
    from diffusers import (
        AutoencoderKL,
        EulerAncestralDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=_TINY_EMBED_DIM,
        norm_num_groups=8,
        attention_head_dim=4,
    )
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=8,
    )
    scheduler = EulerAncestralDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return Diffusers(pipe, encode_prompt=stand_in_encoder, defaults={"steps": 12})


def stand_in_encoder(prompt: str, negative_prompt: str) -> PromptEmbeddings:
    """Fixed random embeddings per prompt: what a text encoder gives, minus the meaning."""

    def embed(text: str) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        return torch.randn(1, 77, _TINY_EMBED_DIM, generator=torch.Generator().manual_seed(seed))

    return PromptEmbeddings(embed(prompt), embed("negative: " + negative_prompt))


async def stream(model: Diffusers, params: dict, out: Path | None) -> om.Frame:
    spec = PreviewSpec(every=1, format="png", max_size=256, decoder=model.preview_decoder or "auto")
    previewer = Previewer()
    final = None
    async with om.Engine(model) as engine:
        async with engine.stream(params) as frames:
            async for frame in frames:
                note = ""
                if out is not None and not frame.final:
                    # The fast latent-to-RGB approximation, rendered off the
                    # event loop while the engine computes the next step.
                    image = await previewer.render(frame, spec)
                    path = out / f"step_{frame.step:03d}.png"
                    path.write_bytes(image.data)
                    note = f" -> {path}"
                what = "image" if frame.decoded else "latents"
                print(
                    f"step {frame.step:>3}/{frame.total}: {what} {tuple(frame.data.shape)} "
                    f"{frame.data.dtype}, computed in {frame.timings.compute_s * 1000:.1f} ms{note}"
                )
                final = frame
    assert final is not None
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", help="a diffusers model to load (Hub id or folder)")
    parser.add_argument("--prompt", default="a lighthouse at dusk")
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--steps", type=int, help="denoise steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for per-step previews and final.png")
    args = parser.parse_args()

    try:
        if args.model_id:
            dtype = torch.float16 if torch.cuda.is_available() else torch.float32
            model = Diffusers.from_pretrained(args.model_id, torch_dtype=dtype)
        else:
            model = tiny_pipeline()
    except ImportError as exc:
        sys.exit(f"error: {exc}")

    params = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "seed": args.seed}
    if args.steps is not None:
        params["steps"] = args.steps
    if args.guidance_scale is not None:
        params["guidance_scale"] = args.guidance_scale
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    try:
        final = asyncio.run(stream(model, params, args.out))
    except om.OmniStreamError as exc:
        sys.exit(f"error: {exc}")

    if args.out is not None:
        # The final frame is the VAE's image, decoded on the engine's producer
        # thread as part of the last step; a PNG that records its params.
        path = final.save(args.out / "final.png", params=params)
        image = final.image()
        print(f"final image: {path} ({image.width}x{image.height})")


if __name__ == "__main__":
    main()
