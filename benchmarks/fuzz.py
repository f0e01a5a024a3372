"""Fuzzer of both doors: hostile and broken messages and HTTP calls against a server in a process of its own.

``python -m benchmarks.fuzz [--messages N] [--seed S] [--connections C] [--doors ws|http|both]
[--http-connections H] [--workers W] [--rate R] [--categories a,b] [--attribute] [--json PATH]
[--server-profile PATH]``

Starts ``omni_stream.server.Server`` (Synthetic model, CPU) on 127.0.0.1
port 0 in a process of its own (``benchmarks/_server_proc.py``: its own
interpreter and event loop, as ``omni-stream serve`` runs), and sends ``N``
messages over ``C`` connections, split over ``W`` fuzzing processes (each
connection its own rng, seeded from ``S`` and its index, so the messages
do not depend on ``W``), drawn from these categories: malformed JSON, wrong
types, unknown keys and types, huge keys (bounded well under
``max_message_bytes``), deep nesting, huge integers, bad ids, binary
frames, valid generates with bad params, cancel / attach of unknown ids,
duplicate ids, valid small generates (some with ``fail_at``, some cancelled
by their sender right after).

What docs/protocol.md promises, counted per message: every ``generate``
and ``attach`` gets exactly one ``accepted`` or one rejecting ``error``;
every rejected message (bad JSON, bad fields, binary) gets exactly one
``error``; a ``cancel`` of an unknown id gets ``error`` ``not_found``; a
``cancel`` of one's own running request gets nothing (or ``not_found`` if
it raced the request's end). Each connection sends one message and waits
for its reply before the next, so replies are matched in order; at the end
every accepted request must have ended exactly once (``done``, or
``cancelled`` when we cancelled it, or ``step_failed`` when it had
``fail_at``), no further reply may arrive, no ``internal`` error code
ever, no error reply over 4096 bytes, no connection closed by the server,
``/health`` ok with nothing left running, and the server process exits 0
on SIGTERM, having logged no ERROR and no traceback. Each fuzzing process
reports its counts and violations as JSON; this one merges them.

The HTTP door (``--doors http`` or ``both``, the default): ``H`` more
clients (default ``C``), each from a loopback address of its own, send
hostile and broken calls to ``/v1/generations`` (``fuzz_http.py`` lists
them and what each answer must be: one, parsed by h11, a documented
status, JSON errors with ``error`` and ``message``, every accepted request
ended once and as asked). ``N`` is the total over every connection of
both doors. The server runs with ``body_timeout_s`` 2 s when the HTTP
door is fuzzed (a stalled body waits for its 408).

Alongside, an honest client, in a process of its own, runs one 20-step
request at a time and the time between its ``progress`` messages is
reported, quiet (before the fuzz, every process started and idle) and
during it (the gaps wholly between the first message sent and the last
reply). Neither its work nor the fuzzers' runs on the server's event loop,
so its step gaps measure the server (and the two processes' share of the
cores). Also reported: messages/s, the server process's peak RSS (VmHWM)
and CPU seconds (``/proc/PID``), its ``/health`` load sampled every 0.5 s,
and each category's reply latency by payload size. ``--rate`` paces the
fuzz (by default each connection sends as soon as its reply came, so the
server runs flat out); ``--attribute`` lines the honest client's slow gaps
up with the messages in flight and the fuzz's own requests running then.
Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from .stress_common import percentile

__all__ = ["main", "run_fuzz"]

ENDING = frozenset({"step_failed", "step_timeout", "engine_error", "preview_failed", "internal"})
SMALL = {"shape": [3, 16, 16], "work": 0}

# Each generator returns (payload, expect): payload a str (text frame) or
# bytes (binary frame); expect "reply" (exactly one error; accepted is a
# violation outside the valid categories) or "may_accept" (one reply, either).
# A cancel of one's own request is sent by Conn.run itself (no reply, or not_found).


def _gen(rng: random.Random, **extra: Any) -> str:
    return json.dumps({"type": "generate", "params": {**SMALL, "steps": rng.randint(1, 4)}, **extra})


def malformed_json(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    choices = [
        '{"type": "generate"', "{", "nul", "", " ", '{"a":}', "[1,2", "\x00", '{"type": "generate",}',
        "{'type': 'cancel'}", '{"type": "cancel", "id": "x"}}', "NaN", '{"type": "generate" "params": {}}',
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randint(1, 200))),
        '"\\ud800"', '{"type": "gen\\xate"}',
    ]
    return rng.choice(choices), "reply"


def wrong_types(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    choices: list[Any] = [
        {"type": 5}, {"type": None}, {"type": ["generate"]}, {"type": "generate", "params": []},
        {"type": "generate", "params": "steps=3"}, {"type": "generate", "params": {"steps": "ten"}},
        {"type": "generate", "params": {}, "detach": "yes"},
        {"type": "generate", "params": {}, "preview": "jpeg"},
        {"type": "generate", "params": {}, "priority": 1.5},
        {"type": "generate", "params": {}, "priority": True},
        {"type": "generate", "params": {}, "output": 3}, {"type": "cancel", "id": 12},
        {"type": "attach", "id": None}, {"type": "generate", "params": {"shape": "3x16x16"}},
        {"type": "generate", "params": {"steps": 2.5}}, {"type": "generate", "params": {"steps": True}},
        {"type": "generate", "params": {}, "preview": {"every": "1"}},
        {"type": "generate", "params": {}, "preview": {"format": "bmp"}},
        {"type": "generate", "params": {}, "preview": {"quality": 0}},
        {"type": "generate", "params": {}, "output": {"format": "mp4"}},
        [1, 2, 3], "generate", 42, None, True,
    ]
    return json.dumps(rng.choice(choices)), "reply"


def unknown_keys(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    choices: list[Any] = [
        {"type": "generate", "params": {}, "detatch": True}, {"type": "frobnicate"}, {"type": ""},
        {"type": "cancel", "id": "x", "extra": 1}, {"type": "generate", "params": {"stepz": 3}},
        {"type": "generate", "params": {}, "preview": {"evry": 2}}, {"no_type": 1}, {},
        {"type": "GENERATE", "params": {}},
        {"type": "generate", "params": {}, **{f"k{i}": i for i in range(50)}},
    ]
    return json.dumps(rng.choice(choices)), "reply"


_MAX_KEYS = 20_000


@functools.cache
def _key_run() -> tuple[str, list[int]]:
    """``{"type": "generate", "params": {}, "key0": 0, ...`` to ``_MAX_KEYS`` keys; where each key ends."""
    text, ends = ['{"type": "generate", "params": {}'], [len('{"type": "generate", "params": {}')]
    for i in range(_MAX_KEYS):
        text.append(f', "key{i}": {i}')
        ends.append(ends[-1] + len(text[-1]))
    return "".join(text), ends


def _many_keys(count: int) -> str:
    """``json.dumps`` of a generate with ``count`` extra keys, cut from one prebuilt string (not built)."""
    text, ends = _key_run()
    return text[: ends[count]] + "}"


def huge_keys(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    n = rng.randint(1000, ctx.max_key_bytes)
    # Only the one drawn is built (the same draws as a list of all six).
    choices: list[Any] = [
        lambda: json.dumps({"type": "generate", "params": {}, "k" * n: 1}),
        lambda: json.dumps({"type": "generate", "params": {"p" * n: 1}}),
        lambda: json.dumps({"type": "generate", "params": {}, "preview": {"x" * n: 1}}),
        lambda: json.dumps({"type": "t" * n}),
        lambda: _many_keys(min(n // 8, _MAX_KEYS)),
        lambda: json.dumps({"type": "generate", "id": "i" * n, "params": {}}),
    ]
    return rng.choice(choices)(), "reply"


def deep_nesting(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    d = rng.choice((100, 1000, 10_000, 100_000))
    choices = [
        "[" * d + "]" * d,
        '{"a":' * d + "1" + "}" * d,
        '{"type": "generate", "params": {"steps": ' + "[" * d + "]" * d + "}}",
        '{"type": "generate", "params": {}, "preview": ' + '{"a":' * d + "1" + "}" * d + "}",
        "[" * d,  # unterminated
    ]
    return rng.choice(choices), "reply"


def huge_ints(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    big = "9" * rng.choice((20, 400, 4300, 5000, 50_000))
    choices = [
        '{"type": "generate", "params": {"steps": ' + big + "}}",
        '{"type": "generate", "params": {"seed": ' + big + "}}",
        '{"type": "generate", "params": {}, "priority": ' + big + "}",
        '{"type": "generate", "params": {}, "preview": {"max_size": ' + big + "}}",
        '{"type": "generate", "params": {"shape": [3, ' + big + ", 16]}}",
        '{"type": "generate", "params": {"hang_s": 1e999}}',
        '{"type": "generate", "params": {"hang_s": NaN}}',
        '{"type": "generate", "params": {"steps": -1}}',
        '{"type": "generate", "params": {"seed": -5}}',
        '{"type": "generate", "params": {}, "priority": 11}',
        '{"type": "generate", "params": {"steps": 1e99}}',
        '{"type": "generate", "params": {"steps": 2.5e0}}',
        big,
    ]
    payload = rng.choice(choices)
    # preview.max_size is capped at max_image_size (docs/protocol.md): accepted.
    return payload, ("may_accept" if "max_size" in payload else "reply")


def bad_ids(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    rid = rng.choice(
        ["", "a" * 129, "spaces here", "ü-id", "../x", "id\n", "a/b", "<script>", "\x00", "x" * 5000]
    )
    kind = rng.choice(("generate", "cancel", "attach"))
    msg: dict[str, Any] = {"type": kind, "id": rid}
    if kind == "generate":
        msg["params"] = dict(SMALL, steps=1)
    return json.dumps(msg), "reply"


def binary(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    n = rng.choice((0, 1, 16, 4096, 100_000))
    payload = rng.randbytes(n) if rng.random() < 0.5 else _gen(rng).encode()
    return payload, "reply"


def bad_params(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    choices: list[Any] = [
        {"shape": [3, 4096, 4096]}, {"shape": [3, 3000, 16]}, {"shape": []}, {"shape": [0, 4]},
        {"shape": [1, 1, 1, 1, 1, 1]}, {"work": 10_000}, {"hang_s": 1000}, {"steps": 20_000},
        {"steps": 0}, {"fail_at": 0}, {"hang_at": -1}, {"output": "pixels"}, {"seed": 2**64},
    ]
    msg = {"type": "generate", "params": rng.choice(choices)}
    if rng.random() < 0.5:
        msg["id"] = ctx.new_id()
    return json.dumps(msg), "reply"


def unknown_ids(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    kind = rng.choice(("cancel", "attach"))
    return json.dumps({"type": kind, "id": f"nosuch-{rng.randrange(10**9)}"}), "reply"


def duplicate_id(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    rid = ctx.last_id or ctx.new_id()
    fa = ctx.fail_at.get(rid)
    params = {**SMALL, "steps": max(fa or 1, rng.randint(1, 4)), "fail_at": fa}
    msg = {"type": "generate", "id": rid, "params": params}
    ctx.fail_at[rid] = fa  # accepted only once the original ended: then it is this one's
    return json.dumps(msg), "reply"


def valid(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    rid = ctx.new_id()
    params: dict[str, Any] = {**SMALL, "steps": rng.randint(1, 6), "seed": rng.randrange(1000)}
    if rng.random() < 0.15:
        params["fail_at"] = rng.randint(1, params["steps"])
    msg: dict[str, Any] = {"type": "generate", "id": rid, "params": params}
    if rng.random() < 0.5:
        msg["preview"] = {
            "format": rng.choice(("jpeg", "raw", "png")), "every": rng.randint(1, 3), "max_size": 16
        }
    if rng.random() < 0.3:
        msg["output"] = {"format": rng.choice(("png", "raw", "jpeg"))}
    ctx.fail_at[rid] = params.get("fail_at")
    return json.dumps(msg), "reply"


CATEGORIES = {
    "malformed_json": malformed_json, "wrong_types": wrong_types, "unknown_keys": unknown_keys,
    "huge_keys": huge_keys, "deep_nesting": deep_nesting, "huge_ints": huge_ints, "bad_ids": bad_ids,
    "binary": binary, "bad_params": bad_params, "unknown_ids": unknown_ids, "duplicate_id": duplicate_id,
    "valid": valid,
}


def _size_class(n: int) -> str:
    """A payload's size, to a decade: what makes one message of a category cost more than another."""
    return "<1k" if n < 1000 else "1k+" if n < 10_000 else "10k+" if n < 100_000 else "100k+"


class Hist:
    """Latencies in log buckets (25% apart from 10 us): mergeable over processes, JSON-able."""

    BASE, RATIO = 1e-5, 1.25

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.n = 0
        self.sum = 0.0
        self.max = 0.0

    def add(self, x: float) -> None:
        i = 0 if x <= self.BASE else int(math.log(x / self.BASE) / math.log(self.RATIO)) + 1
        self.counts[i] += 1
        self.n += 1
        self.sum += x
        self.max = max(self.max, x)

    def to_json(self) -> dict[str, Any]:
        counts = {str(k): v for k, v in self.counts.items()}
        return {"counts": counts, "n": self.n, "sum": self.sum, "max": self.max}

    def merge_json(self, d: dict[str, Any]) -> None:
        for k, v in d["counts"].items():
            self.counts[int(k)] += v
        self.n += d["n"]
        self.sum += d["sum"]
        self.max = max(self.max, d["max"])

    def percentile(self, q: float) -> float:
        """The upper edge of the bucket holding the ``q``-th percentile (at most the maximum)."""
        if not self.n:
            return math.nan
        rank, seen = q / 100 * self.n, 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return min(self.max, self.BASE * self.RATIO**i)
        return self.max


class Tally:
    """What one fuzzing process counted: messages sent, replies, endings, violations, timings."""

    def __init__(self, max_key_bytes: int, timeline: bool = False, categories: Sequence[str] = ()) -> None:
        self.max_key_bytes = max_key_bytes
        self.categories = list(categories or CATEGORIES)
        self.violations: list[str] = []
        self.sent: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()
        self.terminals: collections.Counter[str] = collections.Counter()
        # Per category and payload size: seconds from send to reply, and to build the payload here.
        self.latency: dict[str, Hist] = collections.defaultdict(Hist)
        self.build_s: collections.Counter[str] = collections.Counter()
        # With timeline: per connection, [label, sent, replied] (time.monotonic()) of every message,
        # and [accepted, ended] of every request the server accepted.
        self.timeline: dict[int, list[tuple[str, float, float]]] | None = {} if timeline else None
        self.requests: list[tuple[float, float]] | None = [] if timeline else None
        self.t_first: float | None = None
        self.t_last = 0.0
        # Replies per 10 s of time.monotonic(): the rate over the run, merged over processes.
        self.per_10s: collections.Counter[int] = collections.Counter()

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": dict(self.sent), "replies": dict(self.replies), "terminals": dict(self.terminals),
            "violations": self.violations, "latency": {k: h.to_json() for k, h in self.latency.items()},
            "build_s": dict(self.build_s), "timeline": self.timeline, "requests": self.requests,
            "t_first": self.t_first, "t_last": self.t_last, "cpu_s": time.process_time(),
            "per_10s": dict(self.per_10s),
        }


