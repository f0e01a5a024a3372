"""The attacks of issue #19 ("One core for every door"), each a coroutine against a running server.

Each takes a :class:`Target` (the server's port, the attack's length, the
server's limits) and returns an :class:`Outcome`: what the server answered
(counts by ``status code``), figures of the attack's own, and ``problems``:
answers the server must never give (a 2xx to a cross-site POST, an
answer missing). ``benchmarks/doors.py`` runs each against a fresh
``omni-stream serve`` and measures memory, the honest client and
``/health`` around it. Every loop is bounded in count and time; every
socket goes to 127.0.0.1.

The numbers are the issue's findings (measured on the code before the
core): 1 huge sizes, 2 a body in one-byte chunks, 3 never-reading
fetchers of a large result, 4 stalled bodies, 5 one HTTP client filling
the server, 6 an image that decodes to 48 MiB, 7 what an input image
costs, 8 cross-site and rebinding requests, 9 a priority flood, 10 event
streams as uncounted connections.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .http_wire import Answer, HttpConn, Silent, chunked_body, fetch, request_bytes

__all__ = ["Outcome", "Target", "label"]

MIB = 1 << 20
API = "/v1/generations"
JSON = ("Content-Type", "application/json")
#: A long request of the synthetic model (a flood's): 400 steps.
LONG = {"params": {"shape": [3, 16, 16], "work": 1, "steps": 400},
        "preview": {"format": "jpeg", "max_size": 16}}


@dataclass
class Target:
    """The server under attack: its port, how long the attack lasts, the limits it runs with."""

    port: int
    seconds: float
    limits: dict[str, Any]
    #: What the attack's setup made before the idle baseline (SETUPS).
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"


@dataclass
class Outcome:
    """What the server answered (``answers``: label -> count), the attack's own figures, problems."""

    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def count(self, answer: Answer | None, prefix: str = "") -> None:
        self.answers[prefix + label(answer)] += 1

    def to_dict(self) -> dict[str, Any]:
        answers = dict(sorted(self.answers.items()))
        return {"answers": answers, "figures": self.figures, "problems": self.problems}


def label(answer: Answer | None) -> str:
    """``"202"``, ``"422 limit_exceeded"``, ``"none"`` (no answer)."""
    if answer is None:
        return "none"
    code = ""
    if answer.status >= 400 and answer.headers.get("content-type", "").startswith("application/json"):
        try:
            code = " " + str(answer.json().get("error"))
        except (ValueError, AttributeError):
            code = " (not JSON)"
    return f"{answer.status}{code}"


def _body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


async def _post(t: Target, obj: Any, *, conn: HttpConn | None = None, timeout: float = 30.0,
                headers: tuple[tuple[str, str], ...] = (JSON,), target: str = API) -> Answer | None:
    """POST ``obj`` (on ``conn`` when given, else a fresh connection); None when no answer came."""
    try:
        if conn is None:
            return await fetch(t.port, "POST", target, headers=headers, body=_body(obj), timeout=timeout)
        await conn.send(request_bytes("POST", target, host=conn.host, headers=headers, body=_body(obj)),
                        method="POST")
        return await conn.answer(timeout)
    except (OSError, TimeoutError, ValueError, Exception):  # noqa: BLE001 - no answer is an outcome
        if conn is not None:
            conn.close()
        return None


async def _status(t: Target, rid: str) -> str | None:
    try:
        answer = await fetch(t.port, "GET", f"{API}/{rid}", timeout=10)
    except (OSError, TimeoutError, Exception):  # noqa: BLE001
        return None
    return str(answer.json().get("status")) if answer.status == 200 else f"http {answer.status}"


async def _until_ended(t: Target, ids: list[str], timeout: float) -> int:
    """Poll the requests until each ended (done, failed, cancelled, gone); how many did not in ``timeout``."""
    left = list(ids)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        states = [await _status(t, rid) for rid in left]
        left = [rid for rid, s in zip(left, states, strict=True) if s in ("queued", "running", None)]
        if left:
            await asyncio.sleep(0.25)
    return len(left)


async def _cancel_all(t: Target, ids: list[str]) -> None:
    for rid in ids:
        # Best effort: the server is discarded after.
        with contextlib.suppress(Exception):
            await fetch(t.port, "DELETE", f"{API}/{rid}", timeout=15)


async def _hold(seconds: float) -> None:
    await asyncio.sleep(max(0.0, seconds))


