"""The ``fanout`` figure's load generator: N clients in one process of their own.

The clients speak the websocket protocol (``transport: "ws"``, the
default), or read Server-Sent Events as an ``EventSource`` does
(``"sse"``: ``POST /v1/generations``, then ``GET`` its ``events`` URL on
the same kept-alive connection; ``"sse_post"``: one ``POST`` with
``Accept: text/event-stream`` answered with the events; ``"openai"``: one
``POST /v1/images/generations`` with ``stream`` and ``partial_images``,
answered with OpenAI's image events), over raw asyncio
streams: HTTP/1.1, chunked transfer decoding, the SSE line format.

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
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

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


class _Http:
    """One kept-alive HTTP/1.1 connection: requests, and a response's body as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> _Http:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str]]:
        """Send a request; returns the status and the (lower-cased) headers of its response."""
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(body)}"]
        if body:
            head.append("Content-Type: application/json")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                fields[k.strip().lower()] = v.strip()
        return status, fields

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The response's body, chunk by chunk (chunked, sized, or to the end of the connection)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers
                    return
                chunk = await self.reader.readexactly(size + 2)
                yield chunk[:-2]
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            while chunk := await self.reader.read(1 << 16):
                yield chunk

    async def read_all(self, headers: dict[str, str]) -> bytes:
        return b"".join([c async for c in self.body(headers)])

    def close(self) -> None:
        self.writer.close()


async def _events(http: _Http, headers: dict[str, str]) -> AsyncIterator[tuple[str, str, str | None, int]]:
    """The SSE events of a response as (event, data, id, size in bytes), as an EventSource parses them."""
    buf = b""
    async for chunk in http.body(headers):
        buf += chunk
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            block, buf = buf[:end], buf[end + 2 :]
            event, data, event_id = "message", [], None
            for line in block.decode().split("\n"):
                if not line or line.startswith(":"):
                    continue  # a comment (keepalive)
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    event = value
                elif name == "data":
                    data.append(value)
                elif name == "id":
                    event_id = value
            if data:
                yield event, "\n".join(data), event_id, end + 2


async def _read_sse(
    http: _Http, headers: dict[str, str], extra: str | None, stop: asyncio.Event, frames: list[Any]
) -> tuple[str, float]:
    """As ``_read``, from an event stream: the time is taken when an event is complete."""
    async for event, data, event_id, size in _events(http, headers):
        now = time.perf_counter()
        if event == "preview":
            # What an EventSource handler does: JSON.parse. Not the extra
            # client's megabytes of base64: its own CPU must not load the
            # machine the others share (it takes the step from the id).
            step = int(event_id or -1) if extra else int(json.loads(data)["step"])
            frames.append((step, now, size))
            if extra == "stuck" and len(frames) >= 2:
                # Stops reading: the stream reader's buffer fills, then TCP
                # backpressure reaches the server.
                await stop.wait()
                return "stuck", now
            if extra == "reading" and stop.is_set():
                return "reading", now
            continue
        if event == "image_generation.partial_image":
            # OpenAI's partial image i is the preview of step every * (i + 1)
            # (omni_stream/openai/images.py); here every = 1.
            frames.append((int(json.loads(data)["partial_image_index"]) + 1, now, size))
            continue
        if event == "image_generation.completed":
            frames.append((int(cfg_steps(headers)), now, size))
            return "done", now
        if event in ("done", "cancelled", "error"):
            return event, now
    return "closed by the server", time.perf_counter()


def cfg_steps(headers: dict[str, str]) -> int:
    """The request's step count, which the OpenAI stream's completed event does not carry."""
    return int(headers["x-bench-steps"])


