"""Priority through a real server: one client's mixed priorities, by class, batched and not (issue #38).

One client (one websocket: one principal) sends a burst of eight requests
of the same size, the case issue #38 measured: one at priority -10, six
at 0, then one at +10, in that order, so the +10 one comes last, when
every place in the engine is held by requests that came before it. Each
sample starts a real ``python -m omni_stream serve --model synthetic``
(one torch thread, its own process) with ``--scheduling POLICY``, batched
(the default) or ``--no-batch``, from this checkout and, with
``--before COMMIT``, from a git worktree of that commit too; every
configuration is sampled interleaved (A B B A ...), each on a fresh server.

For each priority class: the seconds from the burst's first send to the
request's first ``progress`` (its first step) and to its ``done``. Figures:
the +10 request's first step and result against the priority-0 ones'
median, under each policy, batched and not: below 1 means it went first.

``python -m benchmarks.priority [--reps N] [--quick] [--before COMMIT]`` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .ab_fanout import worktree
from .crash import ROOT, _recv, _serve
from .harness import Context, interleave, median, new_event_loop

__all__ = ["run_burst"]

POLICIES = ("preemptive", "round-robin", "fcfs")
SHAPE = [4, 16, 16]
#: The burst, in the order it is sent: (id, priority).
BURST = [("low", -10), *((f"mid{i}", 0) for i in range(6)), ("high", 10)]


async def run_burst(url: str, params: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Send :data:`BURST` on one websocket; each request's first step and done, in seconds."""
    from websockets.asyncio.client import connect

    out: dict[str, dict[str, float]] = {rid: {} for rid, _ in BURST}
    async with connect(url, max_size=None) as ws:
        t0 = time.perf_counter()
        for i, (rid, priority) in enumerate(BURST):
            message = {"type": "generate", "id": rid, "params": {**params, "seed": i}, "priority": priority}
            await ws.send(json.dumps(message))
        ended = 0
        while ended < len(BURST):
            msg = await _recv(ws)
            rid = msg.get("id")
            if rid not in out:
                continue
            if msg["type"] == "progress" and "first_s" not in out[rid]:
                out[rid]["first_s"] = time.perf_counter() - t0
            elif msg["type"] in ("done", "cancelled", "error"):
                if msg["type"] != "done":
                    raise RuntimeError(f"request {rid} ended {msg}")
                out[rid]["done_s"] = time.perf_counter() - t0
                ended += 1
    return out


def _classes(sample: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A sample's figures by class: +10, 0 (the median of six), -10."""
    mids = [v for rid, v in sample.items() if rid.startswith("mid")]
    return {
        "+10": sample["high"],
        "0": {k: statistics.median(m[k] for m in mids) for k in ("first_s", "done_s")},
        "-10": sample["low"],
    }


async def measure(
    ctx: Context, *, reps: int, quick: bool, before: str | None = None, policies: Sequence[str] = POLICIES
) -> dict[str, Any]:
    steps = 8 if quick else 20
    work = ctx.work_for(0.01, SHAPE)
    params = {"steps": steps, "shape": SHAPE, "work": work}
    trees = {"after": ROOT} if before is None else {"before": str(worktree(before)), "after": ROOT}
    ctx.log(f"priority: {len(BURST)} requests of {steps} steps, ~10 ms steps (work={work}), trees {list(trees)}")
    results: dict[str, list[dict[str, dict[str, float]]]] = {}

    def sampler(tree: str, policy: str, batched: bool) -> Any:
        key = f"{tree} {policy} {'batched' if batched else 'no-batch'}"
        results[key] = []

        async def sample() -> float:
            args = ["--scheduling", policy] + ([] if batched else ["--no-batch"])
            server = await _serve(*args, root=trees[tree])
            try:
                out = _classes(await run_burst(server.url, params))
            finally:
                await server.stop()
            results[key].append(out)
            return out["+10"]["first_s"] / out["0"]["first_s"]

        return key, sample

    variants = dict(sampler(t, p, b) for t in trees for p in policies for b in (True, False))
    await interleave(variants, reps, ctx=ctx)
    medians = {
        key: {
            cls: {k: median([s[cls][k] for s in samples]) for k in ("first_s", "done_s")}
            for cls in ("+10", "0", "-10")
        }
        for key, samples in results.items()
    }
    return {"steps": steps, "work": work, "medians": medians, "samples": results}


def table(out: dict[str, Any]) -> str:
    """The medians as docs/performance.md shows them."""
    lines = [
        "| tree, policy | +10: first step / result | 0 (median of 6) | -10 | +10 / 0: first step, result |",
        "|---|---|---|---|---|",
    ]
    for key, m in out["medians"].items():
        cells = [f"{m[c]['first_s']:.2f} / {m[c]['done_s']:.2f} s" for c in ("+10", "0", "-10")]
        ratio = (
            f"{m['+10']['first_s'] / m['0']['first_s']:.2f}x, {m['+10']['done_s'] / m['0']['done_s']:.2f}x"
        )
        lines.append(f"| {key} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.priority", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="samples of each configuration (default 3)")
    parser.add_argument("--quick", action="store_true", help="8-step requests: shows that it runs")
    parser.add_argument("--before", help="a commit to measure beside this checkout (a git worktree in /tmp)")
    parser.add_argument("--json", help="write the medians and samples here")
    args = parser.parse_args(argv)
    ctx = Context(verbose=True)
    loop = new_event_loop("asyncio")
    try:
        out = loop.run_until_complete(measure(ctx, reps=args.reps, quick=args.quick, before=args.before))
    finally:
        loop.close()
    print(f"priority: {len(BURST)} requests of {out['steps']} steps (work={out['work']}); medians of {args.reps}:")
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
