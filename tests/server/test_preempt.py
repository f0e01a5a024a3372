"""The server's gate preempts (issue #22): under the preemptive policy a short request does not
wait for a long one to end when every place is held; under round-robin it does."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.asyncio.client import connect

from .conftest import Slow, recv, running, send, until_end, wait_for

LONG: dict[str, Any] = {"steps": 60, "shape": [3, 8, 8], "work": 0, "seed": 1}
SHORT: dict[str, Any] = {"steps": 3, "shape": [3, 8, 8], "work": 0, "seed": 2}


async def _run(scheduling: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    ended: list[str] = []
    async with running(Slow(0.02), scheduling=scheduling, max_active=1) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="long", params=LONG, output={"format": "raw"})
            record = None
            await wait_for(lambda: server.service.registry.get("long") is not None)
            record = server.service.registry.get("long")
            await wait_for(lambda: record.latest_step >= 2)
            await send(ws, type="generate", id="short", params=SHORT)
            msgs: list[dict[str, Any]] = []
            while len(ended) < 2:
                m = await recv(ws, timeout=30)
                msgs.append(m)
                if m["type"] in ("done", "error", "cancelled"):
                    ended.append(m["id"])
    long = [m for m in msgs if m.get("id") == "long"]
    short = [m for m in msgs if m.get("id") == "short"]
    return long, short, ended


@pytest.mark.asyncio
async def test_under_preemptive_scheduling_a_short_request_goes_in_before_a_long_one_ends() -> None:
    long, short, ended = await _run("preemptive")
    assert ended == ["short", "long"]
    kinds = [m["type"] for m in long]
    assert "paused" in kinds and "resumed" in kinds and kinds[-1] == "done"
    # The long one's result is its uninterrupted run's.
    async with running(Slow(0.0)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="alone", params=LONG, output={"format": "raw"})
        alone = [m for m in await until_end(ws, "alone") if m["type"] == "preview" and m["final"]][0]
    result = [m for m in long if m["type"] == "preview" and m["final"]][0]
    assert result["image"] == alone["image"]


@pytest.mark.asyncio
async def test_under_round_robin_the_short_request_waits_for_the_place() -> None:
    long, short, ended = await _run("round-robin")
    assert ended == ["long", "short"]
    assert "paused" not in [m["type"] for m in long]


@pytest.mark.asyncio
async def test_a_preempted_request_cancelled_while_it_waits_frees_its_place_once() -> None:
    async with running(Slow(0.02), scheduling="preemptive", max_active=1) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="long", params=LONG)
            await wait_for(lambda: server.service.registry.get("long") is not None)
            record = server.service.registry.get("long")
            await wait_for(lambda: record.latest_step >= 2)
            await send(ws, type="generate", id="short", params=SHORT)
            await wait_for(lambda: record.paused)
            await send(ws, type="cancel", id="long")
            ends: dict[str, str] = {}
            while len(ends) < 2:
                m = await recv(ws, timeout=30)
                if m["type"] in ("done", "cancelled", "error"):
                    ends[m["id"]] = m["type"]
            assert ends == {"long": "cancelled", "short": "done"}
            gate = server.service.rules.gate
            await wait_for(lambda: gate.in_engine == 0 and gate.waiting == 0)
            # The place is free for the next one: it runs.
            await send(ws, type="generate", id="next", params=SHORT)
            assert [m["type"] for m in await until_end(ws, "next")][-1] == "done"


@pytest.mark.asyncio
async def test_a_short_request_that_came_within_a_quantum_goes_in_once_it_passes() -> None:
    """An arrival looks for a request to preempt once; one that came while the running request was
    still within its quantum takes its place when the quantum passes, not when it ends."""
    ended: list[str] = []
    async with running(Slow(0.02), scheduling="preemptive", quantum=20, max_active=1) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="long", params=LONG)
            await wait_for(lambda: server.service.registry.get("long") is not None)
            record = server.service.registry.get("long")
            await wait_for(lambda: record.latest_step >= 1)
            assert record.latest_step < 20  # within its quantum: nothing to preempt at arrival
            await send(ws, type="generate", id="short", params=SHORT)
            kinds: dict[str, list[str]] = {"long": [], "short": []}
            while len(ended) < 2:
                m = await recv(ws, timeout=30)
                if m.get("id") in kinds:
                    kinds[m["id"]].append(m["type"])
                if m["type"] in ("done", "error", "cancelled"):
                    ended.append(m["id"])
    assert ended == ["short", "long"], kinds
    assert "paused" in kinds["long"] and kinds["long"][-1] == "done"