class Conn:
    """One fuzzing connection: sends, matches replies in order, tracks accepted requests."""

    def __init__(self, tally: Tally, n: int, rng: random.Random, interval: float = 0.0) -> None:
        self.tally = tally
        self.interval = interval  # seconds between this connection's sends (0: as fast as replies come)
        self.n = n
        self.rng = rng
        self.max_key_bytes = tally.max_key_bytes
        self.count = 0
        self.last_id: str | None = None
        self.fail_at: dict[str, int | None] = {}
        self.running: set[str] = set()
        self.ended: collections.Counter[str] = collections.Counter()
        self.accepted: collections.Counter[str] = collections.Counter()
        self.cancelled_by_us: set[str] = set()
        self.maybe_not_found: set[str] = set()
        self.t_accepted: dict[str, float] = {}

    def new_id(self) -> str:
        self.count += 1
        return f"fz{self.n}-{self.count}-{self.rng.randrange(10**6)}"

    def _viol(self, what: str) -> None:
        self.tally.violations.append(f"conn {self.n}: {what}")

    def _stream_msg(self, msg: dict[str, Any]) -> bool:
        """Handle a message of an accepted request; True when it was one."""
        kind, rid = msg.get("type"), msg.get("id")
        # Paused / resumed: the gate's preemption moves a long request aside
        # for a short one (issue #22); loading: a model of several loads;
        # queued: one that waits for a place says where (issue #38).
        if kind in ("progress", "paused", "resumed", "loading", "queued"):
            return True
        ending = kind == "error" and msg.get("code") in ENDING and rid in self.running
        if kind in ("done", "cancelled") or ending:
            if rid not in self.running:
                self._viol(f"terminal {kind} for {rid!r}, which is not running here: {msg}")
                return True
            self.running.discard(rid)
            if self.tally.requests is not None:
                self.tally.requests.append((self.t_accepted.pop(rid, math.nan), time.monotonic()))
            self.ended[rid] += 1
            self.tally.terminals[kind if kind != "error" else msg["code"]] += 1
            fa = self.fail_at.get(rid)
            if kind == "error" and msg["code"] != "step_failed":
                self._viol(f"{rid} ended with {msg['code']}: {msg.get('message')}")
            elif kind == "error" and fa is None:
                self._viol(f"{rid} failed without fail_at: {msg}")
            elif kind == "done" and fa is not None:
                self._viol(f"{rid} done despite fail_at={fa}")
            elif kind == "cancelled" and rid not in self.cancelled_by_us:
                self._viol(f"{rid} cancelled ({msg.get('reason')}) without our cancel")
            return True
        return False

    def _raced_cancel(self, msg: dict[str, Any]) -> bool:
        """``not_found`` for a cancel of our own request that raced its end: allowed."""
        is_not_found = msg.get("type") == "error" and msg.get("code") == "not_found"
        return is_not_found and msg.get("id") in self.maybe_not_found

    def _check_error(self, msg: dict[str, Any]) -> None:
        if msg.get("code") == "internal":
            self._viol(f"internal error: {msg}")
        if len(json.dumps(msg)) > 4096:
            self._viol(f"error reply of {len(json.dumps(msg))} bytes")

    async def _next(self, ws: Any, timeout: float = 30.0) -> dict[str, Any] | None:
        data = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(data, bytes):
            return None  # a preview
        return json.loads(data)

    async def await_reply(self, ws: Any, what: Any) -> dict[str, Any] | None:
        deadline = time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._viol(f"no reply within 30 s to {what()}")
                return None
            msg = await self._next(ws, left)
            if msg is None or self._stream_msg(msg):
                continue
            if msg.get("type") == "error":
                self._check_error(msg)
                if msg.get("code") == "not_found" and msg.get("id") in self.maybe_not_found:
                    self.maybe_not_found.discard(msg["id"])
                    continue
                return msg
            if msg.get("type") == "accepted":
                return msg
            self._viol(f"unexpected message awaiting a reply to {what()}: {msg}")

    async def run(self, url: str, count: int) -> None:
        from websockets.asyncio.client import connect

        tally = self.tally
        names = tally.categories
        timeline = None if tally.timeline is None else tally.timeline.setdefault(self.n, [])
        async with connect(url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
            t_next = time.monotonic()
            for _ in range(count):
                if self.interval:
                    t_next += self.interval
                    if (wait := t_next - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                cat = self.rng.choice(names)
                t_build = time.perf_counter()
                payload, expect = CATEGORIES[cat](self.rng, self)
                label = f"{cat}:{_size_class(len(payload))}"
                tally.build_s[label] += time.perf_counter() - t_build
                tally.sent[cat] += 1
                t_send = time.monotonic()
                if tally.t_first is None:
                    tally.t_first = t_send
                await ws.send(payload)

                def what(cat: str = cat, payload: Any = payload) -> str:
                    return f"{cat} message {payload[:80]!r}"

                reply = await self.await_reply(ws, what)
                t_reply = time.monotonic()
                tally.t_last = max(tally.t_last, t_reply)
                tally.latency[label].add(t_reply - t_send)
                tally.per_10s[int(t_reply // 10)] += 1
                if timeline is not None:
                    timeline.append((label, t_send, t_reply))
                if reply is None:
                    continue
                tally.replies[reply.get("code", reply["type"])] += 1
                if reply["type"] == "accepted":
                    rid = reply["id"]
                    if cat not in ("valid", "duplicate_id") and expect != "may_accept":
                        self._viol(f"{what()} was accepted: {reply}")
                    self.running.add(rid)
                    self.t_accepted[rid] = t_reply
                    self.accepted[rid] += 1
                    self.last_id = rid
                    self.fail_at.setdefault(rid, None)
                    if self.rng.random() < 0.2:
                        # Cancel our own request: no reply, or not_found if it raced its end.
                        self.cancelled_by_us.add(rid)
                        self.maybe_not_found.add(rid)
                        await ws.send(json.dumps({"type": "cancel", "id": rid}))
                        tally.sent["cancel_own"] += 1
                elif cat == "valid" and reply.get("code") not in ("busy", "too_many_requests"):
                    self._viol(f"valid generate rejected: {reply}")
            # Drain: every accepted request ends exactly once, then silence.
            deadline = time.monotonic() + 60
            while self.running and time.monotonic() < deadline:
                msg = await self._next(ws, max(0.1, deadline - time.monotonic()))
                if msg is None or self._stream_msg(msg):
                    continue
                if self._raced_cancel(msg):
                    self.maybe_not_found.discard(msg["id"])
                    continue
                self._viol(f"extra message while draining: {msg}")
            if self.running:
                self._viol(f"requests never ended: {sorted(self.running)[:5]}")
            try:
                while True:
                    msg = await self._next(ws, 0.3)
                    if msg is None:
                        continue
                    if self._raced_cancel(msg):
                        continue
                    self._viol(f"extra message after the end: {msg}")
            except TimeoutError:
                pass
            for rid, n in self.accepted.items():
                if self.ended[rid] != n:
                    self._viol(f"{rid} accepted {n} times, ended {self.ended[rid]} times")


async def _fuzz_connections(url: str, seed: int, conns: Sequence[Sequence[Any]], tally: Tally,
                            interval: float = 0.0, *, http_categories: Sequence[str] = (),
                            stall_s: float = 2.0) -> None:
    """Run connections ``(index, messages, door)`` of a run seeded ``seed`` (door: ``ws``, ``http``).

    Each connection has its own rng: however they are split over processes, the messages are the same.
    An HTTP connection ``i`` calls from 127.0.0.(2 + i): a client (principal) of its own, as each
    websocket is.
    """
    from websockets.exceptions import ConnectionClosed

    from .fuzz_http import HttpFuzzConn

    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])

    async def guarded(i: int, n: int, door: str = "ws") -> None:
        try:
            if door == "http":
                h = HttpFuzzConn(tally, i, random.Random(f"{seed}-http-{i}"), port=port,
                                 source=f"127.0.0.{2 + i % 250}", interval=interval,
                                 categories=list(http_categories) or None, stall_s=stall_s)
                await h.run(n)
            else:
                await Conn(tally, i, random.Random(f"{seed}-{i}"), interval).run(url, n)
        except ConnectionClosed as exc:
            tally.violations.append(f"conn {i}: the server closed it: {exc!r}")
        except TimeoutError:
            tally.violations.append(f"{door} conn {i}: a read timed out")
        except OSError as exc:
            tally.violations.append(f"{door} conn {i}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(guarded(*c) for c in conns))


def _import_before_ready() -> None:
    """What a worker's connections and calls import on their first use: imported before "ready",
    not on the clock.

    Imported mid-run, ``omni_stream`` (fuzz_http.framing_over reads
    ``omni_stream.server.http11``, and the package imports torch) held a
    worker's loop 5 s beside two busy processes: past the server's keep-alive
    timeout (uvicorn's 5 s), so both its HTTP connections were closed under
    their next requests (issue #34).
    """
    import websockets.asyncio.client  # noqa: F401

    import omni_stream.server.http11  # noqa: F401

    from . import fuzz_http  # noqa: F401


async def _worker_main() -> None:
    """A fuzzing process (``python -m benchmarks.fuzz --worker``): config, ready, go, result; JSON lines."""
    _import_before_ready()

    def say(**msg: Any) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    config = json.loads(await asyncio.to_thread(sys.stdin.readline))
    tally = Tally(config["max_key_bytes"], config["timeline"], config["categories"])
    say(event="ready")
    go = json.loads(await asyncio.to_thread(sys.stdin.readline))
    assert go["cmd"] == "go", go
    await _fuzz_connections(config["url"], config["seed"], [tuple(c) for c in config["conns"]], tally,
                            config["interval"], http_categories=config.get("http_categories", ()),
                            stall_s=config.get("stall_s", 2.0))
    say(event="result", **tally.to_json())


def _merge_latency(results: Sequence[dict[str, Any]]) -> dict[str, Hist]:
    out: dict[str, Hist] = collections.defaultdict(Hist)
    for r in results:
        for label, h in r["latency"].items():
            out[label].merge_json(h)
    return dict(out)


#: Buckets of how many fuzz requests ran as an honest step gap began (the last: more than the one before).
_RUNNING = (0, 2, 5, 10, 20, 40, 10**9)


def attribute(gaps: Sequence[tuple[float, float]], timelines: Sequence[Sequence[Sequence[Any]]],
              threshold: float, requests: Sequence[Sequence[float]] = ()) -> dict[str, Any]:
    """Which messages were in flight at the server during the honest client's slow step gaps.

    ``gaps``: (start, end) of each honest step gap under fuzz; ``timelines``:
    per connection, its messages ``[label, sent, replied]`` in order (one at
    a time, so sorted by both). A gap counts as slow above ``threshold``
    seconds. Per label: in how many slow gaps (and in what share of all
    gaps) a message of it was in flight, and in how many it was the one in
    flight longest during the gap (``dominant``). ``requests``: ``[accepted,
    ended]`` of the fuzz's own requests: gaps by how many of them were
    running when the gap began (``by_running``: gaps, slow ones, p50 / p99 ms).
    """
    import bisect

    ends = [[m[2] for m in tl] for tl in timelines]
    in_all: collections.Counter[str] = collections.Counter()
    in_slow: collections.Counter[str] = collections.Counter()
    dominant: collections.Counter[str] = collections.Counter()
    worst: list[dict[str, Any]] = []
    n_slow = 0
    for a, b in gaps:
        slow = b - a > threshold
        n_slow += slow
        labels: set[str] = set()
        best: tuple[float, str, float] = (0.0, "nothing in flight", 0.0)
        for tl, te in zip(timelines, ends, strict=True):
            j = bisect.bisect_right(te, a)  # first message replied after the gap began
            while j < len(tl) and tl[j][1] < b:
                label, ts, tr = tl[j]
                labels.add(label)
                best = max(best, (min(b, tr) - max(a, ts), label, tr - ts))
                j += 1
        in_all.update(labels)
        if slow:
            in_slow.update(labels)
            dominant[best[1]] += 1
            worst.append({"gap_ms": round((b - a) * 1e3, 1), "dominant": best[1],
                          "its_reply_ms": round(best[2] * 1e3, 1), "in_flight": sorted(labels)})
    worst.sort(key=lambda w: -w["gap_ms"])
    n = len(gaps)
    rows = {
        label: {"slow_gaps": in_slow[label], "dominant": dominant[label],
                "share_slow": in_slow[label] / n_slow if n_slow else 0.0,
                "share_all": in_all[label] / n if n else 0.0}
        for label in set(in_all) | set(dominant)
    }
    starts = sorted(a for a, _ in requests)
    stops = sorted(b for _, b in requests)
    buckets: dict[int, list[float]] = collections.defaultdict(list)
    for a, b in gaps:
        running = bisect.bisect_right(starts, a) - bisect.bisect_right(stops, a)  # when the gap began
        buckets[next(x for x in _RUNNING if x >= running)].append(b - a)
    by_running = {
        f"<={k}" if k < _RUNNING[-1] else f">{_RUNNING[-2]}": {
            "gaps": len(v), "slow": sum(g > threshold for g in v),
            "p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3,
        }
        for k, v in sorted(buckets.items())
    }
    return {"threshold_ms": threshold * 1e3, "gaps": n, "slow_gaps": n_slow, "by_running": by_running,
            "by_label": dict(sorted(rows.items(), key=lambda kv: (-kv[1]["dominant"], -kv[1]["slow_gaps"]))),
            "worst": worst[:10]}


async def _run(messages: int, seed: int, connections: int, max_key_bytes: int, honest_requests: int,
               workers: int, timeline: bool, verbose: bool, categories: Sequence[str],
               server_profile: str | None, rate: float,
               server_limits: dict[str, Any] | None = None, doors: str = "both",
               http_connections: int | None = None) -> dict[str, Any]:
    from .fuzz_http import HTTP_CATEGORIES, STALL_SLACK_S
    from .stress_common import ChildError, HonestProcess, JsonChild, ServerProcess, health

    violations: list[str] = []
    t0 = time.perf_counter()
    ws_categories = [c for c in categories if c in CATEGORIES]
    http_categories = [c for c in categories if c in HTTP_CATEGORIES]
    if categories and not ws_categories:
        doors = "http" if doors == "both" else doors
    if categories and not http_categories:
        doors = "ws" if doors == "both" else doors
    # Every connection: (index, its share of the messages, its door); --messages is the total.
    specs = [(i, "ws") for i in range(connections if doors in ("ws", "both") else 0)]
    specs += [(j, "http") for j in range(
        (connections if http_connections is None else http_connections) if doors in ("http", "both") else 0)]
    total = max(1, len(specs))
    conns = [(i, messages // total + (1 if k < messages % total else 0), door)
             for k, (i, door) in enumerate(specs)]
    workers = max(1, min(workers, total))
    # A stalled HTTP body (http_slow) waits body_timeout_s for its 408: 2 s here, not 30.
    limits = {"shutdown_timeout_s": 1.0, "close_timeout_s": 1.0,
              **({"body_timeout_s": 2.0} if doors != "ws" else {}), **(server_limits or {})}
    server = await ServerProcess.start(limits, verbose=verbose, profile=server_profile)
    honest: HonestProcess | None = None
    kids: list[JsonChild] = []
    samples: list[tuple[int, int]] = []
    exit_status: int | None = None
    try:

        async def start_worker(w: int) -> JsonChild:
            kid = await JsonChild.start("benchmarks.fuzz", "--worker", what=f"fuzz worker {w}")
            kids.append(kid)
            mine = [c for k, c in enumerate(conns) if k % workers == w]
            await kid.send(url=server.url, seed=seed, conns=mine, max_key_bytes=max_key_bytes,
                           timeline=timeline, categories=ws_categories, http_categories=http_categories,
                           stall_s=float(limits.get("body_timeout_s", 30.0)) + STALL_SLACK_S,
                           interval=total / rate if rate > 0 else 0.0)
            await kid.expect("ready", timeout=60)
            return kid

        async def start_honest() -> HonestProcess:
            return await HonestProcess.start(server.url, steps=20, params={"shape": [3, 16, 16], "work": 1})

        # Every process started and idle before the quiet baseline: it measures the server alone.
        honest, *_ = await asyncio.gather(start_honest(), *(start_worker(w) for w in range(workers)))
        await honest.quiet(honest_requests)
        await honest.load("fuzz")
        before, t_go = server.stats(), time.monotonic()
        for kid in kids:
            await kid.send(cmd="go")
        sampler = asyncio.create_task(_sample_load(server.http_url, samples))
        results: list[dict[str, Any]] = []
        for kid in kids:
            try:
                results.append(await kid.expect("result", timeout=None))
            except ChildError as exc:
                violations.append(str(exc))
        after, t_done = server.stats(), time.monotonic()
        sampler.cancel()
        try:
            h_res = await honest.stop()
        except ChildError as exc:
            violations.append(f"honest client: {exc}")
            h_res = {"gaps": {}, "stamps": {}, "busy": 0, "errors": []}
        for kid in kids:
            if (code := await kid.close(30)) != 0:
                violations.append(f"{kid.what} exited with status {code}")
        for r in results:
            violations.extend(r["violations"])
        if h_res["errors"]:
            violations.append(f"honest client errors: {h_res['errors'][:3]}")
        # Settled and healthy.
        deadline = time.monotonic() + 10
        while True:
            status, h = await health(server.http_url)
            settled = h.get("server", {}).get("requests") == 0 and h.get("active") == 0
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if status != 200 or not h.get("ok"):
            violations.append(f"/health {status}: {h.get('status')} {h.get('reason')}")
        if h.get("server", {}).get("requests") != 0 or h.get("buffers_in_use") != 0:
            violations.append(
                f"not settled: server {h.get('server')}, buffers_in_use {h.get('buffers_in_use')}"
            )
        end = server.stats()
    finally:
        exit_status = await server.stop()
        for kid in kids:
            await kid.close(5, terminate=True)
        if honest is not None and honest.child.proc.returncode is None:
            await honest.kill()
    if exit_status != 0:
        violations.append(f"the server process exited with status {exit_status} after SIGTERM")
    if server.log_errors:
        tracebacks = sum(1 for line in server.log_errors if line.startswith("Traceback"))
        violations.append(f"the server logged {len(server.log_errors) - tracebacks} ERROR lines and "
                          f"{tracebacks} tracebacks, the first: {server.log_errors[0]}")
    wall = time.perf_counter() - t0

    def merged(key: str) -> dict[str, int]:
        c: collections.Counter[str] = collections.Counter()
        for r in results:
            c.update(r[key])
        return dict(sorted(c.items()))

    firsts = [r["t_first"] for r in results if r["t_first"] is not None]
    t_first = min(firsts) if firsts else 0.0
    t_last = max((r["t_last"] for r in results), default=0.0)
    fuzz_s = max(t_last - t_first, 1e-9)
    q = h_res["gaps"].get("quiet", [])
    # Under fuzz: the step gaps wholly inside the fuzz (first message sent to last reply).
    loaded = zip(h_res["gaps"].get("fuzz", []), h_res["stamps"].get("fuzz", []), strict=True)
    spans = [(t - g, t) for g, t in loaded if t - g >= t_first and t <= t_last]
    f = [b - a for a, b in spans]
    latency = _merge_latency(results)
    per_10s: collections.Counter[int] = collections.Counter()
    for r in results:
        per_10s.update({int(k): v for k, v in r["per_10s"].items()})
    # Messages/s in each whole 10 s of the fuzz (the first and last, partial, left out).
    rates = [per_10s[k] / 10 for k in range(min(per_10s, default=0) + 1, max(per_10s, default=0))]
    out: dict[str, Any] = {
        "messages": messages, "connections": connections, "workers": workers, "seed": seed, "doors": doors,
        "ws_connections": sum(1 for c in conns if c[2] == "ws"),
        "http_connections": sum(1 for c in conns if c[2] == "http"),
        "categories": list(categories), "paced": rate,
        "sent": merged("sent"), "replies": merged("replies"), "terminals": merged("terminals"),
        "honest": {"quiet_steps": len(q), "quiet_p50_ms": percentile(q, 50) * 1e3,
                   "quiet_p99_ms": percentile(q, 99) * 1e3, "fuzz_steps": len(f),
                   "fuzz_p50_ms": percentile(f, 50) * 1e3, "fuzz_p99_ms": percentile(f, 99) * 1e3,
                   "fuzz_max_ms": max(f, default=math.nan) * 1e3, "busy": h_res["busy"]},
        "fuzz_s": round(fuzz_s, 2), "rate": messages / fuzz_s, "rate_by_10s": rates,
        "server": {"peak_rss_mib": end.get("peak_rss_mib"), "rss_mib": end.get("rss_mib"),
                   "cpu_s": end.get("cpu_s"), "exit": exit_status,
                   "fuzz_cpu_s": after.get("cpu_s", math.nan) - before.get("cpu_s", math.nan),
                   "fuzz_wall_s": t_done - t_go},
        "worker_cpu_s": sum(r["cpu_s"] for r in results),
        # The server's /health load every 0.5 s during the fuzz: requests running and queued.
        "load": {"samples": len(samples),
                 "active_mean": sum(a for a, _ in samples) / len(samples) if samples else math.nan,
                 "active_max": max((a for a, _ in samples), default=0),
                 "queued_mean": sum(n for _, n in samples) / len(samples) if samples else math.nan,
                 "queued_max": max((n for _, n in samples), default=0)},
        "latency": {k: {"n": v.n, "sum_s": v.sum, "p50_ms": v.percentile(50) * 1e3,
                        "p99_ms": v.percentile(99) * 1e3, "max_ms": v.max * 1e3,
                        "build_s": sum(r["build_s"].get(k, 0.0) for r in results)}
                    for k, v in sorted(latency.items(), key=lambda kv: -kv[1].sum)},
        "health": h.get("status"), "wall_s": round(wall, 2), "violations": violations,
    }
    if timeline:
        tls = [tl for r in results for tl in (r["timeline"] or {}).values()]
        reqs = [tuple(x) for r in results for x in (r["requests"] or [])]
        out["attribution"] = attribute(spans, tls, 3 * percentile(q, 99), reqs)
    return out


async def _sample_load(http_url: str, out: list[tuple[int, int]]) -> None:
    from .stress_common import health

    while True:
        await asyncio.sleep(0.5)
        try:
            _, h = await health(http_url)
        except (OSError, ValueError):
            continue
        load = h.get("load") or {}
        out.append((int(load.get("active", 0)), int(load.get("queued", 0))))


def run_fuzz(*, messages: int = 500, seed: int = 0, connections: int = 4, max_key_bytes: int = 256 * 1024,
             honest_requests: int = 5, workers: int = 1, attribute: bool = False,
             categories: Sequence[str] = (), verbose: bool = False,
             server_profile: str | None = None, rate: float = 0.0,
             server_limits: dict[str, Any] | None = None, doors: str = "both",
             http_connections: int | None = None) -> dict[str, Any]:
    """One fuzz run (a server process, an honest client process, ``workers`` fuzzing processes): its summary.

    ``attribute``: also line the honest client's slow step gaps up with the
    messages in flight then (``summary["attribution"]``; every message's
    times travel back, so keep it for runs of up to a few 100,000).
    ``categories``: draw only from these (names in ``CATEGORIES`` and
    ``fuzz_http.HTTP_CATEGORIES``; all by default; naming one door's only leaves the other out).
    ``server_profile``: a path for cProfile stats of the server's event-loop thread.
    ``rate``: messages/s over all connections, paced (0: each connection sends its next
    message as soon as the reply to the last one came, what the server's speed allows).
    ``server_limits``: Server options beside the defaults (e.g. ``{"max_messages_per_s": 1e6}``).
    ``doors``: ``ws``, ``http`` or ``both``: ``connections`` websockets and ``http_connections``
    (default: as many) HTTP clients, ``messages`` split evenly over all of them.
    """
    from .fuzz_http import HTTP_CATEGORIES

    unknown = set(categories) - set(CATEGORIES) - set(HTTP_CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}, "
                         f"{', '.join(HTTP_CATEGORIES)}")
    if doors not in ("ws", "http", "both"):
        raise ValueError(f"doors must be ws, http or both, got {doors!r}")
    return asyncio.run(_run(messages, seed, connections, max_key_bytes, honest_requests, workers, attribute,
                            verbose, tuple(categories), server_profile, rate, server_limits, doors,
                            http_connections))


def format_summary(s: dict[str, Any], *, latency_rows: int = 12) -> str:
    h, srv = s["honest"], s["server"]
    lines = [
        (f"fuzz: {s['messages']} messages over {s['ws_connections']} websockets and {s['http_connections']} "
         f"HTTP clients in {s['workers']} "
         f"worker process{'es' if s['workers'] != 1 else ''} (seed {s['seed']}) in {s['wall_s']} s; "
         f"{s['fuzz_s']} s of fuzz, {s['rate']:.0f} messages/s"
         + (f" (paced at {s['paced']:g})" if s.get("paced") else "")
         + (f"; only {','.join(s['categories'])}" if s.get("categories") else "")),
        *([f"  messages/s by 10 s: first {r[0]:.0f}, last {r[-1]:.0f}, min {min(r):.0f}, max {max(r):.0f} "
            f"({len(r)} periods)"] if (r := s["rate_by_10s"]) else []),
        f"  sent: {', '.join(f'{k}={v}' for k, v in s['sent'].items())}",
        f"  replies: {', '.join(f'{k}={v}' for k, v in s['replies'].items())}",
        f"  request endings: {', '.join(f'{k}={v}' for k, v in s['terminals'].items()) or 'none'}",
        (f"  honest client step latency (a process of its own): quiet p50 {h['quiet_p50_ms']:.1f} ms "
         f"p99 {h['quiet_p99_ms']:.1f} ms ({h['quiet_steps']} steps); "
         f"under fuzz p50 {h['fuzz_p50_ms']:.1f} ms p99 {h['fuzz_p99_ms']:.1f} ms "
         f"max {h['fuzz_max_ms']:.1f} ms ({h['fuzz_steps']} steps, {h['busy']} busy)"),
        (f"  server process: peak RSS {srv['peak_rss_mib']:.1f} MiB, CPU {srv['cpu_s']:.1f} s "
         f"({srv['fuzz_cpu_s']:.1f} s during the fuzz: "
         f"{srv['fuzz_cpu_s'] / srv['fuzz_wall_s']:.0%} of a core), "
         f"exit status {srv['exit']}; fuzz workers' CPU {s['worker_cpu_s']:.1f} s"),
        (f"  server load during the fuzz (/health every 0.5 s): active mean {ld['active_mean']:.1f} "
         f"max {ld['active_max']}, queued mean {ld['queued_mean']:.1f} max {ld['queued_max']}")
        if (ld := s["load"])["samples"] else "  server load during the fuzz: not sampled (too short)",
    ]
    if latency_rows:
        lines.append("  reply latency by category:payload size (top by total time): "
                     "n, total s, p50 / p99 / max ms, build s")
        for k, v in list(s["latency"].items())[:latency_rows]:
            lines.append(f"    {k:24} {v['n']:8d} {v['sum_s']:8.1f} {v['p50_ms']:8.1f} {v['p99_ms']:8.1f} "
                         f"{v['max_ms']:8.1f} {v['build_s']:7.1f}")
    a = s.get("attribution")
    if a:
        lines.append(f"  honest gaps over {a['threshold_ms']:.1f} ms (3x quiet p99): {a['slow_gaps']} "
                     f"of {a['gaps']}; in flight at the server then (label: longest in flight in, "
                     "in flight in, share of slow gaps / of all gaps):")
        for k, v in list(a["by_label"].items())[:12]:
            lines.append(f"    {k:24} {v['dominant']:6d} {v['slow_gaps']:6d} "
                         f"{v['share_slow']:7.0%} {v['share_all']:7.0%}")
        lines.append("  honest gaps by fuzz requests running as each began (n: gaps, slow, p50 / p99 ms):")
        for k, v in a["by_running"].items():
            lines.append(f"    {k:8} {v['gaps']:6d} {v['slow']:6d} {v['p50_ms']:8.1f} {v['p99_ms']:8.1f}")
        for w in a["worst"][:5]:
            lines.append(f"    worst gap {w['gap_ms']} ms: {w['dominant']} "
                         f"(replied in {w['its_reply_ms']} ms)")
    lines.append(f"  health at the end: {s['health']}")
    v = s["violations"]
    lines.append(f"  violations: {len(v)}" if v else "  violations: none")
    lines += [f"    - {x[:400]}" for x in v[:20]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=500, help="fuzz messages in all (default 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connections", type=int, default=4, help="fuzzing websocket connections (default 4)")
    ap.add_argument("--doors", choices=("ws", "http", "both"), default="both",
                    help="which doors to fuzz: the websocket, the HTTP API, or both (default both)")
    ap.add_argument("--http-connections", type=int, default=None,
                    help="fuzzing HTTP clients, each from a loopback address of its own "
                         "(default: --connections)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="pace the fuzz at this many messages/s in all (default 0: as fast as replies come)")
    ap.add_argument("--workers", type=int, default=1,
                    help="fuzzing processes the connections are split over (default 1)")
    ap.add_argument("--max-key-bytes", type=int, default=256 * 1024,
                    help="longest huge key (default 256 KiB)")
    ap.add_argument("--honest-requests", type=int, default=5, help="quiet-baseline requests (default 5)")
    ap.add_argument("--attribute", action="store_true",
                    help="line the honest client's slow step gaps up with the fuzz messages in flight then")
    ap.add_argument("--categories", default="",
                    help=f"only these message categories, comma-separated (default: all of "
                         f"{','.join(CATEGORIES)} and the HTTP ones, fuzz_http.HTTP_CATEGORIES)")
    ap.add_argument("--server-limits", default="{}", metavar="JSON",
                    help='Server options beside the defaults, e.g. \'{"max_messages_per_s": 1e6}\'')
    ap.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    ap.add_argument("--server-profile", metavar="PATH",
                    help="cProfile the server's event-loop thread, stats to PATH (python -m pstats PATH)")
    ap.add_argument("--verbose", action="store_true", help="show the server's log")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a fuzzing process (JSON lines)
    args = ap.parse_args(argv)
    if args.worker:
        asyncio.run(_worker_main())
        return 0
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    s = run_fuzz(messages=args.messages, seed=args.seed, connections=args.connections, workers=args.workers,
                 max_key_bytes=args.max_key_bytes, honest_requests=args.honest_requests,
                 attribute=args.attribute, verbose=args.verbose,
                 categories=[c for c in args.categories.split(",") if c], server_profile=args.server_profile,
                 rate=args.rate, server_limits=json.loads(args.server_limits), doors=args.doors,
                 http_connections=args.http_connections)
    print(format_summary(s), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 1 if s["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
