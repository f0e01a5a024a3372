"""A diffusers pipeline streamed every step, against ``pipe(...)`` itself (CPU).

One random-weight Stable Diffusion pipeline built from configs (no
downloads): a UNet with ``block_out_channels`` (32, 64), an SD-like VAE
(four blocks, 8x downsampling), 64 px images (8x8 latents), an Euler
scheduler, 10 steps with classifier-free guidance, fixed prompt embeddings
(``encode_prompt=``, as the tests do). One ``pipe()`` call takes ~0.3-0.5 s
on one core here: steps long enough to be a model, short enough that the
engine's per-step costs would show.

The variants, interleaved (A B ... B A), ``3 * ctx.reps`` samples each
(the samples are short and the machine noisy; ``ctx.reps`` with ``--quick``):

``bare_1t``
    ``pipe(prompt_embeds=..., generator=..., output_type="pt")`` in the main
    thread under ``torch.set_num_threads(1)``: the baseline. The engine's
    producer runs one torch thread by default (``torch_threads``), so both
    sides compute with one thread; this is passed explicitly here.
``native_previews``
    ``om.Engine(Diffusers(pipe, encode_prompt=...), device="cpu")``, every
    step read (policy ``all``) and rendered to a 512 px-bounded JPEG with
    :class:`~omni_stream.preview.Previewer` in a worker thread, the final
    frame (decoded by the VAE on the producer, ``output: "image"``) encoded
    as PNG in a preview thread: what the server's consumer and the CLI do.
``native_stream``
    the engine with every frame read and nothing rendered (information).
``native_taesd``
    ``native_previews`` with ``model.use_preview_vae(AutoencoderTiny)`` and
    ``preview_every=1``: every step decoded by a random-weight TAESD (the
    real taesd sizes) on the producer, the pixels rendered as above.
``callback_stream`` / ``callback_previews``
    ``Diffusers(pipe, mode="callback")``: ``pipe()`` itself on the
    producer, each step's latents emitted from its step callback; read only,
    and read + rendered like ``native_previews``.

``bare_sampler`` / ``native_sampler_previews``
    a request with ``sampler`` :data:`SAMPLER` (DPM++ 2M Karras, a scheduler
    of its own built per request) against ``pipe()`` after ``pipe.scheduler =
    DPMSolverMultistepScheduler.from_config(..., use_karras_sigmas=True)``.
``lora_same`` / ``lora_switch`` (with peft)
    two requests at once on one engine, unbatched (one at a time on the
    producer, so their steps alternate), on a copy of the pipeline with one random LoRA
    (rank 4 on the UNet's attention) loaded: both with the LoRA at 0.8, or
    one with it and one without, which puts a ``set_adapters`` /
    ``disable_lora`` before every step.

Then, after ``bare_1t`` again (two samples each, one when the first is
over 4x slower), ``bare_default``: the same call with torch's default
threads (information: what the thread setting alone is worth on this
machine; apart, because on a busy 2-core machine it can take 10-25x as
long). Then, in a worker thread with one torch thread (the producer's
arrangement): the TAESD decode of 64x64 latents to a 512 px image, and the
pipeline's own VAE decode of its 8x8 latents (the final frame's decode).

Figures: ``native_previews / bare_1t`` (target <= 1.10), ``callback_stream
/ bare_1t`` (target <= 1.05), ``native_sampler_previews / bare_sampler``
(target <= 1.10), ``lora_switch / lora_same`` and the ms of one switch
(information), the TAESD preview run against the run
without (information on a CPU; ``gpu_bench.py`` has the GPU figure), and
the decodes in milliseconds. Needs ``diffusers``.
"""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

import omni_stream as om

from .harness import (
    DEFAULT_TORCH_THREADS,
    Context,
    Figure,
    Target,
    interleave,
    median,
    reset_main_thread,
    run_in_thread,
    torch_threads,
)

__all__ = ["QUICK_SIZES", "SIZES", "Sizes", "build_pipe", "build_taesd", "run"]

