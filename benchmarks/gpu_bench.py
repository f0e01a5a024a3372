"""GPU figures: the engine's per-step cost and copies, and real-sized diffusers pipelines.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (needs only torch and anyio;
the project need not be installed: run from the repository root). Prints a
table and writes JSON (``--json PATH``). Each figure is a ratio measured
side by side in one run, its variants interleaved and each warmed up first:

* ``core`` (``benchmarks/step_shapes.py``, the same rows CI's machines run
  on the simulated GPU): one request of a compute-bound (1.3 ms, 25 ms),
  launch-bound (8 ms) or video-latent (6 ms) step, engine against a bare
  loop (targets <= 1.03 at short steps, <= 1.01 from 6 ms) with the
  hand-written peer (a worker thread that ``.cpu()``s each output) beside it;
  and 9.2 MiB / 64 MiB frames, the engine's delivered GB/s against bare
  pinned ``copy_(non_blocking=True)`` copies (target >= 0.9), every frame
  checked byte for byte.
* ``diffusers_*`` (needs diffusers; skipped, saying why, without it):
  random-weight pipelines built from configs, no downloads. ``sd15``: a
  ``StableDiffusionPipeline`` with SD 1.5's UNet and VAE sizes (UNet
  block_out_channels (320, 640, 1280, 1280), ~860M parameters), fp16, 512 px,
  20 Euler steps with guidance. ``flux``: a ``FluxPipeline`` with a
  ``FluxTransformer2DModel`` at Flux.1's width (24 heads x 128 = 3072) and
  ``--flux-layers`` double/single blocks (default 19/38: Flux.1 dev's depth,
  ~12B parameters), bf16, 1024 px, 10 steps. Each streams through the
  engine with every step read and rendered to a JPEG preview
  (``Previewer``), once with a random-weight TAESD (the real taesd / taef1
  sizes) decoding every step on the GPU (``use_preview_vae``,
  ``preview_every=1``; on a side stream beside the next step) and once
  without (latent previews): on / off, target <= 1.03. Beside them,
  ``pipe(..., output_type="pt")`` itself, and the TAESD and VAE decodes alone
  in milliseconds. For ``sd15`` also ``batched4_vs_unbatched``: four requests
  at once through the engine, batched (the default: one UNet call a step)
  against ``batch=False`` (one call per request), throughput ratio and the
  largest latent difference; and ``model_switch``: two copies of it behind a
  ``ModelRouter`` with ``max_loaded=1``, the load (``pipe.to(device)``) and
  unload seconds and a request with a switch against one without. For both:
  ``pause_to_host_ms``, a request's ``model.snapshot`` (to the host) and
  ``model.restore`` (back) after two steps, and the checkpoint's bytes.
* ``diffusers_flux_cache_*`` (issue #35; ``--only cache`` for these alone):
  the same random Flux, ``--cache-steps`` (28) steps at ``--cache-size``
  (1024) px through the engine, latents out, per-request ``cache`` param:
  ``fbcache`` at 0.2 and 0.35 and ``taylorseer`` (diffusers'
  TaylorSeerCacheConfig defaults) against ``none``, one request at a time,
  settings interleaved: wall seconds, speed-up against ``none``, the share
  of steps that reused the cache (the frames' ``timings.cached``), and the
  final latents' PSNR against the uncached run of the same seed. Then the
  four together (one per setting) against the same four one after another.
  A method the model's ``cache`` param does not offer is a row saying so.
  Random weights: the speed of the mechanics only (a random transformer's
  residuals move more than a trained one's, so fbcache reuses less than it
  would), and the PSNR is no quality figure: quality needs real weights.
  ``--cache-reps`` (1: single samples, to stay within ``--cache-budget-s``,
  90 s, on an H200; the mixed batch is skipped, saying why, when the alone
  rows say it would not fit).

``--dry-run`` runs the diffusers rows (the cache rows at 32 px, 6 steps) on
the CPU with toy sizes (no CUDA needed): a check that the code runs, not a
measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import omni_stream as om  # noqa: E402

# -- diffusers: SD- and Flux-sized random-weight pipelines, TAESD previews on vs off --

TAESD_TARGET = "<= 1.03"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sd15_case(device: torch.device, dtype: torch.dtype, dry_run: bool, steps: int) -> dict:
    """A random ``StableDiffusionPipeline`` at SD 1.5's sizes (toy sizes with ``dry_run``)."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )

    if dry_run:
        unet_cfg = {"block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 32,
                    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}
        vae_cfg = {"block_out_channels": (32, 32, 32, 32), "layers_per_block": 1}
        px, embed_dim, seq = 64, 32, 7
    else:
        # UNet2DConditionModel's defaults are SD 1.5's blocks; its text width is CLIP-L's 768.
        unet_cfg = {"block_out_channels": (320, 640, 1280, 1280), "layers_per_block": 2}
        vae_cfg = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2}
        px, embed_dim, seq = 512, 768, 77
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds, not minutes
        unet = UNet2DConditionModel(sample_size=px // 8, in_channels=4, out_channels=4,
                                    cross_attention_dim=embed_dim, attention_head_dim=8, **unet_cfg)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                            down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, force_upcast=False,
                            sample_size=px, **vae_cfg)
    pipe = StableDiffusionPipeline(
        vae=_cast(vae, dtype), text_encoder=None, tokenizer=None, unet=_cast(unet, dtype),
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear", steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(1, seq, embed_dim, generator=g).to(device, dtype)
    neg = torch.randn(1, seq, embed_dim, generator=g).to(device, dtype)
    return {
        "name": "sd15",
        "pipe": pipe,
        "embeddings": {"prompt_embeds": emb, "negative_prompt_embeds": neg},
        "bare_kwargs": {"prompt_embeds": emb, "negative_prompt_embeds": neg,
                        "num_inference_steps": steps, "height": px, "width": px, "guidance_scale": 7.5},
        "params": {"prompt": "bench", "steps": steps, "seed": 0, "height": px, "width": px,
                   "guidance_scale": 7.5},
        "latent_channels": 4,
        "latent_side": px // 8,
        "sizes": {"unet": unet_cfg["block_out_channels"], "vae": vae_cfg["block_out_channels"],
                  "px": px, "dtype": str(dtype), "steps": steps,
                  "unet_params_M": round(sum(p.numel() for p in unet.parameters()) / 1e6, 1)},
    }


def _flux_case(
    device: torch.device, dtype: torch.dtype, dry_run: bool, steps: int, layers: tuple[int, int]
) -> dict:
    """A random ``FluxPipeline`` at Flux.1's width, ``layers`` (double, single) deep."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    if dry_run:
        tf_cfg = {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
                  "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
                  "axes_dims_rope": (2, 2, 4)}
        vae_cfg = {"block_out_channels": (32, 32, 32, 32), "layers_per_block": 1}
        px, seq, seq_bounds = 32, 7, (4, 64)
    else:
        # FluxTransformer2DModel's defaults are Flux.1's: 24 heads x 128, T5-XXL and CLIP-L widths.
        tf_cfg = {"num_layers": layers[0], "num_single_layers": layers[1], "attention_head_dim": 128,
                  "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                  "axes_dims_rope": (16, 56, 56)}
        vae_cfg = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2}
        px, seq, seq_bounds = 1024, 512, (256, 4096)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, guidance_embeds=True, **tf_cfg)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                            down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                            force_upcast=False, sample_size=px, **vae_cfg)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=seq_bounds[0], max_image_seq_len=seq_bounds[1],
        ),
        vae=_cast(vae, dtype), transformer=_cast(transformer, dtype),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(1, seq, tf_cfg["joint_attention_dim"], generator=g).to(device, dtype)
    pooled = torch.randn(1, tf_cfg["pooled_projection_dim"], generator=g).to(device, dtype)
    return {
        "name": "flux",
        "pipe": pipe,
        "embeddings": {"prompt_embeds": emb, "pooled_prompt_embeds": pooled},
        "bare_kwargs": {"prompt_embeds": emb, "pooled_prompt_embeds": pooled,
                        "num_inference_steps": steps, "height": px, "width": px, "guidance_scale": 3.5},
        "params": {"prompt": "bench", "steps": steps, "seed": 0, "height": px, "width": px,
                   "guidance_scale": 3.5},
        "latent_channels": 16,
        "latent_side": px // 8,
        "sizes": {"width": tf_cfg["num_attention_heads"] * tf_cfg["attention_head_dim"],
                  "layers": [tf_cfg["num_layers"], tf_cfg["num_single_layers"]], "px": px,
                  "dtype": str(dtype), "steps": steps,
                  "transformer_params_M": round(sum(p.numel() for p in transformer.parameters()) / 1e6, 1)},
    }


def _taesd(device: torch.device, dtype: torch.dtype, latent_channels: int):
    """A random-weight AutoencoderTiny with the real taesd (4 ch) / taef1 (16 ch) sizes."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(2)
    with torch.device(device):
        vae = AutoencoderTiny(encoder_block_out_channels=(64, 64, 64, 64),
                              decoder_block_out_channels=(64, 64, 64, 64),
                              latent_channels=latent_channels)
    return _cast(vae, dtype).eval()


def _cast(module, dtype: torch.dtype):
    # diffusers logs a warning for every .to(dtype), even a no-op one.
    return module if dtype == torch.float32 else module.to(dtype)


def _decode_ms(decode, device: torch.device, reps: int) -> list[float]:
    with torch.no_grad():
        decode()
        _sync(device)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            decode()
            _sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench_diffusers_case(case: dict, device: torch.device, reps: int) -> list[dict]:
    """pipe() against the engine streaming with previews, TAESD on and off, interleaved."""
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings
    from omni_stream.preview import Previewer, PreviewSpec, default_decoder

    name, pipe, params = case["name"], case["pipe"], case["params"]
    dtype = next(pipe.vae.parameters()).dtype
    embeddings = PromptEmbeddings(**case["embeddings"])
    model = Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings)
    taesd = _taesd(device, dtype, case["latent_channels"])
    model.use_preview_vae(taesd)
    previewer = Previewer()
    spec = PreviewSpec(every=1, format="jpeg", max_size=512, decoder=default_decoder(model))
    total = model.total_steps(model.validate(params))

    def bare() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            image = pipe(**case["bare_kwargs"], generator=torch.Generator("cpu").manual_seed(0),
                         output_type="pt").images
            image = image.cpu()  # on the host, as the engine delivers it
        return time.perf_counter() - t0

    decodes: list[float] = []
    nonfinite = 0

    async def stream(engine, preview_every) -> float:
        nonlocal nonfinite
        frames = 0
        _sync(device)
        t0 = time.perf_counter()
        async with engine.stream(params, policy="all", preview_every=preview_every) as s:
            async for frame in s:
                frames += 1
                if frame.final:
                    nonfinite += int(not torch.isfinite(frame.data).all())
                    continue  # the result: on the host, not encoded (pipe() does not encode either)
                if preview_every is not None:
                    assert frame.decoded, f"{name}: step {frame.step} was not decoded by the TAESD"
                    decodes.append(frame.timings.decode_s)
                await previewer.render(frame, spec)
        elapsed = time.perf_counter() - t0
        assert frames == total, f"{name}: {frames} frames for {total} steps"
        return elapsed

    samples: dict[str, list[float]] = {"bare": [], "off": [], "on": []}

    async def measure() -> None:
        async with om.Engine(model, device=str(device)) as engine:
            # Untimed: the producer's first calls, the TAESD's first decode, cuDNN's plans.
            await engine.generate(dict(params, steps=2, output="latent"), policy="all", preview_every=1)
            bare()
            order = ["bare", "off", "on"]
            for rep in range(reps):
                for variant in order if rep % 2 == 0 else order[::-1]:
                    if variant == "bare":
                        samples["bare"].append(bare())
                    else:
                        samples[variant].append(await stream(engine, 1 if variant == "on" else None))
                print(f"  {name} rep {rep + 1}/{reps}: "
                      + ", ".join(f"{k}={v[-1]:.3f}s" for k, v in samples.items()), flush=True)

    asyncio.run(measure())
    g = torch.Generator().manual_seed(4)
    side = case["latent_side"]
    latents = torch.randn(1, case["latent_channels"], side, side, generator=g).to(device, dtype)
    taesd_ms = _decode_ms(lambda: taesd.decode(latents), device, max(reps, 3))
    vae_ms = _decode_ms(lambda: pipe.vae.decode(latents), device, max(reps, 3))
    med = {k: statistics.median(v) for k, v in samples.items()}
    step_ms = (med["bare"] - statistics.median(vae_ms) / 1e3) / total * 1e3
    common = dict(
        **{f"{k}_s": v for k, v in med.items()},
        step_ms=step_ms,
        taesd_ms=statistics.median(taesd_ms),
        taesd_in_stream_ms=statistics.median(decodes) * 1e3 if decodes else math.nan,
        vae_ms=statistics.median(vae_ms),
        steps=total,
        final_nonfinite=nonfinite,
        sizes=case["sizes"],
        samples_s=samples,
    )
    return [
        {"figure": f"diffusers_{name}_taesd_on_vs_off", "value": med["on"] / med["off"],
         "target": TAESD_TARGET, **common},
        {"figure": f"diffusers_{name}_stream_vs_pipe", "value": med["off"] / med["bare"],
         "target": "-", **common},
    ]


