"""The hand-over's cost in instructions per frame, per thread: the engine against the peer, without noise.

Wall time and CPU time on a shared machine swing 10-20% between runs;
instructions do not. This runs each variant under valgrind's callgrind
(one thread at a time, every instruction counted) twice, with N1 and N2
frames, and reports (count(N2) - count(N1)) / (N2 - N1) for each thread:
what one more frame costs on the event loop's thread and on the thread
that steps, start-up and imports cancelled out.

Variants (the same near-free Synthetic step, ``work=0``, a 4x8x8 frame, so
that what is counted is the hand-over, not the model):

* ``engine``: ``Engine.stream`` read to its end, from the checkout given
  (``--tree``, default this one: compare two versions by running it twice);
* ``peer``: a worker thread, ``call_soon_threadsafe(queue.put_nowait,
  x.clone())`` per frame, an ``asyncio.Queue`` read on the loop (the
  hand-written streaming of benchmarks/handover.py).

Callgrind serialises threads, so what it counts is the work, not the GIL's
hand-overs or the waits between threads; benchmarks/handover.py measures
those. Needs valgrind; about a minute and a half per run (torch's import
dominates), four runs.

``--pace MS`` sleeps that long before each step, on the stepping thread: the
loop then drains every frame before the next is made, one wake-up a frame
for the engine and the peer alike, as at the step times of
benchmarks/handover.py. Without it (``work=0``, a near-free step) the
stepping thread runs ahead of the loop, a wake-up carries several frames,
and the peer, whose queue is unbounded, batches more than the engine (whose
producer waits for delivery after ``max_run_ahead`` frames). Under callgrind
the loop's work for a frame takes a few milliseconds: pace by 10 ms or more.

``python -m benchmarks.handover_instructions [--tree PATH] [--frames N1 N2] [--pace MS]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENGINE", "PEER", "per_frame", "main"]

#: The engine's run: ``sys.argv``: the checkout's path, the frame count, the pace (seconds).
ENGINE = """
import sys, time
sys.path.insert(0, sys.argv[1])
import anyio
import omni_stream as om
N, PACE = int(sys.argv[2]), float(sys.argv[3])
PARAMS = {"work": 0, "shape": [4, 8, 8]}
class Paced(om.models.Synthetic):
    def step(self, states):
        if PACE:
            time.sleep(PACE)
        return super().step(states)
async def main():
    async with om.Engine(Paced(), device="cpu") as engine:
        await engine.generate(dict(PARAMS, steps=2))
        async for _ in engine.stream(dict(PARAMS, steps=N)):
            pass
anyio.run(main)
"""

#: The hand-written peer: ``sys.argv``: a checkout (for the model), the frame count, the pace.
PEER = """
import sys, threading, asyncio, time
sys.path.insert(0, sys.argv[1])
import torch
import omni_stream as om
N, PACE = int(sys.argv[2]), float(sys.argv[3])
async def main():
    model = om.models.Synthetic()
    cpu = torch.device("cpu")
    model.load(cpu)
    params = model.validate({"steps": N, "work": 0, "shape": [4, 8, 8]})
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()
    def work():
        torch.set_num_threads(1)
        state = model.start(params, cpu)
        for _ in range(N):
            if PACE:
                time.sleep(PACE)
            loop.call_soon_threadsafe(queue.put_nowait, model.step([state])[0].clone())
    thread = threading.Thread(target=work)
    thread.start()
    for _ in range(N):
        await queue.get()
    thread.join()
asyncio.run(main())
"""


def _counts(script: str, tree: str, frames: int, workdir: Path, pace_s: float = 0.0) -> dict[int, int]:
    """Instructions per thread (callgrind's thread number -> count) of one run."""
    out = workdir / f"cg.{frames}.{abs(hash(script)) % 10**8}"
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}.%p",
        sys.executable, "-c", script, tree, str(frames), repr(pace_s),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    counts: dict[int, int] = {}
    for path in workdir.glob(out.name + ".*-*"):
        thread = int(path.name.rsplit("-", 1)[1])
        match = re.search(r"^summary: (\d+)", path.read_text(errors="replace"), re.M)
        if match:
            counts[thread] = int(match.group(1))
        path.unlink()
    return counts


def per_frame(script: str, tree: str, frames: tuple[int, int], pace_s: float = 0.0) -> dict[str, float]:
    """Instructions one more frame costs: on the loop (callgrind's thread 1, the main thread) and
    on the stepping thread (of the others, the one whose count grows most with the frames).

    Other threads (torch's, a worker's) start in a different order from run to run, so
    callgrind's numbers for them do not line up between the two runs: they are left out.
    """
    with tempfile.TemporaryDirectory(prefix="omni-cg-") as tmp:
        low, high = (_counts(script, tree, n, Path(tmp), pace_s) for n in frames)
    span = frames[1] - frames[0]
    growth = {t: (high.get(t, 0) - low.get(t, 0)) / span for t in high}
    loop = growth.pop(1, 0.0)
    return {"loop": loop, "stepping": max(growth.values(), default=0.0)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handover_instructions",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout whose omni_stream the engine runs (default: this one)")
    p.add_argument("--frames", type=int, nargs=2, default=(200, 1200), metavar=("N1", "N2"))
    p.add_argument("--pace", type=float, default=0.0, metavar="MS",
                   help="sleep this long before each step: one wake-up of the loop a frame (10 or more)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind)", file=sys.stderr)
        return 2
    tree = os.path.abspath(args.tree)
    frames = (args.frames[0], args.frames[1])
    pace = f"; paced by {args.pace:g} ms a step" if args.pace else ""
    print(f"instructions per frame, engine from {tree}; frames {frames[0]} and {frames[1]}{pace}")
    print(f"{'variant':<8} {'loop':>10} {'stepping':>10}")
    for name, script in (("engine", ENGINE), ("peer", PEER)):
        got = per_frame(script, tree, frames, args.pace / 1e3)
        print(f"{name:<8} {got['loop']:>10.0f} {got['stepping']:>10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
