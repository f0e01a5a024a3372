"""Figure: step shapes of GPU serving: the engine against a bare loop and the hand-written peer.

``python -m benchmarks.step_shapes --device cuda|sim [--rows NAME ...] [--reps N] [--json PATH]``
(``python -m benchmarks --only step_shapes`` runs it on the simulator).

The same rows on a real GPU (``cuda``: ``scripts/gpu_check.sh`` runs them on
the lent machine) and on the simulated GPU (``sim``: ``CudaDevice``'s own
code driving ``device/simcuda.py``), so the engine's per-step cost and its
copy path are measured on every machine, not only where a GPU is lent.

Three ways to run N steps of one request, interleaved (A B C C B A ...),
each warmed up first (a cuBLAS handle, the pool's pinned buffers, the
threads' first calls: a first request's times are not a step's) and each
reading every frame:

* ``bare``: the steps back to back in a worker thread, no frames at all, one
  synchronize at the end: the floor.
* ``engine``: one request through ``Engine``; the reader takes every frame.
* ``peer``: what users write instead: a worker thread steps, ``.cpu()``s each
  output (the host waits for the step, then copies into a fresh tensor) and
  hands it to an asyncio queue with ``call_soon_threadsafe``.

Rows (on an H200, 2026-12-04, the engine before this figure existed measured
engine/bare 1.110, 1.004, 1.106, 1.069; GB/s 0.054 of the link):

* ``compute_1ms``: six bf16 4096^2 matmuls a step (1.3 ms on an H200), an SD
  latent (4x64x64) out; ``compute_25ms``: 110 of them; ``launch_8ms``: 300
  small elementwise kernels (launch-bound); ``video_6ms``: 28 matmuls, a Wan
  720p latent (16x21x90x160 bf16, 9.2 MiB) out. Value: ``engine / bare``
  (targets <= 1.03 below 6 ms, <= 1.01 from 6 ms), and ``peer / engine``
  beside it (> 1: the engine ahead).
* ``copy_9MiB`` and ``copy_64MiB``: a cheap kernel writes a 9.2 or 64 MiB
  frame a step (its step's mark all over it): copy-bound. Value: the engine's delivered GB/s over a bare
  loop's pinned ``copy_(non_blocking=True)`` into reused buffers, each waited
  for (what the link allows; target >= 0.9). Every delivered frame is checked
  byte for byte: ``corrupt`` counts the ones that are not their step's.

On the simulator a step's device time is ``after_step`` (the compute stream
sleeps) and its host time tiny torch ops as many as take the H200 row's
launch time here (~20 us a kernel); the copy is a host memcpy on the copy
stream's thread, so the copy rows measure this machine's memory, not PCIe,
and the simulator's own stream threads take the GIL a few times a step, as
no GPU does. ``--device cpu`` runs the host ops alone on the CPU device (no
device time, no copy rows): what the engine's own threads cost a
Python-bound producer, without the simulator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import omni_stream as om
from omni_stream.device import SimDevice, simcuda

from .harness import Context, Figure, Target, interleave, median, run_in_thread

__all__ = ["ROWS", "Row", "measure_row", "run"]

SHORT_TARGET = Target("<=", 1.03)
LONG_TARGET = Target("<=", 1.01)
LINK_TARGET = Target(">=", 0.9)
# Buffers a bare copy loop rotates over, as the engine's pool does.
BARE_BUFFERS = 4


@dataclass(frozen=True)
class Row:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: int
    matmuls: int = 0  # bf16 4096^2 matmuls a step (cuda)
    kernels: int = 0  # small elementwise kernels a step (cuda)
    device_s: float = 0.0  # the simulated compute stream's time a step (sim)
    launch_s: float = 0.0  # host time a step on the producer thread (sim)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def copy_bound(self) -> bool:
        return self.matmuls == 0 and self.kernels == 0


# The sim's device and host times are the H200's: 1.29 / 25.2 / 8.1 / 6.3 ms steps, ~20 us of
# host time a kernel launch.
ROWS = (
    Row("compute_1ms", (4, 64, 64), torch.bfloat16, 300, matmuls=6, device_s=0.0013, launch_s=0.00012),
    Row("compute_25ms", (4, 64, 64), torch.bfloat16, 24, matmuls=110, device_s=0.0252, launch_s=0.0022),
    Row("launch_8ms", (4, 64, 64), torch.bfloat16, 60, kernels=300, device_s=0.0005, launch_s=0.0081),
    Row("video_6ms", (16, 21, 90, 160), torch.bfloat16, 60, matmuls=28, device_s=0.0063, launch_s=0.00056),
    Row("copy_9MiB", (32, 21, 90, 160), torch.uint8, 50),
    Row("copy_64MiB", (64, 1024, 1024), torch.uint8, 40),
)

_op_s: list[float] = []


def _op_seconds() -> float:
    """Host seconds of one tiny torch op (``x.add_(1.0)``) in a worker thread, measured once."""
    if not _op_s:
        def measure() -> float:
            x = torch.zeros(8)
            for _ in range(2000):
                x.add_(1.0)
            t0 = time.perf_counter()
            for _ in range(20000):
                x.add_(1.0)
            return (time.perf_counter() - t0) / 20000

        _op_s.append(run_in_thread(measure))
    return _op_s[0]


class ShapeStep(om.StepModel):
    """A step of ``row``'s shape on ``kind`` ("cuda", "sim", or "cpu": the sim's host ops alone).

    Copy-bound rows write step ``i``'s frame as the byte ``i % 251`` (a cheap kernel), so
    every frame can be checked; the others return a fresh latent derived from the step's
    work. On the simulator the work is host ops (``launch_s``) and the compute stream's
    time is ``SimDevice(compute_s=row.device_s)``.
    """

    name = "step-shape"
    params = (om.Param("steps", "int", 10, minimum=1),)

    def __init__(self, row: Row, kind: str) -> None:
        self.row, self.kind = row, kind
        self._ops = round(row.launch_s / _op_seconds()) if kind != "cuda" and row.launch_s else 0
        self._w: torch.Tensor | None = None

    def total_steps(self, params: Mapping[str, Any]) -> int:
        return int(params["steps"])

    def load(self, device: torch.device) -> None:
        if self.kind == "cuda" and self.row.matmuls and self._w is None:
            g = torch.Generator(device="cpu").manual_seed(0)
            self._w = (torch.randn(4096, 4096, generator=g) / 64).to(device=device, dtype=torch.bfloat16)

    def start(self, params: Mapping[str, Any], device: torch.device) -> Any:
        self.load(device)
        state: dict[str, Any] = {"i": 0, "device": device}
        if self.kind == "cuda":
            if self.row.matmuls:
                state["h"] = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            if self.row.kernels:
                state["k"] = torch.zeros(1024, device=device)
            if not self.row.copy_bound:
                state["x"] = torch.zeros(self.row.shape, device=device, dtype=self.row.dtype)
        else:
            state["t"] = torch.zeros(8)
            # Device tensors the model keeps, never written after (a frame in flight stays valid):
            # a fresh host allocation a step would cost page faults no GPU step has.
            state["outs"] = [torch.full(self.row.shape, _mark(i), dtype=self.row.dtype) for i in range(4)]
        return state

    def run_step(self, s: Any) -> torch.Tensor:
        s["i"] += 1
        row = self.row
        if self.kind != "cuda":
            t = s["t"]
            for _ in range(self._ops):
                t.add_(1.0)
            return s["outs"][s["i"] % 4]  # type: ignore[no-any-return]
        if row.copy_bound:
            return torch.full(row.shape, _mark(s["i"]), dtype=row.dtype, device=s["device"])
        if row.matmuls:
            h = s["h"]
            for _ in range(row.matmuls):
                h = torch.tanh(h @ self._w)
            s["h"] = h
            s["x"] = s["x"] * 0.99 + h[0, :1].to(row.dtype)
        if row.kernels:
            k = s["k"]
            for _ in range(row.kernels):
                k = k + 1.0
            s["k"] = k
            s["x"] = s["x"] * 0.99 + k[:1].to(row.dtype)
        return s["x"]  # type: ignore[no-any-return]

    def step(self, states: list[Any]) -> list[torch.Tensor]:
        return [self.run_step(s) for s in states]


def _new_device(row: Row, kind: str) -> om.device.Device:
    if kind == "sim":
        return SimDevice(compute_s=row.device_s)
    return om.device.resolve_device(kind)


def _synchronize(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "sim":
        simcuda.synchronize()


def _mark(step: int) -> int:
    """The byte a copy-bound row's step writes all over its frame."""
    return step % 4 + 1


