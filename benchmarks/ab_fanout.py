"""Fan-out before and after a change, side by side: 100 websocket clients, each its own request.

``python -m benchmarks.ab_fanout --before COMMIT [--rounds 3] [--clients 100] [--steps 10]``

Checks ``COMMIT`` out into a git worktree (``/tmp/omni-ab-<commit>``, kept
for the next run), then runs ``benchmarks.fanout``'s websocket sample (our
server, every client generating its own request with a JPEG preview of
every step; see fanout.py) in a fresh process of each tree in turn,
before and after interleaved, ``rounds`` times. Prints each tree's median
frames per second (previews received by all clients / wall time) and
server CPU per frame, and the ratios after/before. The shared machines
drift by 2-5x within minutes: only the ratio of one run means anything.
Issue #36's bar: typed events out of the core are not slower than the
encoded strings they replaced (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SAMPLE = (
    "import asyncio, json, sys\n"
    "from benchmarks.fanout import _sample\n"
    "clients, steps = int(sys.argv[1]), int(sys.argv[2])\n"
    "print(json.dumps(asyncio.run(_sample('ours', None, clients, steps, 120.0))))\n"
)


def worktree(commit: str) -> Path:
    """A checkout of ``commit`` beside this one (made once, reused)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    where = Path(f"/tmp/omni-ab-{sha}")
    if not where.exists():
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(where), sha], cwd=ROOT, check=True)
    return where


def sample(tree: Path, clients: int, steps: int) -> dict[str, float]:
    """One fan-out sample in a fresh process importing ``tree``'s omni_stream and benchmarks."""
    done = subprocess.run(
        [sys.executable, "-c", _SAMPLE, str(clients), str(steps)],
        cwd=tree, capture_output=True, text=True, timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the sample in {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["finished"] != result["clients"]:
        raise RuntimeError(f"{tree}: {result['finished']} of {result['clients']} clients finished")
    return {"fps": result["fps"], "cpu_ms": result["server_cpu_ms_per_frame"], "p99_ms": result["p99_ms"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    trees = {"before": worktree(args.before), "after": ROOT}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(sample(trees[side], args.clients, args.steps))
            print(f"round {i + 1} {side}: {runs[side][-1]}", flush=True)
    med = {
        side: {key: statistics.median(r[key] for r in rows) for key in ("fps", "cpu_ms", "p99_ms")}
        for side, rows in runs.items()
    }
    print(json.dumps({
        "before": args.before, "clients": args.clients, "steps": args.steps, "rounds": args.rounds,
        "median": med,
        "fps_after_over_before": med["after"]["fps"] / med["before"]["fps"],
        "cpu_per_frame_after_over_before": med["after"]["cpu_ms"] / med["before"]["cpu_ms"],
    }, indent=2))


if __name__ == "__main__":
    main()
