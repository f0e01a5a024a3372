"""Issue #39's attacks on webhooks and on who a client is, against a real ``omni-stream serve``.

``python -m benchmarks.tenant_webhooks [--attack hooks|urls|forwarded|all] [--json PATH]``

- ``hooks`` (attack 3): tenant A floods requests whose webhooks go to a
  receiver that accepts and never answers (its book and its slots); then
  tenant B runs ``--honest`` one-step requests one after another, each with
  a webhook to a receiver that answers at once. Measured: B's webhook delay
  (from the request's end, its payload's ``timestamp``, to the delivery's
  arrival), quiet and beside A; A's requests accepted and refused; B's
  refused (none may be).
- ``urls`` (attack 8): an allow-list ``.../hooks/tenant-a/*``, and URLs
  with dot segments, percent-encoded dots, ``..;``, an encoded slash, an
  upper-case scheme: how many are accepted, and what paths the receiver got.
- ``forwarded`` (attack 5): 40 long POSTs from 127.0.0.1, each with another
  ``X-Forwarded-For``, no ``--trusted-proxy``, default limits (16 requests a
  principal): how many are accepted, under uvicorn and under hypercorn
  (``--loop trio``); and an honest client (from 127.0.0.2, a principal of
  its own) running ``--honest`` 10-step requests one after another, its
  request time quiet and beside the 40.

Every socket goes to 127.0.0.1; the receivers run in this process.
Figures are printed (and written as JSON with ``--json``); nothing is
asserted here: tests/server/test_tenant_webhooks.py and
test_tenant_proxy.py assert the behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from .harness import percentile
from .serve_process import omni_stream_argv
from .stress_common import ROOT

SECRET = "whsec_" + base64.b64encode(b"omni-stream tenant webhook bench!").decode()
TINY = {"steps": 1, "shape": [3, 8, 8], "work": 0}
A_TOKEN, B_TOKEN = {"authorization": "Bearer tok-a"}, {"authorization": "Bearer tok-b"}
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


@contextlib.asynccontextmanager
async def serve(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """``omni-stream serve --port 0 --device cpu ARGS`` (the environment's OMNI_STREAM_* removed
    first: the defaults are the defaults); its URL until the block ends, then SIGTERM."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_")}
    child_env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
    proc = await asyncio.create_subprocess_exec(
        *omni_stream_argv("serve", "--port", "0", "--device", "cpu", *args),
        cwd=ROOT, env=child_env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    stderr = proc.stderr
    log: list[str] = []

    async def listening() -> str:
        while line := (await stderr.readline()).decode(errors="replace"):
            log.append(line)
            if found := _LISTENING.search(line):
                return found.group(1)
        raise RuntimeError(f"omni-stream serve exited: {''.join(log[-20:])}")

    async def drain() -> None:
        while await stderr.readline():
            pass

    reader: asyncio.Future[None] | None = None
    try:
        url = await asyncio.wait_for(listening(), 120)
        reader = asyncio.ensure_future(drain())  # a full pipe would block the server
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        if reader is not None:
            reader.cancel()


@dataclass
class Receiver:
    """A webhook receiver in this process: answers 200 at once, or (``hang``) never."""

    hang: bool = False
    url: str = ""
    #: (arrival wall time, path, payload) of each delivery.
    got: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    opened: int = 0
    #: Tries held open at once, now and at most (a hanging receiver's).
    open_now: int = 0
    max_open: int = 0
    _server: asyncio.AbstractServer | None = None
    _held: list[asyncio.StreamWriter] = field(default_factory=list)

    async def start(self) -> Receiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        for writer in self._held:
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
                body = await reader.readexactly(length)
                if self.hang:
                    self.opened += 1
                    self.open_now += 1
                    self.max_open = max(self.max_open, self.open_now)
                    self._held.append(writer)
                    try:
                        await reader.read()  # until the server gives up on it
                    finally:
                        self.open_now -= 1
                    return
                self.got.append((time.time(), path, json.loads(body)))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()


def _wall(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1e3, 1),
            "p99_ms": round(percentile(xs, 99) * 1e3, 1), "max_ms": round(max(xs) * 1e3, 1)}


async def _b_delays(client: httpx.AsyncClient, fast: Receiver, n: int, tag: str) -> tuple[list[float], int]:
    """B's ``n`` requests one after another, each waiting for its webhook: the delays, and how
    many B had refused."""
    delays, refused = [], 0
    for i in range(n):
        rid = f"b-{tag}-{i}"
        body = {"id": rid, "params": TINY, "webhook": {"url": f"{fast.url}/hooks/{rid}"}}
        reply = await client.post("/v1/generations", json=body, headers=B_TOKEN)
        if reply.status_code != 202:
            refused += 1
            continue
        deadline = time.monotonic() + 300
        while not any(p["data"]["id"] == rid for _, _, p in fast.got) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        for at, _, payload in fast.got:
            if payload["data"]["id"] == rid:
                delays.append(at - _wall(payload["timestamp"]))
    return delays, refused


