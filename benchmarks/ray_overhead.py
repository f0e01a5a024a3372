"""Ray Serve overhead: per-frame cost through a replica, and what a replica holds for a stalled reader.

``python -m benchmarks.ray_overhead [--steps N] [--reps R] [--stall S] [--front-door-reps F]
[--front-door-step-ms MS] [--front-door-size PX] [--front-door-window W] [--json PATH]``

Starts a local Ray instance (``num_cpus=2``, Serve without its HTTP proxy)
and one replica of the synthetic model on the CPU device, in this machine.

1. Per frame: one request of ``N`` steps (``work=0``: the steps cost
   almost nothing, so what is measured is the hand-over) read to its end
   with ``policy="all"``, in process (``Engine``) and through the replica
   (``RemoteEngine``, window 2 and 8), for 64 px and 256 px frames
   (``[3, 64, 64]`` float32: 48 KiB, carried inline by Ray; ``[3, 256,
   256]``: 768 KiB, through the object store). Median of ``R`` runs.
   Then the replica rendering each frame as it does for a server in front
   (a RenderRequest: a JPEG preview of at most 512 px every step, the
   result as PNG) against raw frames, 256 and 1024 px, 20 steps: time a
   frame and bytes a frame carried.
2. A stalled reader: a request of 100,000 steps with ``policy="latest"``,
   read once, then not read for ``S`` seconds while the replica's report
   is sampled: frames in transit (sent, unacknowledged), frames the
   engine coalesced, steps computed, and the replica process's RSS. The
   frames held must stay within the window however long the stall.
3. The front door: ``omni_stream.server.Server`` over a ``RemoteEngine``
   (one replica, window 2, ``--front-door-window``) against the same server over a local
   ``Engine``, both on the CPU device: 10 websocket clients (a process of
   their own, ``fanout_client.py``) each generate 20 steps of ``[3, 64,
   64]`` frames (``work=0``; each step made to take
   ``--front-door-step-ms``, default 10 ms, by a sleep: device time, not
   the CPU's; ``--front-door-size`` sets the side) with a JPEG preview of
   every step, all at once; the remote engine both as the server uses it
   (the replica renders the previews and the result, RendersFrames) and
   sending raw frames for the server to render. Previews
   received (of 200: the server keeps the latest preview per request, so
   a slow path coalesces), frames per second (previews received / wall
   time from the generates to the last ``done``), p50 / p99 latency from
   a step's completion (stamped by the model, in the replica's process for
   the remote engine, on the shared ``CLOCK_MONOTONIC``) to the client's
   receipt of its preview, and CPU time of this process (the front door,
   and for the local variant the engine too) per frame. The two variants
   alternate, ``F`` rounds (``--front-door-reps``, 0 skips the part);
   medians.

Prints one table per part; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

SIZES = (64, 256)
#: Frames rendered on the replica against raw ones: sides, and steps a request.
RENDER_SIZES = (256, 1024)
RENDER_STEPS = 20


def _render_request() -> Any:
    from omni_stream.preview import PreviewSpec, RenderRequest

    return RenderRequest.of(PreviewSpec(every=1, format="jpeg", max_size=512), "png")
#: The front-door part: clients, steps, frame shape, preview.
FD_CLIENTS, FD_STEPS, FD_SHAPE = 10, 20, [3, 64, 64]
FD_PREVIEW = {"every": 1, "format": "jpeg", "max_size": 512}
FD_DEADLINE_S = 60.0


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _drain(stream: Any) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


async def _per_frame_local(params: dict[str, Any], reps: int) -> float:
    import omni_stream as om

    times = []
    async with om.Engine(om.models.Synthetic(), device="cpu") as engine:
        await engine.generate({**params, "steps": 3})  # warm up
        for _ in range(reps):
            t0 = time.perf_counter()
            n = await _drain(engine.stream(params, policy="all"))
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


async def _per_frame_remote(
    name: str, params: dict[str, Any], reps: int, window: int, render: Any = None
) -> tuple[float, float]:
    """Seconds a frame through the replica, and the bytes a frame carried (tensor or image)."""
    from omni_stream.integrations.ray_serve import RemoteEngine

    times: list[float] = []
    carried: list[float] = []
    async with RemoteEngine(name, window=window) as engine:
        await engine.generate({**params, "steps": 3})
        for _ in range(reps):
            t0 = time.perf_counter()
            n = nbytes = 0
            async for frame in engine.stream(params, policy="all", render=render):
                n += 1
                nbytes += len(frame.encoded.data) if frame.encoded is not None else (
                    frame.data.numel() * frame.data.element_size()
                )
            times.append((time.perf_counter() - t0) / n)
            carried.append(nbytes / n)
    return statistics.median(times), statistics.median(carried)


async def _stalled_reader(name: str, stall_s: float) -> dict[str, Any]:
    from omni_stream.integrations.ray_serve import RemoteEngine

    shape = [3, 256, 256]
    frame_bytes = 3 * 256 * 256 * 4
    samples: list[dict[str, Any]] = []
    async with RemoteEngine(name) as engine:
        stream = engine.stream({"shape": shape, "work": 0, "steps": 100_000}, policy="latest")
        await stream.__anext__()
        replica = stream.replica
        await engine.refresh()
        pid = next(v.report.pid for v in engine.replicas() if v.replica == replica)
        start_stats = next(v.report.health.statistics for v in engine.replicas() if v.replica == replica)
        rss0 = _rss_mib(pid)
        t0 = time.monotonic()
        while time.monotonic() - t0 < stall_s:
            await asyncio.sleep(0.5)
            await engine.refresh()
            view = next(v for v in engine.replicas() if v.replica == replica)
            s = view.report.health.statistics
            samples.append({
                "t_s": round(time.monotonic() - t0, 1),
                "in_transit": view.report.in_transit,
                "steps": s.steps - start_stats.steps,
                "coalesced": s.frames_dropped - start_stats.frames_dropped,
                "rss_mib": _rss_mib(pid),
            })
        await stream.aclose()
    held = max(x["in_transit"] for x in samples)
    steps = samples[-1]["steps"]
    rss = [x["rss_mib"] for x in samples if x["rss_mib"] is not None]
    return {
        "stall_s": stall_s,
        "frame_bytes": frame_bytes,
        "max_in_transit_frames": held,
        "max_in_transit_mib": held * frame_bytes / 2**20,
        "steps_computed": steps,
        "unbounded_would_hold_mib": steps * frame_bytes / 2**20,
        "frames_coalesced": samples[-1]["coalesced"],
        "replica_rss_mib_start": rss0,
        "replica_rss_mib_max": max(rss) if rss else None,
        "samples": samples,
    }


def _stamped_synthetic(path: str, step_s: float = 0.0) -> Any:
    """A Synthetic whose steps take ``step_s`` more (a sleep: device time, not the CPU's),
    appending ``seed step perf_counter`` to ``path`` when each step finishes.

    A file, because the replica's model runs in another process (on this
    machine: ``time.perf_counter`` is CLOCK_MONOTONIC, shared by every
    process). The driver truncates the file between samples; writes are
    O_APPEND, so they go on at the new end.
    """
    import omni_stream as om

    class _FileStamped(om.models.Synthetic):
        def __init__(self) -> None:
            super().__init__()
            self._out: Any = None

        def step(self, states: Sequence[Any]) -> Any:
            frames = super().step(states)
            if step_s:
                time.sleep(step_s)
            now = time.perf_counter()
            if self._out is None:
                self._out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the model
            self._out.write("".join(f"{int(s.params['seed'])} {s.step} {now!r}\n" for s in states))
            return frames

    return _FileStamped()


def _read_stamps(path: str) -> dict[tuple[int, int], float]:
    stamps: dict[tuple[int, int], float] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3:
                stamps[(int(parts[0]), int(parts[1]))] = float(parts[2])
    return stamps


async def _front_door_sample(
    kind: str, name: str, path: str, step_s: float, shape: list[int], window: int = 2
) -> dict[str, Any]:
    from omni_stream.integrations.ray_serve import RemoteEngine
    from omni_stream.server import Server

    from .fanout import _clients, _summarise

    cfg = {
        "transport": "ws",
        "clients": FD_CLIENTS,
        "extra": None,
        "extra_params": {},
        "extra_preview": FD_PREVIEW,
        "params": {"steps": FD_STEPS, "work": 0, "shape": shape},
        "preview": FD_PREVIEW,
        "deadline_s": FD_DEADLINE_S,
    }
    server_kw: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "max_connections": FD_CLIENTS + 8}
    if kind in ("remote", "remote_raw"):
        # "remote": the replica renders the previews and the result (the
        # server asks, RendersFrames); "remote_raw": it sends raw frames and
        # the server renders, as before it could ask.
        async with RemoteEngine(name, renders_frames=kind == "remote", window=window) as engine:
            await engine.generate({"steps": 2, "work": 0, "shape": shape})  # warm up
            async with Server(engine, **server_kw) as srv:
                open(path, "w").close()
                cpu0 = time.process_time()
                result = await _clients(dict(cfg, url=srv.url))
                cpu = time.process_time() - cpu0
    else:
        import omni_stream as om

        async with om.Engine(_stamped_synthetic(path, step_s), device="cpu") as engine:
            await engine.generate({"steps": 2, "work": 0, "shape": shape})
            async with Server(engine, **server_kw) as srv:
                open(path, "w").close()
                cpu0 = time.process_time()
                result = await _clients(dict(cfg, url=srv.url))
                cpu = time.process_time() - cpu0
    return _summarise(result, _read_stamps(path), cpu, FD_DEADLINE_S)


#: The front door's variants, in the order of the first round (later rounds rotate it).
FD_KINDS = ("local", "remote", "remote_raw")


def _front_door(
    name: str, path: str, reps: int, step_s: float, size: int = 64, window: int = 2
) -> dict[str, Any]:
    shape = [3, size, size]
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in FD_KINDS}
    for r in range(reps):
        order = FD_KINDS[r % len(FD_KINDS):] + FD_KINDS[: r % len(FD_KINDS)]
        for kind in order:
            # The replica's model stamps its steps into path.remote, whichever remote variant reads it.
            stamps = path + (".local" if kind == "local" else ".remote")
            s = asyncio.run(_front_door_sample(kind, name, stamps, step_s, shape, window))
            if s["finished"] != s["clients"]:
                raise RuntimeError(
                    f"front door over {kind}: {s['finished']}/{s['clients']} done: {s['outcomes']}"
                )
            samples[kind].append(s)
    out: dict[str, Any] = {
        "clients": FD_CLIENTS,
        "steps": FD_STEPS,
        "shape": shape,
        "reps": reps,
        "step_ms": step_s * 1e3,
        "window": window,
        "samples": samples,
    }
    for kind, rows in samples.items():
        for key in ("fps", "frames", "p50_ms", "p99_ms", "server_cpu_ms_per_frame"):
            out[f"{kind}_{key}"] = statistics.median(x[key] for x in rows)
    for kind in ("remote", "remote_raw"):
        out[f"{kind}_fps_ratio"] = statistics.median(
            rem["fps"] / loc["fps"] for loc, rem in zip(samples["local"], samples[kind], strict=True)
        )
    out["fps_ratio"] = out["remote_fps_ratio"]
    return out


def run(
    steps: int,
    reps: int,
    stall_s: float,
    front_door_reps: int = 3,
    front_door_step_s: float = 0.01,
    front_door_size: int = 64,
    front_door_window: int = 2,
) -> dict[str, Any]:
    import tempfile

    import ray
    from ray import serve

    from omni_stream.integrations.ray_serve import deploy, undeploy

    # The replicas import this module's stamped model (benchmarks.ray_overhead).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    stamp_dir = tempfile.mkdtemp(prefix="omni-stream-ray-overhead-")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    name = "bench"
    deploy("synthetic", name=name, replicas=1, num_cpus=0, engine_kwargs={"device": "cpu"})
    out: dict[str, Any] = {"steps": steps, "reps": reps, "per_frame": []}
    try:
        for size in SIZES:
            params = {"shape": [3, size, size], "work": 0, "steps": steps}
            local = asyncio.run(_per_frame_local(params, reps))
            row: dict[str, Any] = {"size": size, "local_ms": local * 1e3}
            for window in (2, 8):
                remote, carried = asyncio.run(_per_frame_remote(name, params, reps, window))
                row[f"remote_w{window}_ms"] = remote * 1e3
                row[f"overhead_w{window}_ms"] = (remote - local) * 1e3
                row["raw_bytes"] = carried
            out["per_frame"].append(row)
        for size in RENDER_SIZES:
            # The replica renders (as for a server in front): a JPEG preview of
            # every step, the result as PNG; against raw frames, same run.
            params = {"shape": [3, size, size], "work": 0, "steps": RENDER_STEPS}
            raw_s, raw_b = asyncio.run(_per_frame_remote(name, params, reps, 2))
            ren_s, ren_b = asyncio.run(_per_frame_remote(name, params, reps, 2, _render_request()))
            out.setdefault("rendered", []).append({
                "size": size, "raw_ms": raw_s * 1e3, "raw_bytes": raw_b,
                "rendered_ms": ren_s * 1e3, "rendered_bytes": ren_b,
            })
        out["stalled_reader"] = asyncio.run(_stalled_reader(name, stall_s))
        if front_door_reps > 0:
            path = os.path.join(stamp_dir, "stamps")
            deploy(
                functools.partial(_stamped_synthetic, path + ".remote", front_door_step_s),
                name="front_door",
                replicas=1,
                num_cpus=0,
                engine_kwargs={"device": "cpu"},
            )
            try:
                out["front_door"] = _front_door(
                    "front_door", path, front_door_reps, front_door_step_s, front_door_size,
                    front_door_window,
                )
            finally:
                undeploy("front_door")
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(stamp_dir, ignore_errors=True)
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"\nper frame, {out['steps']} steps, work=0, policy all, median of {out['reps']}:")
    print(f"{'frame':>10} {'in process':>11} {'replica w2':>11} {'+overhead':>10} {'replica w8':>11} {'+overhead':>10}")
    for r in out["per_frame"]:
        print(
            f"{r['size']:>4} px    {r['local_ms']:>8.3f} ms {r['remote_w2_ms']:>8.3f} ms {r['overhead_w2_ms']:>7.3f} ms"
            f" {r['remote_w8_ms']:>8.3f} ms {r['overhead_w8_ms']:>7.3f} ms"
        )
    print(f"\nrendered on the replica (JPEG <= 512 px every step, PNG result) against raw frames,"
          f" {RENDER_STEPS} steps, window 2, policy all:")
    print(f"{'frame':>10} {'raw':>10} {'bytes':>11} {'rendered':>10} {'bytes':>11}")
    for r in out.get("rendered", []):
        print(
            f"{r['size']:>4} px   {r['raw_ms']:>7.2f} ms {r['raw_bytes'] / 1024:>7.0f} KiB"
            f" {r['rendered_ms']:>7.2f} ms {r['rendered_bytes'] / 1024:>7.0f} KiB"
        )
    s = out["stalled_reader"]
    print(f"\nstalled reader, {s['stall_s']:.0f} s, 256 px frames ({s['frame_bytes'] // 1024} KiB), window 2:")
    print(f"{'t':>6} {'in transit':>11} {'steps':>8} {'coalesced':>10} {'replica RSS':>12}")
    for x in s["samples"]:
        rss = "-" if x["rss_mib"] is None else f"{x['rss_mib']:.0f} MiB"
        print(f"{x['t_s']:>5.1f}s {x['in_transit']:>11} {x['steps']:>8} {x['coalesced']:>10} {rss:>12}")
    print(
        f"held at most {s['max_in_transit_frames']} frames ({s['max_in_transit_mib']:.1f} MiB); "
        f"an unbounded queue would hold {s['steps_computed']} frames ({s['unbounded_would_hold_mib']:.0f} MiB)"
    )
    fd = out.get("front_door")
    if fd:
        print(
            f"\nfront door (Server), {fd['clients']} websocket clients x {fd['steps']} steps"
            f" of {fd['shape']} ({fd['step_ms']:g} ms a step, window {fd['window']}), JPEG every step,"
            f" median of {fd['reps']}:"
        )
        print(f"{'engine':>22} {'previews':>9} {'fps':>8} {'p50':>9} {'p99':>9} {'own CPU/frame':>17}")
        for kind, label in (
            ("local", "local Engine"),
            ("remote", "RemoteEngine, rendered"),
            ("remote_raw", "RemoteEngine, raw"),
        ):
            print(
                f"{label:>22} {fd[kind + '_frames']:>9.0f} {fd[kind + '_fps']:>8.0f}"
                f" {fd[kind + '_p50_ms']:>6.1f} ms {fd[kind + '_p99_ms']:>6.1f} ms"
                f" {fd[kind + '_server_cpu_ms_per_frame']:>11.2f} ms"
            )
        print(
            f"remote / local fps: rendered on the replica {fd['remote_fps_ratio']:.2f}x"
            f" (p99 {fd['remote_p99_ms'] - fd['local_p99_ms']:+.1f} ms),"
            f" raw frames {fd['remote_raw_fps_ratio']:.2f}x"
            f" (p99 {fd['remote_raw_p99_ms'] - fd['local_p99_ms']:+.1f} ms)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ray_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per request (default 200)")
    ap.add_argument("--reps", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    ap.add_argument("--stall", type=float, default=6.0, help="seconds the stalled reader does not read (default 6)")
    ap.add_argument(
        "--front-door-reps",
        type=int,
        default=3,
        help="rounds of the front-door part (10 clients, local against remote engine); "
        "0 skips it (default 3)",
    )
    ap.add_argument(
        "--front-door-step-ms",
        type=float,
        default=10.0,
        help="time each step of the front-door part's model takes (a sleep; default 10)",
    )
    ap.add_argument(
        "--front-door-size",
        type=int,
        default=64,
        help="side of the front-door part's square RGB frames, px (default 64)",
    )
    ap.add_argument(
        "--front-door-window",
        type=int,
        default=2,
        help="the front-door part's RemoteEngine window, frames in transit per request (default 2)",
    )
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        print('needs Ray Serve: pip install "omni-stream[ray]"', file=sys.stderr)
        return 2
    logging.getLogger("ray").setLevel(logging.WARNING)
    out = run(
        args.steps, args.reps, args.stall, args.front_door_reps, args.front_door_step_ms / 1e3,
        args.front_door_size, args.front_door_window,
    )
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