def bench_batching(case: dict, device: torch.device, reps: int, count: int = 4) -> dict:
    """``count`` requests at once through the engine, batched (the default) against ``batch=False``."""
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    name, pipe, params = case["name"], case["pipe"], case["params"]
    embeddings = PromptEmbeddings(**case["embeddings"])
    models = {
        "batched": Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings),
        "unbatched": Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings, batch=False),
    }
    samples: dict[str, list[float]] = {k: [] for k in models}
    finals: dict[str, list[torch.Tensor]] = {}

    async def together(engine) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * count

        async def one(i: int) -> None:
            out[i] = (await engine.generate(dict(params, seed=i, output="latent"))).data

        await asyncio.gather(*(one(i) for i in range(count)))
        return out

    async def measure() -> None:
        for rep in range(reps):
            for key in (["batched", "unbatched"] if rep % 2 == 0 else ["unbatched", "batched"]):
                async with om.Engine(models[key], device=str(device)) as engine:
                    await engine.generate(dict(params, steps=2, output="latent"))  # untimed
                    _sync(device)
                    t0 = time.perf_counter()
                    finals[key] = await together(engine)
                    samples[key].append(time.perf_counter() - t0)
            print(f"  {name} x{count} rep {rep + 1}/{reps}: "
                  + ", ".join(f"{k}={v[-1]:.3f}s" for k, v in samples.items()), flush=True)

    asyncio.run(measure())
    med = {k: statistics.median(v) for k, v in samples.items()}
    diff = max(float((a.float() - b.float()).abs().max())
               for a, b in zip(finals["batched"], finals["unbatched"], strict=True))
    return {"figure": f"diffusers_{name}_batched{count}_vs_unbatched",
            "value": med["unbatched"] / med["batched"], "target": "-",
            **{f"{k}_s": v for k, v in med.items()},
            "max_abs_latent_diff": diff,
            "max_batch_size": models["batched"].max_batch_size, "samples_s": samples}