def _corrupt(frame: torch.Tensor, step: int) -> bool:
    return frame.dtype == torch.uint8 and not bool((frame == _mark(step)).all())


def bare(row: Row, kind: str, steps: int) -> float:
    """The steps alone in a worker thread, warmed; seconds."""
    def body() -> float:
        device = _new_device(row, kind)
        device.prepare_thread()
        model = ShapeStep(row, kind)
        try:
            state = model.start({}, device.torch_device)
            for _ in range(3):  # warm
                model.run_step(state)
                device.after_step()
            _synchronize(kind)
            t0 = time.perf_counter()
            for _ in range(steps):
                model.run_step(state)
                device.after_step()
            _synchronize(kind)
            return time.perf_counter() - t0
        finally:
            device.close()

    return run_in_thread(body)


def bare_copies(row: Row, kind: str, steps: int) -> float:
    """What the link allows: ``steps`` pinned non-blocking copies into reused buffers, each waited
    for (on a side stream, as the engine copies), warmed; seconds."""
    def body() -> float:
        device = _new_device(row, kind)
        device.prepare_thread()
        try:
            src = torch.full(row.shape, 7, dtype=row.dtype, device=device.torch_device)
            dsts = [device.host_buffer(row.shape, row.dtype) for _ in range(BARE_BUFFERS)]
            events: list[Any] = [None] * BARE_BUFFERS
            for k in range(BARE_BUFFERS):  # warm
                events[k] = device.copy_to_host(src, dsts[k])
                events[k].synchronize()
            t0 = time.perf_counter()
            for i in range(steps):
                k = i % BARE_BUFFERS
                events[k] = device.copy_to_host(src, dsts[k], events[k])
                events[k].synchronize()
            return time.perf_counter() - t0
        finally:
            device.close()

    return run_in_thread(body)


