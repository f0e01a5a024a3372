"""The gate's preemption through a real server: short requests while long renders hold every place.

``benchmarks/scheduling.py`` measures the engine's policies with every
request inside one engine. Behind a server, at most ``max_active`` requests
are in the engine and the others wait in the server's gate: under
``round-robin`` (and ``fcfs``) a request that arrives when long renders hold
every place waits for one of them to end; under ``preemptive`` the gate
pauses the running request with the most steps left (to the host) and gives
its place to the newcomer (issue #22).

Each sample starts a real ``python -m omni_stream serve --scheduling POLICY``
(Synthetic, ``OMNI_STREAM_MAX_ACTIVE`` places, one torch thread, its own
process), sends ``longs`` long requests (one websocket each) and, once they
all run, ``shorts`` short ones arriving one every ``gap`` seconds, each on a
websocket of its own (each its own principal, as separate users are). A
short request's time to its first step and to its result is measured from
its ``generate`` being sent; throughput is all the steps over the wall time
from the first long request to the last result. The policies are sampled
interleaved (A B B A ...), each sample on a fresh server.

Figures: preemptive's (and fcfs's) short-request p99 to the first step and
to the result against round-robin's, and its throughput against
round-robin's.

``python -m benchmarks.server_scheduling [--reps N] [--quick]`` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from .crash import _recv, _serve
from .harness import Context, Figure, Target, interleave, median, new_event_loop, percentile

__all__ = ["run"]

POLICIES = ("round-robin", "preemptive", "fcfs")
SHAPE = [4, 16, 16]


async def _request(
    url: str, rid: str, params: dict[str, Any], started: asyncio.Event | None = None
) -> dict[str, float]:
    """Run one request on a websocket of its own: seconds from its send to its first step and to its end."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "generate", "id": rid, "params": params}))
        first = None
        while True:
            msg = await _recv(ws)
            if msg.get("id") != rid:
                continue
            if msg["type"] == "progress" and first is None:
                first = time.perf_counter() - t0
                if started is not None:
                    started.set()
            if msg["type"] in ("done", "cancelled", "error"):
                if msg["type"] != "done" or first is None:
                    raise RuntimeError(f"request {rid} ended {msg}")
                return {"first_s": first, "done_s": time.perf_counter() - t0, "end": time.perf_counter()}


async def _sample(policy: str, work: int, sizes: dict[str, Any]) -> dict[str, Any]:
    server = await _serve("--scheduling", policy, env={"OMNI_STREAM_MAX_ACTIVE": str(sizes["places"])})
    try:
        long_params = {"steps": sizes["long_steps"], "shape": SHAPE, "work": work}
        short_params = {"steps": sizes["short_steps"], "shape": SHAPE, "work": work}
        t0 = time.perf_counter()
        starts = [asyncio.Event() for _ in range(sizes["longs"])]
        longs = [
            asyncio.create_task(_request(server.url, f"long-{i}", {**long_params, "seed": i}, starts[i]))
            for i in range(sizes["longs"])
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 120)
        shorts = []
        for i in range(sizes["shorts"]):
            await asyncio.sleep(sizes["gap_s"])
            shorts.append(asyncio.create_task(
                _request(server.url, f"short-{i}", {**short_params, "seed": 100 + i})
            ))
        short_out = await asyncio.gather(*shorts)
        long_out = await asyncio.gather(*longs)
        wall = max(r["end"] for r in (*short_out, *long_out)) - t0
    finally:
        await server.stop()
    steps = sizes["longs"] * sizes["long_steps"] + sizes["shorts"] * sizes["short_steps"]
    firsts = [r["first_s"] for r in short_out]
    dones = [r["done_s"] for r in short_out]
    return {
        "ttfs_mean_s": sum(firsts) / len(firsts),
        "ttfs_p99_s": percentile(firsts, 99),
        "short_done_mean_s": sum(dones) / len(dones),
        "short_done_p99_s": percentile(dones, 99),
        "long_done_mean_s": sum(r["done_s"] for r in long_out) / len(long_out),
        "steps_per_s": steps / wall,
        "wall_s": wall,
    }


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(places=2, longs=2, long_steps=120, shorts=4, short_steps=4, gap_s=0.1)
    return dict(places=4, longs=4, long_steps=300, shorts=16, short_steps=6, gap_s=0.1)


