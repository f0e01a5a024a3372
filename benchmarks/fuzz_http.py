"""The HTTP half of ``benchmarks/fuzz.py``: hostile and broken calls to ``/v1/generations``.

Each category (:data:`HTTP_CATEGORIES`) draws one call: a method, a path,
headers, a body and how the body goes out (:class:`Call`: all at once, in
chunks, slowly, stalled short of its declared length), and the statuses
docs/http.md allows for it. :class:`HttpFuzzConn` sends its calls one
after another over a keep-alive connection (a new one after an answer that
closes it) from a loopback address of its own (127.0.0.N: the server keys
an HTTP caller on its address, as it keys a websocket on its connection),
and checks, per call:

- exactly one answer, within 30 s, that h11 parses;
- its status in the documented set (:data:`DOCUMENTED`, never 500) and in
  what the call allows;
- an error is a JSON object with ``error`` and ``message`` (strings, no
  ``internal``), at most 4096 bytes; a 202 has ``id``, ``status``, ``urls``
  and ``Location``; an event stream's events parse, start with
  ``accepted`` and end with exactly one ``done`` / ``cancelled`` /
  ``error``, nothing after it.

Every accepted request (202, or a 200 event stream) is followed to its
end: by its stream, else by polling ``GET /v1/generations/{id}`` (the
oldest accepted at most one poll per call, ``sent["http_poll"]``, and the
rest when the connection is done): ``done``, or ``failed`` with
``step_failed`` when it had ``fail_at``, or ``cancelled`` when this
connection's ``DELETE`` said so; anything else is a violation. A request
the server forgot before it was polled (``max_retained`` and the memory
bound forget the oldest ended results) is counted, not judged.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from .http_wire import Answer, HttpConn, chunked_body, request_bytes

__all__ = ["DOCUMENTED", "HTTP_CATEGORIES", "Call", "HttpFuzzConn"]

API = "/v1/generations"
#: Every status docs/http.md and docs/protocol.md give the API's answers (no token here: no 401).
DOCUMENTED = frozenset({200, 202, 400, 403, 404, 405, 408, 409, 413, 421, 422, 429, 503})
#: What a new generate may get besides its refusals of params: accepted, busy, too many.
LOADED = frozenset({202, 429, 503})
SMALL = {"shape": [3, 16, 16], "work": 0}
_TERMINAL = frozenset({"done", "cancelled", "error"})


@dataclass
class Call:
    """One HTTP call: what goes out, and which statuses it may get."""

    method: str
    path: str
    allowed: frozenset[int]
    body: bytes | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: "plain" (all at once), "chunked" (chunks of ``chunk`` bytes), "slow" (a few pieces, pauses
    #: between), "stall" (part of a declared length, then nothing), "declared" (a Content-Length
    #: over the bound, a little sent).
    mode: str = "plain"
    chunk: int = 0
    #: A generate that may start a request: its fail_at (None: none), and whether it streams.
    starts: bool = False
    fail_at: int | None = None
    stream: bool = False
    host: str | None = None
    #: Not HTTP at all ("raw": these bytes are the whole request): a 400 from the HTTP parser,
    #: whose body need not be JSON, and a closed connection.
    raw: bytes | None = None


def _body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _post(obj: Any, allowed: frozenset[int] | set[int], **kw: Any) -> Call:
    return Call("POST", API, frozenset(allowed), _body(obj) if not isinstance(obj, bytes) else obj,
                [("Content-Type", "application/json")], **kw)


def _generate(rng: random.Random, conn: HttpFuzzConn, **extra: Any) -> tuple[dict[str, Any], int | None]:
    params: dict[str, Any] = {**SMALL, "steps": rng.randint(1, 6), "seed": rng.randrange(1000)}
    if rng.random() < 0.15:
        params["fail_at"] = rng.randint(1, params["steps"])
    body: dict[str, Any] = {"params": params, **extra}
    if rng.random() < 0.5:
        body["id"] = conn.new_id()
    if rng.random() < 0.3:
        body["preview"] = {"format": rng.choice(("jpeg", "raw", "png")), "every": rng.randint(1, 3),
                           "max_size": 16}
    if rng.random() < 0.3:
        body["output"] = {"format": rng.choice(("png", "raw", "jpeg"))}
    if rng.random() < 0.3:
        body["priority"] = rng.randint(-10, 10)
    return body, params.get("fail_at")


# -- the categories: (rng, conn) -> Call ---------------------------------------------------------


def http_malformed_json(rng: random.Random, conn: HttpFuzzConn) -> Call:
    choices = [b'{"params": {}', b"{", b"nul", b"", b" ", b'{"a":}', b"[1,2", b"\x00", b'{"params": {},}',
               b"{'params': {}}", b'{"params": {}}}', b"NaN", b'{"params" {}}', b"\xff\xfe{}",
               "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randint(1, 200))).encode()]
    return _post(rng.choice(choices), {400})


def http_wrong_types(rng: random.Random, conn: HttpFuzzConn) -> Call:
    choices: list[Any] = [
        {"params": []}, {"params": "steps=3"}, {"params": {"steps": "ten"}},
        {"params": {}, "preview": "jpeg"},
        {"params": {}, "priority": 1.5}, {"params": {}, "priority": True}, {"params": {}, "output": 3},
        {"params": {"shape": "3x16x16"}}, {"params": {"steps": 2.5}}, {"params": {"steps": True}},
        {"params": {}, "preview": {"every": "1"}}, {"params": {}, "preview": {"format": "bmp"}},
        {"params": {}, "preview": {"quality": 0}}, {"params": {}, "output": {"format": "mp4"}},
        {"id": 12, "params": {}}, {"id": ["a"], "params": {}}, [1, 2, 3], "generate", 42, None, True,
    ]
    return _post(rng.choice(choices), {400, 422})


def http_unknown_keys(rng: random.Random, conn: HttpFuzzConn) -> Call:
    choices: list[Any] = [
        {"params": {}, "detach": True}, {"type": "generate", "params": {}}, {"params": {"stepz": 3}},
        {"params": {}, "preview": {"evry": 2}}, {}, {"params": {}, "detatch": True},
        {"params": {}, **{f"k{i}": i for i in range(50)}}, {"params": {}, "output": {"fmt": "png"}},
    ]
    return _post(rng.choice(choices), {400, 422})


def http_huge_keys(rng: random.Random, conn: HttpFuzzConn) -> Call:
    n = rng.randint(1000, conn.max_key_bytes)
    choices: list[Callable[[], Any]] = [
        lambda: {"params": {}, "k" * n: 1}, lambda: {"params": {"p" * n: 1}},
        lambda: {"params": {}, "preview": {"x" * n: 1}}, lambda: {"id": "i" * n, "params": {}},
        lambda: {"params": {}, **{f"key{i}": i for i in range(min(n // 8, 20_000))}},
        lambda: {"params": {"prompt": "w" * n}},
    ]
    return _post(rng.choice(choices)(), {400, 422})


def http_deep_json(rng: random.Random, conn: HttpFuzzConn) -> Call:
    d = rng.choice((100, 1000, 10_000, 100_000))
    big = "9" * rng.choice((20, 400, 4300, 5000, 50_000))
    choices = [
        "[" * d + "]" * d, '{"a":' * d + "1" + "}" * d, '{"params": {"steps": ' + "[" * d + "]" * d + "}}",
        '{"params": {}, "preview": ' + '{"a":' * d + "1" + "}" * d + "}", "[" * d,
        '{"params": {"steps": ' + big + "}}", '{"params": {"seed": ' + big + "}}",
        '{"params": {}, "priority": ' + big + "}", '{"params": {"shape": [3, ' + big + ", 16]}}",
        '{"params": {"hang_s": 1e999}}', '{"params": {"hang_s": NaN}}', '{"params": {"steps": -1}}',
        '{"params": {}, "priority": 11}', '{"params": {"steps": 1e99}}', big,
    ]
    return _post(rng.choice(choices).encode(), {400, 422})


def http_bad_ids(rng: random.Random, conn: HttpFuzzConn) -> Call:
    if rng.random() < 0.5:
        rid = rng.choice([".", "..", "", "a" * 129, "spaces here", "ü-id", "../x", "id\n", "a/b", "<script>",
                          "\x00", "x" * 5000, "%2e%2e"])
        return _post({"id": rid, "params": dict(SMALL, steps=1)}, {400})
    path = rng.choice([".", "..", "%2e", "%2e%2e", "a%2Fb", "x" * 5000, "%00", "%C3%BC", "..%2F..%2Fhealth",
                       "%2F", "nosuch%20id"])
    tail = rng.choice(("", "/events", "/output", "/preview"))
    method = "DELETE" if not tail and rng.random() < 0.4 else "GET"
    return Call(method, f"{API}/{path}{tail}", frozenset({400, 404}))


def http_valid(rng: random.Random, conn: HttpFuzzConn) -> Call:
    body, fail_at = _generate(rng, conn)
    if rng.random() < 0.05:
        # Wait for the result: the output itself, or the error of GET .../output.
        call = _post(body, {200, 409, 429, 503}, starts=True, fail_at=fail_at)
        return dataclasses.replace(call, path=API + "?wait=true")
    return _post(body, LOADED, starts=True, fail_at=fail_at)


def http_event_stream(rng: random.Random, conn: HttpFuzzConn) -> Call:
    body, fail_at = _generate(rng, conn)
    call = _post(body, {200, 429, 503}, starts=True, fail_at=fail_at, stream=True)
    call.headers.append(("Accept", "text/event-stream"))
    return call


def framing_over(data: int, chunk: int) -> int:
    """How far a body of ``data`` bytes in ``chunk``-byte chunks is over the server's framing allowance.

    omni_stream/server/http11.py: refused (413) once the framing parsed is
    over FRAMING_ALLOWANCE plus 1/8 of the data; a chunk costs its size in
    hex and two CRLFs. Negative: under it. The server counts from the slice
    after the request's head (its first 1 KiB or so is not counted), so
    within a slice of the allowance either answer may come.
    """
    from omni_stream.server.http11 import FRAMING_ALLOWANCE

    chunks = -(-data // chunk)
    framing = chunks * (len(f"{chunk:x}") + 4) + 5
    return framing - (FRAMING_ALLOWANCE + data // 8)


def http_chunked(rng: random.Random, conn: HttpFuzzConn) -> Call:
    if rng.random() < 0.1:
        # A body whose framing outweighs its data: refused after a bounded parse.
        return _post(b'{"params": {}, "pad": "' + b"a" * 65_536 + b'"}', {413}, mode="chunked", chunk=1)
    chunk = rng.choice((1, 3, 7, 100, 4096))
    if rng.random() < 0.5:
        body, fail_at = _generate(rng, conn)
        call = _post(body, LOADED, mode="chunked", chunk=chunk, starts=True, fail_at=fail_at)
    else:
        call = rng.choice((http_malformed_json, http_wrong_types, http_unknown_keys))(rng, conn)
        call.mode, call.chunk = "chunked", chunk
    over = framing_over(len(call.body or b""), chunk)
    if over > 2048:
        # A few bytes a chunk: refused for its framing before it is read whole (nothing starts).
        call.allowed, call.starts = frozenset({413}), False
    elif over > -2048:
        call.allowed = call.allowed | {413}  # near the allowance: either answer
    return call


def http_slow(rng: random.Random, conn: HttpFuzzConn) -> Call:
    body, fail_at = _generate(rng, conn)
    if rng.random() < 0.05:
        # Part of the declared body, then nothing: 408 after body_timeout_s.
        return _post(body, {408}, mode="stall")
    return _post(body, LOADED, mode="slow", starts=True, fail_at=fail_at)


def http_origin_host(rng: random.Random, conn: HttpFuzzConn) -> Call:
    evil = rng.choice(("http://evil.example", "null", f"http://evil.example:{conn.port}", "https://127.0.0.1.evil"))
    known = conn.any_known() or "nosuch"
    which = rng.randrange(6)
    if which == 0:
        call = _post(_generate(rng, conn)[0], {403})
        call.headers.append(("Origin", evil))
    elif which == 1:
        call = Call("DELETE", f"{API}/{known}", frozenset({403}), headers=[("Origin", evil)])
    elif which == 2:
        call = Call(rng.choice(("GET", "HEAD")), rng.choice((API, f"{API}/{known}", "/health", "/models")),
                    frozenset({421}), host=f"evil.example:{conn.port}")
    elif which == 3:
        call = _post(_generate(rng, conn)[0], {421}, host=f"evil.example:{conn.port}")
        call.headers.append(("Origin", f"http://evil.example:{conn.port}"))
    elif which == 4:
        body, fail_at = _generate(rng, conn)
        call = _post(body, LOADED, starts=True, fail_at=fail_at)
        call.headers.append(("Origin", f"http://127.0.0.1:{conn.port}"))
    else:
        call = Call("GET", f"{API}/{known}", frozenset({200, 404}), host=f"localhost:{conn.port}")
    return call


def http_unknown_ids(rng: random.Random, conn: HttpFuzzConn) -> Call:
    rid = f"nosuch-{rng.randrange(10**9)}"
    tail = rng.choice(("", "/events", "/output", "/preview", ""))
    method = "DELETE" if not tail and rng.random() < 0.5 else rng.choice(("GET", "GET", "HEAD"))
    return Call(method, f"{API}/{rid}{tail}", frozenset({404}))


def http_known_ids(rng: random.Random, conn: HttpFuzzConn) -> Call:
    rid = conn.any_known()
    if rid is None:
        return Call("GET", API, frozenset({200}))
    tail = rng.choice(("", "", "/output", "/preview", "/events", "cancel"))
    if tail == "cancel":
        return Call("DELETE", f"{API}/{rid}", frozenset({200, 404}))
    # Forgotten already (retention, the memory bound): 404.
    allowed = {"": {200, 404}, "/output": {200, 404, 409}, "/preview": {200, 404},
               "/events": {200, 404}}[tail]
    return Call(rng.choice(("GET", "GET", "HEAD")) if tail != "/events" else "GET", f"{API}/{rid}{tail}",
                frozenset(allowed), stream=tail == "/events")


def http_methods(rng: random.Random, conn: HttpFuzzConn) -> Call:
    return rng.choice([
        Call("PUT", API, frozenset({405}), b"{}"), Call("PATCH", f"{API}/x", frozenset({405}), b"{}"),
        Call("POST", f"{API}/x", frozenset({405}), b"{}"), Call("OPTIONS", API, frozenset({405})),
        Call("GET", "/nope", frozenset({404})), Call("HEAD", API, frozenset({200})),
        Call("DELETE", API, frozenset({405})), Call("GET", "/v1/generations/", frozenset({404, 405})),
        Call("GET", "/v1/generations/x/y/z", frozenset({404})), Call("TRACE", API, frozenset({405})),
    ])


def http_not_http(rng: random.Random, conn: HttpFuzzConn) -> Call:
    raw = rng.choice([
        b"GARBAGE\r\n\r\n", b"GET /a b HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32) + b"\r\n\r\n",
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n",
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: y\r\n\r\n",
        # Refused at the door (Origin) before its body is read, and the body's framing is broken.
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    ])
    return Call("GET", "/", frozenset({400}), raw=raw)


def http_oversize(rng: random.Random, conn: HttpFuzzConn) -> Call:
    if rng.random() < 0.8:
        return _post(b'{"params": {}, "pad": "' + b"a" * 1000, {413}, mode="declared")
    return _post(b'{"params": {}, "pad": "' + b"a" * (1 << 20) + b'"}', {413})


HTTP_CATEGORIES: dict[str, Callable[[random.Random, HttpFuzzConn], Call]] = {
    "http_malformed_json": http_malformed_json, "http_wrong_types": http_wrong_types,
    "http_unknown_keys": http_unknown_keys, "http_huge_keys": http_huge_keys,
    "http_deep_json": http_deep_json,
    "http_bad_ids": http_bad_ids, "http_valid": http_valid, "http_event_stream": http_event_stream,
    "http_chunked": http_chunked, "http_slow": http_slow, "http_origin_host": http_origin_host,
    "http_unknown_ids": http_unknown_ids, "http_known_ids": http_known_ids, "http_methods": http_methods,
    "http_oversize": http_oversize, "http_not_http": http_not_http,
}


def _events(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """An event stream as (event, data) pairs; comments and keep-alives skipped; data None if not JSON."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    for block in text.split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if not data:
            continue
        try:
            obj = json.loads("\n".join(data))
        except ValueError:
            obj = None
        out.append((name, obj if isinstance(obj, dict) else None))
    return out