async def engine(row: Row, kind: str, steps: int, corrupt: list[int]) -> float:
    """One request through the engine, warmed in the same engine, every frame read; seconds.

    Then, untimed, a request of a copy-bound row whose every frame is checked as it arrives
    (``corrupt`` counts the frames that are not their step's).
    """
    async with om.Engine(ShapeStep(row, kind), device=_new_device(row, kind)) as eng:
        await eng.generate({"steps": 3})
        n = 0
        t0 = time.perf_counter()
        async for _ in eng.stream({"steps": steps}):
            n += 1
        elapsed = time.perf_counter() - t0
        if row.copy_bound:
            async for frame in eng.stream({"steps": min(steps, 12)}):
                corrupt[0] += _corrupt(frame.data, frame.step)
    assert n == steps, f"{row.name}: {n} frames for {steps} steps"
    return elapsed


async def peer(row: Row, kind: str, steps: int) -> float:
    """A worker thread that steps, ``.cpu()``s each output and queues it for the loop, warmed; seconds."""
    loop = asyncio.get_running_loop()
    frames: asyncio.Queue[torch.Tensor | None] = asyncio.Queue()
    go = threading.Event()
    started: list[float] = []

    def work() -> None:
        device = _new_device(row, kind)
        device.prepare_thread()
        model = ShapeStep(row, kind)
        try:
            state = model.start({}, device.torch_device)
            for _ in range(3):  # warm
                model.run_step(state).cpu()
            go.wait()
            started.append(time.perf_counter())
            for _ in range(steps):
                out = model.run_step(state)
                device.after_step()
                if kind != "cuda":
                    _synchronize(kind)  # .cpu(): the host waits for the step...
                    host = out.clone()  # ...then copies into a fresh tensor
                else:
                    host = out.cpu()
                loop.call_soon_threadsafe(frames.put_nowait, host)
        finally:
            device.close()
            loop.call_soon_threadsafe(frames.put_nowait, None)

    thread = threading.Thread(target=work, name="peer")
    thread.start()
    go.set()
    n = 0
    while await frames.get() is not None:
        n += 1
    end = time.perf_counter()
    thread.join()
    assert n == steps
    return end - started[0]


