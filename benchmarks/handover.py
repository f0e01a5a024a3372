"""The hand-over (issue #23): the engine against the thread-and-queue peer and a bare worker loop.

The peer (:func:`peer_steps`) is the streaming users write by hand: a
worker thread steps the requests and, after each step, hands every frame
to the loop with ``call_soon_threadsafe(queue.put_nowait, x.clone())``;
one reader task per request awaits its ``asyncio.Queue`` (on trio: the
token's ``run_sync_soon`` and a memory channel). The floor
(:func:`bare_worker_steps`) is the same steps in a worker thread with no
streaming at all. The engine (:func:`engine_steps`) runs the same
requests, batched as the peer and the floor batch them, every frame read.

All three get the same conditions: one torch thread where the steps run
(the engine's default on 1-2 cores), the loop thread's idle OpenMP team
released first (what ``Engine.start`` does; ``threads.py`` shows why it
matters), so what differs is the hand-over alone.

At ~0.5, 1, 5 and 10 ms Synthetic steps, one request and 16, side by side
in one run. Values: ``vs_peer`` = peer time / engine time (target >= 1.0:
the engine at least as fast as the hand-written peer), ``vs_bare`` =
engine time / floor time (targets <= 1.05 at 1 ms, <= 1.02 at 10 ms).
Details: microseconds of wall time per frame, and of CPU per frame on the
loop thread and on the thread that steps (``time.thread_time`` in each).

In the suite: ``python -m benchmarks --only handover [--loop asyncio]``.
Standalone, on every anyio backend (trio included), printed as a table:
``python -m benchmarks.handover [--backend asyncio uvloop trio] [--reps N] [--quick] [--against TREE]``
(``--against``: another checkout's engine beside this one, interleaved: ``other/engine`` > 1
when this one is faster).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import torch

import omni_stream as om
from omni_stream._backend import current_backend
from omni_stream.device.openmp import release_idle_team

from .harness import Context, Figure, Target, interleave, median, reset_main_thread, torch_threads

__all__ = ["CONFIGS", "Sample", "bare_worker_steps", "engine_steps", "main", "peer_steps", "run"]

#: (label, step seconds, requests, target for vs_bare)
CONFIGS: list[tuple[str, float, int, Target | None]] = [
    ("0.5ms", 0.0005, 1, None),
    ("1ms", 0.001, 1, Target("<=", 1.05)),
    ("5ms", 0.005, 1, None),
    ("10ms", 0.010, 1, Target("<=", 1.02)),
    ("16x0.5ms", 0.0005, 16, None),
    ("16x1ms", 0.001, 16, None),
    ("16x5ms", 0.005, 16, None),
    ("16x10ms", 0.010, 16, None),
]
#: The engine at least as fast as the hand-written peer, at every size.
PEER_TARGET = Target(">=", 1.0)
#: Seconds of stepping per sample (quick: a quarter).
SAMPLE_S = 0.4


@dataclass(slots=True)
class Sample:
    """One run: wall seconds, CPU seconds on the loop thread and on the stepping thread, and how
    many times the stepping thread blocked (its voluntary context switches; NaN without /proc).

    A stepping thread that blocks is mostly one that finished a torch call (which drops the
    GIL) while the loop held the GIL: it sleeps until the loop lets go, then waits to be
    scheduled again. That is where the loop's Python costs the producer wall time.
    """

    wall: float
    loop_cpu: float = 0.0
    step_cpu: float = 0.0
    step_blocks: float = math.nan


@dataclass(slots=True)
class _Timed:
    """Where the stepping thread records itself (its ids) and its CPU clock."""

    ident: int | None = None
    native: int | None = None
    cpu: list[float] = field(default_factory=list)
    blocks: list[float] = field(default_factory=list)


def thread_blocks(native_id: int | None) -> float:
    """The thread's voluntary context switches so far (Linux ``/proc``); NaN where unknown."""
    if native_id is None:
        return math.nan
    try:
        with open(f"/proc/self/task/{native_id}/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return math.nan


def _checked(model: om.StepModel, params: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [model.validate(p) for p in params]


def bare_worker_steps(params: Sequence[Mapping[str, Any]]) -> Sample:
    """The floor: every request stepped together in a worker thread, nothing streamed."""
    model = om.models.Synthetic()
    cpu = torch.device("cpu")
    checked = _checked(model, params)
    total = model.total_steps(checked[0])
    out: list[Sample] = []

    def body() -> None:
        with torch_threads(1):
            model.load(cpu)
            c0, t0 = time.thread_time(), time.perf_counter()
            states = [model.start(p, cpu) for p in checked]
            for _ in range(total):
                model.step(states)
            out.append(Sample(time.perf_counter() - t0, 0.0, time.thread_time() - c0))

    release_idle_team()
    thread = threading.Thread(target=body, name="handover-bare")
    thread.start()
    thread.join()
    return out[0]


async def peer_steps(params: Sequence[Mapping[str, Any]]) -> Sample:
    """The hand-written peer: a worker thread, a clone and a thread-safe put per frame, a queue per reader."""
    model = om.models.Synthetic()
    cpu = torch.device("cpu")
    checked = _checked(model, params)
    total = model.total_steps(checked[0])
    timed = _Timed()
    if current_backend() == "trio":
        import trio

        channels = [trio.open_memory_channel[torch.Tensor](math.inf) for _ in params]
        call: Callable[..., object] = trio.lowlevel.current_trio_token().run_sync_soon
        puts: list[Callable[[torch.Tensor], object]] = [send.send_nowait for send, _ in channels]
        gets: list[Callable[[], Awaitable[torch.Tensor]]] = [receive.receive for _, receive in channels]
    else:
        import asyncio

        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue[torch.Tensor]() for _ in params]
        call = loop.call_soon_threadsafe
        puts = [q.put_nowait for q in queues]
        gets = [q.get for q in queues]

    def denoise() -> None:
        with torch_threads(1):
            model.load(cpu)
            me = threading.get_native_id()
            c0, b0 = time.thread_time(), thread_blocks(me)
            states = [model.start(p, cpu) for p in checked]
            for _ in range(total):
                for put, x in zip(puts, model.step(states), strict=True):
                    call(put, x.clone())
            timed.cpu.append(time.thread_time() - c0)
            timed.blocks.append(thread_blocks(me) - b0)

    async def read(get: Callable[[], Awaitable[torch.Tensor]]) -> None:
        for _ in range(total):
            await get()

    release_idle_team()
    thread = threading.Thread(target=denoise, name="handover-peer", daemon=True)
    c0, t0 = time.thread_time(), time.perf_counter()
    thread.start()
    async with anyio.create_task_group() as tg:
        for get in gets:
            tg.start_soon(read, get)
    wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - c0
    await anyio.to_thread.run_sync(thread.join)
    return Sample(wall, loop_cpu, timed.cpu[0], timed.blocks[0])


async def engine_steps(params: Sequence[Mapping[str, Any]], *, package: ModuleType = om) -> Sample:
    """The same requests through a fresh Engine of ``package`` (this checkout's omni_stream by default).

    ``package`` lets a comparison import another version of omni_stream under
    another name and run it beside this one. A one-step request runs first,
    untimed, so the producer is up and the model loaded.
    """
    timed = _Timed()

    class Noted(package.models.Synthetic):  # type: ignore[misc, name-defined]
        def load(self, device: torch.device) -> None:
            timed.ident = threading.get_ident()  # load runs on the producer thread
            timed.native = threading.get_native_id()
            super().load(device)

    async with package.Engine(Noted(), device="cpu", max_batch_size=max(1, len(params))) as engine:
        await engine.generate(dict(params[0], steps=1))
        assert timed.ident is not None
        producer_clock = time.pthread_getcpuclockid(timed.ident)

        async def read(stream: Any) -> None:
            async for _ in stream:
                pass

        b0 = thread_blocks(timed.native)
        p0, c0, t0 = time.clock_gettime(producer_clock), time.thread_time(), time.perf_counter()
        streams = [engine.stream(p) for p in params]
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(read, s)
        wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - c0
        step_cpu, blocks = time.clock_gettime(producer_clock) - p0, thread_blocks(timed.native) - b0
        return Sample(wall, loop_cpu, step_cpu, blocks)


def _params(step_s: float, n: int, work: int, quick: bool) -> list[dict[str, Any]]:
    seconds = SAMPLE_S / 4 if quick else SAMPLE_S
    steps = max(4 if quick else 8, round(seconds / (n * step_s)))
    return [{"steps": steps, "work": work, "seed": i} for i in range(n)]


def load_other(tree: str) -> ModuleType:
    """Another checkout's omni_stream, imported beside this one as ``omni_stream_other``.

    The package imports itself relatively, so a copy under another name is
    a second, independent engine: ``--against`` runs it interleaved with
    this one in the same process (the same machine state for both, which
    a comparison across two runs on a shared machine does not have).
    """
    import importlib.util
    from pathlib import Path

    root = Path(tree, "omni_stream")
    spec = importlib.util.spec_from_file_location(
        "omni_stream_other", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no omni_stream package under {tree}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["omni_stream_other"] = module
    spec.loader.exec_module(module)
    return module


def _variants(
    params: list[dict[str, Any]], other: ModuleType | None = None
) -> dict[str, Callable[[], Awaitable[Sample]]]:
    async def engine() -> Sample:
        reset_main_thread()
        return await engine_steps(params)

    async def before() -> Sample:
        reset_main_thread()
        return await engine_steps(params, package=other)  # type: ignore[arg-type]

    async def peer() -> Sample:
        reset_main_thread()
        return await peer_steps(params)

    async def bare() -> Sample:
        reset_main_thread()
        return bare_worker_steps(params)

    variants = {"engine": engine, "peer": peer, "bare": bare}
    if other is not None:
        variants["other"] = before
    return variants


def summarize(samples: Mapping[str, Sequence[Sample]], frames: int) -> dict[str, dict[str, float]]:
    """Medians per variant, in microseconds per frame: wall, loop CPU, stepping-thread CPU;
    and the stepping thread's blocks per frame."""
    return {
        name: {
            "wall_us": median([s.wall for s in got]) / frames * 1e6,
            "loop_cpu_us": median([s.loop_cpu for s in got]) / frames * 1e6,
            "step_cpu_us": median([s.step_cpu for s in got]) / frames * 1e6,
            "step_blocks": median([s.step_blocks for s in got]) / frames,
        }
        for name, got in samples.items()
    }


async def run(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    configs = [c for c in CONFIGS if not ctx.quick or c[0] in ("1ms", "10ms", "16x1ms")]
    for label, step_s, n, bare_target in configs:
        work = ctx.work_for(step_s)
        params = _params(step_s, n, work, ctx.quick)
        frames = n * params[0]["steps"]
        ctx.log(f"handover {label}: {n} request(s) x {params[0]['steps']} steps, work={work}")
        samples = await interleave(_variants(params), ctx.reps, ctx=ctx)
        us = summarize(samples, frames)
        wall = {k: median([s.wall for s in v]) for k, v in samples.items()}
        details = {
            "requests": n,
            "steps": params[0]["steps"],
            "work": work,
            "us_per_frame": us,
            "samples_s": {k: [s.wall for s in v] for k, v in samples.items()},
        }
        baseline = {"peer": wall["peer"], "bare": wall["bare"]}
        engine = {"engine": wall["engine"]}
        loop_us = us["engine"]["loop_cpu_us"] - us["peer"]["loop_cpu_us"]
        figures.append(
            Figure(
                name=f"handover.{label}.vs_peer",
                value=wall["peer"] / wall["engine"],
                target=PEER_TARGET,
                baseline=baseline,
                engine=engine,
                limits=(
                    "peer time / engine time. Both wake the loop from the stepping thread; the "
                    "engine once per batch of ready frames, the peer once per frame. The engine's "
                    f"loop spends {loop_us:+.1f} us of CPU a frame against the peer's"
                ),
                details=details,
            )
        )
        figures.append(
            Figure(
                name=f"handover.{label}.vs_bare",
                value=wall["engine"] / wall["bare"],
                target=bare_target,
                baseline=baseline,
                engine=engine,
                limits=(
                    "engine time / the same steps in a worker thread with no streaming: what a "
                    "frame's copy, hand-over and delivery add, mostly the loop holding the GIL the "
                    "producer's next torch call needs"
                ),
                details=details,
            )
        )
    return figures


# -- standalone: every anyio backend ---------------------------------------------

#: name -> (anyio backend, backend_options)
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def _on_backend(name: str, variant: Callable[[], Awaitable[Sample]]) -> Sample:
    backend, options = BACKENDS[name]
    return anyio.run(variant, backend=backend, backend_options=options)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handover", description=__doc__.split("\n")[0])
    p.add_argument("--backend", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--reps", type=int, default=5, help="runs per variant (default 5)")
    p.add_argument("--quick", action="store_true", help="1 ms, 10 ms and 16x1 ms only, shorter runs")
    p.add_argument("--only", nargs="+", metavar="LABEL", help="configs by label (0.5ms ... 16x10ms)")
    p.add_argument(
        "--against", metavar="TREE",
        help="also run another checkout's engine, interleaved (e.g. a `git archive` of the commit before)",
    )
    args = p.parse_args(argv)
    other = load_other(args.against) if args.against else None
    ctx = Context(quick=args.quick, reps=args.reps, verbose=False)
    configs = [c for c in CONFIGS if (not args.only or c[0] in args.only)]
    if args.quick and not args.only:
        configs = [c for c in configs if c[0] in ("1ms", "10ms", "16x1ms")]
    print(f"omni_stream from {om.__file__}; us per frame: wall (loop CPU / stepping-thread CPU); "
          "blocks: the stepping thread's blocks a frame, engine/peer")
    print(
        f"{'backend':<8} {'config':<9} {'engine':>24} {'peer':>24} {'bare':>10} "
        f"{'peer/engine':>12} {'engine/bare':>12} {'blocks':>11}"
        + (f" {'other/engine':>13}" if other else "")
    )
    for label, step_s, n, _ in configs:
        params = _params(step_s, n, ctx.work_for(step_s), args.quick)
        frames = n * params[0]["steps"]
        for name in args.backend:
            variants = _variants(params, other)
            samples: dict[str, list[Sample]] = {k: [] for k in variants}
            for rep in range(args.reps):
                order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for k in order:
                    samples[k].append(_on_backend(name, variants[k]))
            us = summarize(samples, frames)

            def cell(k: str, us: dict[str, dict[str, float]] = us) -> str:
                u = us[k]
                return f"{u['wall_us']:.1f} ({u['loop_cpu_us']:.1f}/{u['step_cpu_us']:.1f})"

            e, pe, b = (us[k]["wall_us"] for k in ("engine", "peer", "bare"))
            print(
                f"{name:<8} {label:<9} {cell('engine'):>24} {cell('peer'):>24} {b:>10.1f} "
                f"{pe / e:>12.3f} {e / b:>12.3f} "
                f"{us['engine']['step_blocks']:>5.2f}/{us['peer']['step_blocks']:<5.2f}"
                + (f" {us['other']['wall_us'] / e:>13.3f}" if other else ""),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
