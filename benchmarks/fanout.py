"""Figure 6, websocket fan-out: 100 clients on loopback through the server, against a ComfyUI-style peer.

Each of 100 clients (in a separate process, see ``fanout_client.py``)
connects, and then all at once each generates its own request with a JPEG
preview of every step. Measured, for ``omni_stream.server.Server`` and for
the peer (``naive_server.py``: one queue, one serial publish loop,
permessage-deflate), side by side:

* frames per second: previews received by all clients / wall time from the
  generates to the last ``done``;
* latency from a step's completion (stamped by the model on the producer
  thread) to the client's receipt of that step's preview, p50 and p99;
* server CPU per frame: the server process's CPU time (loop, producer,
  preview thread) / previews received.

Then with a 101st client watching a heavy request (1024 px frames sent
raw, 3 MiB each, so that a stalled socket fills within a few frames):
once reading everything, once reading two previews and then nothing (its
request runs on). The ratio of the others' frame rate between the two is
what the stuck reader costs everyone else: a slow reader must slow only
itself.

Generation and preview rendering are the same in both (the same Engine and
Previewer), so the differences are the send path's.

The same load read as Server-Sent Events from the same server (``sse``:
each client ``POST``s ``/v1/generations`` and ``GET``s the answer's
``events`` URL on the same kept-alive connection, as a page with an
``EventSource`` does; ``sse_post``: one ``POST`` with ``Accept:
text/event-stream``), with the latency taken when the client has parsed a
``preview`` event, against the websocket clients in the same run; and the
stalled 101st client as an event-stream reader.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import omni_stream as om

from .harness import Context, Figure, Target, interleave, median, percentile

__all__ = ["StampedSynthetic", "run"]

SHAPE = [3, 256, 256]
PREVIEW = {"every": 1, "format": "jpeg", "max_size": 512}
#: The 101st client's request: big raw frames, so its socket fills in a few steps.
EXTRA_PARAMS = {"steps": 10_000, "shape": [3, 1024, 1024]}
EXTRA_PREVIEW = {"every": 1, "format": "raw", "max_size": None}
#: Our own bound: with one client stuck, the others keep this share of their frame rate.
STUCK_TARGET = Target(">=", 0.8)
#: The issue's targets: p99 from a step's completion to the client, and the
#: frame rate with one stalled client present against the peer's.
LATENCY_TARGET = Target("<=", 50.0)
STUCK_VS_NAIVE_TARGET = Target(">=", 3.0)


class StampedSynthetic(om.models.Synthetic):
    """Synthetic that records when each (seed, step) finished computing (``time.perf_counter``).

    It takes a ``prompt`` (unused) so that the OpenAI door, which always sends
    one, can drive it too.
    """

    params = (*om.models.Synthetic.params, om.Param("prompt", "str", "", "unused: the OpenAI door sends one"))

    def __init__(self) -> None:
        super().__init__()
        self.stamps: dict[tuple[int, int], float] = {}

    def step(self, states: Sequence[Any]) -> list[torch.Tensor]:
        frames = super().step(states)
        now = time.perf_counter()
        for s in states:
            self.stamps[(int(s.params["seed"]), s.step)] = now
        return frames


async def _clients(cfg: dict[str, Any]) -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.fanout_client",
        cwd=root,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(json.dumps(cfg).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{err.decode()[-2000:]}")
    return json.loads(out)


def _summarise(
    result: dict[str, Any], stamps: dict[tuple[int, int], float], cpu_s: float, deadline_s: float
) -> dict[str, Any]:
    normal = [c for c in result["clients"] if not c["extra"]]
    frames = [f for c in normal for f in c["frames"]]
    ends = [c["t_end"] for c in normal if c["outcome"] == "done"]
    # Clients still waiting at the deadline had the whole deadline to get their frames.
    wall = max(ends) - result["t_start"] if len(ends) == len(normal) else deadline_s
    lat = [
        (t - stamps[(c["client"], step)]) * 1e3
        for c in normal
        for step, t, _ in c["frames"]
        if (c["client"], step) in stamps
    ]
    all_frames = sum(len(c["frames"]) for c in result["clients"])
    return {
        "frames": len(frames),
        "fps": len(frames) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "finished": len(ends),
        "clients": len(normal),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=float("nan")),
        "server_cpu_ms_per_frame": cpu_s / max(1, all_frames) * 1e3,
        "client_cpu_ms_per_frame": result["client_cpu_s"] / max(1, all_frames) * 1e3,
        "bytes_per_frame": sum(f[2] for f in frames) / max(1, len(frames)),
        "outcomes": sorted({c["outcome"] for c in result["clients"]}),
    }


async def _sample(
    kind: str,
    extra: str | None,
    clients: int,
    steps: int,
    deadline_s: float,
    transport: str = "ws",
    **server: Any,
) -> dict[str, Any]:
    model = StampedSynthetic()
    cfg = {
        "transport": transport,
        "clients": clients,
        "extra": extra,
        "extra_params": EXTRA_PARAMS,
        "extra_preview": EXTRA_PREVIEW,
        "params": {"steps": steps, "work": 0, "shape": SHAPE},
        "preview": PREVIEW,
        "deadline_s": deadline_s,
    }
    if kind == "ours":
        from omni_stream.server import Server

        if transport != "ws":
            # Generations started over HTTP are detached: every one of them
            # counts against max_retained (64 by default) while it runs.
            server.setdefault("max_retained", clients + 8)
            # Over HTTP a client is its address (core/principal.py): the 100
            # clients here share 127.0.0.1, where in production they are 100
            # addresses. Give the one address the room of 100 principals.
            server.setdefault("max_requests_per_principal", clients + 8)
            server.setdefault("max_connections_per_principal", clients + 8)
            server.setdefault("max_messages_per_s", 100.0 * clients)
        async with Server(
            model, host="127.0.0.1", port=0, device="cpu", max_connections=clients + 8, **server
        ) as srv:
            cpu0 = time.process_time()
            result = await _clients(dict(cfg, url=srv.url if transport == "ws" else srv.http_url))
            cpu = time.process_time() - cpu0
    else:
        from .naive_server import NaiveServer

        async with om.Engine(model, device="cpu") as engine, NaiveServer(engine) as server:
            cpu0 = time.process_time()
            result = await _clients(dict(cfg, url=server.url))
            cpu = time.process_time() - cpu0
    return _summarise(result, model.stamps, cpu, deadline_s)


async def run(ctx: Context) -> list[Figure]:
    clients, steps = (5, 2) if ctx.quick else (100, 10)
    reps = 1 if ctx.quick else max(1, min(ctx.reps, 3))
    # A stalled peer never finishes: the deadline bounds that sample.
    deadline = 10.0 if ctx.quick else 20.0
    ctx.log(f"fanout: {clients} clients x {steps} steps of {SHAPE}, JPEG every step; deadline {deadline:g} s")

    def sampler(kind: str, extra: str | None, transport: str = "ws", **server: Any):
        async def sample() -> dict[str, Any]:
            s = await _sample(kind, extra, clients, steps, deadline, transport, **server)
            label = kind + ("" if transport == "ws" else f" {transport}")
            label += "".join(f" {k}={v}" for k, v in server.items())
            ctx.log(
                f"{label}{' +' + extra if extra else ''}: {s['fps']:.0f} fps, p50 {s['p50_ms']:.1f} ms, "
                f"p99 {s['p99_ms']:.1f} ms, {s['finished']}/{s['clients']} done, "
                f"server {s['server_cpu_ms_per_frame']:.2f} ms CPU/frame"
            )
            return s

        return sample

    samples = await interleave(
        {
            "ours": sampler("ours", None),
            "ours_2_preview_threads": sampler("ours", None, preview_threads=2),
            # max_active's default before it followed the device (two
            # batches: 16), against today's on the CPU device (2).
            "ours_max_active_16": sampler("ours", None, max_active=16),
            "naive": sampler("naive", None),
            "ours_reading": sampler("ours", "reading"),
            "ours_stuck": sampler("ours", "stuck"),
            "naive_reading": sampler("naive", "reading"),
            "naive_stuck": sampler("naive", "stuck"),
            "sse": sampler("ours", None, "sse"),
            "sse_post": sampler("ours", None, "sse_post"),
            "sse_reading": sampler("ours", "reading", "sse"),
            "sse_stuck": sampler("ours", "stuck", "sse"),
            # OpenAI's Images API, streamed: a partial image (JPEG, full size) at every step.
            "openai": sampler("ours", None, "openai"),
        },
        reps,
    )

    def m(kind: str, key: str) -> float:
        return median([s[key] for s in samples[kind]])

    def raw(kind: str) -> dict[str, float]:
        return {
            "fps": m(kind, "fps"),
            "p50_ms": m(kind, "p50_ms"),
            "p99_ms": m(kind, "p99_ms"),
            "cpu_ms_per_frame": m(kind, "server_cpu_ms_per_frame"),
            "finished": m(kind, "finished"),
            "wall_s": m(kind, "wall_s"),
        }

    details = {
        "clients": clients,
        "steps": steps,
        "shape": SHAPE,
        "preview": PREVIEW,
        "extra_params": EXTRA_PARAMS,
        "extra_preview": EXTRA_PREVIEW,
        "samples": samples,
    }
    limits_send = (
        "the previews themselves (one preview thread renders every JPEG for both) and the 2 cores "
        "the server, its producer and the clients' process share"
    )
    limits_sse = (
        "an event carries the preview base64-encoded in JSON (4/3 the bytes) and is encoded "
        "for each reader on the server's loop, then parsed by the reader; the rest (engine, "
        "previews, outbox, uvicorn) is the websocket's"
    )

    def fig(
        name: str, value: float, base: str, ours: str, limits: str, *,
        target: Target | None = None, unit: str = "x",
    ) -> Figure:
        return Figure(
            name=name, value=value, target=target, unit=unit,
            baseline=raw(base), engine=raw(ours), limits=limits, details=details,
        )

    return [
        fig(
            "fanout.p99_ms",
            m("ours", "p99_ms"),
            "naive",
            "ours",
            (
                "render capacity: one preview thread renders every preview and result; at work=0 "
                "the requests in the engine (max_active) step faster than it renders, so each "
                "preview waits for it (latest wins: the older ones are never rendered); "
                f"p50 {m('ours', 'p50_ms'):.0f} ms; with preview_threads=2: p99 "
                f"{m('ours_2_preview_threads', 'p99_ms'):.0f} ms"
            ),
            target=LATENCY_TARGET,
            unit="ms",
        ),
        fig(
            "fanout.p99_ms_2_preview_threads",
            m("ours_2_preview_threads", "p99_ms"),
            "ours",
            "ours_2_preview_threads",
            "OMNI_STREAM_PREVIEW_THREADS=2: JPEG encoding releases the GIL, so a second thread uses the second core",
            unit="ms",
        ),
        fig(
            "fanout.fps_default_vs_max_active_16",
            m("ours", "fps") / m("ours_max_active_16", "fps"),
            "ours_max_active_16",
            "ours",
            (
                "max_active on the CPU device: 4 (the default) against 16 (two batches, the "
                "accelerator's rule); the same load, alternating"
            ),
        ),
        fig(
            "fanout.p99_max_active_16_vs_default",
            m("ours_max_active_16", "p99_ms") / m("ours", "p99_ms"),
            "ours_max_active_16",
            "ours",
            "step completion to the client's receipt; with 16 in the engine 16 requests' previews queue for the preview thread",
        ),
        # A peer that delivered nothing counts as one frame in the whole
        # deadline, so the ratio stays finite (and is then a lower bound).
        fig(
            "fanout.stuck_client.fps_vs_naive",
            m("ours_stuck", "fps") / max(m("naive_stuck", "fps"), 1.0 / deadline),
            "naive_stuck",
            "ours_stuck",
            (
                "the peer's serial publish loop blocks on the stuck socket (its other clients got "
                f"{m('naive_stuck', 'frames'):.0f} frames in {deadline:g} s); ours holds that "
                "client's frames in its own outbox and closes it, nobody else waits"
            ),
            target=STUCK_VS_NAIVE_TARGET,
        ),
        fig(
            "fanout.fps_vs_naive",
            m("ours", "fps") / m("naive", "fps"),
            "naive",
            "ours",
            limits_send,
        ),
        fig(
            "fanout.wall_naive_vs_ours",
            m("naive", "wall_s") / m("ours", "wall_s"),
            "naive",
            "ours",
            (
                "time for all 100 requests to finish: at work=0 a request's steps come faster than "
                "its previews render, so latest-wins sends ours fewer of them (frames a second "
                "counts those received) and the requests end sooner"
            ),
        ),
        fig(
            "fanout.p99_latency_naive_vs_ours",
            m("naive", "p99_ms") / m("ours", "p99_ms"),
            "naive",
            "ours",
            "naive: every message waits behind all queued ones; ours sends per connection, latest wins",
        ),
        fig(
            "fanout.cpu_per_frame_naive_vs_ours",
            m("naive", "server_cpu_ms_per_frame") / m("ours", "server_cpu_ms_per_frame"),
            "naive",
            "ours",
            "naive deflates every (already compressed) JPEG on the loop",
        ),
        fig(
            "fanout.stuck_client.fps_kept",
            m("ours_stuck", "fps") / m("ours_reading", "fps"),
            "ours_reading",
            "ours_stuck",
            "the same load with the 101st client reading; only the send path differs",
            target=STUCK_TARGET,
        ),
        fig(
            "fanout.stuck_client.naive_fps_kept",
            m("naive_stuck", "fps") / m("naive_reading", "fps"),
            "naive_reading",
            "naive_stuck",
            "the serial publish loop waits on the stuck socket; everyone's frames queue behind it",
        ),
        fig(
            "fanout.sse.p99_ms",
            m("sse", "p99_ms"),
            "ours",
            "sse",
            (
                "the same server and load as fanout.p99_ms, read as Server-Sent Events "
                "(EventSource-style: POST, then GET the events URL); websocket p99 "
                f"{m('ours', 'p99_ms'):.0f} ms beside it"
            ),
            unit="ms",
        ),
        fig(
            "fanout.sse.fps_vs_ws",
            m("sse", "fps") / m("ours", "fps"),
            "ours",
            "sse",
            limits_sse,
        ),
        fig(
            "fanout.sse.p99_vs_ws",
            m("sse", "p99_ms") / m("ours", "p99_ms"),
            "ours",
            "sse",
            limits_sse,
        ),
        fig(
            "fanout.openai_partials.fps_vs_ws",
            m("openai", "fps") / m("ours", "fps"),
            "ours",
            "openai",
            "POST /v1/images/generations with stream and partial_images = steps - 1: a partial image "
            "(the step's JPEG preview, base64 in JSON) at every step but the last, then the completed "
            "image; " + limits_sse,
        ),
        fig(
            "fanout.openai_partials.p99_vs_ws",
            m("openai", "p99_ms") / m("ours", "p99_ms"),
            "ours",
            "openai",
            "step completion to the client's parse of its partial image, against the websocket's "
            f"preview (p99 {m('openai', 'p99_ms'):.0f} against {m('ours', 'p99_ms'):.0f} ms); " + limits_sse,
        ),
        fig(
            "fanout.sse_post.fps_vs_ws",
            m("sse_post", "fps") / m("ours", "fps"),
            "ours",
            "sse_post",
            "one POST with Accept: text/event-stream answered with the events (one round trip "
            "fewer than POST then GET); " + limits_sse,
        ),
        fig(
            "fanout.sse_post.p99_vs_ws",
            m("sse_post", "p99_ms") / m("ours", "p99_ms"),
            "ours",
            "sse_post",
            "one POST with Accept: text/event-stream answered with the events; " + limits_sse,
        ),
        fig(
            "fanout.sse.stuck_client.fps_kept",
            m("sse_stuck", "fps") / m("sse_reading", "fps"),
            "sse_reading",
            "sse_stuck",
            "as fanout.stuck_client.fps_kept with 101 event-stream readers: the stalled one's "
            "outbox keeps only the latest previews, its own writer alone waits on its socket",
            target=STUCK_TARGET,
        ),
    ]
