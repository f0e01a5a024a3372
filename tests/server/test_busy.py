"""Admission control over real websockets: busy, fair shares, priority, bounded model params."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.asyncio.client import connect

import omni_stream as om
from omni_stream import protocol

from .conftest import SMALL, Slow, http_get, running, send, until, until_end

LONG = {**SMALL, "steps": 10_000}


async def generate(ws: Any, rid: str, params: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Send a generate; its ``accepted`` or its rejecting ``error``."""
    await send(ws, type="generate", id=rid, params=LONG if params is None else params, **extra)
    return await until(ws, lambda m: m.get("id") == rid and m["type"] in ("accepted", "error"))


@pytest.mark.asyncio
async def test_past_max_active_plus_max_queued_a_generate_gets_busy_with_retry_after() -> None:
    async with running(Slow(0.02), max_active=2, max_queued=2) as server, connect(server.url) as ws:
        for i in range(4):
            assert (await generate(ws, f"r{i}"))["type"] == "accepted"
        err = await generate(ws, "r4")
        assert (err["type"], err["code"], err["id"]) == ("error", "busy", "r4")
        assert 1.0 <= err["retry_after_s"] <= 60.0
        assert "OMNI_STREAM_MAX_QUEUED" in err["message"]
        # /health: still 200 (the server is healthy, only full), status busy, the load.
        reply = await http_get(server, "/health")
        body = reply.json()
        assert (reply.status, body["status"], body["ok"]) == (200, "busy", True)
        load = body["load"]
        assert {k: load[k] for k in ("active", "queued", "max_active", "max_queued")} == {
            "active": 2, "queued": 2, "max_active": 2, "max_queued": 2,
        }
        assert 1.0 <= load["retry_after_s"] <= 60.0
        metrics = (await http_get(server, "/metrics")).body.decode()
        assert 'omni_stream_rejections_total{code="busy",model="slow"} 1.0' in metrics
        assert 'omni_stream_requests_total{model="slow",outcome="rejected"} 1.0' in metrics
        # A slot frees: the next one is taken, and the server is no longer busy.
        await send(ws, type="cancel", id="r0")
        assert (await until_end(ws, "r0"))[-1]["type"] == "cancelled"
        assert (await generate(ws, "r5"))["type"] == "accepted"


@pytest.mark.asyncio
async def test_health_reports_the_load_when_not_busy() -> None:
    async with running(Slow(0.02)) as server, connect(server.url) as ws:
        assert (await generate(ws, "one"))["type"] == "accepted"
        body = (await http_get(server, "/health")).json()
        assert body["status"] == "ok"
        # On the CPU device max_active defaults to 4 (limits.HOST_ACTIVE_PER_ENGINE), not two batches.
        assert body["load"] == {"active": 1, "queued": 0, "max_active": 4, "max_queued": 128}


@pytest.mark.asyncio
async def test_one_connection_cannot_hold_the_whole_queue() -> None:
    # Capacity 6; with two connections open, a fair share is 3 once the
    # queue (requests past max_active) is over half full.
    async with (
        running(Slow(0.02), max_active=2, max_queued=4) as server,
        connect(server.url) as a,
        connect(server.url) as b,
    ):
        for i in range(5):  # the queue fills to 3 of 4 before a share applies
            assert (await generate(a, f"a{i}"))["type"] == "accepted"
        err = await generate(a, "a5")
        assert (err["code"], err["id"]) == ("busy", "a5")
        assert "fair share of 3" in err["message"] and 1.0 <= err["retry_after_s"] <= 60.0
        # The other connection still gets in, up to the global bound.
        assert (await generate(b, "b0"))["type"] == "accepted"
        err = await generate(b, "b1")
        assert err["code"] == "busy" and "holds 6 requests" in err["message"]


@pytest.mark.asyncio
async def test_a_busy_generate_without_an_id_gets_an_error_without_one() -> None:
    async with running(Slow(0.02), max_active=1, max_queued=1) as server, connect(server.url) as ws:
        for i in range(2):
            assert (await generate(ws, f"r{i}"))["type"] == "accepted"
        await send(ws, type="generate", params=LONG)
        err = await until(ws, lambda m: m["type"] == "error")
        assert err["code"] == "busy" and "id" not in err and err["retry_after_s"] >= 1.0


# -- priority --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_priority_is_validated_and_reaches_the_engine_as_far_as_its_token_is_granted(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ops=s3cret priority=5\nplain=0ther\n")
    async with running(Slow(0.02), tokens_file=str(tokens)) as server:
        async with connect(server.url + "?token=s3cret") as ws, connect(server.url + "?token=0ther") as other:
            for bad in (11, -11, 1.5, True, "3", None):
                err = await generate(ws, "bad", priority=bad)
                assert (err["code"], err["field"]) == ("invalid_field", "priority"), bad
            assert (await generate(ws, "hi", priority=7))["type"] == "accepted"
            assert (await generate(ws, "plain"))["type"] == "accepted"
            # Not granted: its priority orders its own requests only, never
            # another tenant's in the engine (issue #19, finding 9).
            assert (await generate(other, "own", priority=9))["type"] == "accepted"
            by_id = server.engine._by_id
            assert (by_id["hi"].priority, by_id["plain"].priority, by_id["own"].priority) == (5, 0, 0)


@pytest.mark.asyncio
async def test_a_granted_high_priority_request_overtakes_a_low_one(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ops=s3cret priority=10\n")
    engine = om.Engine(Slow(0.005), device="cpu", max_batch_size=1)
    async with engine, running(engine, tokens_file=str(tokens)) as server, connect(
        server.url + "?token=s3cret"
    ) as ws:
        await send(ws, type="generate", id="low", params={**SMALL, "steps": 400}, priority=-10)
        await until(ws, lambda m: m.get("id") == "low" and m["type"] == "progress")
        await send(ws, type="generate", id="high", params={**SMALL, "steps": 30}, priority=10)
        low_steps = []
        while True:
            msg = await until(ws, lambda m: m["type"] in ("progress", "done"))
            if msg["id"] == "low" and msg["type"] == "progress":
                low_steps.append(msg["step"])
            if msg["id"] == "high" and msg["type"] == "done":
                break
        # Round robin would have advanced "low" by ~30 steps meanwhile; aging
        # gives it one step per 80 rounds at this gap (its -10 counts as 0
        # against the granted 10).
        assert max(low_steps) - min(low_steps) <= 5, low_steps


# -- the model's own bounds over the wire ----------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"shape": [64, 2048, 2048]}, "shape"),  # 268M values, every side within max_image_size
        ({"work": 10_000}, "work"),
        ({"hang_at": 1, "hang_s": 86_400}, "hang_s"),
    ],
)
async def test_synthetic_params_past_the_models_bounds_are_refused(params: dict, field: str) -> None:
    async with running() as server, connect(server.url) as ws:
        err = await generate(ws, "big", {**SMALL, **params})
        assert (err["type"], err["code"], err["field"]) == ("error", "bad_params", field)
        assert server.engine.statistics().queued == 0


def test_busy_is_a_rejection_code() -> None:
    assert "busy" in protocol.REJECTION_CODES
    busy = protocol.ErrorMessage.build("busy", "full", request_id="x", retry_after_s=1.0)
    assert busy.code == "busy" and busy.to_dict()["retry_after_s"] == 1.0
