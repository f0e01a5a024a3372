"""Several models and several images on the random SD pipeline of ``diffusers_stream``.

``switch``
    two models (two copies of the pipeline) behind a :class:`ModelRouter`
    with ``max_loaded=1``; requests alternate between them, so each waits
    for the other model to unload and its own to load (a new Engine: its
    producer thread, ``model.load``) before its first step. Against
    ``stay``: the same requests all on one model, which stays loaded.
    Figures: ``switch / stay`` (the time a model switch adds, per request,
    as a ratio of a request's time), and the load and unload seconds the
    router measured. On this CPU a load moves no weights (the pipeline is
    on the CPU already): the seconds are the engine's start and stop; on a
    GPU, ``pipe.to(device)`` adds the weights' transfer (``gpu_bench``).

``num_images``
    one request of ``num_images=4`` against four requests of one image at
    once (batched together): the same four denoise rows per UNet call, one
    prompt encoding instead of four. Figure: ``four requests / one request``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import omni_stream as om
from omni_stream.engine.router import ModelRouter

from .diffusers_stream import QUICK_SIZES, SIZES, THREADS, _embeddings, _quiet_diffusers, build_pipe
from .harness import Context, Figure, interleave, median, reset_main_thread

__all__ = ["run"]

REQUESTS = 4  # per sample, in the switch comparison


async def _router_run(models: dict[str, Any], names: list[str], request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds for one request per name in ``names``, one after another, through a router of
    ``models`` with max_loaded=1; and its load / unload times."""
    reset_main_thread()
    # The raw cost of a switch: no residency quantum, no swap budget.
    async with ModelRouter(models, max_loaded=1, min_residency_s=0, max_swaps_per_min=1_000_000, device="cpu",
                           torch_threads=THREADS) as router:
        await router.generate(dict(request, steps=1, output="latent"), model=names[0])  # untimed: first load
        t0 = time.perf_counter()
        for name in names:
            await router.generate(dict(request, output="latent"), model=name)
        wall = time.perf_counter() - t0
        return wall, router.load_times()


async def run(ctx: Context) -> list[Figure]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("diffusers_models needs diffusers (pip install diffusers)") from exc
    _quiet_diffusers()
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    sizes = QUICK_SIZES if ctx.quick else SIZES
    emb, neg = _embeddings(sizes)
    embeddings = PromptEmbeddings(prompt_embeds=emb, negative_prompt_embeds=neg)

    def model() -> Any:
        return Diffusers(build_pipe(sizes), encode_prompt=lambda p, n: embeddings)

    models = {"one": model(), "two": model()}
    request = {"prompt": "bench", "steps": sizes.steps, "seed": 1, "height": sizes.px, "width": sizes.px}
    ctx.log(f"diffusers_models: SD pipeline UNet {sizes.unet}, {sizes.px} px, {sizes.steps} steps, "
            f"{THREADS} torch thread")
    loads: list[dict[str, Any]] = []

    def variant(names: list[str]) -> Any:
        async def sample() -> float:
            wall, times = await _router_run(models, names, request)
            loads.append(times)
            return wall

        return sample

    switching = ["two", "one"] * (REQUESTS // 2)  # the first request of a sample loads "two"
    samples = await interleave(
        {"stay": variant(["one"] * REQUESTS), "switch": variant(switching)}, ctx.reps, ctx=ctx
    )
    med = {k: median(v) for k, v in samples.items()}
    load_s = median([t["two"][0] for t in loads if t["two"][0] > 0])
    unload_s = median([t["one"][1] for t in loads if t["one"][1] > 0])
    per_switch = (med["switch"] - med["stay"]) / REQUESTS

    # num_images=4 in one request against 4 one-image requests batched together.
    pipe_model = Diffusers(build_pipe(sizes), encode_prompt=lambda p, n: embeddings)
    finals: dict[str, Any] = {}

    async def one_request() -> float:
        reset_main_thread()
        async with om.Engine(pipe_model, device="cpu", torch_threads=THREADS) as engine:
            await engine.generate(dict(request, steps=1, output="latent"))
            t0 = time.perf_counter()
            finals["one"] = await engine.generate(dict(request, num_images=4, output="latent"))
            return time.perf_counter() - t0

    async def four_requests() -> float:
        import anyio

        reset_main_thread()
        async with om.Engine(pipe_model, device="cpu", torch_threads=THREADS) as engine:
            await engine.generate(dict(request, steps=1, output="latent"))
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(engine.generate, dict(request, seed=i, output="latent"))
            return time.perf_counter() - t0

    images = await interleave({"four_requests": four_requests, "one_request": one_request}, ctx.reps, ctx=ctx)
    img = {k: median(v) for k, v in images.items()}
    shape = tuple(finals["one"].data.shape)
    assert finals["one"].image_count == 4 and shape[0] == 4 and torch.isfinite(finals["one"].data).all()
    return [
        Figure(
            name="diffusers_models.switch",
            value=med["switch"] / med["stay"],
            target=None,
            baseline={"stay_s": med["stay"]},
            engine={"switch_s": med["switch"], "per_switch_s": per_switch, "load_s": load_s, "unload_s": unload_s},
            limits=(
                f"{REQUESTS} requests one after another alternating between two models with max_loaded=1 "
                f"(each a model switch) against all on one loaded model; a switch adds {per_switch * 1e3:.0f} ms "
                f"(load {load_s * 1e3:.0f} ms, unload {unload_s * 1e3:.0f} ms: an engine start and stop; "
                "no weights move on the CPU)"
            ),
            details={"samples_s": samples, "load_times": loads},
        ),
        Figure(
            name="diffusers_models.num_images_4",
            value=img["four_requests"] / img["one_request"],
            target=None,
            baseline={"four_requests_s": img["four_requests"]},
            engine={"one_request_s": img["one_request"]},
            limits=(
                "one request of num_images=4 against four one-image requests batched together "
                f"(the same {4 * 2} UNet rows a call with guidance); final latents {shape}"
            ),
            details={"samples_s": images},
        ),
    ]
