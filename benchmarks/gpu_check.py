"""What users run, on the GPU, in one pass: ``python -m benchmarks.gpu_check --device cuda --out DIR``.

``scripts/gpu_check.sh`` runs it on a CUDA machine (after installing the
wheels that machine lacks); ``--device sim --quick`` runs the same parts on
the simulated GPU, which CI does (``tests/test_gpu_check.py``), so this
script cannot rot where no GPU runs. Parts, each bounded, each recorded in
one JSON (``DIR/gpu-check.json``) whatever the others do:

* ``tests``: the GPU tests (``-m gpu``: every test of tests/device/test_cuda.py
  and the GPU-marked model tests, both halves) in a pytest subprocess.
* ``chaos``: the engine chaos (benchmarks/chaos.py: random requests, cancels,
  timeouts, injected failures, every frame checked bit for bit) on the device.
* ``serve``: ``omni-stream serve --model mixture`` on the device, and clients
  over both doors: a websocket request read to its end with previews, one
  cancelled after two previews, one whose client disconnects; an HTTP
  request streamed as Server-Sent Events, one cancelled with DELETE, one
  whose event stream is dropped; then the server must be healthy, have no
  host buffer leased, count the cancels, and still serve.
* ``bench``: ``benchmarks/gpu_bench.py`` (the step shapes, the copies, and
  with diffusers the SD 1.5- and Flux-sized pipelines) on CUDA, or the step
  shapes on the simulator.
* ``cache``: gpu_bench.py's step-caching rows (``--only cache``: 28 steps of
  a Flux.1-sized random transformer at 1024 px per ``cache`` setting, and a
  mixed batch of 4), last and bounded apart, since no GPU has timed them
  yet; on the simulator their CPU dry run.

Exit status 0 when every part passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


# -- tests ------------------------------------------------------------------------------------


def part_tests(device: str, timeout: float) -> dict[str, Any]:
    # On the simulator only its halves can run; on a GPU both.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "gpu",
           "tests/device/test_cuda.py", "tests/models/test_mixture.py"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}
    return {"ok": proc.returncode == 0, "exit": proc.returncode, "summary": tail, "counts": counts,
            "seconds": round(time.monotonic() - t0, 1),
            "failures": [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]}


# -- chaos ------------------------------------------------------------------------------------


def part_chaos(device: str, requests: int, max_seconds: float) -> dict[str, Any]:
    from benchmarks.chaos import run_chaos

    s = run_chaos(device=device, requests=requests, seed=11, concurrency=8, max_seconds=max_seconds)
    ok = not s["violations"] and s["corrupt"] == 0 and s["leaked_buffers"] == 0 and s["health"] == "ok"
    return {"ok": ok, **{k: s[k] for k in ("requests", "frames_checked", "corrupt", "leaked_buffers",
                                           "health", "outcomes", "wall_s")},
            "violations": s["violations"][:20]}


# -- serve ------------------------------------------------------------------------------------


class _Server:
    """``omni-stream serve`` in its own process, as a user starts it."""

    def __init__(self, device: str) -> None:
        cmd = [sys.executable, "-m", "omni_stream", "serve", "--model", "mixture", "--device", device,
               "--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                self.lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError("serve did not say where it listens within 120 s:\n" + "\n".join(self.log[-20:]))
            if m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
                return

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as reply:
                body = reply.read()
                return reply.status, json.loads(body) if reply.headers.get_content_type() == "application/json" else body
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as reply:
                return reply.status, json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _ws(server: _Server, request_id: str, steps: int, *, cancel_after: int | None = None,
        drop_after: int | None = None) -> dict[str, Any]:
    """One websocket request: read to its end, or cancel / disconnect after ``N`` previews."""
    from websockets.sync.client import connect

    previews, types = 0, []
    with connect(server.url.replace("http", "ws") + "/ws", open_timeout=30, max_size=None) as ws:
        ws.send(json.dumps({"type": "generate", "id": request_id,
                            "params": {"steps": steps, "size": 256, "seed": 5},
                            "preview": {"every": 1, "format": "jpeg", "max_size": 256}}))
        while True:
            data = ws.recv(timeout=120)
            if isinstance(data, bytes):
                previews += 1
                if cancel_after is not None and previews == cancel_after:
                    ws.send(json.dumps({"type": "cancel", "id": request_id}))
                if drop_after is not None and previews == drop_after:
                    return {"previews": previews, "end": "disconnected"}
                continue
            msg = json.loads(data)
            types.append(msg["type"])
            if msg["type"] in ("done", "cancelled", "error"):
                return {"previews": previews, "end": msg["type"], "reason": msg.get("reason"),
                        "message": msg.get("message")}


def _sse(server: _Server, steps: int, *, drop_after: int | None = None) -> dict[str, Any]:
    """An HTTP request whose events come in the POST's answer (``?stream``): read to the end, or
    dropped after ``N`` previews."""
    body = json.dumps({"params": {"steps": steps, "size": 256, "seed": 6},
                       "preview": {"every": 1, "format": "jpeg", "max_size": 128}}).encode()
    req = urllib.request.Request(server.url + "/v1/generations", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    events: list[str] = []
    previews = 0
    with urllib.request.urlopen(req, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                events.append(line[7:])
                if line[7:] == "preview":
                    previews += 1
                    if drop_after is not None and previews == drop_after:
                        return {"previews": previews, "end": "dropped"}
                if line[7:] in ("done", "cancelled", "error"):
                    return {"previews": previews, "end": line[7:]}
    return {"previews": previews, "end": events[-1] if events else None}


def part_serve(device: str, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server = _Server(device)
    try:
        out["ws_full"] = _ws(server, "ws-full", steps)
        out["ws_cancel"] = _ws(server, "ws-cancel", steps, cancel_after=2)
        out["ws_disconnect"] = _ws(server, "ws-drop", steps, drop_after=2)
        out["sse_full"] = _sse(server, steps)
        out["sse_dropped"] = _sse(server, steps, drop_after=2)
        status, created = server.call("POST", "/v1/generations", {"params": {"steps": steps, "size": 256}})
        rid = created["id"] if isinstance(created, dict) else None
        out["http_cancel"] = {"post": status, "delete": server.call("DELETE", f"/v1/generations/{rid}")[0]}
        # Everything settles: no request left, no host buffer leased, the cancels counted.
        deadline = time.monotonic() + 60
        health: Any = None
        while time.monotonic() < deadline:
            code, health = server.get("/health")
            if code == 200 and health.get("active") == 0 and health.get("queued") == 0 \
                    and health.get("buffers_in_use") == 0:
                break
            time.sleep(0.2)
        out["health"] = {k: health.get(k) for k in ("status", "active", "queued", "completed", "cancelled",
                                                     "failed", "buffers_in_use", "buffers_total")} \
            if isinstance(health, dict) else health
        out["after"] = _ws(server, "ws-after", steps)  # still serves
        code, metrics = server.get("/metrics")
        out["metrics"] = code == 200 and b"omni_stream_" in metrics
    except Exception as exc:  # noqa: BLE001 - recorded: the other parts still run
        out["exception"] = repr(exc)
    finally:
        out["exit"] = server.stop()
        out["log_tail"] = server.log[-15:]
    h = out.get("health") if isinstance(out.get("health"), dict) else {}
    out["ok"] = (
        "exception" not in out
        and out["ws_full"]["end"] == "done" and out["ws_full"]["previews"] >= steps
        and out["ws_cancel"]["end"] == "cancelled"
        and out["sse_full"]["end"] == "done"
        and out["http_cancel"]["delete"] in (200, 202, 204)
        and h.get("status") == "ok" and h.get("buffers_in_use") == 0 and (h.get("cancelled") or 0) >= 3
        and out["after"]["end"] == "done" and out["metrics"] and out["exit"] == 0
    )
    return out


# -- bench ------------------------------------------------------------------------------------


def part_bench(device: str, quick: bool, out_dir: Path, timeout: float) -> dict[str, Any]:
    if device == "cuda":
        # (The step-caching rows are their own part, bounded apart: see part_cache.)
        cmd = [sys.executable, "benchmarks/gpu_bench.py", "--json", str(out_dir / "gpu-bench.json"),
               "--cache-steps", "0"]
        if os.environ.get("FLUX_LAYERS"):
            cmd += ["--flux-layers", os.environ["FLUX_LAYERS"]]
        path = out_dir / "gpu-bench.json"
    else:
        cmd = [sys.executable, "-m", "benchmarks.step_shapes", "--device", "sim", "--reps", "1" if quick else "3",
               "--json", str(out_dir / "step-shapes-sim.json")] + (["--quick"] if quick else [])
        path = out_dir / "step-shapes-sim.json"
    return _bench_run(cmd, path, out_dir / "bench.log", timeout)


def part_cache(device: str, out_dir: Path, timeout: float) -> dict[str, Any]:
    """gpu_bench.py's step-caching rows (issue #35): a Flux.1-sized random transformer, 28 steps
    at 1024 px, each cache setting against none and a mixed batch of 4 (on the simulated GPU:
    its dry run on the CPU, a check that the part runs)."""
    path = out_dir / "gpu-bench-cache.json"
    cmd = [sys.executable, "benchmarks/gpu_bench.py", "--only", "cache", "--json", str(path)]
    if device == "cuda":
        if os.environ.get("FLUX_LAYERS"):
            cmd += ["--flux-layers", os.environ["FLUX_LAYERS"]]
    else:
        cmd += ["--dry-run", "--cache-steps", "2"]
    return _bench_run(cmd, path, out_dir / "cache.log", timeout)


def _bench_run(cmd: list[str], path: Path, log: Path, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = None, f"timed out after {timeout} s: {exc.stdout or ''}"
    figures = json.loads(path.read_text()) if path.exists() else None
    log.write_text(text if isinstance(text, str) else str(text))
    rows = figures.get("figures", figures.get("rows", [])) if isinstance(figures, dict) else []
    corrupt = sum(int(r.get("corrupt", 0)) for r in rows)
    return {"ok": code == 0 and corrupt == 0, "exit": code, "seconds": round(time.monotonic() - t0, 1),
            "corrupt": corrupt, "figures": figures}


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    ap.add_argument("--parts", nargs="*", default=["tests", "chaos", "serve", "bench", "cache"],
                    choices=["tests", "chaos", "serve", "bench", "cache"])
    ap.add_argument("--quick", action="store_true", help="small runs: checks each part works")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": args.device, "python": platform.python_version()}
    try:
        import torch

        report["torch"] = torch.__version__
        if args.device == "cuda":
            report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001
        report["torch"] = repr(exc)
    path = args.out / "gpu-check.json"
    quick = args.quick
    parts = {
        "tests": lambda: part_tests(args.device, 120 if quick else 200),
        "chaos": lambda: part_chaos(args.device, 30 if quick else 200, 20 if quick else 60),
        "serve": lambda: part_serve(args.device, 4 if quick else 12),
        "bench": lambda: part_bench(args.device, quick, args.out, 120 if quick else 330),
        # Last, so rows whose length on a GPU is not known yet cannot starve the others.
        "cache": lambda: part_cache(args.device, args.out, 120 if quick else 150),
    }
    for name in args.parts:
        t0 = time.monotonic()
        print(f"gpu_check: {name} on {args.device}...", flush=True)
        try:
            result = parts[name]()
        except Exception as exc:  # noqa: BLE001 - recorded; the next part runs
            result = {"ok": False, "exception": repr(exc)}
        result.setdefault("seconds", round(time.monotonic() - t0, 1))
        report[name] = result
        print(f"gpu_check: {name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s", flush=True)
        path.write_text(json.dumps(report, indent=2, default=str))
    ok = all(report[n].get("ok") for n in args.parts)
    report["ok"] = ok
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"gpu_check: {'all parts passed' if ok else 'FAILED'}; {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
