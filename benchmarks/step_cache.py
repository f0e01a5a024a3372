"""Step caching on the CPU: First-Block Cache, TeaCache, TaylorSeer against none, alone and mixed (issue #35).

A random-weight Flux transformer built from a config (no download), larger
than the tests' so the transformer is most of a step: 2 double and 6 single
blocks, 4 heads of 32 (width 128), 128x128 px (1024 latent tokens), 28
steps, one torch thread, the native loop (``FluxDiffusers``) driven
directly (``model.step``), no server.

1. Alone, per setting (none; ``fbcache`` at 0.2, 0.35, 0.5, 1.0; ``teacache``
   at 0.25, 0.4, 0.6, 0.8; ``taylorseer`` at diffusers' defaults, interval 5,
   warmup 3, order 1, and at interval 3): the wall time of the 28 steps (the
   median of ``reps``, settings interleaved), the share of steps that reused
   or forecast, and the PSNR of
   the final image (the VAE's decode, in [0, 1]) against the uncached
   run's. Random weights: the PSNR says how far caching moved *these*
   latents, not how a real model's picture looks; quality needs real
   weights.
2. A mixed batch: four requests (uncached, ``fbcache`` 0.5, ``teacache``
   0.6, ``taylorseer``) run together, batched, against the same four run one
   after another alone: the ratio of the wall times.

``python -m benchmarks.step_cache [--reps N] [--steps N]`` runs it standalone.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["measure"]

#: Each setting by its name in the table: its ``cache`` param.
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    **{f"fbcache {t}": {"method": "fbcache", "threshold": t} for t in (0.2, 0.35, 0.5, 1.0)},
    **{f"teacache {t}": {"method": "teacache", "rel_l1": t} for t in (0.25, 0.4, 0.6, 0.8)},
    "taylorseer": {"method": "taylorseer"},
    "taylorseer interval 3": {"method": "taylorseer", "interval": 3},
}
MIXED = ("none", "fbcache 0.5", "teacache 0.6", "taylorseer")
SIZE = 128


def _model(max_batch_size: int = 8) -> Any:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=6, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=[8, 8], in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=16, norm_num_groups=4,
        scaling_factor=0.3611, shift_factor=0.1159,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, transformer=transformer, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None)

    def encode(prompt: str, negative_prompt: str) -> Any:
        g = torch.Generator().manual_seed(len(prompt))
        return PromptEmbeddings(prompt_embeds=torch.randn(1, 16, 64, generator=g),
                                pooled_prompt_embeds=torch.randn(1, 32, generator=g))

    return Diffusers(pipe, encode_prompt=encode, max_batch_size=max_batch_size)


def _params(model: Any, setting: str, steps: int, seed: int = 7) -> Any:
    return model.validate({"prompt": "a lighthouse at dusk", "steps": steps, "seed": seed,
                           "height": SIZE, "width": SIZE, "cache": SETTINGS[setting]})


def _run_alone(model: Any, params: Any) -> tuple[float, Any, torch.Tensor]:
    state = model.start(params, torch.device("cpu"))
    t0 = time.perf_counter()
    frame = None
    for _ in range(state.total):
        frame = model.step([state])[0]
    wall = time.perf_counter() - t0
    return wall, state.cache, frame


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _image(model: Any, latents: torch.Tensor) -> torch.Tensor:
    from types import SimpleNamespace

    with torch.no_grad():  # (decode reads only the state's image count)
        return (model.decode(SimpleNamespace(images=1), latents).float().clamp(-1, 1) + 1) / 2


def measure(*, reps: int = 3, steps: int = 28, log: Any = print) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model()
    names = list(SETTINGS)
    walls: dict[str, list[float]] = {t: [] for t in names}
    skips: dict[str, float] = {}
    finals: dict[str, torch.Tensor] = {}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for t in order:
            wall, cache, frame = _run_alone(model, _params(model, t, steps))
            walls[t].append(wall)
            skips[t] = 0.0 if cache is None else cache.cached / (cache.cached + cache.computed)
            finals[t] = frame
        log(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{t}={walls[t][-1]:.2f}s" for t in names))
    reference = _image(model, finals["none"])
    alone = {
        t: {
            "wall_s": statistics.median(walls[t]),
            "speedup": statistics.median(walls["none"]) / statistics.median(walls[t]),
            "skip_rate": skips[t],
            "psnr_db": _psnr(_image(model, finals[t]), reference),
        }
        for t in names
    }
    # A mixed batch against the same requests apart.
    mix = MIXED
    batched, apart = [], []
    for rep in range(reps):
        for kind in (("batched", "apart") if rep % 2 == 0 else ("apart", "batched")):
            params = [_params(model, t, steps, seed=i) for i, t in enumerate(mix)]
            if kind == "apart":
                apart.append(sum(_run_alone(model, p)[0] for p in params))
            else:
                states = [model.start(p, torch.device("cpu")) for p in params]
                t0 = time.perf_counter()
                for _ in range(steps):
                    model.step(states)
                batched.append(time.perf_counter() - t0)
        log(f"  mixed rep {rep + 1}/{reps}: batched {batched[-1]:.2f}s, apart {apart[-1]:.2f}s")
    return {
        "steps": steps,
        "alone": alone,
        "mixed": {
            "batched_s": statistics.median(batched),
            "apart_s": statistics.median(apart),
            "speedup": statistics.median(apart) / statistics.median(batched),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="samples of each (default 3)")
    parser.add_argument("--steps", type=int, default=28, help="denoise steps (default 28)")
    args = parser.parse_args(argv)
    out = measure(reps=args.reps, steps=args.steps)
    print(f"step_cache: Flux-shaped random transformer, {SIZE}x{SIZE} px, {out['steps']} steps, one thread")
    print("| cache | wall time (median) | vs none | steps reused | PSNR vs none |")
    print("|---|---|---|---|---|")
    for name, row in out["alone"].items():
        psnr = "identical" if math.isinf(row["psnr_db"]) else f"{row['psnr_db']:.1f} dB"
        print(f"| {name} | {row['wall_s']:.2f} s | {row['speedup']:.2f}x | {row['skip_rate']:.0%} | {psnr} |")
    m = out["mixed"]
    print(f"mixed batch ({', '.join(MIXED)}): batched {m['batched_s']:.2f} s, "
          f"apart {m['apart_s']:.2f} s: {m['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
