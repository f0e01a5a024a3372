"""Engine chaos: random requests, cancels, timeouts and injected failures, every frame checked.

``python -m benchmarks.chaos [--device cpu|sim|cuda] [--requests N] [--seed S] [--concurrency C]``

One engine (on the CPU or the simulated accelerator, which drives the real
copier and buffer pool) serves ``N`` Synthetic requests, at most ``C`` at
a time, each drawn at random: steps, shape, work, policy, priority, a slow
or fast reader, and how it ends:

``complete``     read to the final frame
``break``        break out of ``async for`` after k frames (``async with`` closes it)
``cancel``       ``engine.cancel(id)`` after k frames (or before the first)
``task_cancel``  the reading task is cancelled after a random few ms
``timeout``      ``hang_at`` a step for 0.15 s with ``timeout=0.05``: must raise StepTimeoutError
``fail``         ``fail_at`` a random step: must raise StepFailedError there, and only there

Checks: every delivered frame equals ``Synthetic().expected_frames(params)``
at its step bit for bit; steps only go forward (``all``: one per step);
a request that was not told to fail, time out or be cancelled completes;
failures carry the injected step; after settling no host buffer is leased
and nothing is active or queued; the engine is healthy and still serves an
exact request. Prints a summary; exit status 1 on any violation.
Bounded: every request has a 60 s deadline, the whole run ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run_chaos"]

SHAPES = ([4, 8, 8], [3, 16, 16], [4, 16, 16], [1, 4, 4], [4, 32, 32])
KINDS = ("complete", "break", "cancel", "task_cancel", "timeout", "fail")
WEIGHTS = (40, 15, 15, 12, 4, 14)


def _plan(rng: random.Random, i: int) -> dict[str, Any]:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    steps = rng.randint(1, 12)
    params: dict[str, Any] = {
        "steps": steps,
        "shape": rng.choice(SHAPES),
        "work": rng.choice((0, 0, 1, 3)),
        "seed": rng.randrange(2**31),
    }
    plan: dict[str, Any] = {
        "id": f"chaos-{i}",
        "kind": kind,
        "params": params,
        "policy": rng.choice(("all", "latest")),
        "priority": rng.randint(-10, 10),
        "slow": rng.random() < 0.3,
        "k": rng.randint(0, steps),  # frames to read before break / cancel
        "delay": rng.uniform(0, 0.03),  # task_cancel after
    }
    if kind == "fail":
        params["fail_at"] = rng.randint(1, steps)
    elif kind == "timeout":
        params["hang_at"] = rng.randint(1, steps)
        params["hang_s"] = 0.15
        plan["timeout"] = 0.05
    return plan


class Chaos:
    def __init__(self, device: str, seed: int) -> None:
        import omni_stream as om
        from omni_stream.models import Synthetic

        self.om = om
        self.model = Synthetic()
        self.device = device
        self.rng = random.Random(seed)
        self.frames_checked = 0
        self.corrupt = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.violations: list[str] = []
        self._expected: dict[tuple, list[Any]] = {}
        self.injected_fail = 0
        self.injected_timeout = 0

    def expected(self, params: dict[str, Any]) -> list[Any]:
        key = (params["steps"], tuple(params["shape"]), params["seed"])
        if key not in self._expected:
            if len(self._expected) > 256:
                self._expected.clear()
            self._expected[key] = self.model.expected_frames(params)
        return self._expected[key]

    def check_frame(self, plan: dict[str, Any], frame: Any, last_step: int) -> int:
        import torch

        p = plan["params"]
        rid = plan["id"]
        if frame.request_id != rid or frame.total != p["steps"]:
            self.violations.append(f"{rid}: frame {frame!r} of the wrong request or total")
        if frame.step <= last_step or (plan["policy"] == "all" and frame.step != last_step + 1):
            self.violations.append(f"{rid} ({plan['policy']}): step {frame.step} after {last_step}")
        if "fail_at" in p and frame.step >= p["fail_at"]:
            self.violations.append(f"{rid}: frame {frame.step} at or past fail_at={p['fail_at']}")
        want = self.expected(p)[frame.step - 1]
        self.frames_checked += 1
        if not torch.equal(frame.data.cpu(), want):
            self.corrupt += 1
            self.violations.append(f"{rid}: frame {frame.step} differs from expected_frames (params {p})")
        return frame.step

    async def one(self, engine: Any, plan: dict[str, Any]) -> None:
        om = self.om
        rid, kind, p = plan["id"], plan["kind"], plan["params"]
        last = 0
        got_final = False
        cancelled_ok = None
        try:
            stream = engine.stream(
                p, request_id=rid, policy=plan["policy"], timeout=plan.get("timeout"), priority=plan["priority"]
            )
            async with stream:
                if kind == "cancel" and plan["k"] == 0:
                    cancelled_ok = engine.cancel(rid)
                async for frame in stream:
                    last = self.check_frame(plan, frame, last)
                    got_final = got_final or frame.final
                    if plan["slow"]:
                        await asyncio.sleep(0.002)
                    if kind == "break" and last >= plan["k"]:
                        break
                    if kind == "cancel" and cancelled_ok is None and last >= plan["k"]:
                        cancelled_ok = engine.cancel(rid)
        except om.StepFailedError as exc:
            self.outcomes["failed"] += 1
            if kind != "fail":
                self.violations.append(f"{rid} ({kind}): StepFailedError nobody injected: {exc}")
            elif f"step {p['fail_at']}" not in str(exc.__cause__ or exc):
                self.violations.append(f"{rid}: failure not at fail_at={p['fail_at']}: {exc!r} / {exc.__cause__!r}")
            return
        except om.StepTimeoutError as exc:
            self.outcomes["timed_out"] += 1
            if kind != "timeout":
                self.violations.append(f"{rid} ({kind}): StepTimeoutError without a timeout: {exc}")
            return
        except om.RequestCancelledError as exc:
            self.outcomes["cancelled"] += 1
            if kind != "cancel" or not cancelled_ok:
                self.violations.append(f"{rid} ({kind}, cancel()={cancelled_ok}): RequestCancelledError: {exc}")
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else is a finding
            self.outcomes["unexpected_error"] += 1
            self.violations.append(f"{rid} ({kind}): {type(exc).__name__}: {exc}")
            return
        # Ended without an exception.
        if kind == "break" and last >= plan["k"] and not got_final:
            self.outcomes["broke_out"] += 1
            return
        if not got_final:
            self.violations.append(f"{rid} ({kind}): the stream ended without its final frame (last step {last})")
            return
        self.outcomes["completed"] += 1
        if kind == "fail":
            self.violations.append(f"{rid}: completed despite fail_at={p['fail_at']}")
        elif kind == "timeout":
            self.violations.append(f"{rid}: completed despite hang_at with a {plan['timeout']} s timeout")
        elif kind == "cancel" and cancelled_ok:
            self.violations.append(f"{rid}: engine.cancel() returned True but the stream completed")

    async def guarded(self, engine: Any, plan: dict[str, Any]) -> None:
        if plan["kind"] == "fail":
            self.injected_fail += 1
        if plan["kind"] == "timeout":
            self.injected_timeout += 1
        if plan["kind"] == "task_cancel":
            task = asyncio.create_task(self.one(engine, plan))
            await asyncio.sleep(plan["delay"])
            task.cancel()
            try:
                await asyncio.wait_for(task, 60)
                # It finished before the cancel landed: its outcome was counted.
            except asyncio.CancelledError:
                self.outcomes["task_cancelled"] += 1
            except TimeoutError:
                self.violations.append(f"{plan['id']}: a cancelled task did not end within 60 s")
            return
        try:
            await asyncio.wait_for(self.one(engine, plan), 60)
        except TimeoutError:
            self.violations.append(f"{plan['id']} ({plan['kind']}): no end within 60 s")

    async def run(self, requests: int, concurrency: int, max_seconds: float) -> dict[str, Any]:
        om = self.om
        device: Any = self.device
        if device == "sim":
            device = om.device.SimDevice(compute_s=0.001, copy_s=0.003)
        t0 = time.perf_counter()
        async with om.Engine(self.model, device=device, max_batch_size=4, queue_size=4) as engine:
            sem = asyncio.Semaphore(concurrency)

            async def slot(plan: dict[str, Any]) -> None:
                async with sem:
                    if time.perf_counter() - t0 > max_seconds:
                        self.outcomes["skipped_time_bound"] += 1
                        return
                    await self.guarded(engine, plan)

            plans = [_plan(self.rng, i) for i in range(requests)]
            await asyncio.gather(*(slot(p) for p in plans))
            # Settle: no buffer leased, nothing live.
            deadline = time.monotonic() + 15
            while True:
                st = engine.statistics()
                if st.buffers_in_use == 0 and st.active == 0 and st.queued == 0:
                    break
                if time.monotonic() > deadline:
                    self.violations.append(
                        f"not settled after 15 s: buffers_in_use={st.buffers_in_use} active={st.active} "
                        f"queued={st.queued}"
                    )
                    break
                await asyncio.sleep(0.01)
            stats = engine.statistics()
            if stats.failed > self.injected_fail:
                self.violations.append(f"engine counted {stats.failed} failures, {self.injected_fail} injected")
            if stats.timed_out > self.injected_timeout:
                self.violations.append(f"engine counted {stats.timed_out} timeouts, {self.injected_timeout} injected")
            h = engine.health()
            if not h.ok:
                self.violations.append(f"engine unhealthy at the end: {h.status} {h.reason}")
            # The pump still serves an exact request.
            probe = {"steps": 5, "shape": [4, 8, 8], "work": 0, "seed": 4242}
            plan = {"id": "chaos-probe", "kind": "complete", "params": probe, "policy": "all",
                    "priority": 0, "slow": False, "k": 0, "delay": 0}
            await self.guarded(engine, plan)
        wall = time.perf_counter() - t0
        return {
            "device": self.device,
            "requests": requests,
            "frames_checked": self.frames_checked,
            "corrupt": self.corrupt,
            "leaked_buffers": stats.buffers_in_use,
            "outcomes": dict(sorted(self.outcomes.items())),
            "engine": {"completed": stats.completed, "cancelled": stats.cancelled, "failed": stats.failed,
                       "timed_out": stats.timed_out, "steps": stats.steps, "batches": stats.batches},
            "health": h.status,
            "wall_s": round(wall, 2),
            "violations": list(self.violations),
        }


def run_chaos(*, device: str = "cpu", requests: int = 200, seed: int = 0, concurrency: int = 8,
              max_seconds: float = 300.0) -> dict[str, Any]:
    """Run one chaos pass in a fresh event loop; returns the summary dict."""
    return asyncio.run(Chaos(device, seed).run(requests, concurrency, max_seconds))


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"chaos on {s['device']}: {s['requests']} requests in {s['wall_s']} s",
        f"  frames checked: {s['frames_checked']}, corrupt: {s['corrupt']}, leaked buffers: {s['leaked_buffers']}",
        f"  outcomes: {', '.join(f'{k}={v}' for k, v in s['outcomes'].items())}",
        f"  engine: {', '.join(f'{k}={v}' for k, v in s['engine'].items())}; health {s['health']}",
    ]
    v = s["violations"]
    lines.append(f"  violations: {len(v)}" if v else "  violations: none")
    lines += [f"    - {x}" for x in v[:20]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "sim", "cuda"), default="cpu")
    ap.add_argument("--requests", type=int, default=200, help="requests in all (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests at once (default 8)")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop starting requests after this")
    ap.add_argument("--verbose", action="store_true", help="show the engine's warnings (injected faults log)")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    summary = run_chaos(device=args.device, requests=args.requests, seed=args.seed,
                        concurrency=args.concurrency, max_seconds=args.max_seconds)
    print(format_summary(summary), flush=True)
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
