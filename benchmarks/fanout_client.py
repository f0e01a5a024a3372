"""The ``fanout`` figure's load generator: N websocket clients in one process of their own.

Why a separate process: on a 2-core machine, 100 clients parsing frames in
the server's own event loop would take that loop's time and CPU, so the
server's latency and CPU per frame would measure the clients too. In a
process of their own they compete for the cores like real clients on the
same host would, and the server's CPU time (``time.process_time`` there)
is the server's alone. This module imports no torch, so it starts fast.

Reads a JSON config on stdin, writes a JSON result on stdout. Receipt times
are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux, shared by every
process), so the server process can subtract its own step-completion times.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

_LENGTH = struct.Struct(">I")


def _preview_step(frame: bytes) -> int:
    (n,) = _LENGTH.unpack_from(frame)
    return int(json.loads(frame[_LENGTH.size : _LENGTH.size + n])["step"])


async def _read(ws: ClientConnection, extra: str | None, stop: asyncio.Event, frames: list[Any]) -> tuple[str, float]:
    async for msg in ws:
        now = time.perf_counter()
        if isinstance(msg, bytes):
            frames.append((_preview_step(msg), now, len(msg)))
            if extra == "stuck" and len(frames) >= 2:
                # Stops reading: the library buffers up to its queue, then
                # TCP backpressure reaches the server.
                await stop.wait()
                return "stuck", now
            if extra == "reading" and stop.is_set():
                return "reading", now
            continue
        kind = json.loads(msg)["type"]
        if kind in ("done", "cancelled", "error"):
            return kind, now
    return "closed by the server", time.perf_counter()


async def _client(
    i: int, cfg: dict[str, Any], start: asyncio.Event, stop: asyncio.Event, ready: list[int]
) -> dict[str, Any]:
    """One client: connect, wait for the start, generate, read to the end or the deadline."""
    extra = cfg["extra"] if i == cfg["clients"] + 1 else None
    params = dict(cfg["params"], seed=i)
    preview = cfg["preview"]
    if extra:
        params.update(cfg["extra_params"])
        preview = cfg["extra_preview"]
    frames: list[tuple[int, float, int]] = []
    outcome, t_end = "unfinished", float("nan")
    try:
        # The extra client buffers one message at most: a stalled reader's
        # socket must fill (as a frozen browser tab's does), not the
        # library's 16-message queue.
        max_queue = 1 if extra else 16
        async with connect(
            cfg["url"], max_size=1 << 24, max_queue=max_queue, open_timeout=60, close_timeout=1
        ) as ws:
            message = {"type": "generate", "id": f"c{i}", "params": params, "preview": preview}
            if extra:
                # The extra client's request runs first: its two previews are
                # in (and a stuck client has stopped reading) before the
                # others start, so every sample measures the same situation.
                await ws.send(json.dumps(message))
                reader = asyncio.create_task(_read(ws, extra, stop, frames))
                while len(frames) < 2 and not reader.done():
                    await asyncio.sleep(0.005)
                ready.append(i)
                outcome, t_end = await reader
                return {"client": i, "extra": extra, "frames": frames, "outcome": outcome, "t_end": t_end}
            ready.append(i)
            await start.wait()
            await ws.send(json.dumps(message))
            try:
                async with asyncio.timeout(None if extra else cfg["deadline_s"]):
                    outcome, t_end = await _read(ws, extra, stop, frames)
            except TimeoutError:
                outcome = "unfinished"
    except Exception as exc:  # noqa: BLE001 - a refused or dropped connection is a result here
        if outcome == "unfinished":
            outcome = f"connection: {type(exc).__name__}: {exc}"[:200]
    return {"client": i, "extra": extra, "frames": frames, "outcome": outcome, "t_end": t_end}


async def _main(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["clients"] + (1 if cfg["extra"] else 0)
    start, stop = asyncio.Event(), asyncio.Event()
    ready: list[int] = []
    cpu0 = time.process_time()
    tasks = {i: asyncio.create_task(_client(i, cfg, start, stop, ready)) for i in range(1, n + 1)}
    # Everyone connects first, then all generate at once.
    while len(ready) < n and not any(t.done() for t in tasks.values()):
        await asyncio.sleep(0.01)
    t_start = time.perf_counter()
    start.set()
    normal = [t for i, t in tasks.items() if i <= cfg["clients"]]
    await asyncio.wait(normal)
    stop.set()
    results = [await t for t in tasks.values()]
    return {"t_start": t_start, "clients": results, "client_cpu_s": time.process_time() - cpu0}


if __name__ == "__main__":
    config = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_main(config))))
