"""Pause and resume through the server (issue #22): the websocket, HTTP, the client, the events."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omni_stream import client as omc
from omni_stream.models import Synthetic

from .conftest import Slow, recv, running, send, until_end, wait_for

P: dict[str, Any] = {"steps": 12, "shape": [3, 8, 8], "work": 0, "seed": 4}


@pytest.mark.asyncio
async def test_a_paused_request_says_paused_runs_no_step_and_resumed_ends_as_an_uninterrupted_run() -> None:
    async with running(Slow(0.02)) as server:
        async with connect(server.url) as ws, httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            # Detached: its id is the capability, so the HTTP caller may pause and resume it too.
            await send(ws, type="generate", id="p", params=P, detach=True,
                       preview={"format": "raw", "max_size": None}, output={"format": "raw"})
            first = [await recv(ws) for _ in range(2)]  # accepted, the first progress
            await send(ws, type="pause", id="p", to_host=True)
            record = server.service.registry.get("p")
            await wait_for(lambda: record.paused)
            status = (await http.get("/v1/generations/p")).json()
            held = record.latest_step
            engine = server.engine
            await wait_for(lambda: not any(r.status.name == "RUNNING" and not r.paused
                                           for r in engine._table.live.values()))
            stepped = record.latest_step
            again = await http.post("/v1/generations/p/pause")
            resumed = await http.post("/v1/generations/p/resume")
            msgs = await until_end(ws, "p")
            not_paused = await http.post("/v1/generations/p/resume")
    kinds = [m["type"] for m in first + msgs]
    assert "paused" in kinds and "resumed" in kinds and kinds[-1] == "done"
    assert kinds.index("paused") < kinds.index("resumed")
    assert status["status"] == "paused"
    assert stepped <= held + 1  # the step in progress completes, no other starts
    assert again.status_code == 400 and again.json()["error"] == "bad_message"
    assert resumed.status_code == 200 and resumed.json()["status"] in ("running", "done")
    assert not_paused.status_code == 400
    # The result is the uninterrupted run's (its state went to the host and came back).
    final = [m for m in msgs if m["type"] == "preview" and m["final"]][0]
    async with running(Synthetic()) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="q", params=P, output={"format": "raw"})
        plain = [m for m in await until_end(ws, "q") if m["type"] == "preview" and m["final"]][0]
    assert final["image"] == plain["image"]


@pytest.mark.asyncio
async def test_the_python_client_pauses_and_sees_it() -> None:
    async with running(Slow(0.02)) as server, omc.connect(server.url) as client:
        stream = client.generate(P, id="c", progress=True)
        async with stream:
            async for item in stream:
                if getattr(item, "step", 0) == 2:
                    break
            await client.pause("c")
            record = server.service.registry.get("c")
            await wait_for(lambda: stream.paused or record.paused)
            await client.resume("c")
            rest = [item async for item in stream]
    assert rest and getattr(rest[-1], "final", False)