#: What ``stall_s`` adds to the server's body_timeout_s (a stalled body's 408 comes within it).
STALL_SLACK_S = 5.0


class HttpFuzzConn:
    """One fuzzing HTTP client (see the module docstring); counts into a fuzz ``Tally``."""

    def __init__(self, tally: Any, n: int, rng: random.Random, *, port: int, source: str | None,
                 interval: float = 0.0, categories: list[str] | None = None, stall_s: float = 2.0) -> None:
        self.tally = tally
        self.n = n
        self.rng = rng
        self.port = port
        self.source = source
        self.interval = interval
        self.categories = categories or list(HTTP_CATEGORIES)
        self.max_key_bytes = tally.max_key_bytes
        #: How long a stalled body waits for its 408 (the server's body_timeout_s, plus STALL_SLACK_S).
        self.stall_s = stall_s
        self.body_timeout_s = max(0.0, stall_s - STALL_SLACK_S)
        self.count = 0
        #: Accepted requests: id -> (fail_at, accepted at); ended ones leave it.
        self.pending: dict[str, tuple[int | None, float]] = {}
        self.known: collections.deque[str] = collections.deque(maxlen=64)
        self.cancelled: set[str] = set()
        self.ended: collections.Counter[str] = collections.Counter()
        self.conn = HttpConn(port, source=source)

    def new_id(self) -> str:
        self.count += 1
        return f"hz{self.n}-{self.count}-{self.rng.randrange(10**6)}"

    def any_known(self) -> str | None:
        return self.rng.choice(self.known) if self.known else None

    def _viol(self, what: str) -> None:
        self.tally.violations.append(f"http conn {self.n}: {what}")

    # -- one call ----------------------------------------------------------------------------

    async def call(self, call: Call, what: str) -> Answer | None:
        """Send ``call``, read its answer (a stream to its end); None (a violation counted) when none came."""
        conn = self.conn
        host = conn.host if call.host is None else call.host
        started = asyncio.get_running_loop().time()
        try:
            if call.raw is not None:
                await conn.send(call.raw, method=call.method)
            elif call.mode == "plain":
                await conn.send(request_bytes(call.method, call.path, host=host, headers=call.headers,
                                              body=call.body), method=call.method)
            elif call.mode == "chunked":
                await conn.send(request_bytes(call.method, call.path, host=host, headers=call.headers,
                                              chunked=True), method=call.method)
                await conn.write(chunked_body(call.body or b"", call.chunk))
            elif call.mode == "slow":
                body = call.body or b""
                await conn.send(request_bytes(call.method, call.path, host=host, headers=call.headers,
                                              length=len(body)), method=call.method)
                pieces = self.rng.randint(2, 4)
                step = max(1, len(body) // pieces)
                for i in range(0, len(body), step):
                    await asyncio.sleep(self.rng.uniform(0.01, 0.1))
                    await conn.write(body[i:i + step])
            elif call.mode in ("stall", "declared"):
                body = call.body or b""
                declared = len(body) + 1000 if call.mode == "stall" else 2_000_000
                await conn.send(request_bytes(call.method, call.path, host=host, headers=call.headers,
                                              length=declared) + body[: len(body) // 2 or len(body)],
                                method=call.method)
            timeout = 30.0 + (self.stall_s if call.mode == "stall" else 0.0)
            if call.stream:
                return await self._stream_answer(timeout)
            return await conn.answer(timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._viol(f"no answer within 30 s to {what}")
        except h11.RemoteProtocolError as exc:
            self._viol(f"a malformed answer to {what}: {exc}")
        except (ConnectionError, OSError) as exc:
            late = asyncio.get_running_loop().time() - started >= self.body_timeout_s
            if call.mode == "slow" and late:
                # Its body took longer than the server's body_timeout_s (a
                # loaded machine): dropped with 408 as documented, not a fault.
                self.tally.replies["http 408 (a slow body past its deadline)"] += 1
            else:
                self._viol(f"the connection failed during {what}: {type(exc).__name__}: {exc}")
        conn.close()
        return None

    async def _stream_answer(self, timeout: float) -> Answer:
        head = await self.conn.head(timeout)
        body = bytearray()
        async for part in self.conn.body_parts(timeout):
            body += part
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
        return Answer(head.status_code, headers, bytes(body))

    # -- what an answer must be ---------------------------------------------------------------

    def check(self, call: Call, answer: Answer, what: str) -> str:
        """Check ``answer`` against the module docstring's rules; its label (``http 422 bad_params``)."""
        status = answer.status
        code = ""
        if status not in DOCUMENTED:
            self._viol(f"status {status} (not documented) for {what}: {answer.body[:200]!r}")
        elif status not in call.allowed:
            self._viol(f"status {status} for {what}, expected {sorted(call.allowed)}: {answer.body[:200]!r}")
        head_only = call.method == "HEAD"
        if call.raw is not None:
            if not answer.closes:
                self._viol(f"a request that is not HTTP ({what}) left the connection open")
            return f"http {status} (not HTTP)"
        if status >= 400 and not head_only:
            try:
                obj = json.loads(answer.body)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("error"), str) or not isinstance(
                obj.get("message"), str
            ):
                self._viol(f"error body without error and message for {what}: {answer.body[:200]!r}")
            else:
                code = obj["error"]
                if code == "internal":
                    self._viol(f"internal error for {what}: {obj}")
            if not answer.headers.get("content-type", "").startswith("application/json"):
                self._viol(f"error answer of type {answer.headers.get('content-type')!r} for {what}")
            if len(answer.body) > 4096:
                self._viol(f"error answer of {len(answer.body)} bytes for {what}")
        if status == 202 and not head_only:
            try:
                obj = json.loads(answer.body)
                ok = isinstance(obj.get("id"), str) and "status" in obj and "urls" in obj
            except (ValueError, AttributeError):
                ok = False
            if not ok or "location" not in answer.headers:
                self._viol(f"a 202 without id, status, urls or Location for {what}: {answer.body[:200]!r}")
        return f"http {status}{' ' + code if code else ''}"

    def follow(self, call: Call, answer: Answer, what: str) -> None:
        """Track a request the answer started; check a stream's events."""
        t = time.monotonic()
        if call.stream and answer.status == 200:
            events = _events(answer.body.decode("utf-8", errors="replace"))
            names = [e for e, _ in events]
            terminals = [i for i, e in enumerate(names) if e in _TERMINAL]
            if any(data is None for _, data in events):
                self._viol(f"an event whose data is not a JSON object in the stream of {what}")
            if len(terminals) != 1 or terminals[0] != len(names) - 1:
                self._viol(f"the stream of {what} ended with {names[-3:]} ({len(terminals)} terminal events)")
                return
            end, data = events[-1]
            rid = str((data or {}).get("id"))
            if call.path == API:  # a POST's stream: it started this request
                if names[0] != "accepted":
                    self._viol(f"the stream of {what} began with {names[0]!r}, not accepted")
                self.known.append(rid)
                self._ended(rid, call.fail_at, end, data or {}, what)
            elif rid in self.pending:
                self._ended(rid, self.pending[rid][0], end, data or {}, what)
            return
        if call.starts and answer.status == 202:
            rid = json.loads(answer.body)["id"]
            self.pending[rid] = (call.fail_at, t)
            self.known.append(rid)
        elif call.starts and call.path.endswith("?wait=true") and answer.status in (200, 409):
            if answer.status == 200 and call.fail_at is not None:
                self._viol(f"{what} with fail_at={call.fail_at} answered its output")
        elif call.method == "DELETE" and answer.status == 200:
            obj = json.loads(answer.body)
            rid = str(obj.get("id"))
            if obj.get("status") == "cancelled":
                self.cancelled.add(rid)
            if rid in self.pending and obj.get("status") in ("done", "failed", "cancelled"):
                self._judge(rid, obj)

    def _ended(self, rid: str, fail_at: int | None, end: str, data: dict[str, Any], what: str) -> None:
        """A stream's terminal event for ``rid``: the outcome it must be."""
        self.pending.pop(rid, None)
        self.ended[rid] += 1
        self.tally.terminals[f"http {end if end != 'error' else data.get('code')}"] += 1
        if end == "error" and (data.get("code") != "step_failed" or fail_at is None):
            self._viol(f"{rid} ended with {data.get('code')} (fail_at {fail_at}): {data.get('message')}")
        elif end == "done" and fail_at is not None:
            self._viol(f"{rid} done despite fail_at={fail_at}")
        elif end == "cancelled" and rid not in self.cancelled:
            self._viol(f"{rid} cancelled ({data.get('reason')}) without our DELETE")

    def _judge(self, rid: str, status: dict[str, Any]) -> None:
        """A polled status of an ended request: the outcome it must be."""
        fail_at, _ = self.pending.pop(rid)
        state = status.get("status")
        error = status.get("error") or {}
        self.ended[rid] += 1
        self.tally.terminals[f"http {state}"] += 1
        if state == "failed" and (error.get("code") != "step_failed" or fail_at is None):
            self._viol(f"{rid} failed with {error} (fail_at {fail_at})")
        elif state == "done" and fail_at is not None and rid not in self.cancelled:
            self._viol(f"{rid} done despite fail_at={fail_at}")
        elif state == "cancelled" and (rid not in self.cancelled or error.get("reason") != "client"):
            self._viol(f"{rid} cancelled ({error}) without our DELETE")

    async def poll(self, *, oldest_s: float = 0.2) -> bool:
        """Poll the oldest accepted request (accepted ``oldest_s`` ago or more); whether one was polled."""
        now = time.monotonic()
        rid = next((r for r, (_, t) in self.pending.items() if now - t >= oldest_s), None)
        if rid is None:
            return False
        self.tally.sent["http_poll"] += 1
        answer = await self.call(Call("GET", f"{API}/{rid}", frozenset({200, 404})), f"a poll of {rid}")
        if answer is None:
            return True
        self.check(Call("GET", f"{API}/{rid}", frozenset({200, 404})), answer, f"a poll of {rid}")
        if answer.status == 404:
            self.pending.pop(rid, None)
            self.tally.terminals["http forgotten before polled"] += 1
        elif answer.status == 200:
            status = json.loads(answer.body)
            if status.get("status") in ("done", "failed", "cancelled"):
                self._judge(rid, status)
            else:
                self.pending[rid] = (self.pending[rid][0], time.monotonic())  # polled again later
        return True

    # -- the run ---------------------------------------------------------------------------------

    async def run(self, count: int) -> None:
        tally = self.tally
        t_next = time.monotonic()
        try:
            for _ in range(count):
                if self.interval:
                    t_next += self.interval
                    if (wait := t_next - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                cat = self.rng.choice(self.categories)
                t_build = time.perf_counter()
                call = HTTP_CATEGORIES[cat](self.rng, self)
                size = len(call.body or b"") + len(call.path)
                label_ = f"{cat}:{_size_class(size)}"
                tally.build_s[label_] += time.perf_counter() - t_build
                tally.sent[cat] += 1
                what = f"{cat} {call.method} {call.path[:60]!r} ({call.mode}) {(call.body or b'')[:60]!r}"
                t_send = time.monotonic()
                if tally.t_first is None:
                    tally.t_first = t_send
                answer = await self.call(call, what)
                t_reply = time.monotonic()
                tally.t_last = max(tally.t_last, t_reply)
                tally.latency[label_].add(t_reply - t_send)
                tally.per_10s[int(t_reply // 10)] += 1
                if tally.timeline is not None:
                    tally.timeline.setdefault(10_000 + self.n, []).append((label_, t_send, t_reply))
                if answer is None:
                    continue
                tally.replies[self.check(call, answer, what)] += 1
                self.follow(call, answer, what)
                if call.starts and answer.status == 202 and self.rng.random() < 0.2:
                    rid = json.loads(answer.body)["id"]
                    tally.sent["http_cancel_own"] += 1
                    cancel = Call("DELETE", f"{API}/{rid}", frozenset({200}))
                    reply = await self.call(cancel, f"a DELETE of our own {rid}")
                    if reply is not None:
                        self.check(cancel, reply, f"a DELETE of our own {rid}")
                        self.follow(cancel, reply, f"a DELETE of our own {rid}")
                await self.poll()
            deadline = time.monotonic() + 60
            while self.pending and time.monotonic() < deadline:
                if not await self.poll(oldest_s=0.0):
                    await asyncio.sleep(0.1)
            if self.pending:
                self._viol(f"requests never ended: {sorted(self.pending)[:5]}")
            for rid, n in self.ended.items():
                if n != 1:
                    self._viol(f"{rid} ended {n} times")
        finally:
            self.conn.close()


def _size_class(n: int) -> str:
    return "<1k" if n < 1000 else "1k+" if n < 10_000 else "10k+" if n < 100_000 else "100k+"
