"""A Ray replica killed mid-render (issue #22): steps redone and the time to the first resumed frame.

A local Ray cluster (2 CPUs) runs two replicas of the tests' ``handy``
model (Synthetic, each step a 20 ms sleep) and of ``nosnap`` (the same,
unable to snapshot: a callback-mode pipeline, say), behind one
``RemoteEngine`` with ``checkpoint_every=10``. Each round streams an
80-step request, reads 25 frames, SIGKILLs the replica that runs it and
reads on: the front door hands the request to the other replica, from
the checkpoint of step 20 (``handy``) or from step 0 (``nosnap``).
Reported per round: the step it resumed after, the frames the reader had,
the steps redone, and the milliseconds from the kill to the first frame
past what the reader had. Rounds alternate the two models.

``python -m benchmarks.ray_handover [--rounds N]`` (from a checkout: it
uses the tests' model and cluster helper; needs the ``ray`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


async def _rounds(rounds: int) -> list[tuple[str, int, int, int, float]]:
    from omni_stream.integrations.ray_serve import RemoteEngine
    from tests.integrations.test_ray_serve_handover_cluster import SMALL

    rows: list[tuple[str, int, int, int, float]] = []
    async with RemoteEngine("h", checkpoint_every=10) as engine:
        for i in range(rounds):
            while len([v for v in engine.replicas() if v.ok]) < 2:
                await asyncio.sleep(0.1)  # Ray replaces the replica killed last round
            model = "nosnap" if i % 2 else "handy"
            stream = engine.stream({**SMALL, "steps": 80, "seed": i}, request_id=f"m{i}", model=model)
            async for frame in stream:
                if frame.step >= 25:
                    break
            victim = stream.replica
            pid = next(v.report.pid for v in engine.replicas() if v.replica == victim)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            first: float | None = None
            async for frame in stream:
                if first is None and stream.handovers and frame.step > stream.handovers[0].received:
                    first = time.monotonic() - killed
            (handover,) = stream.handovers
            assert first is not None
            rows.append((model, handover.step, handover.received, handover.redone, first * 1e3))
            print(
                f"{model}: resumed after step {handover.step}, the reader had {handover.received}, "
                f"{handover.redone} redone, first resumed frame {first * 1e3:.0f} ms after the kill",
                flush=True,
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_handover", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="kills, alternating the two models (default 6)")
    args = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from ray import serve

    from omni_stream.integrations.ray_serve import deploy
    from tests.integrations.cluster import start_local_ray
    from tests.integrations.test_ray_serve_handover_cluster import Handy, NoSnap

    start_local_ray()
    serve.start(proxy_location="Disabled")
    deploy({"handy": Handy(), "nosnap": NoSnap()}, name="h", replicas=2, num_cpus=0,
           engine_kwargs={"device": "cpu"}, health_check_period_s=1.0)
    rows = asyncio.run(_rounds(args.rounds))
    for model in ("handy", "nosnap"):
        ms = [r[4] for r in rows if r[0] == model]
        redone = [r[3] for r in rows if r[0] == model]
        if ms:
            print(f"{model}: steps redone median {statistics.median(redone):.0f}; first resumed frame "
                  f"median {statistics.median(ms):.0f} ms (min {min(ms):.0f}, max {max(ms):.0f}) over {len(ms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