async def attack_hooks(honest: int, flood: int) -> dict[str, Any]:
    slow, fast = await Receiver(hang=True).start(), await Receiver().start()
    with tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False) as tokens:
        tokens.write("a=tok-a\nb=tok-b\n")
    env = {"OMNI_STREAM_TOKENS_FILE": tokens.name, "OMNI_STREAM_WEBHOOK_SECRET": SECRET,
           "OMNI_STREAM_WEBHOOK_ALLOW": f"{slow.url}/hooks/* {fast.url}/hooks/*"}
    try:
        async with serve("--model", "synthetic", env=env) as url, httpx.AsyncClient(
            base_url=url, timeout=60
        ) as client:
            quiet, quiet_refused = await _b_delays(client, fast, honest, "quiet")
            started = time.monotonic()
            a_answers: dict[int, int] = {}
            for i in range(flood):
                body = {"id": f"a{i}", "params": TINY, "webhook": {"url": f"{slow.url}/hooks/a{i}"}}
                reply = await client.post("/v1/generations", json=body, headers=A_TOKEN)
                a_answers[reply.status_code] = a_answers.get(reply.status_code, 0) + 1
            flood_s = time.monotonic() - started
            await asyncio.sleep(1.0)  # A's deliveries reach its receiver and hang there
            beside, beside_refused = await _b_delays(client, fast, honest, "attack")
            held_open = (slow.opened, slow.max_open)
    finally:
        os.unlink(tokens.name)
        await slow.close()
        await fast.close()
    return {
        "a_flood": {"posts": flood, "seconds": round(flood_s, 1), "answers": a_answers,
                    "a_tries_reaching_its_receiver": held_open[0], "a_tries_open_at_once_max": held_open[1]},
        "b_webhook_delay_quiet": _summary(quiet), "b_refused_quiet": quiet_refused,
        "b_webhook_delay_beside_a": _summary(beside), "b_refused_beside_a": beside_refused,
        "p99_ratio": round(percentile(beside, 99) / percentile(quiet, 99), 2) if quiet and beside else None,
    }


async def attack_urls() -> dict[str, Any]:
    hook = await Receiver().start()
    base = f"{hook.url}/hooks/tenant-a/"
    attacks = [base + "../tenant-b/steal", base + "../../admin/delete", base + "%2e%2e/tenant-b/steal",
               base + ".%2E/.%2e/admin/delete", base + "..;/tenant-b/steal", base + "..%2Ftenant-b/steal",
               base.replace("http://", "HTTP://") + "x", base + "./x", base + "a/../x"]
    env = {"OMNI_STREAM_WEBHOOK_SECRET": SECRET, "OMNI_STREAM_WEBHOOK_ALLOW": base + "*"}
    answers: dict[str, int] = {}
    try:
        async with serve("--model", "synthetic", env=env) as url, httpx.AsyncClient(
            base_url=url, timeout=60
        ) as client:
            for i, target in enumerate(attacks):
                body = {"id": f"u{i}", "params": TINY, "webhook": {"url": target}}
                reply = await client.post("/v1/generations", json=body)
                answers[target.removeprefix(hook.url)] = reply.status_code
            ok = {"id": "ok", "params": TINY, "webhook": {"url": base + "ok"}}
            answers["/hooks/tenant-a/ok"] = (await client.post("/v1/generations", json=ok)).status_code
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "/hooks/tenant-a/ok" not in {p for _, p, _ in hook.got}:
                await asyncio.sleep(0.02)
            await asyncio.sleep(2.0)  # anything accepted that should not have been arrives too
    finally:
        await hook.close()
    accepted = [k for k, v in answers.items() if v == 202 and k != "/hooks/tenant-a/ok"]
    return {"answers": answers, "accepted_attacks": len(accepted),
            "receiver_got": sorted({path for _, path, _ in hook.got})}


async def _honest_times(url: str, n: int) -> list[float]:
    """``n`` 10-step requests with ``?wait=true`` one after another, from 127.0.0.2: their times."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=120, transport=transport) as client:
        for _ in range(n):
            started = time.monotonic()
            reply = await client.post("/v1/generations?wait=true", json={"params": {"steps": 10}})
            if reply.status_code == 200:
                times.append(time.monotonic() - started)
    return times


async def attack_forwarded(honest: int, posts: int, loop: str) -> dict[str, Any]:
    async with serve("--loop", loop) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        await _honest_times(url, 2)  # warm
        quiet = await _honest_times(url, honest)
        answers: dict[int, int] = {}
        for i in range(posts):
            reply = await client.post(
                "/v1/generations", json={"params": {"steps": 10000}},
                headers={"x-forwarded-for": f"198.18.{i // 250}.{i % 250 + 1}"},  # another client each
            )
            answers[reply.status_code] = answers.get(reply.status_code, 0) + 1
        beside = await _honest_times(url, honest)
    return {
        "loop": loop, "spoofed_posts": posts, "answers": answers, "accepted": answers.get(202, 0),
        "honest_request_quiet": _summary(quiet), "honest_request_beside": _summary(beside),
        "p99_ratio": round(percentile(beside, 99) / percentile(quiet, 99), 2) if quiet and beside else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.attack in ("hooks", "all"):
        out["hooks"] = await attack_hooks(args.honest, args.flood)
        print("attack 3 (webhooks):", json.dumps(out["hooks"], indent=1), flush=True)
    if args.attack in ("urls", "all"):
        out["urls"] = await attack_urls()
        print("attack 8 (URL forms):", json.dumps(out["urls"], indent=1), flush=True)
    if args.attack in ("forwarded", "all"):
        for loop in ("asyncio", "trio"):
            out[f"forwarded_{loop}"] = await attack_forwarded(args.honest, args.posts, loop)
            print(f"attack 5 (X-Forwarded-For, {loop}):", json.dumps(out[f"forwarded_{loop}"], indent=1),
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--attack", choices=("hooks", "urls", "forwarded", "all"), default="all")
    parser.add_argument("--honest", type=int, default=20, help="the honest tenant's requests per phase")
    parser.add_argument("--flood", type=int, default=1024, help="attack 3: A's requests with a webhook")
    parser.add_argument("--posts", type=int, default=40, help="attack 5: spoofed POSTs")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    out = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
