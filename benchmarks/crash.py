"""A crash through a real process (issue #22): ``kill -9`` of ``omni-stream serve --state-dir`` mid-render.

Each repetition, against real ``python -m omni_stream serve`` processes on
127.0.0.1 (their own interpreters, ``OMNI_STREAM_TORCH_THREADS=1``):

1. ``serve --state-dir DIR --checkpoint-every E`` starts; a websocket sends
   a detached ``generate`` (Synthetic, ``--steps`` steps of ~``--step-ms``
   ms, one seed for every repetition) and reads its progress;
2. at a step drawn at random (past the first checkpoint, before the last
   E steps) the process gets SIGKILL; what the client had received is read
   to the end, so the last step it saw is known;
3. ``serve`` starts again on the same folder (the clock starts as it is
   spawned); the client polls the port, attaches by id, and reads
   ``restarted`` (the step the request goes on from and why) and the first
   ``progress`` past it: the time from the spawn to that frame is split into
   the server's start-up (spawn to its ``listening on`` log line: the
   interpreter, torch, the model, the folder opened and its requests
   resumed) and the rest (to the first resumed frame at the client);
4. it reads to the result, which must equal the result of an uninterrupted
   run of the same request on a server without a state directory.

Figures: the steps redone per crash (the steps the client had seen after
the checkpoint it went on from, which the restarted server runs again)
against the checkpoint interval (target <= 1: at most one interval), the
time from the restart to the first resumed frame (and its split), and the
share of repetitions whose result equals the uninterrupted run's (target 1).
A plain ``serve`` start-up (no state directory) is measured beside them.

``python -m benchmarks.crash [--reps N] [--steps S] [--every E] [--step-ms MS] [--seed R]``
runs it standalone (also ``python -m benchmarks --only crash``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .harness import Context, Figure, Target, median, new_event_loop

__all__ = ["run"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
SHAPE = [3, 32, 32]


@dataclass
class Serve:
    """One ``omni-stream serve`` process: spawned at ``spawned``, listening at ``listening``."""

    proc: asyncio.subprocess.Process
    port: int
    spawned: float
    listening: float
    reader: asyncio.Task[None]
    log: list[str]

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.reader.cancel()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _serve(
    *args: str, port: int = 0, env: dict[str, str] | None = None, root: str = ROOT
) -> Serve:
    """Spawn ``serve`` (``env``: ``OMNI_STREAM_*`` settings; the caller's own are dropped, so the
    defaults are the defaults; ``root``: the checkout whose omni_stream runs, this one by
    default); return once it logs ``listening on`` (RuntimeError with its log if it exits
    first)."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_")}
    child.update(PYTHONUNBUFFERED="1", PYTHONPATH=root, OMNI_STREAM_TORCH_THREADS="1", **(env or {}))
    spawned = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omni_stream", "serve", "--model", "synthetic", "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port), *args,
        cwd=root, env=child, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, limit=1 << 20,
    )
    assert proc.stderr is not None
    stderr = proc.stderr
    log: list[str] = []
    while True:
        line = (await asyncio.wait_for(stderr.readline(), 180)).decode(errors="replace")
        if not line:
            raise RuntimeError(f"serve exited with status {await proc.wait()}:\n{''.join(log[-30:])}")
        log.append(line)
        found = _LISTENING.search(line)
        if found:
            listening = time.perf_counter()
            break

    async def drain() -> None:  # a full pipe would block the server
        while line := (await stderr.readline()).decode(errors="replace"):
            log.append(line)

    return Serve(proc, int(found.group(1)), spawned, listening, asyncio.create_task(drain()), log)


async def _recv(ws: Any) -> dict[str, Any]:
    from omni_stream.protocol import unpack_preview

    data = await asyncio.wait_for(ws.recv(), 120)
    if isinstance(data, bytes):
        header, image = unpack_preview(data)
        return {"type": "preview", **header.to_dict(), "image": bytes(image)}
    return dict(json.loads(data))


async def _until_end(ws: Any, rid: str, out: list[dict[str, Any]]) -> bytes:
    """Read ``rid``'s messages into ``out`` to its end; its result (RuntimeError unless done)."""
    result = None
    while True:
        msg = await _recv(ws)
        if msg.get("id") != rid:
            continue
        out.append(msg)
        if msg["type"] == "preview" and msg["final"]:
            result = msg["image"]
        if msg["type"] in ("done", "cancelled", "error"):
            if msg["type"] != "done" or result is None:
                raise RuntimeError(f"request {rid} ended {msg}")
            return result


