"""The copy path before and after issue #33, side by side on the simulated GPU.

``python -m benchmarks.ab_copier [--before 54f7f64] [--rounds 3] [--rows ...]``

"Before" is this checkout with the copier and the buffer pool of commit
``--before`` (the landed engine that died on its first GPU), with the one-line
patch the H200 run needed to run at all: its ``wait_event`` without the timed
``Event.wait`` branch, so it polls ``query()`` with a back-off, as it did there.
"After" is this checkout. Both run ``benchmarks.step_shapes --device sim``
(engine against a bare loop and the hand-written peer), in their own
processes, alternating (A B B A ...), and the medians of each row are
printed side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_POLL = '''

def wait_event(event, timeout):
    # The H200 run's patch: device/base.py's wait_event without its timed-wait branch.
    import time as _time

    if event.query():
        return True
    deadline = _time.monotonic() + timeout
    pause = 20e-6
    while not event.query():
        now = _time.monotonic()
        if now >= deadline:
            return False
        _time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)
    return True
'''


def build_before(commit: str, where: Path) -> Path:
    """A copy of this checkout with ``commit``'s copier and pool (patched to run); returns its root."""
    tree = where / "before"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", ".whl", "gpu-results"))

    def old(path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    copier = old("omni_stream/engine/copier.py")
    copier = copier.replace("from ..device.base import wait_event\n", "")
    copier = copier.replace("_WAIT_SLICE_S = 0.25\n", "_WAIT_SLICE_S = 0.25\n" + _POLL, 1)
    (tree / "omni_stream/engine/copier.py").write_text(copier)
    (tree / "omni_stream/device/pool.py").write_text(old("omni_stream/device/pool.py"))
    engine = (tree / "omni_stream/engine/engine.py").read_text()
    engine = engine.replace(
        "            max_lent=max(0, max_buffers - limits.max_batch_size * limits.max_run_ahead),\n"
        "            max_lent_per_owner=limits.queue_size + 2,\n", "")
    for field in ("buffers_lent=pool.buffers_lent", "frames_lent=self._copier.frames_lent",
                  "frames_cloned=self._copier.frames_cloned"):
        engine = engine.replace(field, field.split("=")[0] + "=0")
    (tree / "omni_stream/engine/engine.py").write_text(engine)
    return tree


def run_tree(tree: Path, rows: list[str], reps: int, out: Path) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "benchmarks.step_shapes", "--device", "sim", "--reps", str(reps),
           "--json", str(out)]
    if rows:
        cmd += ["--rows", *rows]
    subprocess.run(cmd, cwd=tree, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return {r["figure"]: r for r in json.loads(out.read_text())["rows"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="54f7f64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="repetitions inside each round")
    ap.add_argument("--rows", nargs="*", default=[])
    ap.add_argument("--waits", action="store_true", help="count the copier's waits a frame instead (copier_waits)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": build_before(args.before, Path(tmp)), "after": ROOT}
        if args.waits:
            for name, tree in trees.items():
                print(f"== {name}", flush=True)
                subprocess.run([sys.executable, "-m", "benchmarks.copier_waits", *(["--rows", *args.rows] if args.rows
                               else [])], cwd=tree, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
            return 0
        results: dict[str, list[dict[str, dict]]] = {"before": [], "after": []}
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                results[name].append(run_tree(trees[name], args.rows, args.reps, Path(tmp) / f"{name}{i}.json"))
    print(f"\n{'row':14s} {'before':>8s} {'after':>8s}   (engine/bare; copy rows: engine GB/s / bare)"
          f"   peer/engine before, after")
    for row in results["after"][0]:
        med = {k: statistics.median(r[row]["value"] for r in v) for k, v in results.items()}
        peer = {k: statistics.median(r[row]["peer_over_engine"] for r in v) for k, v in results.items()}
        print(f"{row:14s} {med['before']:8.3f} {med['after']:8.3f}   {peer['before']:.3f}, {peer['after']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