async def _start_sse(http: _Http, cfg: dict[str, Any], body: dict[str, Any]) -> dict[str, str]:
    """Start a generation; returns the headers of its event stream's response."""
    if cfg["transport"] == "openai":
        # The OpenAI door: one POST, partial images as SSE (every step but the last).
        params = dict(body["params"])
        steps = int(params["steps"])
        openai = {"prompt": "fanout", "stream": True, "partial_images": steps - 1, "output_format": "jpeg",
                  **params}
        status, headers = await http.request("POST", "/v1/images/generations", json.dumps(openai).encode())
        if status != 200:
            raise RuntimeError(f"POST /v1/images/generations: {status} {(await http.read_all(headers))[:200]!r}")
        return {**headers, "x-bench-steps": str(steps)}
    payload = json.dumps(body).encode()
    if cfg["transport"] == "sse_post":
        status, headers = await http.request(
            "POST", "/v1/generations", payload, {"Accept": "text/event-stream"}
        )
        if status != 200:
            raise RuntimeError(f"POST /v1/generations: {status} {(await http.read_all(headers))[:200]!r}")
        return headers
    status, headers = await http.request("POST", "/v1/generations", payload)
    answer = await http.read_all(headers)
    if status != 202:
        raise RuntimeError(f"POST /v1/generations: {status} {answer[:200]!r}")
    events_url = json.loads(answer)["urls"]["events"]
    status, headers = await http.request("GET", events_url, headers={"Accept": "text/event-stream"})
    if status != 200:
        raise RuntimeError(f"GET {events_url}: {status} {(await http.read_all(headers))[:200]!r}")
    return headers


async def _cancel_sse(url: str, request_id: str) -> None:
    # A generation started over HTTP is detached: hanging up does not cancel
    # it (a websocket's does), so the extra client cancels its own.
    http = await _Http.open(url)
    try:
        _, headers = await http.request("DELETE", f"/v1/generations/{request_id}")
        await http.read_all(headers)
    finally:
        http.close()


async def _client_sse(
    i: int, cfg: dict[str, Any], start: asyncio.Event, stop: asyncio.Event, ready: list[int]
) -> dict[str, Any]:
    """``_client`` over HTTP: connect, wait for the start, POST, read the events to the end or deadline."""
    extra = cfg["extra"] if i == cfg["clients"] + 1 else None
    params = dict(cfg["params"], seed=i)
    preview = cfg["preview"]
    if extra:
        params.update(cfg["extra_params"])
        preview = cfg["extra_preview"]
    frames: list[tuple[int, float, int]] = []
    outcome, t_end = "unfinished", float("nan")
    body = {"id": f"c{i}", "params": params, "preview": preview}
    http: _Http | None = None
    try:
        async with asyncio.timeout(60):
            http = await _Http.open(cfg["url"])
        if extra:
            # As in _client: the extra request runs first, two previews in.
            try:
                headers = await _start_sse(http, cfg, body)
                reader = asyncio.create_task(_read_sse(http, headers, extra, stop, frames))
                while len(frames) < 2 and not reader.done():
                    await asyncio.sleep(0.005)
                ready.append(i)
                outcome, t_end = await reader
            finally:
                http.close()
                await _cancel_sse(cfg["url"], body["id"])
            return {"client": i, "extra": extra, "frames": frames, "outcome": outcome, "t_end": t_end}
        ready.append(i)
        await start.wait()
        try:
            async with asyncio.timeout(cfg["deadline_s"]):
                headers = await _start_sse(http, cfg, body)
                outcome, t_end = await _read_sse(http, headers, extra, stop, frames)
        except TimeoutError:
            outcome = "unfinished"
    except Exception as exc:  # noqa: BLE001 - a refused or dropped connection is a result here
        if outcome == "unfinished":
            outcome = f"connection: {type(exc).__name__}: {exc}"[:200]
    finally:
        if http is not None:
            http.close()
    return {"client": i, "extra": extra, "frames": frames, "outcome": outcome, "t_end": t_end}


async def _main(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["clients"] + (1 if cfg["extra"] else 0)
    start, stop = asyncio.Event(), asyncio.Event()
    ready: list[int] = []
    cpu0 = time.process_time()
    client = _client if cfg.get("transport", "ws") == "ws" else _client_sse
    tasks = {i: asyncio.create_task(client(i, cfg, start, stop, ready)) for i in range(1, n + 1)}
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