def _params(steps: int, work: int, seed: int) -> dict[str, Any]:
    return {"steps": steps, "shape": SHAPE, "work": work, "seed": seed}


async def _reference(params: dict[str, Any]) -> tuple[bytes, float]:
    """The uninterrupted run's result, on a server without a state directory; its start-up (s)."""
    from websockets.asyncio.client import connect

    server = await _serve()
    try:
        async with connect(server.url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "ref", "params": params}))
            return await _until_end(ws, "ref", []), server.listening - server.spawned
    finally:
        await server.stop()


async def _attach_soon(port: int, rid: str, deadline: float) -> Any:
    """A websocket to ``port`` with ``attach`` sent, as soon as the server listens."""
    from websockets.asyncio.client import connect

    while True:
        try:
            ws = await connect(f"ws://127.0.0.1:{port}/ws", max_size=None, open_timeout=5)
        except OSError:
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.005)
            continue
        await ws.send(json.dumps({"type": "attach", "id": rid}))
        return ws


async def _one_crash(
    rep: int, params: dict[str, Any], every: int, kill_at: int, expected: bytes
) -> dict[str, Any]:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    folder = tempfile.mkdtemp(prefix="omni-crash-")
    rid = f"crash-{rep}"
    args = ("--state-dir", folder, "--checkpoint-every", str(every))
    try:
        server = await _serve(*args)
        seen = 0
        async with connect(server.url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "generate", "id": rid, "params": params, "detach": True}))
            while seen < kill_at:
                msg = await _recv(ws)
                if msg["type"] == "progress":
                    seen = max(seen, int(msg["step"]))
            os.kill(server.proc.pid, signal.SIGKILL)
            await server.proc.wait()
            try:  # what was on its way before the kill: the last step the client saw
                while True:
                    msg = await _recv(ws)
                    if msg["type"] == "progress":
                        seen = max(seen, int(msg["step"]))
            except (ConnectionClosed, TimeoutError):
                pass
        server.reader.cancel()

        # The restart: the same port, polled from the spawn, so the first frame is timed from it.
        port = _free_port()
        spawn = asyncio.create_task(_serve(*args, port=port))
        t_spawn = time.perf_counter()
        ws = await _attach_soon(port, rid, t_spawn + 180)
        msgs: list[dict[str, Any]] = []
        restarted: dict[str, Any] | None = None
        first_at = None
        try:
            while first_at is None:
                msg = await _recv(ws)
                if msg.get("id") != rid:
                    continue
                msgs.append(msg)
                if msg["type"] == "restarted":
                    restarted = msg
                elif msg["type"] == "progress" and restarted is not None:
                    if msg["step"] > restarted["from_step"]:
                        first_at = time.perf_counter()
                elif msg["type"] in ("done", "error", "cancelled"):
                    raise RuntimeError(f"request {rid} ended before a resumed frame: {msg}")
            first_step = int(msgs[-1]["step"])
            result = await _until_end(ws, rid, msgs)
        finally:
            await ws.close()
        restarted_server = await spawn
        await restarted_server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert restarted is not None
    from_step = int(restarted["from_step"])
    return {
        "kill_at": kill_at,
        "seen": seen,
        "from_step": from_step,
        "reason": restarted["reason"],
        "redone": max(0, seen - from_step),
        "startup_s": restarted_server.listening - restarted_server.spawned,
        "restart_to_first_s": first_at - restarted_server.spawned,
        "first_step": first_step,
        "identical": result == expected,
    }


async def measure(
    *, reps: int, steps: int, every: int, step_s: float, seed: int, log: Any, ctx: Context | None = None
) -> dict[str, Any]:
    """Run the crashes; the per-repetition rows and the medians."""
    ctx = ctx or Context(verbose=False)
    work = ctx.work_for(step_s, SHAPE)
    params = _params(steps, work, seed=1234)
    log(f"crash: {reps} kills of serve --state-dir, {steps} steps of ~{step_s * 1e3:g} ms (work={work}), "
        f"checkpoint every {every}")
    expected, plain_startup = await _reference(params)
    rng = random.Random(seed)
    rows = []
    for rep in range(reps):
        kill_at = rng.randint(every + 1, steps - every - 1)
        row = await _one_crash(rep, params, every, kill_at, expected)
        log(
            f"  rep {rep}: killed after step {row['seen']} (drawn {kill_at}), went on from "
            f"{row['from_step']} ({row['reason']}): {row['redone']} steps redone; spawn to listening "
            f"{row['startup_s'] * 1e3:.0f} ms, to the first resumed frame (step {row['first_step']}) "
            f"{row['restart_to_first_s'] * 1e3:.0f} ms; result identical: {row['identical']}"
        )
        rows.append(row)
    startup = median([r["startup_s"] for r in rows])
    first = median([r["restart_to_first_s"] for r in rows])
    return {
        "rows": rows,
        "params": {**params, "every": every, "step_s": step_s},
        "plain_startup_s": plain_startup,
        "redone_median": median([r["redone"] for r in rows]),
        "redone_max": max(r["redone"] for r in rows),
        "startup_s": startup,
        "restart_to_first_s": first,
        "rest_s": first - startup,
        "identical": sum(r["identical"] for r in rows) / len(rows),
    }