def bench_pause_to_host(case: dict, device: torch.device, reps: int) -> dict:
    """A request paused to host memory and back (issue #22): ``model.snapshot`` of a request
    after two steps (its latents, scheduler and conditioning to the host) and ``model.restore``
    (back to the device), in milliseconds, and the checkpoint's bytes."""
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    name, pipe, params = case["name"], case["pipe"], case["params"]
    embeddings = PromptEmbeddings(**case["embeddings"])
    model = Diffusers(pipe, encode_prompt=lambda p, n: embeddings)
    checked = model.validate(params)
    state = model.start(checked, device)
    for _ in range(2):
        model.step([state])
    snap_ms, restore_ms = [], []
    checkpoint = None
    for _ in range(max(3, reps)):
        _sync(device)
        t0 = time.perf_counter()
        checkpoint = model.snapshot(state)
        _sync(device)
        t1 = time.perf_counter()
        restored = model.restore(checkpoint, device)
        _sync(device)
        t2 = time.perf_counter()
        model.close(restored)
        snap_ms.append((t1 - t0) * 1e3)
        restore_ms.append((t2 - t1) * 1e3)
    model.close(state)
    assert checkpoint is not None
    return {"figure": f"diffusers_{name}_pause_to_host_ms", "value": statistics.median(snap_ms),
            "target": "-", "snapshot_ms": statistics.median(snap_ms),
            "restore_ms": statistics.median(restore_ms),
            "checkpoint_bytes": len(checkpoint.to_bytes())}


