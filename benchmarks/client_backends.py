"""The Python client's cost on each anyio backend: websockets' client on asyncio and uvloop, AnyioSocket on trio.

One real ``omni-stream serve`` (Synthetic on the CPU, ``work=0``, one torch
thread) runs in a process of its own, so this process's CPU time is the
client's alone. Each round opens a client under each backend in turn
(``anyio.run``, the backends interleaved) and reads ``--requests`` requests
of ``--steps`` steps with a raw preview every step and progress messages,
one after the other on one connection. Reported per backend: the client's
CPU per message received (its process time over the messages: progress,
previews, the result, ``done``) and the wall time per request, each the
median over the rounds, and each backend's CPU per message against
asyncio's. The server paces the messages (latest-wins previews), so the
message count varies a little between runs; the CPU per message is what
compares.

``python -m benchmarks.client_backends [--rounds N] [--requests R] [--steps S] [--size PX]``
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

__all__ = ["main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def _serve() -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_")}
    env["OMNI_STREAM_TORCH_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream", "serve", "--model", "synthetic", "--device", "cpu",
         "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"listening on http://(127\.0\.0\.1:\d+)", line)
        if found:
            # Keep reading its log: a full pipe would stop the server.
            threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True).start()
            return proc, f"ws://{found.group(1)}/ws"
    proc.kill()
    raise RuntimeError("omni-stream serve did not start")


async def _session(url: str, requests: int, params: dict[str, Any]) -> tuple[int, float, float]:
    """(messages, client CPU s, wall s) for ``requests`` requests read to their end on one connection."""
    from omni_stream import client as omc

    preview = {"format": "raw", "every": 1}
    async with omc.connect(url) as client:
        await client.generate(dict(params, steps=2), preview=preview).result()  # warm: the first request
        messages = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(requests):
            async for _item in client.generate(params, preview=preview, progress=True):
                messages += 1
            messages += 1  # done
        return messages, time.process_time() - cpu0, time.perf_counter() - wall0


def measure(rounds: int, requests: int, steps: int, size: int) -> dict[str, dict[str, float]]:
    """Each backend's medians: ``cpu_us_per_message``, ``wall_ms_per_request``, ``messages``."""
    sys.path.insert(0, str(ROOT))
    params = {"steps": steps, "work": 0, "shape": [3, size, size]}
    proc, url = _serve()
    rows: dict[str, list[tuple[int, float, float]]] = {name: [] for name in BACKENDS}
    try:
        for r in range(rounds):
            for name, (backend, options) in BACKENDS.items():
                got = anyio.run(_session, url, requests, params, backend=backend, backend_options=options)
                rows[name].append(got)
                print(f"  round {r + 1}/{rounds} {name}: {got[0]} messages, "
                      f"{got[1] / got[0] * 1e6:.1f} us CPU each", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out: dict[str, dict[str, float]] = {}
    for name, samples in rows.items():
        out[name] = {
            "cpu_us_per_message": statistics.median(cpu / n * 1e6 for n, cpu, _ in samples),
            "wall_ms_per_request": statistics.median(wall / requests * 1e3 for _, _, wall in samples),
            "messages": statistics.median(n for n, _, _ in samples),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.client_backends", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the backends interleaved in each (default 5)")
    ap.add_argument("--requests", type=int, default=5, help="requests per round and backend (default 5)")
    ap.add_argument("--steps", type=int, default=200, help="steps per request (default 200)")
    ap.add_argument("--size", type=int, default=64, help="side of the square RGB frames, px (default 64)")
    args = ap.parse_args(argv)
    out = measure(args.rounds, args.requests, args.steps, args.size)
    base = out["asyncio"]["cpu_us_per_message"]
    print(f"client_backends: {args.requests} requests x {args.steps} steps of [3, {args.size}, {args.size}], "
          f"raw previews and progress; medians of {args.rounds} rounds")
    for name, row in out.items():
        print(f"  {name:8s} client CPU {row['cpu_us_per_message']:7.1f} us/message "
              f"({row['cpu_us_per_message'] / base:.2f}x asyncio), {row['wall_ms_per_request']:7.1f} ms/request, "
              f"{row['messages']:.0f} messages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