def _sockets_state(clients: list[Silent], out: Outcome) -> dict[str, int]:
    """Per client that never read: the answer waiting in its socket (peeked), and the socket's state."""
    states: collections.Counter[str] = collections.Counter()
    for c in clients:
        status = c.status()
        out.answers[str(status) if status is not None else "no answer yet"] += 1
        state = c.state()
        states["reset by the server" if state == Silent.CLOSED else "closed by the server"
               if state == Silent.CLOSE_WAIT else "open"] += 1
    return dict(states)


async def _server_connections(t: Target) -> int | None:
    """The clients the server holds now (``/health``)."""
    try:
        return int((await fetch(t.port, "GET", "/health", timeout=10)).json()["server"]["connections"])
    except (OSError, TimeoutError, ValueError, KeyError, Exception):  # noqa: BLE001
        return None


# -- 1: huge sizes (the default Mixture model) ----------------------------------------------------


async def _size_sweep(t: Target, out: Outcome, start: int) -> None:
    """Every 4th size down from ``start`` to 256, again and again (each a bank to build: the model
    caches 4), 4 connections at once, for ``seconds``; then wait for the admitted ones to end."""
    sizes = itertools.cycle(range(start, 255, -4))
    admitted: list[str] = []
    largest = 0
    deadline = time.monotonic() + t.seconds

    async def sweep() -> None:
        nonlocal largest
        conn = HttpConn(t.port)
        sent = 0
        while time.monotonic() < deadline and sent < 100_000:
            sent += 1
            size = next(sizes)
            answer = await _post(t, {"params": {"steps": 2, "size": size}}, conn=conn)
            out.count(answer, "sweep: ")
            if answer is not None and answer.status == 202:
                admitted.append(answer.json()["id"])
                largest = max(largest, size)
        conn.close()

    await asyncio.gather(*(sweep() for _ in range(4)))
    out.figures.update(largest_admitted_size=largest, admitted=len(admitted))
    out.figures["not_ended_in_120_s"] = await _until_ended(t, admitted, 120)


async def attack_size(t: Target) -> Outcome:
    """``size`` 1600 and 1024, then every 4th size from 1020 down, over and over, 4 at a time."""
    out = Outcome()
    for size in (1600, 1024):
        out.count(await _post(t, {"params": {"steps": 2, "size": size}}), f"size {size}: ")
    await _size_sweep(t, out, 1020)
    return out


async def attack_size_small_bound(t: Target) -> Outcome:
    """1-step requests at sizes 512, 508, 504, 500 at once, then sizes from 496 down, over and over."""
    out = Outcome()
    sizes = (512, 508, 504, 500)
    answers = await asyncio.gather(*(_post(t, {"params": {"steps": 1, "size": s}}) for s in sizes))
    ids = []
    for size, answer in zip(sizes, answers, strict=True):
        out.count(answer, f"size {size}: ")
        if answer is not None and answer.status == 202:
            ids.append(answer.json()["id"])
    await _until_ended(t, ids, 120)
    await _size_sweep(t, out, 496)
    return out


# -- 2: a body in one-byte chunks -------------------------------------------------------------------


async def _tiny_chunks_once(t: Target, wire: bytes, out: Outcome, times: list[float]) -> None:
    conn = HttpConn(t.port)
    head = request_bytes("POST", API, host=conn.host, headers=[JSON], chunked=True)
    t0 = time.monotonic()
    try:
        await conn.send(head, method="POST")
        answer_task = asyncio.create_task(conn.answer(timeout=60))
        sent = 0
        # All of it goes out, or until the server stops taking it (or answered and closed).
        for offset in range(0, len(wire), 64 << 10):
            if not await conn.write(wire[offset:offset + (64 << 10)], drain_timeout=15):
                break
            sent += min(64 << 10, len(wire) - offset)
        try:
            answer = await answer_task
        except (OSError, TimeoutError, ValueError, Exception):  # noqa: BLE001
            answer = None
        times.append(time.monotonic() - t0 if answer is None else answer.head_s)
        out.count(answer)
        out.figures.setdefault("wire_bytes_sent", []).append(sent)
        if answer is None or answer.status != 413:
            out.problems.append(f"a body in one-byte chunks got {label(answer)}, not 413")
    finally:
        conn.close()