def bench_model_switch(case: dict, device: torch.device, reps: int) -> dict:
    """Two copies of the pipeline behind a ModelRouter with max_loaded=1: a request on the
    other model waits for this one's unload (``pipe.to("cpu")``) and that one's load
    (``pipe.to(device)``, a new engine). Seconds of each, and a request's time with a switch
    against without."""
    import copy

    from omni_stream.engine.router import ModelRouter
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    name, pipe, params = case["name"], case["pipe"], case["params"]
    embeddings = PromptEmbeddings(**case["embeddings"])
    other = copy.deepcopy(pipe).to("cpu")  # starts unloaded, as a second checkpoint would
    models = {"a": Diffusers(pipe, encode_prompt=lambda p, n: embeddings),
              "b": Diffusers(other, encode_prompt=lambda p, n: embeddings)}
    samples: dict[str, list[float]] = {"stay": [], "switch": []}
    loads: list[dict] = []

    async def measure() -> None:
        # The raw cost of a switch: no residency quantum, no swap budget.
        async with ModelRouter(models, max_loaded=1, min_residency_s=0, max_swaps_per_min=1_000_000,
                               device=str(device)) as router:
            await router.generate(dict(params, steps=2, output="latent"), model="a")  # untimed
            for rep in range(reps):
                for key, model in (("stay", "a"), ("switch", "b"), ("switch", "a")):
                    _sync(device)
                    t0 = time.perf_counter()
                    await router.generate(dict(params, output="latent"), model=model)
                    _sync(device)
                    samples[key].append(time.perf_counter() - t0)
                loads.append(router.load_times())
                print(f"  {name} model switch rep {rep + 1}/{reps}: "
                      + ", ".join(f"{k}={v[-1]:.3f}s" for k, v in samples.items()), flush=True)

    asyncio.run(measure())
    med = {k: statistics.median(v) for k, v in samples.items()}
    load_s = statistics.median(t[m][0] for t in loads for m in ("a", "b") if t[m][0] > 0)
    unload_s = statistics.median(t[m][1] for t in loads for m in ("a", "b") if t[m][1] > 0)
    models.clear()  # the copy's memory back before the next case (not del: measure() reads the name)
    del other
    return {"figure": f"diffusers_{name}_model_switch", "value": med["switch"] / med["stay"], "target": "-",
            "stay_s": med["stay"], "switch_s": med["switch"], "load_s": load_s, "unload_s": unload_s,
            "samples_s": samples}


