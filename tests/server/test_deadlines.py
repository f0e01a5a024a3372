"""Deadlines on a real server (issue #38): Cancel-After on HTTP, deadline_s on the websocket.

The service keeps the time (server/service.py, ``_keep_time``): a queued
request whose deadline comes ends ``expired`` without running, a running
one is cancelled with reason ``deadline``, both visible in the status, the
events and ``/metrics``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from .conftest import SMALL, Slow, running, send, until_end, wait_for

LONG: dict[str, Any] = {**SMALL, "steps": 10_000}


@pytest.mark.asyncio
async def test_cancel_after_expires_a_queued_request_and_cancels_a_running_one() -> None:
    async with running(Slow(0.01), max_active=1) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            running_one = await http.post(
                "/v1/generations", json={"id": "runs", "params": LONG}, headers={"Cancel-After": "600ms"}
            )
            queued = await http.post(
                "/v1/generations", json={"id": "waits", "params": LONG}, headers={"Cancel-After": "200ms"}
            )
            bad = await http.post("/v1/generations", json={"params": LONG}, headers={"Cancel-After": "later"})
            assert (running_one.status_code, queued.status_code) == (202, 202)
            await wait_for(lambda: all(server.service.registry.get(i).ended for i in ("runs", "waits")),
                           what="both deadlines")
            waits = (await http.get("/v1/generations/waits")).json()
            runs = (await http.get("/v1/generations/runs")).json()
            metrics = (await http.get("/metrics")).text
    assert (bad.status_code, bad.json()["field"]) == (400, "Cancel-After")
    assert (waits["status"], waits["step"], waits["error"]) == ("expired", 0, {"reason": "expired"})
    assert (runs["status"], runs["error"]) == ("cancelled", {"reason": "deadline"}) and runs["step"] > 0
    assert 'omni_stream_deadlines_total{model="slow",reason="expired"} 1.0' in metrics
    assert 'omni_stream_deadlines_total{model="slow",reason="deadline"} 1.0' in metrics


@pytest.mark.asyncio
async def test_a_websocket_generate_with_deadline_s_ends_cancelled_with_the_reason() -> None:
    async with running(Slow(0.01)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="w", params=LONG, deadline_s=0.3)
        messages = await until_end(ws, "w")
    assert messages[0]["type"] == "accepted"
    assert messages[-1] == {"type": "cancelled", "id": "w", "reason": "deadline"}