async def attack_tiny_chunks(t: Target) -> Outcome:
    """Rounds of 3 connections at once, each a ~1 MiB body in 1-byte chunks (~6 MB on the wire)."""
    out = Outcome()
    body = _body({"params": {"steps": 2}, "pad": "a" * (MIB - 64)})
    wire = chunked_body(body, 1)
    out.figures["body_bytes"], out.figures["wire_bytes"] = len(body), len(wire)
    times: list[float] = []
    deadline = time.monotonic() + t.seconds
    rounds = 0
    while time.monotonic() < deadline and rounds < 100:
        rounds += 1
        await asyncio.gather(*(_tiny_chunks_once(t, wire, out, times) for _ in range(3)))
    sent = out.figures.pop("wire_bytes_sent", [])
    out.figures.update(rounds=rounds, answer_s_max=round(max(times, default=0.0), 3),
                       wire_bytes_sent_max=max(sent, default=0))
    return out


# -- 3: never-reading fetchers of a 3 MiB result ----------------------------------------------------


async def setup_unread_output(t: Target) -> dict[str, Any]:
    """The 3 MiB raw result the fetchers ask for, made before the idle baseline (its cost is not theirs)."""
    result = await _post(t, {"params": {"shape": [3, 1024, 1024], "steps": 2, "work": 0},
                             "output": {"format": "raw"}})
    if result is None or result.status != 202:
        return {"problem": f"the 3 MiB request was not accepted: {label(result)}"}
    rid = result.json()["id"]
    await _until_ended(t, [rid], 60)
    whole = await fetch(t.port, "GET", f"{API}/{rid}/output", timeout=30)
    return {"id": rid, "result_bytes": len(whole.body)}


async def attack_unread_output(t: Target) -> Outcome:
    """200 sockets with 4 KiB receive buffers GET the output of a 3 MiB raw result, never read.

    Held until the server cut off every fetcher it served (its ``/health`` connections back to
    the honest client's one), at most ``send_timeout_s`` + 15 s, at least ``seconds``.
    """
    out = Outcome()
    if "problem" in t.setup:
        out.problems.append(t.setup["problem"])
        return out
    rid = t.setup["id"]
    out.figures["result_bytes"] = t.setup["result_bytes"]
    clients: list[Silent] = []
    t0 = time.monotonic()
    for _ in range(200):
        try:
            c = await Silent.connect(t.port, rcvbuf=4096, timeout=5)
        except (OSError, TimeoutError):
            out.answers["connect failed"] += 1
            continue
        clients.append(c)
        await c.send(request_bytes("GET", f"{API}/{rid}/output", host=t.host), timeout=5)
    timeout = float(t.limits["send_timeout_s"])
    await _hold(t.seconds - (time.monotonic() - t0))
    held = None
    while time.monotonic() - t0 < timeout + 15:
        held = await _server_connections(t)
        if held is not None and held <= 1 and time.monotonic() - t0 >= t.seconds:
            break
        await asyncio.sleep(0.5)
    out.figures["held_s"] = round(time.monotonic() - t0, 1)
    out.figures["server_connections_at_end"] = held
    out.figures["sockets"] = _sockets_state(clients, out)
    if held is not None and held > 1:
        out.problems.append(f"{held - 1} never-reading fetchers still held {out.figures['held_s']} s on "
                            f"(send_timeout_s {timeout:g})")
    for c in clients:
        c.abort()
    return out


# -- 4: stalled bodies ------------------------------------------------------------------------------


async def _stalled(t: Target, n: int, sent: int, declared: int) -> Outcome:
    out = Outcome()
    payload = (b'{"params": {}, "pad": "' + b"a" * declared)[:sent]
    clients: list[Silent] = []
    t0 = time.monotonic()
    for _ in range(n):
        try:
            c = await Silent.connect(t.port, timeout=5)
        except (OSError, TimeoutError):
            out.answers["connect failed"] += 1
            continue
        clients.append(c)
        await c.send(request_bytes("POST", API, host=t.host, headers=[JSON], length=declared), timeout=5)

    async def send(c: Silent) -> None:
        for offset in range(0, len(payload), 64 << 10):
            if not await c.send(payload[offset:offset + (64 << 10)], timeout=10):
                return

    await asyncio.gather(*(send(c) for c in clients))
    out.figures["sending_s"] = round(time.monotonic() - t0, 2)
    hold = max(t.seconds, float(t.limits["body_timeout_s"]) + 5.0) - (time.monotonic() - t0)
    await _hold(hold)
    out.figures["held_s"] = round(time.monotonic() - t0, 1)
    out.figures["server_connections_at_end"] = await _server_connections(t)
    out.figures["sockets"] = _sockets_state(clients, out)
    if out.figures["held_s"] > float(t.limits["body_timeout_s"]) + 2 and out.answers.get("no answer yet"):
        out.problems.append(f"{out.answers['no answer yet']} stalled bodies had no answer after "
                            f"{out.figures['held_s']} s (body_timeout_s {t.limits['body_timeout_s']:g})")
    for c in clients:
        c.abort()
    return out


