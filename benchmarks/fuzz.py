"""Websocket fuzzer: hostile and broken messages against a server this process starts.

``python -m benchmarks.fuzz [--messages N] [--seed S] [--connections C]``

Starts ``omni_stream.server.Server`` (Synthetic model, CPU) on 127.0.0.1
port 0 and sends ``N`` messages over ``C`` connections, drawn from these
categories: malformed JSON, wrong types, unknown keys and types, huge keys
(bounded well under ``max_message_bytes``), deep nesting, huge integers,
bad ids, binary frames, valid generates with bad params, cancel / attach of
unknown ids, duplicate ids, valid small generates (some with ``fail_at``,
some cancelled by their sender right after).

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
ever, no connection closed by the server, and ``/health`` ok with nothing
left running.

Alongside, an honest client runs one 20-step request at a time and the
time between its ``progress`` messages is reported, quiet (before the
fuzz) and during it. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from .stress_common import HonestClient, health, percentile

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
        {"type": "generate", "params": {}, "detach": "yes"}, {"type": "generate", "params": {}, "preview": "jpeg"},
        {"type": "generate", "params": {}, "priority": 1.5}, {"type": "generate", "params": {}, "priority": True},
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
        {"type": "GENERATE", "params": {}}, {"type": "generate", "params": {}, **{f"k{i}": i for i in range(50)}},
    ]
    return json.dumps(rng.choice(choices)), "reply"


def huge_keys(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    n = rng.randint(1000, ctx.max_key_bytes)
    choices: list[Any] = [
        {"type": "generate", "params": {}, "k" * n: 1},
        {"type": "generate", "params": {"p" * n: 1}},
        {"type": "generate", "params": {}, "preview": {"x" * n: 1}},
        {"type": "t" * n},
        {"type": "generate", "params": {}, **{f"key{i}": i for i in range(min(n // 8, 20000))}},
        {"type": "generate", "id": "i" * n, "params": {}},
    ]
    return json.dumps(rng.choice(choices)), "reply"


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
    rid = rng.choice(["", "a" * 129, "spaces here", "ü-id", "../x", "id\n", "a/b", "<script>", "\x00", "x" * 5000])
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
    msg = {"type": "generate", "id": rid, "params": {**SMALL, "steps": max(fa or 1, rng.randint(1, 4)), "fail_at": fa}}
    ctx.fail_at[rid] = fa  # accepted only once the original ended: then it is this one's
    return json.dumps(msg), "reply"


def valid(rng: random.Random, ctx: Any) -> tuple[Any, Any]:
    rid = ctx.new_id()
    params: dict[str, Any] = {**SMALL, "steps": rng.randint(1, 6), "seed": rng.randrange(1000)}
    if rng.random() < 0.15:
        params["fail_at"] = rng.randint(1, params["steps"])
    msg: dict[str, Any] = {"type": "generate", "id": rid, "params": params}
    if rng.random() < 0.5:
        msg["preview"] = {"format": rng.choice(("jpeg", "raw", "png")), "every": rng.randint(1, 3), "max_size": 16}
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


class Conn:
    """One fuzzing connection: sends, matches replies in order, tracks accepted requests."""

    def __init__(self, fuzz: Fuzz, n: int, rng: random.Random) -> None:
        self.fuzz = fuzz
        self.n = n
        self.rng = rng
        self.max_key_bytes = fuzz.max_key_bytes
        self.count = 0
        self.last_id: str | None = None
        self.fail_at: dict[str, int | None] = {}
        self.running: set[str] = set()
        self.ended: collections.Counter[str] = collections.Counter()
        self.accepted: collections.Counter[str] = collections.Counter()
        self.cancelled_by_us: set[str] = set()
        self.maybe_not_found: set[str] = set()

    def new_id(self) -> str:
        self.count += 1
        return f"fz{self.n}-{self.count}-{self.rng.randrange(10**6)}"

    def _viol(self, what: str) -> None:
        self.fuzz.violations.append(f"conn {self.n}: {what}")

    def _stream_msg(self, msg: dict[str, Any]) -> bool:
        """Handle a message of an accepted request; True when it was one."""
        kind, rid = msg.get("type"), msg.get("id")
        if kind in ("progress",):
            return True
        if kind in ("done", "cancelled") or (kind == "error" and msg.get("code") in ENDING and rid in self.running):
            if rid not in self.running:
                self._viol(f"terminal {kind} for {rid!r}, which is not running here: {msg}")
                return True
            self.running.discard(rid)
            self.ended[rid] += 1
            self.fuzz.terminals[kind if kind != "error" else msg["code"]] += 1
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

    async def await_reply(self, ws: Any, what: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._viol(f"no reply within 30 s to {what}")
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
            self._viol(f"unexpected message awaiting a reply to {what}: {msg}")

    async def run(self, url: str, count: int) -> None:
        from websockets.asyncio.client import connect

        names = list(CATEGORIES)
        async with connect(url, max_size=1 << 26, open_timeout=30, close_timeout=2) as ws:
            for _ in range(count):
                cat = self.rng.choice(names)
                payload, expect = CATEGORIES[cat](self.rng, self)
                self.fuzz.sent[cat] += 1
                await ws.send(payload)
                what = f"{cat} message {payload[:80]!r}"
                reply = await self.await_reply(ws, what)
                if reply is None:
                    continue
                self.fuzz.replies[reply.get("code", reply["type"])] += 1
                if reply["type"] == "accepted":
                    rid = reply["id"]
                    if cat not in ("valid", "duplicate_id") and expect != "may_accept":
                        self._viol(f"{what} was accepted: {reply}")
                    self.running.add(rid)
                    self.accepted[rid] += 1
                    self.last_id = rid
                    self.fail_at.setdefault(rid, None)
                    if self.rng.random() < 0.2:
                        # Cancel our own request: no reply, or not_found if it raced its end.
                        self.cancelled_by_us.add(rid)
                        self.maybe_not_found.add(rid)
                        await ws.send(json.dumps({"type": "cancel", "id": rid}))
                        self.fuzz.sent["cancel_own"] += 1
                elif cat == "valid" and reply.get("code") not in ("busy", "too_many_requests"):
                    self._viol(f"valid generate rejected: {reply}")
            # Drain: every accepted request ends exactly once, then silence.
            deadline = time.monotonic() + 60
            while self.running and time.monotonic() < deadline:
                msg = await self._next(ws, max(0.1, deadline - time.monotonic()))
                if msg is None or self._stream_msg(msg):
                    continue
                if msg.get("type") == "error" and msg.get("code") == "not_found" and msg.get("id") in self.maybe_not_found:
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
                    if msg.get("type") == "error" and msg.get("code") == "not_found" and msg.get("id") in self.maybe_not_found:
                        continue
                    self._viol(f"extra message after the end: {msg}")
            except TimeoutError:
                pass
            for rid, n in self.accepted.items():
                if self.ended[rid] != n:
                    self._viol(f"{rid} accepted {n} times, ended {self.ended[rid]} times")


class Fuzz:
    def __init__(self, seed: int, max_key_bytes: int) -> None:
        self.seed = seed
        self.max_key_bytes = max_key_bytes
        self.violations: list[str] = []
        self.sent: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()
        self.terminals: collections.Counter[str] = collections.Counter()

    async def run(self, messages: int, connections: int, honest_requests: int) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        from omni_stream.models import Synthetic
        from omni_stream.server import Server

        t0 = time.perf_counter()
        async with Server(Synthetic(), host="127.0.0.1", port=0, device="cpu",
                          shutdown_timeout_s=1.0, close_timeout_s=1.0) as server:
            honest = HonestClient(server.url, steps=20, params={"shape": [3, 16, 16], "work": 1})
            await honest.run(requests=honest_requests)  # quiet baseline
            honest.phase = "fuzz"
            htask = asyncio.create_task(honest.run())
            conns = [Conn(self, i, random.Random(f"{self.seed}-{i}")) for i in range(connections)]
            share = [messages // connections + (1 if i < messages % connections else 0) for i in range(connections)]

            async def guarded(c: Conn, n: int) -> None:
                try:
                    await c.run(server.url, n)
                except ConnectionClosed as exc:
                    self.violations.append(f"conn {c.n}: the server closed it: {exc!r}")
                except TimeoutError:
                    self.violations.append(f"conn {c.n}: a read timed out")

            await asyncio.gather(*(guarded(c, n) for c, n in zip(conns, share)))
            honest.stop()
            try:
                await asyncio.wait_for(htask, 60)
            except Exception as exc:  # noqa: BLE001
                self.violations.append(f"honest client: {type(exc).__name__}: {exc}")
            if honest.errors:
                self.violations.append(f"honest client errors: {honest.errors[:3]}")
            # Settled and healthy.
            deadline = time.monotonic() + 10
            while True:
                status, h = await health(server.http_url)
                if h.get("server", {}).get("requests") == 0 and h.get("active") == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            if status != 200 or not h.get("ok"):
                self.violations.append(f"/health {status}: {h.get('status')} {h.get('reason')}")
            if h.get("server", {}).get("requests") != 0 or h.get("buffers_in_use") != 0:
                self.violations.append(f"not settled: server {h.get('server')}, buffers_in_use {h.get('buffers_in_use')}")
        wall = time.perf_counter() - t0
        q, f = honest.gaps.get("quiet", []), honest.gaps.get("fuzz", [])
        return {
            "messages": messages, "connections": connections, "seed": self.seed,
            "sent": dict(sorted(self.sent.items())), "replies": dict(sorted(self.replies.items())),
            "terminals": dict(sorted(self.terminals.items())),
            "honest": {"quiet_steps": len(q), "quiet_p50_ms": percentile(q, 50) * 1e3, "quiet_p99_ms": percentile(q, 99) * 1e3,
                       "fuzz_steps": len(f), "fuzz_p50_ms": percentile(f, 50) * 1e3, "fuzz_p99_ms": percentile(f, 99) * 1e3,
                       "busy": honest.busy},
            "health": h.get("status"), "wall_s": round(wall, 2), "violations": list(self.violations),
        }


def run_fuzz(*, messages: int = 500, seed: int = 0, connections: int = 4, max_key_bytes: int = 256 * 1024,
             honest_requests: int = 5) -> dict[str, Any]:
    """One fuzz run in a fresh event loop; returns the summary dict."""
    return asyncio.run(Fuzz(seed, max_key_bytes).run(messages, connections, honest_requests))


def format_summary(s: dict[str, Any]) -> str:
    h = s["honest"]
    lines = [
        f"fuzz: {s['messages']} messages over {s['connections']} connections (seed {s['seed']}) in {s['wall_s']} s",
        f"  sent: {', '.join(f'{k}={v}' for k, v in s['sent'].items())}",
        f"  replies: {', '.join(f'{k}={v}' for k, v in s['replies'].items())}",
        f"  request endings: {', '.join(f'{k}={v}' for k, v in s['terminals'].items()) or 'none'}",
        (f"  honest client step latency: quiet p50 {h['quiet_p50_ms']:.1f} ms p99 {h['quiet_p99_ms']:.1f} ms "
        f"({h['quiet_steps']} steps); under fuzz p50 {h['fuzz_p50_ms']:.1f} ms p99 {h['fuzz_p99_ms']:.1f} ms "
        f"({h['fuzz_steps']} steps, {h['busy']} busy)"),
        f"  health at the end: {s['health']}",
    ]
    v = s["violations"]
    lines.append(f"  violations: {len(v)}" if v else "  violations: none")
    lines += [f"    - {x[:400]}" for x in v[:20]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=500, help="fuzz messages in all (default 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connections", type=int, default=4, help="fuzzing connections (default 4)")
    ap.add_argument("--max-key-bytes", type=int, default=256 * 1024, help="longest huge key (default 256 KiB)")
    ap.add_argument("--honest-requests", type=int, default=5, help="quiet-baseline requests (default 5)")
    ap.add_argument("--verbose", action="store_true", help="show the server's log")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_stream").setLevel(logging.ERROR)
    s = run_fuzz(messages=args.messages, seed=args.seed, connections=args.connections,
                 max_key_bytes=args.max_key_bytes, honest_requests=args.honest_requests)
    print(format_summary(s), flush=True)
    return 1 if s["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
