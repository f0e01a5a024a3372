"""Where torch compute runs: the OpenMP arrangement behind the ``limit`` figure.

Torch's CPU build uses GNU OpenMP (libgomp). Each thread that runs a
parallel torch op gets its own team of helper threads, and libgomp decides
how those helpers wait for the next parallel region by counting them: while
the threads it manages number no more than the CPUs, a helper spins for
about 3 ms (``GOMP_SPINCOUNT`` 300,000) before it sleeps; once there are
more (two teams on two cores), every wait spins only 100 times and then
sleeps on a futex, so each parallel region pays a wake-up. The second mode
is what ``OMP_WAIT_POLICY=passive`` asks for, and it is the "3-4x slower in
a worker thread" of docs/performance.md: the main thread built the model
(its team exists), the engine steps in a worker (a second team).

Which mode is slower depends on the machine: on an idle 2-core box
spinning wins, on a busy one (another process on the second core) a
spinning helper waits for a core it cannot get and a parallel region
takes milliseconds. A producer thread that runs torch with one thread has
no team at all: it never spins, never sleeps on a barrier, and cannot be
hurt by the main thread's team. The voluntary context switches per step
say which mode a run was in (about 2 per parallel region when sleeping, 0
when spinning or single-threaded). ``worker_released`` is the way out that
keeps every core: the main thread's idle team is released before the worker
runs (``omni_stream.device.openmp``, called by ``Engine.start``), so the
worker's team is the only one and spins like the main thread's did.

Each arrangement runs in a fresh process (the state is per process and
cannot be undone), interleaved, several times. ``python -m
benchmarks.threads probe ARRANGEMENT WORK N STEPS`` is one such process.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

from .harness import Context, Figure, interleave, median, warm_main_thread

__all__ = ["ARRANGEMENTS", "run"]

#: name -> (where the steps run, torch threads in that thread, main thread warm,
#: main thread's team released before the worker starts, extra env)
ARRANGEMENTS: dict[str, tuple[str, int | None, bool, bool, dict[str, str]]] = {
    # A user's plain script: model built and stepped in the main thread.
    "main": ("main", None, True, False, {}),
    # A worker thread with torch's defaults after the main thread built the model.
    "worker_after_main": ("worker", None, True, False, {}),
    # The same, with nobody else ever running torch: one team only.
    "worker_alone": ("worker", None, False, False, {}),
    # The engine's default producer setting: torch.set_num_threads(1) in the worker.
    "worker_1t": ("worker", 1, True, False, {}),
    # What the engine does at start: the main thread's idle team is released
    # (omni_stream.device.openmp), then the worker runs with torch's defaults;
    # the producer with torch_threads = the CPU count.
    "worker_released": ("worker", None, True, True, {}),
    # The sleeping mode on purpose, in the main thread: same mechanism as worker_after_main.
    "main_passive": ("main", None, True, False, {"OMP_WAIT_POLICY": "passive"}),
}


def _probe(arrangement: str, work: int, n: int, steps: int) -> dict[str, float]:
    import torch

    from omni_stream.models import Synthetic

    from omni_stream.device.openmp import release_idle_team

    where, threads, warm, release, _ = ARRANGEMENTS[arrangement]
    if warm:
        warm_main_thread()
    if release and not release_idle_team():
        raise RuntimeError("this torch cannot release an OpenMP team (not GNU libgomp)")
    model = Synthetic()
    cpu = torch.device("cpu")

    def body() -> dict[str, float]:
        if threads is not None:
            torch.set_num_threads(threads)
        model.load(cpu)
        states = [model.start(model.validate({"steps": 10**5, "work": work, "seed": i}), cpu) for i in range(n)]
        for _ in range(3):
            model.step(states)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(steps):
            model.step(states)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        return {
            "step_ms": wall / steps * 1e3,
            "cpu_ms_per_step": cpu_s / steps * 1e3,
            "voluntary_cs_per_step": (r1.ru_nvcsw - r0.ru_nvcsw) / steps,
        }

    if where == "main":
        return body()
    out: list[dict[str, float]] = []
    t = threading.Thread(target=lambda: out.append(body()))
    t.start()
    t.join()
    return out[0]


async def _sample(arrangement: str, work: int, n: int, steps: int) -> dict[str, float]:
    env = dict(os.environ, **ARRANGEMENTS[arrangement][4])
    cmd = [sys.executable, "-m", "benchmarks.threads", "probe", arrangement, str(work), str(n), str(steps)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = await asyncio.to_thread(subprocess.run, cmd, env=env, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"threads probe {arrangement} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def run(ctx: Context) -> list[Figure]:
    work = ctx.work_for(0.001)
    n, steps = 16, (5 if ctx.quick else 40)
    ctx.log(f"threads: {n} requests batched, work={work}, {steps} steps, one process per sample")

    def sampler(name: str) -> Any:
        async def sample() -> dict[str, float]:
            return await _sample(name, work, n, steps)

        return sample

    # Quick mode only checks that the probes run: the three arrangements that
    # make the point, once each.
    names = ["main", "worker_after_main", "worker_1t"] if ctx.quick else list(ARRANGEMENTS)
    if not ctx.quick:
        from omni_stream.device.openmp import supported

        if not supported():
            names.remove("worker_released")
    reps = 1 if ctx.quick else max(1, min(ctx.reps, 3))
    samples = await interleave({a: sampler(a) for a in names}, reps)
    step_ms = {a: median([s["step_ms"] for s in v]) for a, v in samples.items()}
    cs = {a: median([s["voluntary_cs_per_step"] for s in v]) for a, v in samples.items()}
    cpu_ms = {a: median([s["cpu_ms_per_step"] for s in v]) for a, v in samples.items()}
    for a in names:
        ctx.log(f"{a:18s} {step_ms[a]:8.2f} ms/step  {cs[a]:6.1f} voluntary cs/step  {cpu_ms[a]:7.2f} cpu ms/step")
    details = {
        "work": work,
        "requests": n,
        "steps": steps,
        "step_ms": step_ms,
        "voluntary_cs_per_step": cs,
        "cpu_ms_per_step": cpu_ms,
        "samples": samples,
    }
    raw: dict[str, float] = {f"{a}_ms": v for a, v in step_ms.items()}
    baseline: dict[str, float] = {
        k: raw[k] for k in ("main_ms", "worker_alone_ms", "main_passive_ms") if k in raw
    }
    engine_side = {k: raw[k] for k in ("worker_after_main_ms", "worker_1t_ms", "worker_released_ms") if k in raw}
    figures = [
        Figure(
            name="threads.worker_after_main_vs_main",
            value=step_ms["worker_after_main"] / step_ms["main"],
            target=None,
            baseline=baseline,
            engine=engine_side,
            limits=(
                f"two OpenMP teams on {os.cpu_count()} CPUs: libgomp stops spinning and sleeps "
                f"({cs['worker_after_main']:.0f} vs {cs['main']:.0f} voluntary context switches a step); "
                "worse when the machine is idle, better when it is busy"
            ),
            details=details,
        ),
        Figure(
            name="threads.worker_1t_vs_main",
            value=step_ms["worker_1t"] / step_ms["main"],
            target=None,
            baseline=baseline,
            engine=engine_side,
            limits="one thread has no team: no spin, no sleep, half the FLOPs of two cores at best",
            details=details,
        ),
        Figure(
            name="threads.worker_1t_vs_worker_after_main",
            value=step_ms["worker_1t"] / step_ms["worker_after_main"],
            target=None,
            baseline={"worker_after_main_ms": raw["worker_after_main_ms"]},
            engine={"worker_1t_ms": raw["worker_1t_ms"]},
            limits="< 1: torch.set_num_threads(1) in the producer thread beats torch's default here",
            details=details,
        ),
    ]
    if "worker_released" in step_ms:
        figures.append(
            Figure(
                name="threads.worker_released_vs_main",
                value=step_ms["worker_released"] / step_ms["main"],
                target=None,
                baseline=baseline,
                engine=engine_side,
                limits=(
                    "the main thread's idle team released first (what Engine.start does): one team "
                    f"in the process again ({cs['worker_released']:.0f} voluntary context switches a step)"
                ),
                details=details,
            )
        )
    return figures


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "probe" or sys.argv[2] not in ARRANGEMENTS:
        sys.exit(f"usage: python -m benchmarks.threads probe {{{'|'.join(ARRANGEMENTS)}}} WORK N STEPS")
    print(json.dumps(_probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