async def attack_slow_bodies(t: Target) -> Outcome:
    """300 POSTs that send their headers and 10 bytes of a 1,048,000-byte body, then nothing."""
    return await _stalled(t, 300, 10, 1_048_000)


async def attack_partial_bodies(t: Target) -> Outcome:
    """200 POSTs that send 1,000,000 bytes of a 1,048,000-byte body, then nothing."""
    return await _stalled(t, 200, 1_000_000, 1_048_000)


# -- 5: one HTTP client fills the server --------------------------------------------------------


async def attack_http_flood(t: Target) -> Outcome:
    """4 keep-alive connections from one address POST 400-step requests flat out for ``seconds``."""
    out = Outcome()
    accepted: list[str] = []
    deadline = time.monotonic() + t.seconds
    first_refusal: float | None = None
    t0 = time.monotonic()

    async def flood() -> None:
        nonlocal first_refusal
        conn = HttpConn(t.port)
        sent = 0
        while time.monotonic() < deadline and sent < 100_000:
            sent += 1
            answer = await _post(t, LONG, conn=conn)
            out.count(answer)
            if answer is not None and answer.status == 202:
                accepted.append(answer.json()["id"])
            elif first_refusal is None:
                first_refusal = time.monotonic() - t0
        conn.close()

    await asyncio.gather(*(flood() for _ in range(4)))
    out.figures.update(accepted=len(accepted), first_refusal_s=first_refusal)
    await _cancel_all(t, accepted)
    return out


# -- 6, 7: input images (the image model) ---------------------------------------------------------


async def _image_posts(t: Target, urls: Iterator[str], *, rate: float, workers: int = 4,
                       steps: int = 2) -> tuple[Outcome, list[str]]:
    """POST generates with images from ``urls`` at ``rate`` a second (0: flat out) for ``seconds``."""
    out = Outcome()
    ids: list[str] = []
    deadline = time.monotonic() + t.seconds
    interval = workers / rate if rate > 0 else 0.0

    async def worker(i: int) -> None:
        conn = HttpConn(t.port)
        t_next = time.monotonic() + i * interval / workers
        sent = 0
        while time.monotonic() < deadline and sent < 10_000:
            if interval:
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
                t_next += interval
            sent += 1
            body = {"params": {"image": next(urls), "steps": steps, "work": 0}, "preview": {"format": "raw",
                                                                                           "max_size": 16}}
            answer = await _post(t, body, conn=conn, timeout=60)
            out.count(answer)
            if answer is not None and answer.status == 202:
                ids.append(answer.json()["id"])
        conn.close()

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return out, ids


def _cycle(*items: str) -> Iterator[str]:
    while True:
        yield from items


async def attack_image_decode(t: Target) -> Outcome:
    """A 4096x4096 PNG (~78 KB as a data URL) 2.5 times a second for ``seconds``."""
    from .image_model import png_data_url

    url = png_data_url(4096, "blank")
    out, ids = await _image_posts(t, _cycle(url), rate=2.5)
    out.figures["data_url_bytes"] = len(url)
    out.figures["not_ended_in_60_s"] = await _until_ended(t, ids, 60)
    return out


async def attack_image_decode_allowed(t: Target) -> Outcome:
    """A 2048x2048 PNG (max_image_size: decoded, in a worker thread) 2.5 times a second."""
    from .image_model import png_data_url

    url = png_data_url(2048, "pattern")
    out, ids = await _image_posts(t, _cycle(url), rate=2.5)
    out.figures["data_url_bytes"] = len(url)
    out.figures["not_ended_in_60_s"] = await _until_ended(t, ids, 60)
    return out


async def attack_image_memory(t: Target) -> Outcome:
    """1024x1024 and 2048x2048 input images, alternately, flat out from 4 connections for ``seconds``."""
    from .image_model import png_data_url

    out, ids = await _image_posts(t, _cycle(png_data_url(1024), png_data_url(2048)), rate=0.0, steps=20)
    out.figures["accepted"] = len(ids)
    out.figures["not_ended_in_60_s"] = await _until_ended(t, ids, 60)
    return out


