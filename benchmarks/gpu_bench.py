"""GPU figures: the engine's device-to-host copies and the cost of streaming every step.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (needs only torch and anyio;
the project need not be installed: run from the repository root). Prints a
table and writes JSON (``--json PATH``). Each figure is a ratio measured
side by side in one run, baseline and engine interleaved:

* ``d2h_bandwidth``: bytes per second of frames delivered by the engine
  (copy on a side stream into pinned buffers, event wait, hand-over clone)
  against a bare pinned ``copy_(non_blocking=True)`` + synchronize of the
  same bytes. Target >= 0.8.
* ``stream_overhead_*``: wall time of N denoise-like steps (a matmul chain on
  the device) with every step's latent streamed to the host, against the
  same steps with no streaming. Target <= 1.02. One SD-sized latent
  (4x64x64) and one video-sized latent (16x21x90x160, bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import omni_stream as om  # noqa: E402


def _bare_copy_rate(src: torch.Tensor, reps: int) -> float:
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * reps / (time.perf_counter() - t0)


class _Frames(om.StepModel):
    """Each step returns a fresh device tensor (a cheap kernel): copy-bound."""

    name = "copy-bound"

    def __init__(self, shape, dtype, steps):
        self.shape, self.dtype, self.steps = shape, dtype, steps

    def total_steps(self, params):
        return self.steps

    def start(self, params, device):
        return {"x": torch.randn(self.shape, device=device, dtype=self.dtype)}

    def step(self, states):
        return [s["x"] + 0 for s in states]


class _Denoiser(om.StepModel):
    """A denoise-like step: a matmul chain whose output has the latent's shape."""

    name = "denoiser"

    def __init__(self, shape, dtype, steps, width=4096, depth=8):
        self.shape, self.dtype, self.steps = shape, dtype, steps
        self.width, self.depth = width, depth
        self.w = None

    def total_steps(self, params):
        return self.steps

    def load(self, device):
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(self.width, self.width, generator=g) / self.width**0.5
        self.w = w.to(device=device, dtype=self.dtype)

    def start(self, params, device):
        if self.w is None:
            self.load(device)
        return {
            "h": torch.randn(self.width, self.width, device=device, dtype=self.dtype),
            "x": torch.randn(self.shape, device=device, dtype=self.dtype),
        }

    def run_step(self, s):
        h = s["h"]
        for _ in range(self.depth):
            h = torch.tanh(h @ self.w)
        s["h"] = h
        s["x"] = s["x"] * 0.99 + h.flatten()[: 1].to(s["x"].dtype)
        return s["x"]

    def step(self, states):
        return [self.run_step(s) for s in states]


async def _engine_run(model, steps, **engine_kw):
    async with om.Engine(model, device="cuda", **engine_kw) as engine:
        t0 = time.perf_counter()
        n = 0
        async for _ in engine.stream({}, policy="all"):
            n += 1
        elapsed = time.perf_counter() - t0
    assert n == steps
    return elapsed


def _bare_steps(model, steps):
    device = torch.device("cuda")
    model.load(device)
    s = model.start({}, device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.run_step(s)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_bandwidth(reps: int) -> dict:
    shape, dtype = (16, 21, 90, 160), torch.bfloat16  # Wan 720p latent, 9.2 MiB
    nbytes = torch.Size(shape).numel() * 2
    src = torch.randn(shape, device="cuda", dtype=dtype)
    bare, eng = [], []
    for _ in range(reps):
        bare.append(_bare_copy_rate(src, 50))
        elapsed = asyncio.run(_engine_run(_Frames(shape, dtype, 50), 50))
        eng.append(nbytes * 50 / elapsed)
    b, e = statistics.median(bare), statistics.median(eng)
    return {"figure": "d2h_bandwidth", "value": e / b, "target": ">= 0.8",
            "bare_GBps": b / 1e9, "engine_GBps": e / 1e9, "payload_MiB": nbytes / 2**20}


def bench_overhead(name, shape, dtype, steps, reps) -> dict:
    bare, eng = [], []
    for _ in range(reps):
        bare.append(_bare_steps(_Denoiser(shape, dtype, steps), steps))
        eng.append(asyncio.run(_engine_run(_Denoiser(shape, dtype, steps), steps)))
    b, e = statistics.median(bare), statistics.median(eng)
    return {"figure": f"stream_overhead_{name}", "value": e / b, "target": "<= 1.02",
            "bare_step_ms": b / steps * 1e3, "engine_step_ms": e / steps * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    rows = [
        bench_bandwidth(args.reps),
        bench_overhead("sd_latent", (4, 64, 64), torch.float16, 40, args.reps),
        bench_overhead("video_latent", (16, 21, 90, 160), torch.bfloat16, 40, args.reps),
    ]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version()}
    for r in rows:
        extra = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in r.items() if k not in ("figure", "value", "target"))
        print(f"{r['figure']:<28} {r['value']:.3f}  (target {r['target']})  {extra}")
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "figures": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