NATIVE_TARGET = Target("<=", 1.10)
CALLBACK_TARGET = Target("<=", 1.05)
#: The Engine's producer threads, and the baseline's: one torch thread on both sides.
THREADS = 1
#: The non-default sampler measured against pipe() with the same scheduler.
SAMPLER = "dpmpp_2m_karras"


@dataclass(frozen=True)
class Sizes:
    """The random pipeline's sizes (one figure run uses one set)."""

    unet: tuple[int, ...]
    unet_layers: int
    vae: tuple[int, ...]
    vae_layers: int
    groups: int
    embed_dim: int
    seq: int
    px: int
    steps: int
    #: Latent side of the standalone TAESD decode row (64 -> 512 px).
    taesd_latent: int
    taesd_reps: int


SIZES = Sizes(
    unet=(32, 64), unet_layers=2, vae=(64, 128, 128, 128), vae_layers=2, groups=32,
    embed_dim=64, seq=77, px=64, steps=10, taesd_latent=64, taesd_reps=3,
)
#: --quick: the same code on toy sizes (its numbers only show that it runs).
QUICK_SIZES = Sizes(
    unet=(8, 16), unet_layers=1, vae=(8, 8, 8, 8), vae_layers=1, groups=4,
    embed_dim=16, seq=7, px=64, steps=3, taesd_latent=8, taesd_reps=1,
)


def _quiet_diffusers() -> None:
    # diffusers' schedulers call np.array(tensor, copy=False) (a numpy 2
    # deprecation): not ours, and not worth a line per step.
    warnings.filterwarnings("ignore", message="__array__ implementation", category=DeprecationWarning)