def _figures(out: dict[str, Any], every: int) -> list[Figure]:
    rows = out["rows"]
    shape = (
        f"{len(rows)} kill -9 of a real serve --state-dir at a random step, {out['params']['steps']} steps, "
        f"a checkpoint every {every}"
    )
    return [
        Figure(
            name="crash.steps_redone_per_interval",
            value=out["redone_median"] / every,
            target=Target("<=", 1.0),
            baseline={"checkpoint_every": every},
            engine={"redone_median": out["redone_median"], "redone_max": out["redone_max"]},
            limits=shape + ": the steps the client had seen past the checkpoint it went on from, median",
            details={"rows": rows},
        ),
        Figure(
            name="crash.restart_to_first_frame_ms",
            value=out["restart_to_first_s"] * 1e3,
            target=None,
            unit="ms",
            baseline={"plain_startup_s": out["plain_startup_s"]},
            engine={"startup_s": out["startup_s"], "rest_s": out["rest_s"]},
            limits=shape + ": spawn to the first resumed frame at the client, median "
            f"(start-up {out['startup_s'] * 1e3:.0f} ms, then {out['rest_s'] * 1e3:.0f} ms; a plain "
            f"serve starts in {out['plain_startup_s'] * 1e3:.0f} ms)",
            details={"params": out["params"]},
        ),
        Figure(
            name="crash.identical_results",
            value=out["identical"],
            target=Target(">=", 1.0),
            baseline={},
            engine={},
            limits=shape + ": the share of resumed results equal to an uninterrupted run's",
        ),
    ]


async def run(ctx: Context) -> list[Figure]:
    every = 10
    reps, steps = (2, 60) if ctx.quick else (max(3, ctx.reps), 120)
    out = await measure(reps=reps, steps=steps, every=every, step_s=0.015, seed=22, log=ctx.log, ctx=ctx)
    return _figures(out, every)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.crash", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="crashes (default 5)")
    parser.add_argument("--steps", type=int, default=120, help="steps of the request (default 120)")
    parser.add_argument("--every", type=int, default=10, help="--checkpoint-every (default 10)")
    parser.add_argument("--step-ms", type=float, default=15.0, help="a step's time, about (default 15)")
    parser.add_argument("--seed", type=int, default=22, help="draws the kill steps (default 22)")
    parser.add_argument("--json", help="write the rows and medians here")
    args = parser.parse_args(argv)
    if args.steps < 2 * args.every + 2:
        parser.error("--steps must leave room for a kill past the first checkpoint and before the last")

    def log(msg: str) -> None:
        print(msg, flush=True)

    loop = new_event_loop("asyncio")
    try:
        out = loop.run_until_complete(measure(
            reps=args.reps, steps=args.steps, every=args.every, step_s=args.step_ms / 1e3, seed=args.seed,
            log=log,
        ))
    finally:
        loop.close()
    print(
        f"crash: steps redone per crash median {out['redone_median']:g} (max {out['redone_max']}) of a "
        f"{args.every}-step interval; restart (spawn) to the first resumed frame median "
        f"{out['restart_to_first_s'] * 1e3:.0f} ms = serve start-up {out['startup_s'] * 1e3:.0f} ms + "
        f"{out['rest_s'] * 1e3:.0f} ms; plain serve start-up {out['plain_startup_s'] * 1e3:.0f} ms; "
        f"results identical to an uninterrupted run: {out['identical']:.0%}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    # A result that differs is a violation; more steps redone than an interval is not (a
    # checkpoint handed over but not yet on the disk at the kill): it is reported.
    return 1 if out["identical"] < 1.0 else 0


if __name__ == "__main__":
    sys.exit(main())