# -- 8: cross-site requests and DNS rebinding --------------------------------------------------------


_Case = tuple[str, str, str, list[tuple[str, str]], bytes | None, set[int]]


def _cross_site_cases(t: Target, known: str) -> list[_Case]:
    """(what, method, path, headers, body, statuses allowed): foreign ones first, then the controls."""
    evil, rebound = "http://evil.example", f"http://evil.example:{t.port}"
    body = _body({"params": {"steps": 1, "shape": [3, 8, 8], "work": 0}})
    ws = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"),
          ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]
    h = t.host
    return [
        ("POST, Origin evil", "POST", API, [("Host", h), ("Origin", evil), JSON], body, {403}),
        ("POST text/plain, Origin evil", "POST", API, [("Host", h), ("Origin", evil),
                                                      ("Content-Type", "text/plain")], body, {403}),
        ("POST, Origin null", "POST", API, [("Host", h), ("Origin", "null"), JSON], body, {403}),
        ("DELETE, Origin evil", "DELETE", f"{API}/{known}", [("Host", h), ("Origin", evil)], None, {403}),
        ("POST, Host evil", "POST", API, [("Host", f"evil.example:{t.port}"), JSON], body, {421}),
        ("POST, rebound (Host and Origin evil)", "POST", API,
         [("Host", f"evil.example:{t.port}"), ("Origin", rebound), JSON], body, {421}),
        ("GET status, Host evil", "GET", f"{API}/{known}", [("Host", f"evil.example:{t.port}")], None, {421}),
        ("GET output, Host evil", "GET", f"{API}/{known}/output", [("Host", "evil.example")], None, {421}),
        ("GET list, Host evil", "GET", API, [("Host", f"evil.example:{t.port}")], None, {421}),
        ("GET /health, Host evil", "GET", "/health", [("Host", f"evil.example:{t.port}")], None, {421}),
        ("websocket, Origin evil", "GET", "/ws", [("Host", h), ("Origin", evil), *ws], None, {403}),
        ("websocket, Host evil", "GET", "/ws", [("Host", f"evil.example:{t.port}"), *ws], None, {421}),
        ("OPTIONS preflight, Origin evil", "OPTIONS", API, [("Host", h), ("Origin", evil),
                                                           ("Access-Control-Request-Method", "POST")], None,
         {403, 405}),
        # The controls: the server's own origin and loopback names are served.
        ("POST, own origin", "POST", API, [("Host", h), ("Origin", f"http://127.0.0.1:{t.port}"), JSON], body,
         {202, 429, 503}),
        ("POST, Host localhost", "POST", API, [("Host", f"localhost:{t.port}"), JSON], body, {202, 429, 503}),
        ("GET status, Host [::1]", "GET", f"{API}/{known}", [("Host", f"[::1]:{t.port}")], None, {200}),
    ]


async def attack_cross_site(t: Target) -> Outcome:
    """Cross-site and rebound requests (and controls), 20 calls a second for ``seconds``."""
    out = Outcome()
    first = await _post(t, {"params": {"steps": 1, "shape": [3, 8, 8], "work": 0}})
    if first is None or first.status != 202:
        out.problems.append(f"the control request was not accepted: {label(first)}")
        return out
    cases = _cross_site_cases(t, first.json()["id"])
    deadline = time.monotonic() + t.seconds
    calls = 0
    while time.monotonic() < deadline and calls < 10_000:
        for what, method, path, headers, body, allowed in cases:
            calls += 1
            answer: Answer | None
            try:
                answer = await fetch(t.port, method, path, headers=headers, body=body, host="", timeout=15)
            except (OSError, TimeoutError, ValueError, Exception):  # noqa: BLE001
                answer = None
            out.count(answer, f"{what}: ")
            if answer is None or answer.status not in allowed:
                out.problems.append(f"{what}: {label(answer)}, expected {sorted(allowed)}")
            elif answer is not None and "access-control-allow-origin" in answer.headers:
                out.problems.append(f"{what}: CORS header {answer.headers['access-control-allow-origin']!r}")
            await asyncio.sleep(0.05)
    out.figures["calls"] = calls
    out.problems = sorted(set(out.problems))
    return out


# -- 9: a priority flood over websockets ---------------------------------------------------------