def build_pipe(sizes: Sizes) -> Any:
    """A random-weight ``StableDiffusionPipeline`` (no text encoder) of ``sizes``, seeded."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )

    n = len(sizes.unet)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=sizes.unet,
        layers_per_block=sizes.unet_layers,
        sample_size=sizes.px // 8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=sizes.embed_dim,
        norm_num_groups=sizes.groups,
        attention_head_dim=8,
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=sizes.vae,
        layers_per_block=sizes.vae_layers,
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * len(sizes.vae),
        up_block_types=["UpDecoderBlock2D"] * len(sizes.vae),
        latent_channels=4,
        norm_num_groups=sizes.groups,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_taesd(dtype: torch.dtype = torch.float32, latent_channels: int = 4) -> Any:
    """A random-weight ``AutoencoderTiny`` with the real taesd sizes (diffusers' defaults).

    Encoder and decoder block_out_channels (64, 64, 64, 64), blocks (1, 3,
    3, 3) / (3, 3, 3, 1), 8x upsampling: what ``madebyollin/taesd`` is
    (``latent_channels=16`` for taesd3 / taef1).
    """
    from diffusers import AutoencoderTiny

    torch.manual_seed(2)
    vae = AutoencoderTiny(
        encoder_block_out_channels=(64, 64, 64, 64),
        decoder_block_out_channels=(64, 64, 64, 64),
        latent_channels=latent_channels,
    )
    if dtype != torch.float32:
        vae = vae.to(dtype=dtype)
    return vae.eval()


def _embeddings(sizes: Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(1, sizes.seq, sizes.embed_dim, generator=g),
        torch.randn(1, sizes.seq, sizes.embed_dim, generator=g),
    )


def _lora_model(sizes: Sizes, embeddings: Any) -> tuple[Any, str, list[float]]:
    """A native model on a copy of the pipeline with one random LoRA ("ink") loaded; the error
    text instead where peft is missing; and the ms of each of 20 switches on and off."""
    try:
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft import LoraConfig
        from peft.utils import get_peft_model_state_dict
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}", []
    from omni_stream.models.diffusers import Diffusers

    pipe = build_pipe(sizes)  # the same weights, its own modules: the others run without peft's layers
    torch.manual_seed(9)
    unet = UNet2DConditionModel.from_config(pipe.unet.config)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    folder = tempfile.mkdtemp(prefix="omni-lora-")
    StableDiffusionPipeline.save_lora_weights(
        folder, unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    )
    # batch=False: both variants make one UNet call per request and step (two
    # requests with the same LoRAs would otherwise share calls, the others not).
    model = Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings, batch=False)
    model.load_loras({"ink": folder})
    bank = model._loras
    switch_ms = []
    for i in range(20):
        t0 = time.perf_counter()
        bank.activate((("ink", 0.8),) if i % 2 == 0 else ())
        switch_ms.append((time.perf_counter() - t0) * 1e3)
    return model, "", switch_ms


def _decode_ms(decode: Callable[[], Any], reps: int, *, warm: bool = True) -> list[float]:
    """Milliseconds of each of ``reps`` calls, after one untimed call if ``warm``."""
    with torch.no_grad():
        if warm:
            decode()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            decode()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _taesd_gflop(latent_side: int) -> float:
    """Rough GFLOP of a taesd decode: its 64->64 3x3 convolutions (3 blocks of 3 and one
    upsampling conv at 1x, 2x, 4x; one block of 3 and one conv at 8x) dominate."""
    per_pixel = 64 * 64 * 9 * 2  # FLOP of one 64->64 3x3 conv at one pixel
    convs = {1: 9 + 0, 2: 1 + 9, 4: 1 + 9, 8: 1 + 3}
    return sum(n * per_pixel * (latent_side * k) ** 2 for k, n in convs.items()) / 1e9


def _spread(xs: Sequence[float]) -> dict[str, float]:
    m = median(xs)
    return {"median": m, "min": min(xs), "max": max(xs), "range_rel": (max(xs) - min(xs)) / m}


def _paired(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-repetition ratios a_i / b_i (the two ran next to each other)."""
    return [x / y for x, y in zip(a, b, strict=True)]


async def run(ctx: Context) -> list[Figure]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("diffusers_stream needs diffusers (pip install diffusers)") from exc
    _quiet_diffusers()
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings
    from omni_stream.preview import (
        Previewer,
        PreviewSpec,
        default_decoder,
        encode_output,
    )

    sizes = QUICK_SIZES if ctx.quick else SIZES
    pipe = build_pipe(sizes)
    emb, neg = _embeddings(sizes)
    embeddings = PromptEmbeddings(prompt_embeds=emb, negative_prompt_embeds=neg)
    params = {"prompt": "bench", "steps": sizes.steps, "seed": 0, "height": sizes.px, "width": sizes.px}

    native = Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings)
    native_taesd = Diffusers(pipe, encode_prompt=lambda prompt, negative: embeddings)
    taesd = build_taesd()
    native_taesd.use_preview_vae(taesd)
    callback: Any = None
    callback_error = ""
    try:
        callback = Diffusers(
            pipe, mode="callback", call_kwargs={"prompt_embeds": emb, "negative_prompt_embeds": neg}
        )
    except ImportError as exc:  # callback.py missing or broken: measure the rest
        callback_error = f"{type(exc).__name__}: {exc}"
        ctx.log(f"callback mode not measured: {callback_error}")
    callback_params = {"steps": sizes.steps, "seed": 0, "height": sizes.px, "width": sizes.px}

    previewer = Previewer()
    spec = PreviewSpec(every=1, format="jpeg", max_size=512, decoder=default_decoder(native))
    total = native.total_steps(native.validate(params))
    ctx.log(
        f"diffusers_stream: SD pipeline, UNet {sizes.unet} x{sizes.unet_layers}, VAE {sizes.vae} "
        f"x{sizes.vae_layers}, {sizes.px} px ({sizes.px // 8}x{sizes.px // 8} latents), "
        f"{sizes.steps} Euler steps with guidance, {THREADS} torch thread"
    )

    def bare_call(on: Any = pipe) -> torch.Tensor:
        return on(
            prompt_embeds=emb,
            negative_prompt_embeds=neg,
            num_inference_steps=sizes.steps,
            height=sizes.px,
            width=sizes.px,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images[0]

    outputs: dict[str, torch.Tensor] = {}
    #: Process CPU seconds of each timed sample (every thread: producer, loop, previews).
    cpu_s: dict[str, list[float]] = {}

    def bare(threads: int | None, key: str, on: Any = pipe) -> Callable[[], Awaitable[float]]:
        async def sample() -> float:
            reset_main_thread()
            with torch_threads(threads), torch.no_grad():
                c0, t0 = time.process_time(), time.perf_counter()
                image = bare_call(on)
                elapsed = time.perf_counter() - t0
                cpu_s.setdefault(key, []).append(time.process_time() - c0)
            outputs[key] = image * 2.0 - 1.0  # the engine's range
            return elapsed

        return sample

    decode_s: dict[str, list[float]] = {}

    def engine(
        model: Any, run_params: Mapping[str, Any], key: str, *, render: bool, preview_every: int | None = None
    ) -> Callable[[], Awaitable[float]]:
        async def sample() -> float:
            reset_main_thread()
            frames = rendered = 0
            final = None
            decodes = []
            async with om.Engine(model, device="cpu", torch_threads=THREADS) as eng:
                # Untimed: the new producer thread's first UNet call.
                await eng.generate(dict(run_params, steps=1, output="latent"), policy="all")
                c0, t0 = time.process_time(), time.perf_counter()
                async with eng.stream(run_params, policy="all", preview_every=preview_every) as stream:
                    async for frame in stream:
                        frames += 1
                        if frame.decoded and not frame.final:
                            decodes.append(frame.timings.decode_s)
                        if frame.final:
                            final = frame
                            if render:
                                # The server's result message: full size, PNG.
                                image = await previewer.run_sync(encode_output, frame, "png", None, run_params)
                                rendered += len(image.data) > 0
                        elif render:
                            image = await previewer.render(frame, spec)
                            rendered += len(image.data) > 0
                elapsed = time.perf_counter() - t0
                cpu_s.setdefault(key, []).append(time.process_time() - c0)
            assert frames == total, f"{key}: {frames} frames for {total} steps"
            assert not render or rendered == total, f"{key}: rendered {rendered} of {total}"
            assert final is not None and final.decoded, f"{key}: the final frame is not the image"
            if preview_every is not None:
                assert len(decodes) == total - 1, f"{key}: {len(decodes)} previews decoded on the producer"
                decode_s.setdefault(key, []).extend(decodes)
            outputs[key] = final.data
            return elapsed

        return sample

    def pair(
        model: Any, first: Mapping[str, Any], second: Mapping[str, Any], key: str
    ) -> Callable[[], Awaitable[float]]:
        """Two requests at once on one engine: their steps alternate on the producer."""

        async def drain(eng: om.Engine, run_params: Mapping[str, Any]) -> None:
            async with eng.stream(run_params, policy="all") as stream:
                async for _ in stream:
                    pass

        async def sample() -> float:
            reset_main_thread()
            async with om.Engine(model, device="cpu", torch_threads=THREADS) as eng:
                await eng.generate(dict(first, steps=1, output="latent"), policy="all")
                c0, t0 = time.process_time(), time.perf_counter()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain, eng, first)
                    tg.start_soon(drain, eng, second)
                elapsed = time.perf_counter() - t0
                cpu_s.setdefault(key, []).append(time.process_time() - c0)
                return elapsed

        return sample

    # The sampler: its own scheduler per request, against pipe() switched to it.
    from omni_stream.models.diffusers import samplers as sampler_table

    entry = next(s for s in sampler_table.NOISE if s.name == SAMPLER)
    switched = copy.copy(pipe)
    switched.scheduler = sampler_table.build(entry, pipe.scheduler.config)
    sampler_params = dict(params, sampler=SAMPLER)

    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "bare_1t": bare(THREADS, "bare_1t"),
        "bare_sampler": bare(THREADS, "bare_sampler", switched),
        "native_sampler_previews": engine(native, sampler_params, "native_sampler_previews", render=True),
        "native_previews": engine(native, params, "native_previews", render=True),
        "native_stream": engine(native, params, "native_stream", render=False),
        "native_taesd": engine(native_taesd, params, "native_taesd", render=True, preview_every=1),
    }
    if callback is not None:
        variants["callback_stream"] = engine(callback, callback_params, "callback_stream", render=False)
        variants["callback_previews"] = engine(callback, callback_params, "callback_previews", render=True)
    lora_model, lora_error, switch_ms = _lora_model(sizes, embeddings)
    if lora_model is not None:
        with_lora = dict(params, loras=[{"name": "ink", "scale": 0.8}])
        variants["lora_same"] = pair(lora_model, with_lora, dict(with_lora, seed=1), "lora_same")
        variants["lora_switch"] = pair(lora_model, with_lora, dict(params, seed=1), "lora_switch")
    else:
        ctx.log(f"LoRA switching not measured: {lora_error}")

    # Untimed: every code path once (first calls allocate, import, build caches).
    reset_main_thread()
    with torch_threads(THREADS), torch.no_grad():
        bare_call()
    # The samples are short (~0.4 s) and the machine shared (the same pipe()
    # call took 0.32-0.62 s within one run here): three times the suite's
    # repetitions for the figures with targets.
    reps = ctx.reps if ctx.quick else 3 * ctx.reps
    samples = await interleave(variants, reps, ctx=ctx)
    # torch's default threads, apart: on a shared 2-core machine a two-thread
    # team can take 10-25x as long (a helper waits for a core someone else
    # holds), which would stretch the run without telling more.
    threads_samples: dict[str, list[float]] = {"bare_1t": [], "bare_default": []}
    one_t, default_t = bare(THREADS, "bare_1t_beside_default"), bare(None, "bare_default")
    for rep in range(1 if ctx.quick else 2):
        threads_samples["bare_1t"].append(await one_t())
        threads_samples["bare_default"].append(await default_t())
        ctx.log(
            f"threads {rep + 1}: bare_1t={threads_samples['bare_1t'][-1]:.4g}, "
            f"bare_default={threads_samples['bare_default'][-1]:.4g}"
        )
        if threads_samples["bare_default"][-1] > 4 * threads_samples["bare_1t"][-1]:
            break  # the point is made; another sample would cost another ~10 s
    med = {k: median(v) for k, v in samples.items()}
    med["bare_default"] = median(threads_samples["bare_default"])
    med["bare_1t_beside_default"] = median(threads_samples["bare_1t"])

    # The decodes alone, in a worker thread with the producer's one torch thread.
    reset_main_thread()
    side = sizes.taesd_latent
    big = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(4))
    small = torch.randn(1, 4, sizes.px // 8, sizes.px // 8, generator=torch.Generator().manual_seed(5))
    reps_small = max(3, ctx.reps)
    taesd_small_ms = run_in_thread(lambda: _decode_ms(lambda: taesd.decode(small), reps_small), threads=THREADS)
    # Warm from the small decodes and the streaming runs (a 512 px decode takes seconds).
    taesd_ms = run_in_thread(
        lambda: _decode_ms(lambda: taesd.decode(big), sizes.taesd_reps, warm=False), threads=THREADS
    )
    vae_ms = run_in_thread(lambda: _decode_ms(lambda: pipe.vae.decode(small), reps_small), threads=THREADS)
    out_px = side * 8  # taesd upsamples 8x

    # The engine gives pipe()'s image (native: the same operations; callback: pipe() itself).
    diffs = {
        k: float((v - outputs["bare_1t"]).abs().max())
        for k, v in outputs.items()
        if k not in ("bare_1t", "bare_sampler", "native_sampler_previews")
    }
    diffs["native_sampler_previews_vs_bare_sampler"] = float(
        (outputs["native_sampler_previews"] - outputs["bare_sampler"]).abs().max()
    )
    # A step of pipe() (the final VAE decode taken out).
    step_ms = (med["bare_1t"] - median(vae_ms) / 1e3) / total * 1e3
    taesd_in_stream_ms = median(decode_s.get("native_taesd", [])) * 1e3
    spread = {k: _spread(v) for k, v in samples.items()}
    details: dict[str, Any] = {
        "sizes": {k: getattr(sizes, k) for k in sizes.__dataclass_fields__},
        "steps": total,
        "torch_threads_baseline_and_producer": THREADS,
        "torch_threads_default": DEFAULT_TORCH_THREADS,
        "samples_s": samples,
        "threads_samples_s": threads_samples,
        "cpu_s": cpu_s,
        "cpu_median_s": {k: median(v) for k, v in cpu_s.items()},
        "spread": spread,
        "max_abs_diff_vs_pipe": diffs,
        "bare_ms_per_step": step_ms,
        "taesd_decode_in_stream_ms": taesd_in_stream_ms,
        "taesd_decode_ms_samples": taesd_ms,
        "taesd_decode_pipeline_latents_ms_samples": taesd_small_ms,
        "vae_decode_ms_samples": vae_ms,
        "callback_error": callback_error,
        "sampler": SAMPLER,
        "lora_error": lora_error,
        "lora_switch_ms_samples": switch_ms,
    }

    def paired_text(a: str, b: str) -> str:
        ratios = _paired(samples[a], samples[b])
        cpu = median(cpu_s[a]) / median(cpu_s[b])
        fastest = min(samples[a]) / min(samples[b])
        return (
            f"per-rep {a}/{b}: median {median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f}; "
            f"fastest/fastest {fastest:.3f}; process CPU {cpu:.3f}x"
        )

    baseline = {"bare_1t": med["bare_1t"]}
    figures = [
        Figure(
            name="diffusers_stream.native_previews_vs_pipe",
            value=med["native_previews"] / med["bare_1t"],
            target=NATIVE_TARGET,
            baseline=baseline,
            engine={"native_previews": med["native_previews"], "native_stream": med["native_stream"]},
            limits=(
                f"{total} steps of {step_ms:.1f} ms (one torch thread both sides): the engine's "
                f"per-frame work and a JPEG preview of every step in a preview thread beside the "
                f"producer on 2 shared cores; {paired_text('native_previews', 'bare_1t')}; "
                f"streaming alone {med['native_stream'] / med['bare_1t']:.3f}x"
            ),
            details=details,
        ),
        Figure(
            name="diffusers_stream.native_stream_vs_pipe",
            value=med["native_stream"] / med["bare_1t"],
            target=None,
            baseline=baseline,
            engine={"native_stream": med["native_stream"]},
            limits=(
                f"every frame read, none rendered: the engine's own cost over pipe(); "
                f"{paired_text('native_stream', 'bare_1t')}"
            ),
            details=details,
        ),
    ]
    figures.append(
        Figure(
            name="diffusers_stream.native_sampler_previews_vs_pipe",
            value=med["native_sampler_previews"] / med["bare_sampler"],
            target=NATIVE_TARGET,
            baseline={"bare_sampler": med["bare_sampler"]},
            engine={"native_sampler_previews": med["native_sampler_previews"]},
            limits=(
                f"sampler {SAMPLER!r} per request (a deep copy of a scheduler built once) against "
                f"pipe() with that scheduler, JPEG previews of every step; "
                f"{paired_text('native_sampler_previews', 'bare_sampler')}; largest difference in "
                f"the result {diffs['native_sampler_previews_vs_bare_sampler']:.3g}"
            ),
            details=details,
        )
    )
    if lora_model is not None:
        figures.append(
            Figure(
                name="diffusers_stream.lora_switch_vs_same",
                value=med["lora_switch"] / med["lora_same"],
                target=None,
                baseline={"lora_same": med["lora_same"]},
                engine={"lora_switch": med["lora_switch"], "switch_ms": median(switch_ms)},
                limits=(
                    f"two requests whose steps alternate, one LoRA (rank 4) on or off at every step "
                    f"against both with it: one set_adapters / disable_lora takes "
                    f"{median(switch_ms):.2f} ms ({min(switch_ms):.2f}-{max(switch_ms):.2f}) on this "
                    f"UNet; {paired_text('lora_switch', 'lora_same')}"
                ),
                details=details,
            )
        )
    if callback is not None:
        figures += [
            Figure(
                name="diffusers_stream.callback_vs_pipe",
                value=med["callback_stream"] / med["bare_1t"],
                target=CALLBACK_TARGET,
                baseline=baseline,
                engine={"callback_stream": med["callback_stream"], "callback_previews": med["callback_previews"]},
                limits=(
                    f"pipe() itself on the producer: a clone and a hand-over per step from the "
                    f"callback; {paired_text('callback_stream', 'bare_1t')}; with JPEG previews "
                    f"{med['callback_previews'] / med['bare_1t']:.3f}x"
                ),
                details=details,
            ),
        ]
    figures += [
        Figure(
            name="diffusers_stream.taesd_previews_vs_none",
            value=med["native_taesd"] / med["native_previews"],
            target=None,
            baseline={"native_previews": med["native_previews"]},
            engine={"native_taesd": med["native_taesd"], "taesd_ms_per_decode": taesd_in_stream_ms},
            limits=(
                f"the TAESD decode runs on the producer, in series with the UNet: "
                f"{taesd_in_stream_ms:.1f} ms a preview against {step_ms:.1f} ms a step on one CPU "
                f"thread ({total - 1} previews; gpu_bench.py measures this on a GPU); "
                f"{paired_text('native_taesd', 'native_previews')}"
            ),
            details=details,
        ),
        Figure(
            name="diffusers_stream.taesd_decode_ms",
            value=median(taesd_ms),
            target=None,
            baseline={"latent_side": float(side), "out_px": float(out_px)},
            engine={"ms": median(taesd_ms), "min_ms": min(taesd_ms), "max_ms": max(taesd_ms),
                    f"ms_at_{sizes.px // 8}x{sizes.px // 8}": median(taesd_small_ms)},
            unit="ms",
            limits=(
                f"random-weight TAESD (the real taesd sizes, 2.4M params), {side}x{side} latents -> "
                f"{out_px} px, one CPU thread: its last stages are 64-channel 3x3 convolutions at "
                f"{out_px // 2} and {out_px} px (~{_taesd_gflop(side):.0f} GFLOP a decode)"
            ),
            details=details,
        ),
        Figure(
            name="diffusers_stream.vae_decode_ms",
            value=median(vae_ms),
            target=None,
            baseline={"taesd_same_latents_ms": median(taesd_small_ms)},
            engine={"ms": median(vae_ms), "min_ms": min(vae_ms), "max_ms": max(vae_ms)},
            unit="ms",
            limits=(
                f"the pipeline's random SD-like VAE (block_out_channels {sizes.vae}, "
                f"layers_per_block={sizes.vae_layers}) on its {sizes.px // 8}x{sizes.px // 8} "
                f"latents -> {sizes.px} px, one CPU thread: the final frame's decode"
            ),
            details=details,
        ),
        Figure(
            name="diffusers_stream.pipe_default_threads_vs_1t",
            value=med["bare_default"] / med["bare_1t_beside_default"],
            target=None,
            baseline={"bare_1t": med["bare_1t_beside_default"]},
            engine={"bare_default": med["bare_default"]},
            limits=(
                f"pipe() in the main thread with torch's default {DEFAULT_TORCH_THREADS} threads "
                f"against one: the baseline above uses one, as the engine's producer does"
            ),
            details=details,
        ),
    ]
    return figures