async def measure_row(row: Row, kind: str, reps: int, *, quick: bool = False, ctx: Context | None = None) -> dict:
    """One row: its samples interleaved; a dict of the figures."""
    steps = max(6, row.steps // 6) if quick else row.steps
    corrupt = [0]

    async def b() -> float:
        return bare(row, kind, steps)

    async def bc() -> float:
        return bare_copies(row, kind, steps)

    async def e() -> float:
        return await engine(row, kind, steps, corrupt)

    async def p() -> float:
        return await peer(row, kind, steps)

    variants: dict[str, Callable[[], Any]] = {"bare": b, "engine": e, "peer": p}
    if row.copy_bound:
        variants = {"bare_copies": bc, "engine": e, "peer": p}
    samples = await interleave(variants, reps, ctx=ctx)
    med = {k: median(v) for k, v in samples.items()}
    out: dict[str, Any] = {
        "figure": row.name, "device": kind, "steps": steps, "frame_MiB": row.nbytes / 2**20,
        "step_ms": {k: v / steps * 1e3 for k, v in med.items()},
        "peer_over_engine": med["peer"] / med["engine"], "corrupt": corrupt[0], "samples_s": samples,
    }
    if row.copy_bound:
        gbps = {k: row.nbytes * steps / v / 1e9 for k, v in med.items()}
        out.update(value=gbps["engine"] / gbps["bare_copies"], target=str(LINK_TARGET), GBps=gbps)
    else:
        target = SHORT_TARGET if row.device_s < 0.006 else LONG_TARGET
        out.update(value=med["engine"] / med["bare"], target=str(target))
    return out


async def run(ctx: Context, rows: tuple[Row, ...] = ROWS, kind: str = "sim") -> list[Figure]:
    """``python -m benchmarks``: every row on ``kind``."""
    figures = []
    for row in rows:
        ctx.log(f"step_shapes {row.name} on {kind}")
        r = await measure_row(row, kind, ctx.reps, quick=ctx.quick, ctx=ctx)
        target = Target(r["target"].split()[0], float(r["target"].split()[1]))
        figures.append(Figure(
            name=f"step_shapes.{kind}.{row.name}", value=r["value"], target=target,
            baseline={k: v for k, v in r["step_ms"].items() if k != "engine"},
            engine={"engine_step_ms": r["step_ms"]["engine"]}, unit="x",
            limits=("the simulated streams' sleeps and host memcpy, this machine's cores"
                    if kind == "sim" else "the GPU"),
            details={k: v for k, v in r.items() if k not in ("value", "target")},
        ))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "sim", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "sim")
    ap.add_argument("--rows", nargs="*", choices=[r.name for r in ROWS])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="few steps: checks it runs, measures little")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device sim", file=sys.stderr)
        return 2
    rows = tuple(r for r in ROWS if (not args.rows or r.name in args.rows)
                 and not (args.device == "cpu" and r.copy_bound))

    async def all_rows() -> list[dict]:
        out = []
        for row in rows:
            r = await measure_row(row, args.device, args.reps, quick=args.quick)
            out.append(r)
            extra = (f"GB/s engine {r['GBps']['engine']:.2f}, bare {r['GBps']['bare_copies']:.2f}, "
                     f"peer {r['GBps']['peer']:.2f}" if "GBps" in r else
                     ", ".join(f"{k} {v:.3f} ms" for k, v in r["step_ms"].items()))
            print(f"{row.name:14s} {r['value']:.3f} (target {r['target']})  peer/engine "
                  f"{r['peer_over_engine']:.3f}  corrupt {r['corrupt']}  {extra}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"device": args.device, "rows": out}, indent=2))
        return out

    asyncio.run(all_rows())
    return 0


if __name__ == "__main__":
    sys.exit(main())
