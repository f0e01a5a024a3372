"""What checkpoints cost (issue #22), on the random SD pipeline of ``diffusers_stream``.

``plain``
    requests of 30 steps through the engine, one after another.
``checkpointed``
    the same with ``checkpoint_every=10`` (the server's default): the
    producer snapshots each request after steps 10 and 20 (``model.snapshot``:
    latents, scheduler, generator, conditioning to the host) and hands the
    checkpoint on; serialising it (``to_bytes``) happens off the producer,
    as the server's state keeper does it, and is timed apart.

Figures: ``checkpointed / plain`` wall time (target <= 1.01), the
milliseconds a snapshot takes on the producer and ``to_bytes`` off it, the
bytes of one checkpoint, and the time from a new engine's start to the
first frame of a request resumed from a checkpoint (what a restart costs
before the first resumed frame).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import omni_stream as om

from .diffusers_stream import QUICK_SIZES, SIZES, THREADS, _embeddings, _quiet_diffusers, build_pipe
from .harness import Context, Figure, Target, interleave, median, reset_main_thread

__all__ = ["run"]

EVERY = 10


async def run(ctx: Context) -> list[Figure]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("checkpoints needs diffusers (pip install diffusers)") from exc
    _quiet_diffusers()
    from omni_stream.models.diffusers import Diffusers, PromptEmbeddings

    sizes = QUICK_SIZES if ctx.quick else SIZES
    steps = 12 if ctx.quick else 30
    emb, neg = _embeddings(sizes)
    embeddings = PromptEmbeddings(prompt_embeds=emb, negative_prompt_embeds=neg)
    model = Diffusers(build_pipe(sizes), encode_prompt=lambda p, n: embeddings, batch=False)
    request = {"prompt": "bench", "steps": steps, "seed": 1, "height": sizes.px, "width": sizes.px}
    ctx.log(f"checkpoints: SD pipeline UNet {sizes.unet}, {sizes.px} px, {steps} steps, every {EVERY}")
    snapshots: list[Any] = []
    serialise_ms: list[float] = []
    sizes_b: list[int] = []
    count = 3

    async def plain() -> float:
        reset_main_thread()
        async with om.Engine(model, device="cpu", torch_threads=THREADS) as engine:
            await engine.generate(dict(request, steps=1, output="latent"))
            t0 = time.perf_counter()
            for i in range(count):
                await engine.generate(dict(request, seed=i, output="latent"))
            return time.perf_counter() - t0

    async def checkpointed() -> float:
        reset_main_thread()
        got: list[Any] = []
        async with om.Engine(model, device="cpu", torch_threads=THREADS) as engine:
            await engine.generate(dict(request, steps=1, output="latent"))
            t0 = time.perf_counter()
            for i in range(count):
                stream = engine.stream(dict(request, seed=i, output="latent"), checkpoint_every=EVERY,
                                       on_checkpoint=lambda rid, c: got.append(c))
                async with stream:
                    async for _ in stream:
                        pass
            wall = time.perf_counter() - t0
        for checkpoint in got:  # off the producer, as the state keeper's worker does it
            t1 = time.perf_counter()
            data = checkpoint.to_bytes()
            serialise_ms.append((time.perf_counter() - t1) * 1e3)
            sizes_b.append(len(data))
        snapshots.extend(got)
        return wall

    samples = await interleave({"plain": plain, "checkpointed": checkpointed}, ctx.reps, ctx=ctx)
    med = {k: median(v) for k, v in samples.items()}

    # The snapshot itself, timed on its own (on this thread, as the producer runs it).
    engine_ms: list[float] = []
    checked = model.validate(request)
    state = model.start(checked, __import__("torch").device("cpu"))
    for _ in range(EVERY):
        model.step([state])
    for _ in range(10):
        t0 = time.perf_counter()
        model.snapshot(state)
        engine_ms.append((time.perf_counter() - t0) * 1e3)
    model.close(state)

    # A restart: a new engine, a request resumed from the step-10 checkpoint, to its first frame.
    first_ms: list[float] = []
    checkpoint = snapshots[0]
    for _ in range(3):
        t0 = time.perf_counter()
        async with om.Engine(model, device="cpu", torch_threads=THREADS) as engine:
            stream = engine.stream(None, resume=checkpoint)
            async with stream:
                first = await stream.__anext__()
                first_ms.append((time.perf_counter() - t0) * 1e3)
        assert first.step == checkpoint.step + 1
    per_request = 2 if steps >= 2 * EVERY + 1 else 1
    return [
        Figure(
            name="checkpoints.overhead",
            value=med["checkpointed"] / med["plain"],
            target=Target("<=", 1.01),
            baseline={"plain_s": med["plain"]},
            engine={"checkpointed_s": med["checkpointed"], "snapshot_ms": statistics.median(engine_ms),
                    "to_bytes_ms": statistics.median(serialise_ms), "bytes": statistics.median(sizes_b)},
            limits=(
                f"{count} requests of {steps} steps, a checkpoint every {EVERY} ({per_request} a request): "
                f"a snapshot takes {statistics.median(engine_ms):.2f} ms on the producer, to_bytes "
                f"{statistics.median(serialise_ms):.2f} ms off it, {statistics.median(sizes_b) / 1024:.0f} KiB"
            ),
            details={"samples_s": samples},
        ),
        Figure(
            name="checkpoints.resume_first_frame_ms",
            value=statistics.median(first_ms),
            target=None,
            unit="ms",
            baseline={},
            engine={"first_frame_ms": statistics.median(first_ms)},
            limits="a new engine's start to the first frame of a request resumed from a step-10 checkpoint",
            details={"samples_ms": first_ms},
        ),
    ]