# -- step caching per request (issue #35): Flux-sized, cached against uncached --

#: (row name, the request's ``cache`` param); taylorseer: diffusers' TaylorSeerCacheConfig
#: defaults (interval 5, warmup 3, order 1) are the param's.
CACHE_SETTINGS: tuple[tuple[str, dict], ...] = (
    ("none", {"method": "none"}),
    ("fbcache_0.2", {"method": "fbcache", "threshold": 0.2}),
    ("fbcache_0.35", {"method": "fbcache", "threshold": 0.35}),
    ("taylorseer", {"method": "taylorseer"}),
)
NOT_QUALITY = "random weights: not a quality figure"
#: The mixed batch costs about twice the alone rows (apart: their sum; together: at most it).
MIXED_COST = 2.0


def cache_methods(model) -> tuple[str, ...]:
    """The step-caching methods ``model`` offers: its ``cache`` param's ``method`` choices."""
    for param in getattr(model, "params", ()):
        if param.name == "cache":
            for field in param.fields:
                if field.name == "method":
                    return tuple(field.choices or (field.default,))
    return ()


def _latent_psnr(latents: torch.Tensor, reference: torch.Tensor) -> float:
    """dB, the peak being the reference's range (latents have no fixed one); inf when equal."""
    a, b = latents.float(), reference.float()
    mse = float(((a - b) ** 2).mean())
    peak = float(b.max() - b.min())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


async def _drain(engine, params: dict) -> dict:
    """One request read to its end, every frame: its reused steps, frames, batch sizes, result."""
    reused = frames = batch = 0
    final = None
    async with engine.stream(params, policy="all") as s:
        async for frame in s:
            frames += 1
            reused += int(frame.timings.cached)
            batch = max(batch, frame.timings.batch_size)
            if frame.final:
                final = frame.data
    assert final is not None and frames == params["steps"], f"{frames} frames for {params['steps']} steps"
    return {"reused": reused, "frames": frames, "batch": batch, "final": final}