async def attack_priority_flood(t: Target) -> Outcome:
    """4 websocket connections keep 16 priority-10 requests of 400 steps each, topped up, for ``seconds``."""
    from websockets.asyncio.client import connect

    out = Outcome()
    deadline = time.monotonic() + t.seconds

    async def flood(i: int) -> None:
        n = 0

        def generate() -> str:
            nonlocal n
            n += 1
            return json.dumps({"type": "generate", "id": f"prio-{i}-{n}", "priority": 10, **LONG})

        try:
            async with connect(t.url, max_size=1 << 24, open_timeout=30, close_timeout=2) as ws:
                for _ in range(16):
                    await ws.send(generate())
                while time.monotonic() < deadline:
                    try:
                        data = await asyncio.wait_for(ws.recv(), max(0.05, deadline - time.monotonic()))
                    except TimeoutError:
                        break
                    if isinstance(data, bytes):
                        continue
                    msg = json.loads(data)
                    kind = msg.get("type")
                    if kind == "accepted":
                        out.answers["accepted"] += 1
                    elif kind in ("done", "cancelled") or kind == "error":
                        out.answers[msg.get("code") or kind] += 1
                        if kind == "error" and msg.get("code") == "busy":
                            await asyncio.sleep(0.2)
                        if n < 10_000:
                            await ws.send(generate())
        except (OSError, TimeoutError, Exception) as exc:  # noqa: BLE001 - reported
            out.problems.append(f"flood connection {i}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(flood(i) for i in range(4)))
    return out


# -- 10: event streams as connections -------------------------------------------------------------


async def _open_stream(t: Target, method: str, path: str, body: bytes | None) -> tuple[HttpConn | None, str]:
    conn = HttpConn(t.port)
    headers = [("Accept", "text/event-stream")] + ([JSON] if body is not None else [])
    try:
        wire = request_bytes(method, path, host=conn.host, headers=headers, body=body)
        await conn.send(wire, method=method)
        head = await conn.head(timeout=15)
    except (OSError, TimeoutError, ValueError, Exception):  # noqa: BLE001
        conn.close()
        return None, "none"
    if head.status_code == 200:
        return conn, "200 stream"
    rest = b""
    try:
        async for part in conn.body_parts(timeout=15):
            rest += part
    except (OSError, TimeoutError, Exception):  # noqa: BLE001
        pass
    conn.close()
    headers_ = {k.decode().lower(): v.decode() for k, v in head.headers}
    return None, label(Answer(head.status_code, headers_, rest))


async def attack_sse_connections(t: Target) -> Outcome:
    """100 POSTs with ``Accept: text/event-stream``, then 100 GETs of events, one address, never read.

    Long requests, the streams held for ``seconds``: each open stream is a connection of its principal.
    """
    out = Outcome()
    streams: list[HttpConn] = []
    longer = {**LONG, "params": {**LONG["params"], "steps": 10_000}}
    ids = ["sse-plain"] + [f"sse-{i}" for i in range(100)]
    plain = await _post(t, {**longer, "id": ids[0]})
    out.answers[f"plain POST: {label(plain)}"] += 1
    for rid in ids[1:]:
        conn, what = await _open_stream(t, "POST", API, _body({**longer, "id": rid}))
        out.answers[f"POST event stream: {what}"] += 1
        if conn is not None:
            streams.append(conn)
    if plain is not None and plain.status == 202:
        for _ in range(100):
            conn, what = await _open_stream(t, "GET", f"{API}/{ids[0]}/events", None)
            out.answers[f"GET events: {what}"] += 1
            if conn is not None:
                streams.append(conn)
    out.figures["open_streams"] = len(streams)
    per = int(t.limits["max_connections_per_principal"])
    if len(streams) > per:
        out.problems.append(f"one address holds {len(streams)} event streams, over "
                            f"max_connections_per_principal={per}")
    await _hold(t.seconds)
    for conn in streams:
        conn.close()
    await _cancel_all(t, ids)
    return out


#: Attack id -> what it makes before the server's idle baseline is measured.
SETUPS: dict[str, Callable[[Target], Awaitable[dict[str, Any]]]] = {"3": setup_unread_output}
#: Attack id -> its coroutine.
RUNS: dict[str, Callable[[Target], Awaitable[Outcome]]] = {
    "1": attack_size, "1b": attack_size_small_bound, "2": attack_tiny_chunks, "3": attack_unread_output,
    "4": attack_slow_bodies, "4b": attack_partial_bodies, "5": attack_http_flood, "6": attack_image_decode,
    "6b": attack_image_decode_allowed, "7": attack_image_memory, "8": attack_cross_site,
    "9": attack_priority_flood, "10": attack_sse_connections,
}
