"""The queue a client steers (issue #38).

A client's ``priority`` orders its own requests under every policy, batched
or not: a higher-priority request that comes to a full engine takes the
place of one of the same client's lower-priority requests (paused,
``preempted``, resumed later), and never another client's. A stream on a
waiting request opens with ``queued`` and its position.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect

from .conftest import Slow, recv, running, send, wait_for

PARAMS: dict[str, Any] = {"steps": 24, "shape": [3, 8, 8], "work": 0}

# What is tested is the core's order, the same under every loop (the websocket and the
# loops' own paths are tested elsewhere under both): once, under asyncio's.
pytestmark = pytest.mark.one_loop


async def _until_all_end(ws: Any, ids: set[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    ended: set[str] = set()
    while ended != ids:
        m = await recv(ws, timeout=30)
        msgs.append(m)
        if m["type"] in ("done", "error", "cancelled"):
            ended.add(m["id"])
    return msgs


def _first(msgs: list[dict[str, Any]], rid: str, kind: str) -> int:
    """The index of ``rid``'s first ``kind`` message."""
    return next(i for i, m in enumerate(msgs) if m.get("id") == rid and m["type"] == kind)


@pytest.mark.asyncio
@pytest.mark.parametrize("scheduling", ["preemptive", "round-robin", "fcfs"])
async def test_a_higher_priority_request_takes_the_place_of_its_clients_lower_ones(scheduling: str) -> None:
    async with running(Slow(0.01), scheduling=scheduling, max_active=2) as server:
        registry = server.service.registry
        async with connect(server.url) as ws:
            for rid in ("a", "b", "c"):
                await send(ws, type="generate", id=rid, params={**PARAMS, "seed": ord(rid)})
            await wait_for(lambda: all((r := registry.get(x)) and r.latest_step >= 1 for x in "ab"))
            assert registry.get("c").latest_step == 0  # every place held: c waits
            await send(ws, type="generate", id="hi", params={**PARAMS, "seed": 9}, priority=10)
            msgs = await _until_all_end(ws, {"a", "b", "c", "hi"})
    # hi went in at once, before c (same client, lower priority, came first) started or ended.
    assert _first(msgs, "hi", "progress") < _first(msgs, "c", "progress")
    assert _first(msgs, "hi", "done") < _first(msgs, "c", "done")
    paused = [m for m in msgs if m["type"] == "paused"]
    assert len(paused) == 1 and paused[0]["id"] in "ab" and paused[0]["reason"] == "preempted"
    resumed = [m for m in msgs if m["type"] == "resumed"]
    assert [m["id"] for m in resumed] == [paused[0]["id"]]
    assert {m["id"] for m in msgs if m["type"] == "done"} == {"a", "b", "c", "hi"}


@pytest.mark.asyncio
async def test_a_priority_never_takes_another_clients_place_and_orders_the_queue() -> None:
    async with running(Slow(0.01), scheduling="round-robin", max_active=2) as server:
        registry, rules = server.service.registry, server.service.rules
        async with connect(server.url) as mine, connect(server.url) as theirs:
            for rid in ("a", "b"):
                await send(theirs, type="generate", id=rid, params={**PARAMS, "seed": 1})
            await wait_for(lambda: all((r := registry.get(x)) and r.latest_step >= 1 for x in "ab"))
            # Another client's priority ranks its own requests only: these wait for a place.
            await send(mine, type="generate", id="low", params={**PARAMS, "seed": 2}, priority=-5)
            await send(mine, type="generate", id="high", params={**PARAMS, "seed": 3}, priority=7)
            await wait_for(lambda: "high" in rules.gate and "low" in rules.gate)
            assert rules.queue_positions() == {"high": 0, "low": 1}
            theirs_msgs = await _until_all_end(theirs, {"a", "b"})
            mine_msgs = await _until_all_end(mine, {"low", "high"})
    assert "paused" not in [m["type"] for m in theirs_msgs]
    assert _first(mine_msgs, "high", "progress") < _first(mine_msgs, "low", "progress")


@pytest.mark.asyncio
async def test_every_stream_opens_with_where_a_waiting_request_stands() -> None:
    """``queued`` with its position: after ``accepted`` on a generate that waits, and at the open
    of an attach and of an SSE stream; its first ``progress`` replaces it (issue #38)."""
    import httpx

    # (close_timeout: it stops reading its previews, so the server reads its close late.)
    async with running(Slow(0.02), max_active=1) as server, connect(server.url, close_timeout=0.2) as ws:
        await send(ws, type="generate", id="run", params={**PARAMS, "seed": 1})
        await wait_for(lambda: (r := server.service.registry.get("run")) is not None and r.latest_step >= 1)
        for rid in ("w1", "w2"):
            await send(ws, type="generate", id=rid, params={**PARAMS, "seed": 2}, detach=True)
        got: dict[str, list[dict[str, Any]]] = {"w1": [], "w2": []}
        while len(got["w2"]) < 2:
            m = await recv(ws, timeout=30)
            if m.get("id") in got:
                got[m["id"]].append(m)
        assert [(m["type"], m.get("position")) for m in got["w2"]] == [("accepted", None), ("queued", 1)]
        assert got["w1"][1] == {"type": "queued", "id": "w1", "position": 0}
        # Another connection attaches to the detached w2 (its id is the capability).
        async with connect(server.url) as other:
            await send(other, type="attach", id="w2")
            opened = [await recv(other, timeout=30) for _ in range(2)]
            assert [m["type"] for m in opened] == ["accepted", "queued"] and opened[1]["position"] == 1
        # SSE: its first events, then the request runs and progress replaces the snapshot.
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            reply = await client.post("/v1/generations", json={"params": {**PARAMS, "seed": 3}})
            events: list[tuple[str, Any]] = []
            async with client.stream("GET", reply.json()["urls"]["events"]) as response:
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        events.append((line[7:], None))
                    elif line.startswith("data: ") and events[-1][0] == "queued":
                        events[-1] = ("queued", json.loads(line[6:])["position"])
                    if events and events[-1][0] in ("progress", "done"):
                        break
        # 0: another principal (an HTTP client's address) with nothing in the engine goes first
        # (gate.py, rule 3), before the websocket's w1 and w2.
        assert events[:2] == [("accepted", None), ("queued", 0)] and events[-1][0] == "progress"


@pytest.mark.asyncio
async def test_the_eta_counts_the_steps_time_not_the_wait_before_them() -> None:
    """A request that waited in the queue: from a quarter of its steps on, its ``eta_s`` is near
    the time it really had left (it was the wait plus its steps over the steps done: 3x off)."""
    import time

    async with running(Slow(0.02), max_active=1) as server, connect(server.url) as ws:
        # (Longer than what `first` has left: it waits, not preempting it.)
        await send(ws, type="generate", id="first", params={**PARAMS, "steps": 20, "seed": 1})
        await send(ws, type="generate", id="second", params={**PARAMS, "steps": 24, "seed": 2})
        seen: list[tuple[int, float, float]] = []
        while True:
            m = await recv(ws, timeout=30)
            if m.get("id") != "second":
                continue
            if m["type"] == "progress":
                seen.append((m["step"], m["eta_s"], time.monotonic()))
            if m["type"] == "done":
                end = time.monotonic()
                break
    middle = [(eta, end - at) for step, eta, at in seen if 6 <= step <= 18]
    assert middle
    for eta, left in middle:
        assert abs(eta - left) <= 0.5 * left + 0.05, (eta, left)