def bench_step_cache(case: dict, device: torch.device, *, steps: int, size: int, reps: int,
                     budget_s: float) -> list[dict]:
    """The ``cache`` settings against ``none`` alone, then one request of each together against
    the four one after another (module docstring). A row per setting, skipped ones saying why."""
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    pipe = case["pipe"]
    embeddings = PromptEmbeddings(**case["embeddings"])
    model = Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings)
    offered = cache_methods(model)
    settings = {name: cache for name, cache in CACHE_SETTINGS if cache["method"] in offered}
    skipped = {
        name: f"the model's cache param offers {', '.join(offered) or 'nothing'}, not {cache['method']}"
        for name, cache in CACHE_SETTINGS if name not in settings
    }
    for name, why in skipped.items():
        print(f"  flux cache {name}: skipped: {why}", flush=True)
    # One of each setting in the mixed batch; a missing method's place goes to an uncached request.
    mix_names = [name if name in settings else "none" for name, _ in CACHE_SETTINGS]
    mix = [settings[name] for name in mix_names]

    def params(cache: dict, seed: int = 0, n: int = steps) -> dict:
        return dict(case["params"], steps=n, height=size, width=size, seed=seed, output="latent",
                     cache=cache)

    def cache_of(cache: dict) -> dict:  # the checked param: the method's defaults filled in
        return model.validate({k: v for k, v in params(cache).items() if k != "output"})["cache"]

    checked = {name: cache_of(cache) for name, cache in settings.items()}
    walls: dict[str, list[float]] = {name: [] for name in settings}
    runs: dict[str, dict] = {}
    mixed: dict[str, list[float]] = {"together": [], "apart": []}
    mixed_runs: dict[str, list[dict]] = {}
    why_no_mix = ""
    t_start = time.perf_counter()

    async def measure() -> None:
        nonlocal why_no_mix
        async with om.Engine(model, device=str(device)) as engine:
            # Untimed: each method's compute and reuse paths, alone and batched (kernels, plans).
            await asyncio.gather(*(_drain(engine, params(c, i, min(steps, 6))) for i, c in enumerate(mix)))
            await _drain(engine, params(mix[0], 0, 2))
            names = list(settings)
            for rep in range(reps):
                for name in names if rep % 2 == 0 else names[::-1]:
                    _sync(device)
                    t0 = time.perf_counter()
                    runs[name] = await _drain(engine, params(settings[name]))
                    walls[name].append(time.perf_counter() - t0)
                print(f"  flux cache rep {rep + 1}/{reps}: "
                      + ", ".join(f"{k}={v[-1]:.2f}s" for k, v in walls.items()), flush=True)
            spent = time.perf_counter() - t_start
            need = MIXED_COST * reps * sum(statistics.median(walls[name]) for name in mix_names)
            if spent + need > budget_s:
                why_no_mix = (f"the alone rows took {spent:.0f} s and the mixed batch would take about "
                              f"{need:.0f} s more, past --cache-budget-s {budget_s:.0f}")
                return
            for rep in range(reps):
                for kind in (("together", "apart") if rep % 2 == 0 else ("apart", "together")):
                    _sync(device)
                    t0 = time.perf_counter()
                    if kind == "together":
                        out = await asyncio.gather(*(_drain(engine, params(c, i)) for i, c in enumerate(mix)))
                    else:
                        out = [await _drain(engine, params(c, i)) for i, c in enumerate(mix)]
                    mixed[kind].append(time.perf_counter() - t0)
                    mixed_runs[kind] = list(out)
                print(f"  flux cache mixed x{len(mix)} rep {rep + 1}/{reps}: "
                      + ", ".join(f"{k}={v[-1]:.2f}s" for k, v in mixed.items()), flush=True)

    asyncio.run(measure())
    base = statistics.median(walls["none"])
    reference = runs["none"]["final"]
    # The transformer's sizes; its steps and px here are these rows' own.
    sizes = {k: v for k, v in case["sizes"].items() if k not in ("px", "steps")}
    common = {"steps": steps, "px": size, "reps": reps, "sizes": sizes}
    out: list[dict] = []
    for name, _ in CACHE_SETTINGS:
        figure = f"diffusers_flux_cache_{name}"
        if name in skipped:
            out.append({"figure": figure, "value": None, "target": "-", "skipped": skipped[name]})
            continue
        run, wall = runs[name], statistics.median(walls[name])
        row = {"figure": figure, "value": base / wall, "target": "-", "wall_s": wall,
               "reused": run["reused"] / run["frames"], "reused_steps": run["reused"],
               "cache": checked[name], **common, "samples_s": walls[name]}
        if name != "none":
            psnr = _latent_psnr(run["final"], reference)
            row.update(psnr_db=None if math.isinf(psnr) else psnr, identical_to_none=math.isinf(psnr),
                       psnr_note=NOT_QUALITY)
        row["final_nonfinite"] = int(not torch.isfinite(run["final"]).all())
        out.append(row)
    figure = f"diffusers_flux_cache_mixed{len(mix)}_together_vs_apart"
    if why_no_mix:
        print(f"  flux cache mixed: skipped: {why_no_mix}", flush=True)
        out.append({"figure": figure, "value": None, "target": "-", "skipped": why_no_mix})
    else:
        together, apart = (statistics.median(mixed[k]) for k in ("together", "apart"))
        diff = max(float((a["final"].float() - b["final"].float()).abs().max())
                   for a, b in zip(mixed_runs["together"], mixed_runs["apart"], strict=True))
        runs_t = mixed_runs["together"]
        reused = sum(r["reused"] for r in runs_t) / sum(r["frames"] for r in runs_t)
        out.append({"figure": figure, "value": apart / together, "target": "-", "together_s": together,
                    "apart_s": apart, "reused": reused,
                    "max_batch": max(r["batch"] for r in runs_t), "max_abs_latent_diff": diff,
                    "caches": [cache_of(c) for c in mix], **common,
                    "samples_s": mixed})
    _print_cache_table(out)
    return out