async def measure(
    ctx: Context, *, reps: int, quick: bool, policies: Sequence[str] = POLICIES
) -> dict[str, Any]:
    work = ctx.work_for(0.004, SHAPE)
    sizes = _sizes(quick)
    ctx.log(f"server_scheduling: {sizes}, ~4 ms steps (work={work}), policies {list(policies)}")
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}

    def sampler(policy: str) -> Any:
        async def sample() -> float:
            out = await _sample(policy, work, sizes)
            results[policy].append(out)
            ctx.log(
                f"  {policy}: short first step p99 {out['ttfs_p99_s'] * 1e3:.0f} ms, result p99 "
                f"{out['short_done_p99_s'] * 1e3:.0f} ms, {out['steps_per_s']:.0f} steps/s"
            )
            return float(out["ttfs_p99_s"])

        return sample

    await interleave({p: sampler(p) for p in policies}, reps, ctx=ctx)
    med = {p: {k: median([r[k] for r in results[p]]) for k in results[p][0]} for p in policies}
    return {"sizes": sizes, "work": work, "medians": med, "samples": results}


def _figures(out: dict[str, Any]) -> list[Figure]:
    med, sizes = out["medians"], out["sizes"]
    base = med["round-robin"]
    shape = (
        f"a real serve, {sizes['places']} places held by {sizes['longs']} requests of "
        f"{sizes['long_steps']} steps; "
        f"{sizes['shorts']} of {sizes['short_steps']} steps arriving every {sizes['gap_s'] * 1e3:g} ms over "
        "websockets; "
    )
    figures = []
    for policy in (p for p in med if p != "round-robin"):
        m = med[policy]
        target = policy == "preemptive"
        figures += [
            Figure(
                name=f"server_scheduling.{policy}.short_ttfs_p99_vs_round_robin",
                value=m["ttfs_p99_s"] / base["ttfs_p99_s"],
                target=Target("<=", 1.0) if target else None,
                baseline={k: base[k] for k in ("ttfs_mean_s", "ttfs_p99_s")},
                engine={k: m[k] for k in ("ttfs_mean_s", "ttfs_p99_s")},
                limits=shape + "a short request's send to its first progress, p99",
                details={"medians": med, "samples": out["samples"]},
            ),
            Figure(
                name=f"server_scheduling.{policy}.short_done_p99_vs_round_robin",
                value=m["short_done_p99_s"] / base["short_done_p99_s"],
                target=Target("<=", 1.0) if target else None,
                baseline={k: base[k] for k in ("short_done_mean_s", "short_done_p99_s")},
                engine={k: m[k] for k in ("short_done_mean_s", "short_done_p99_s", "long_done_mean_s")},
                limits=shape + "a short request's send to its done, p99",
            ),
            Figure(
                name=f"server_scheduling.{policy}.throughput_vs_round_robin",
                value=m["steps_per_s"] / base["steps_per_s"],
                target=Target(">=", 0.95) if target else None,
                baseline={"steps_per_s": base["steps_per_s"]},
                engine={"steps_per_s": m["steps_per_s"]},
                limits=shape + "all the steps over the wall time",
            ),
        ]
    return figures


async def run(ctx: Context) -> list[Figure]:
    return _figures(await measure(ctx, reps=max(2, ctx.reps // 2), quick=ctx.quick))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.server_scheduling", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3, help="samples of each policy (default 3)")
    parser.add_argument("--quick", action="store_true", help="a small workload: shows that it runs")
    parser.add_argument("--json", help="write the medians and samples here")
    args = parser.parse_args(argv)
    ctx = Context(verbose=True)
    loop = new_event_loop("asyncio")
    try:
        out = loop.run_until_complete(measure(ctx, reps=args.reps, quick=args.quick))
    finally:
        loop.close()
    med = out["medians"]
    print(f"server_scheduling: {out['sizes']} (work={out['work']}); medians of {args.reps}:")
    for policy, m in med.items():
        print(
            f"  {policy:12s} short first step mean {m['ttfs_mean_s'] * 1e3:7.0f} ms p99 "
            f"{m['ttfs_p99_s'] * 1e3:7.0f} ms | short result mean {m['short_done_mean_s'] * 1e3:7.0f} ms p99 "
            f"{m['short_done_p99_s'] * 1e3:7.0f} ms | long result mean {m['long_done_mean_s']:.2f} s | "
            f"{m['steps_per_s']:.0f} steps/s"
        )
    for figure in _figures(out):
        target = f" (target {figure.target})" if figure.target else ""
        print(f"  {figure.name}: {figure.value:.3f}{target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
