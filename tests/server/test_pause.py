"""Pause and resume through the server (issue #22): the websocket, HTTP, the client, the events."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
import torch
from websockets.asyncio.client import connect

import omni_stream as om
from omni_stream import client as omc
from omni_stream.models import Synthetic

from .conftest import Slow, recv, running, send, until, until_end, wait_for

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


class WholeRun(om.StepModel):
    """A library-style loop in one call (callback mode), its second step held at a gate."""

    name = "whole_run"
    runs_whole_requests = True
    params = (om.Param("steps", "int", 4, minimum=1),)

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def total_steps(self, params: Any) -> int:
        return int(params["steps"])

    def start(self, params: Any, device: torch.device) -> Any:
        return dict(params)

    def step(self, states: Any) -> list[torch.Tensor]:
        raise AssertionError("a whole-request model is never stepped")

    def run(self, state: Any, emit: om.Emit) -> None:
        for i in range(1, state["steps"] + 1):
            if i == 2:
                self.gate.wait(10)
            emit(torch.zeros(3, 8, 8))


def held_loop(gate: threading.Event) -> om.GeneratorModel:
    def loop(params: Any) -> Any:
        for i in range(1, 5):
            if i == 2:
                gate.wait(10)
            yield torch.zeros(3, 8, 8)

    return om.from_generator(loop, total=4, name="loop")


@pytest.mark.asyncio
@pytest.mark.parametrize(("make", "why"), [(held_loop, "model loop cannot snapshot its state"),
                                           (WholeRun, "model whole_run runs each request in one call")])
async def test_a_request_whose_model_cannot_stop_between_steps_is_refused_over_both_doors_saying_why(
    make: Any, why: str
) -> None:
    # Issue #34: such a pause was accepted ("paused" to the watchers); a whole-request one then
    # failed with a StepTimeoutError blaming its reader once its step bound ran out.
    gate = threading.Event()
    async with running(make(gate)) as server:
        async with connect(server.url) as ws, httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            await send(ws, type="generate", id="g", params={"steps": 4} if make is WholeRun else {}, detach=True)
            await until(ws, lambda m: m.get("id") == "g" and m["type"] == "progress")  # step 2 waits
            await send(ws, type="pause", id="g", to_host=True)
            refused = await until(ws, lambda m: m["type"] == "error")
            over_http = await http.post("/v1/generations/g/pause")
            status = (await http.get("/v1/generations/g")).json()
            gate.set()
            msgs = await until_end(ws, "g")
    assert (refused["code"], refused["id"]) == ("bad_message", "g")
    assert refused["message"].startswith(f"request g cannot be paused: {why}")
    assert over_http.status_code == 400 and over_http.json()["error"] == "bad_message"
    assert over_http.json()["message"].startswith(f"request g cannot be paused: {why}")
    assert status["status"] == "running"
    kinds = [m["type"] for m in msgs]
    assert "paused" not in kinds and kinds[-1] == "done"