def _print_cache_table(rows: list[dict]) -> None:
    first = next((r for r in rows if "steps" in r), None)
    if first is None:
        return
    reps = first["reps"]
    print(f"flux step caching: random weights {first['sizes'].get('layers')} layers, {first['px']} px, "
          f"{first['steps']} steps, {reps} rep{'s' * (reps != 1)}"
          f"{' (single samples, not medians)' if reps == 1 else ' (medians, interleaved)'}: speed only")
    print(f"| cache | wall | vs none | steps reused | final latents' PSNR vs none ({NOT_QUALITY}) |")
    print("|---|---|---|---|---|")
    *alone, mixed = rows
    for r in alone:
        name = r["figure"].removeprefix("diffusers_flux_cache_")
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | |")
            continue
        psnr = "-" if name == "none" else "identical" if r["identical_to_none"] else f"{r['psnr_db']:.1f} dB"
        print(f"| {name} | {r['wall_s']:.2f} s | {r['value']:.2f}x | {r['reused']:.0%} | {psnr} |")
    if "skipped" in mixed:
        print(f"mixed batch: skipped: {mixed['skipped']}", flush=True)
        return
    caches = ", ".join(c["method"] + (f" {c['threshold']}" if c["method"] == "fbcache" else "")
                       for c in mixed["caches"])
    print(f"mixed batch ({caches}): together {mixed['together_s']:.2f} s (batches of up to "
          f"{mixed['max_batch']}), one after another {mixed['apart_s']:.2f} s: {mixed['value']:.2f}x; "
          f"{mixed['reused']:.0%} of steps reused; largest latent difference together vs apart "
          f"{mixed['max_abs_latent_diff']:.3g}", flush=True)


def bench_diffusers(args, device: torch.device, rows: list[dict]) -> str:
    """Append the diffusers rows to ``rows`` (written to ``--json`` as each model ends).

    Returns why nothing was measured ("" when it was): diffusers is missing.
    """
    try:
        import diffusers
    except ImportError as exc:
        return (f"diffusers is not importable ({exc}); scripts/gpu_check.sh installs it from "
                "wheels in .whl (see the script), skipping the diffusers rows")
    warnings.filterwarnings("ignore", message="__array__ implementation", category=DeprecationWarning)
    # Not "should be kept in float32: []" for every cast of a random model.
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        return _bench_diffusers(args, device, rows)
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)


