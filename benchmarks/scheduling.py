"""Scheduling policies on a mixed workload: many short requests among a few long ones.

One engine (Synthetic, ~2 ms steps calibrated, ``max_batch_size`` 2) gets
4 long requests (120 steps) at once, then 32 short ones (6 steps) arriving
one every 12 ms while the long ones run: the load users see when a 2-second
image queues behind minute-long videos. Under each policy
(``Engine(scheduling=...)``: ``round-robin``, ``fcfs``, ``preemptive``),
interleaved in one run:

* the short requests' time to their first step and to their result, mean
  and p99 (from their arrival);
* the long requests' completion time, mean;
* throughput: all the work's steps / the wall time from the first arrival
  to the last result.

Figures: each policy's short-request p99 time to first step and completion
against round-robin's, and its throughput against round-robin's (the issue:
the preemptive default must beat both others on the short requests' p99
without losing more than 5% of total throughput).
"""

from __future__ import annotations

import time
from typing import Any

import anyio

import omni_stream as om
from omni_stream.models import Synthetic

from .harness import Context, Figure, Target, interleave, median, percentile, reset_main_thread

__all__ = ["run"]

#: Variant -> (policy, quantum).
POLICIES = {
    "round-robin": ("round-robin", 4), "fcfs": ("fcfs", 4), "preemptive": ("preemptive", 1),
    "preemptive_q4": ("preemptive", 4),
}
SHAPE = [4, 16, 16]


async def _workload(policy: str, quantum: int, work: int, *, longs: int, shorts: int, long_steps: int, short_steps: int,
                    gap_s: float) -> dict[str, Any]:
    reset_main_thread()
    firsts: list[float] = []
    dones: list[float] = []
    long_dones: list[float] = []
    ends: list[float] = []
    async with om.Engine(
        Synthetic(), device="cpu", max_batch_size=2, scheduling=policy, quantum=quantum, torch_threads=1
    ) as engine:
        await engine.generate({"steps": 1, "shape": SHAPE, "work": work})  # untimed warm-up
        t0 = time.perf_counter()

        async def one(params: dict[str, Any], *, short: bool) -> None:
            arrived = time.perf_counter()
            first = None
            async with engine.stream(params) as stream:
                async for frame in stream:
                    if first is None:
                        first = time.perf_counter() - arrived
            done = time.perf_counter()
            ends.append(done)
            if short:
                assert first is not None
                firsts.append(first)
                dones.append(done - arrived)
            else:
                long_dones.append(done - arrived)

        async with anyio.create_task_group() as tg:
            for i in range(longs):
                tg.start_soon(lambda i=i: one({"steps": long_steps, "shape": SHAPE, "work": work, "seed": i},
                                              short=False))
            for i in range(shorts):
                await anyio.sleep(gap_s)
                tg.start_soon(lambda i=i: one({"steps": short_steps, "shape": SHAPE, "work": work,
                                               "seed": 100 + i}, short=True))
        wall = max(ends) - t0
    steps = longs * long_steps + shorts * short_steps
    return {
        "ttfs_mean_s": sum(firsts) / len(firsts),
        "ttfs_p99_s": percentile(firsts, 99),
        "short_done_mean_s": sum(dones) / len(dones),
        "short_done_p99_s": percentile(dones, 99),
        "long_done_mean_s": sum(long_dones) / len(long_dones),
        "steps_per_s": steps / wall,
        "wall_s": wall,
    }


async def run(ctx: Context) -> list[Figure]:
    work = ctx.work_for(0.002, SHAPE)
    sizes = dict(longs=4, shorts=32, long_steps=120, short_steps=6, gap_s=0.012)
    if ctx.quick:
        sizes = dict(longs=2, shorts=6, long_steps=30, short_steps=3, gap_s=0.01)
    ctx.log(f"scheduling: {sizes}, ~2 ms steps (work={work}), max_batch_size 2")
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}

    def sampler(variant: str) -> Any:
        policy, quantum = POLICIES[variant]

        async def sample() -> float:
            out = await _workload(policy, quantum, work, **sizes)
            results[variant].append(out)
            return float(out["ttfs_p99_s"])

        return sample

    await interleave({p: sampler(p) for p in POLICIES}, ctx.reps, ctx=ctx)
    med = {p: {k: median([r[k] for r in results[p]]) for k in results[p][0]} for p in POLICIES}
    base = med["round-robin"]
    figures = []
    for policy in ("fcfs", "preemptive", "preemptive_q4"):
        m = med[policy]
        shape = (
            f"{sizes['shorts']} short requests of {sizes['short_steps']} steps arriving every "
            f"{sizes['gap_s'] * 1e3:g} ms among {sizes['longs']} of {sizes['long_steps']}; "
        )
        figures += [
            Figure(
                name=f"scheduling.{policy}.short_ttfs_p99_vs_round_robin",
                value=m["ttfs_p99_s"] / base["ttfs_p99_s"],
                target=Target("<=", 1.0) if policy == "preemptive" else None,
                baseline={k: base[k] for k in ("ttfs_mean_s", "ttfs_p99_s")},
                engine={k: m[k] for k in ("ttfs_mean_s", "ttfs_p99_s")},
                limits=shape + "time from a short request's arrival to its first frame, p99",
                details={"medians": med, "samples": results},
            ),
            Figure(
                name=f"scheduling.{policy}.short_done_p99_vs_round_robin",
                value=m["short_done_p99_s"] / base["short_done_p99_s"],
                target=Target("<=", 1.0) if policy == "preemptive" else None,
                baseline={k: base[k] for k in ("short_done_mean_s", "short_done_p99_s")},
                engine={k: m[k] for k in ("short_done_mean_s", "short_done_p99_s", "long_done_mean_s")},
                limits=shape + "time from a short request's arrival to its result, p99",
                details={"medians": med},
            ),
            Figure(
                name=f"scheduling.{policy}.throughput_vs_round_robin",
                value=m["steps_per_s"] / base["steps_per_s"],
                target=Target(">=", 0.95) if policy == "preemptive" else None,
                baseline={"steps_per_s": base["steps_per_s"]},
                engine={"steps_per_s": m["steps_per_s"]},
                limits=shape + "all the work's steps over the wall time",
                details={"medians": med},
            ),
        ]
    return figures