def _bench_diffusers(args, device: torch.device, rows: list[dict]) -> str:
    dry = args.dry_run
    only_cache = args.only == "cache"
    cases = [
        ("sd15", lambda: _sd15_case(device, torch.float32 if dry else torch.float16, dry,
                                    2 if dry else args.sd_steps), 1 if dry else max(args.reps, 5)),
        ("flux", lambda: _flux_case(device, torch.float32 if dry else torch.bfloat16, dry,
                                    2 if dry else args.flux_steps, args.flux_layers),
         1 if dry else args.reps),
    ]
    for name, build, reps in cases:
        if (args.diffusers_models and name not in args.diffusers_models) or (only_cache and name != "flux"):
            continue
        t0 = time.perf_counter()
        case = build()
        print(f"  {name}: built {case['sizes']} in {time.perf_counter() - t0:.1f} s", flush=True)
        first = len(rows)
        if not only_cache:
            rows += bench_diffusers_case(case, device, reps)
            if name == "sd15":
                # Batching across requests, on by default: 4 at once, one UNet call a step or four.
                rows.append(bench_batching(case, device, 1 if dry else 3))
                # Several models, one on the device at a time: what a switch costs.
                rows.append(bench_model_switch(case, device, 1 if dry else 2))
            # A request paused to the host and back (snapshot / restore).
            rows.append(bench_pause_to_host(case, device, 1 if dry else 5))
        if name == "flux" and args.cache_steps > 0:
            # Step caching per request: last, as its block wrappers stay on the transformer.
            t1 = time.perf_counter()
            rows += bench_step_cache(
                case, device, steps=min(args.cache_steps, 6) if dry else args.cache_steps,
                size=case["params"]["height"] if dry else args.cache_size,
                reps=1 if dry else args.cache_reps, budget_s=args.cache_budget_s)
            print(f"  flux cache rows: {time.perf_counter() - t1:.1f} s", flush=True)
        _print_rows(rows[first:])
        if args.json:
            args.json.write_text(json.dumps({"meta": _meta(device), "figures": rows}, indent=2))
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ""


def _meta(device: torch.device) -> dict:
    meta = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    try:
        import diffusers

        meta["diffusers"] = diffusers.__version__
    except ImportError:
        meta["diffusers"] = None
    return meta


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        if r.get("skipped"):
            print(f"{r['figure']:<28} skipped: {r['skipped']}", flush=True)
            continue
        extra = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in r.items()
                          if k not in ("figure", "value", "target", "samples_s", "cache", "caches"))
        print(f"{r['figure']:<28} {r['value']:.3f}  (target {r['target']})  {extra}", flush=True)


def _layers(text: str) -> tuple[int, int]:
    double, single = (int(x) for x in text.split(","))
    return double, single


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=("core", "diffusers", "cache", "all"), default="all",
                    help="core: bandwidth and stream overhead; diffusers: the pipeline rows (the cache "
                         "rows among them); cache: the Flux step-caching rows alone")
    ap.add_argument("--diffusers-models", nargs="+", choices=("sd15", "flux"),
                    help="which diffusers models (default both)")
    ap.add_argument("--flux-layers", type=_layers, default=(19, 38), metavar="DOUBLE,SINGLE",
                    help="Flux transformer depth (default 19,38: Flux.1's)")
    ap.add_argument("--sd-steps", type=int, default=20)
    ap.add_argument("--flux-steps", type=int, default=10)
    ap.add_argument("--cache-steps", type=int, default=28, help="steps of the cache rows (0: none of them)")
    ap.add_argument("--cache-size", type=int, default=1024, help="px of the cache rows (default 1024)")
    ap.add_argument("--cache-reps", type=int, default=1,
                    help="samples of each cache row (default 1: single samples, to fit the budget)")
    ap.add_argument("--cache-budget-s", type=float, default=90.0,
                    help="the mixed-batch cache row is skipped, saying why, when it would end past this")
    ap.add_argument("--dry-run", action="store_true",
                    help="the diffusers rows on the CPU at toy sizes: checks the code runs, measures nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # toy models: two threads would only wait for each other
        try:
            why = bench_diffusers(args, device, [])
        finally:
            torch.set_num_threads(threads)
        if why:
            print(why, file=sys.stderr)
            return 2
        print(json.dumps(_meta(device)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows: list[dict] = []
    why = ""
    if args.only in ("core", "all"):
        from benchmarks.step_shapes import ROWS, measure_row

        for row in ROWS:
            r = asyncio.run(measure_row(row, "cuda", args.reps))
            r.pop("samples_s", None)
            rows.append(r)
            _print_rows(rows[-1:])
            if args.json:
                args.json.write_text(json.dumps({"meta": _meta(device), "figures": rows}, indent=2))
    if args.only in ("diffusers", "cache", "all"):
        why = bench_diffusers(args, device, rows)
        if why:
            print(why, flush=True)
    meta = dict(_meta(device), diffusers_skipped=why or None)
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "figures": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
