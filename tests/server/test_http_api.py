"""The HTTP API (docs/http.md) through a real uvicorn server: /v1/generations, its events, mounting."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from websockets.asyncio.client import connect

import omni_stream as om
from omni_stream import protocol
from omni_stream.models import Synthetic
from omni_stream.protocol import PreviewHeader
from omni_stream.server import create_app
from omni_stream.server.events import sse_event
from omni_stream.core.outbox import OutboxItem

from .conftest import SMALL, Slow, recv, running, send, until_end, wait_for

TOKEN = "http-api-token"


async def read_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parse a text/event-stream body into ``{"event", "id", "data"}`` dicts (data JSON-decoded)."""
    event: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if line == "":
            if "data" in event:
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(": ")
            event[key] = json.loads(value) if key == "data" else value


async def all_events(client: httpx.AsyncClient, url: str, **kwargs: Any) -> list[dict[str, Any]]:
    out = []
    with anyio.fail_after(30):
        async with client.stream("GET", url, **kwargs) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for event in read_events(response):
                out.append(event)
    return out


@contextlib.asynccontextmanager
async def http(server: Any, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30, **kwargs) as client:
        yield client


# -- the lifecycle of one generation -------------------------------------------------


@pytest.mark.asyncio
async def test_post_then_events_then_output() -> None:
    async with running() as server, http(server) as client:
        reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 4, "seed": 3}})
        assert reply.status_code == 202
        body = reply.json()
        rid = body["id"]
        assert body["status"] in ("queued", "running", "done") and body["total"] == 4
        assert body["urls"] == {
            "self": f"/v1/generations/{rid}",
            "events": f"/v1/generations/{rid}/events",
            "output": f"/v1/generations/{rid}/output",
            "preview": f"/v1/generations/{rid}/preview",
        }
        assert reply.headers["location"] == body["urls"]["self"]
        events = await all_events(client, body["urls"]["events"])
        kinds = [e["event"] for e in events]
        assert kinds[0] == "accepted" and kinds[-1] == "done"
        final = [e for e in events if e["event"] == "preview" and e["data"]["final"]]
        assert len(final) == 1 and final[0]["id"] == "4"
        # The preview event is the websocket frame's header plus the image as a data: URL.
        image_url = final[0]["data"]["image"]
        assert image_url.startswith("data:image/png;base64,")
        output = await client.get(body["urls"]["output"])
        assert output.status_code == 200 and output.headers["content-type"] == "image/png"
        assert output.content == base64.b64decode(image_url.split(",", 1)[1])
        assert Image.open(io.BytesIO(output.content)).size == (SMALL["shape"][2], SMALL["shape"][1])
        status = (await client.get(body["urls"]["self"])).json()
        assert (status["status"], status["step"], status["total"]) == ("done", 4, 4)
        assert status["queue_position"] is None and status["error"] is None
        assert status["seed"] == 3 == events[0]["data"]["seed"]


@pytest.mark.asyncio
async def test_a_drawn_seed_is_in_the_answer_the_status_and_accepted() -> None:
    async with running() as server, http(server) as client:
        reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 2}})
        body = reply.json()
        seed = body["seed"]
        assert isinstance(seed, int) and 0 <= seed < 2**32, body
        events = await all_events(client, body["urls"]["events"])
        assert events[0]["event"] == "accepted" and events[0]["data"]["seed"] == seed
        first = await client.get(body["urls"]["output"])
        again = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 2, "seed": seed}})
        await all_events(client, again.json()["urls"]["events"])
        assert (await client.get(again.json()["urls"]["output"])).content == first.content


@pytest.mark.asyncio
async def test_the_result_is_the_same_over_http_and_the_websocket() -> None:
    params = {**SMALL, "steps": 3, "seed": 11}
    async with running() as server, http(server) as client:
        reply = await client.post("/v1/generations?wait=true", json={"params": params})
        assert reply.status_code == 200 and reply.headers["content-type"] == "image/png"
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="w", params=params)
            msgs = await until_end(ws, "w")
        final = [m for m in msgs if m["type"] == "preview" and m["final"]][0]
        assert reply.content == final["image"]


@pytest.mark.asyncio
async def test_post_with_accept_event_stream_answers_with_the_events() -> None:
    async with running() as server, http(server) as client:
        with anyio.fail_after(30):
            async with client.stream(
                "POST",
                "/v1/generations",
                json={"params": {**SMALL, "steps": 3}},
                headers={"Accept": "text/event-stream"},
            ) as response:
                assert response.status_code == 200
                events = [e async for e in read_events(response)]
        assert [e["event"] for e in events][0] == "accepted"
        assert events[-1]["event"] == "done" and events[-1]["id"] == "3"
        steps = [int(e["id"]) for e in events if e["event"] == "progress"]
        assert steps == sorted(steps) and steps[-1] == 3


@pytest.mark.asyncio
async def test_status_while_queued_and_running_then_cancel() -> None:
    # One slot: the second request queues behind the first.
    engine = om.Engine(Slow(0.02), device="cpu", max_batch_size=1)
    async with engine, running(engine) as server, http(server) as client:
        first = (await client.post("/v1/generations", json={"params": {**SMALL, "steps": 400}})).json()
        second = (await client.post("/v1/generations", json={"params": {**SMALL, "steps": 400}})).json()

        async def status(rid: str) -> dict[str, Any]:
            return (await client.get(f"/v1/generations/{rid}")).json()

        await wait_for(lambda: server.service.registry.get(first["id"]).latest_step > 0, what="first running")
        s1, s2 = await status(first["id"]), await status(second["id"])
        assert s1["status"] == "running" and s1["step"] >= 1 and s1["queue_position"] is None
        assert s1["eta_s"] is not None and s1["eta_s"] > 0
        # The engine takes a new request into its next round: queued (position 0) until its first step.
        assert (s2["status"], s2["queue_position"]) in (("queued", 0), ("running", None))
        # The queue, running first; output not ready yet.
        listing = (await client.get("/v1/generations")).json()
        assert [g["status"] for g in listing["generations"]][0] == "running"
        assert len(listing["generations"]) == 2
        early = await client.get(f"/v1/generations/{first['id']}/output")
        assert early.status_code == 409 and early.json()["error"] == "not_ready"
        # A step's progress is published before its preview is rendered (a worker thread): wait for one.
        record = server.service.registry.get(first["id"])
        await wait_for(lambda: record.latest_preview() is not None, what="a first preview")
        preview = await client.get(f"/v1/generations/{first['id']}/preview")
        assert preview.status_code == 200 and preview.headers["content-type"] == "image/jpeg"
        assert int(preview.headers["x-omni-stream-step"]) >= 1
        # DELETE cancels and answers with the final status.
        for rid in (second["id"], first["id"]):
            gone = await client.delete(f"/v1/generations/{rid}")
            assert gone.status_code == 200 and gone.json()["status"] == "cancelled"
            assert gone.json()["error"]["reason"] == "client"
        failed = await client.get(f"/v1/generations/{first['id']}/output")
        assert failed.status_code == 409
        assert server.engine.statistics().cancelled == 2


@pytest.mark.asyncio
async def test_a_cancelled_requests_output_says_it_was_cancelled_and_by_whom() -> None:
    async with running(Slow(0.01)) as server, http(server) as client:
        rid = (await client.post("/v1/generations", json={"params": {**SMALL, "steps": 2000}})).json()["id"]
        assert (await client.delete(f"/v1/generations/{rid}")).json()["status"] == "cancelled"
        reply = await client.get(f"/v1/generations/{rid}/output")
    body = reply.json()
    assert reply.status_code == 409
    assert (body["error"], body["reason"], body["id"]) == ("cancelled", "client", rid)
    assert "cancelled by a client" in body["message"] and "no output" in body["message"]
    assert "once it is done" not in body["message"]  # it never will be


@pytest.mark.asyncio
async def test_events_resume_after_last_event_id() -> None:
    async with running(Slow(0.01)) as server, http(server) as client:
        rid = (await client.post("/v1/generations", json={"params": {**SMALL, "steps": 60}})).json()["id"]
        # Read a few events, then drop the stream (the request runs on: it is detached).
        seen = 0
        async with client.stream("GET", f"/v1/generations/{rid}/events") as response:
            async for event in read_events(response):
                if event["event"] == "progress":
                    seen = int(event["id"])
                    if seen >= 5:
                        break
        events = await all_events(
            client, f"/v1/generations/{rid}/events", headers={"Last-Event-ID": str(seen)}
        )
        kinds = [e["event"] for e in events]
        assert "accepted" not in kinds and kinds[-1] == "done"
        steps = [int(e["id"]) for e in events if e["event"] in ("progress", "preview")]
        assert steps and all(step > seen for step in steps), (seen, steps)
        assert server.engine.statistics().cancelled == 0


@pytest.mark.asyncio
async def test_a_stalled_event_stream_never_slows_the_request_or_others() -> None:
    # A reader that never reads its SSE stream: latest-wins in its outbox, then
    # its stream ends; the request itself runs at full speed.
    async with running(Slow(0.005), max_pending=4, send_timeout_s=0.5) as server, http(server) as client:
        rid = (
            await client.post(
                "/v1/generations", json={"params": {"steps": 200, "shape": [3, 256, 256]}, "preview": {"format": "raw"}}
            )
        ).json()["id"]
        stalled = await anyio.connect_tcp(server.host, server.port)
        # Asks for the request's events, and never reads them.
        await stalled.send(f"GET /v1/generations/{rid}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        try:
            other = await client.post("/v1/generations?wait=1", json={"params": {**SMALL, "steps": 5}})
            assert other.status_code == 200
            record = server.service.registry.get(rid)
            await wait_for(lambda: record.ended, timeout=60, what="the request to finish")
            assert (await client.get(f"/v1/generations/{rid}")).json()["status"] == "done"
        finally:
            await stalled.aclose()


# -- refusals --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_bad_bodies_get_the_websocket_codes_with_http_statuses() -> None:
    async with running(max_message_bytes=4096) as server, http(server) as client:
        cases = [
            (b"{nope", 400, "bad_json"),
            (b"[1]", 400, "bad_message"),
            (json.dumps({"params": {}, "detach": False}).encode(), 400, "invalid_field"),
            (json.dumps({"params": {"steps": -1}}).encode(), 422, "bad_params"),
            (json.dumps({"params": {"steps": 2}, "priority": 99}).encode(), 400, "invalid_field"),
            (b"{" + b" " * 5000 + b"}", 413, "limit_exceeded"),
        ]
        for body, status, code in cases:
            reply = await client.post("/v1/generations", content=body)
            assert (reply.status_code, reply.json()["error"]) == (status, code), body[:40]
            assert len(reply.content) < 1024  # never an echo of what was sent
        # An id taken by another job is a conflict (the same body again is a retry: its job,
        # tests/server/test_retries.py); an unknown one not found.
        ok = await client.post("/v1/generations", json={"id": "same", "params": {**SMALL, "steps": 2}})
        assert ok.status_code == 202
        dup = await client.post("/v1/generations", json={"id": "same", "params": {**SMALL, "steps": 3}})
        assert (dup.status_code, dup.json()["error"]) == (409, "duplicate_id")
        for method, path in [("GET", "/v1/generations/nope"), ("DELETE", "/v1/generations/nope"),
                             ("GET", "/v1/generations/nope/output"), ("GET", "/v1/generations/nope/events")]:
            reply = await client.request(method, path)
            assert (reply.status_code, reply.json()["error"]) == (404, "not_found"), path


@pytest.mark.asyncio
async def test_busy_is_503_with_retry_after() -> None:
    async with running(Slow(0.02), max_active=1, max_queued=1) as server, http(server) as client:
        held = []
        for _ in range(2):
            reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 300}})
            assert reply.status_code == 202
            held.append(reply.json()["id"])
        # One in the engine (max_active), one waiting in the gate (max_queued).
        await wait_for(lambda: server.service.rules.load().held >= 2, what="both to be held")
        assert (server.service.gate.in_engine, server.service.gate.waiting) == (1, 1)
        third = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 3}})
        assert third.status_code == 503 and third.json()["error"] == "busy"
        assert int(third.headers["retry-after"]) >= 1 and third.json()["retry_after_s"] > 0
        for rid in held:
            await client.delete(f"/v1/generations/{rid}")


@pytest.mark.asyncio
async def test_the_token_guards_every_route_but_health_and_the_page() -> None:
    async with running(token=TOKEN) as server, http(server) as client:
        for method, path in [("GET", "/models"), ("GET", "/metrics"), ("GET", "/v1/generations"),
                             ("POST", "/v1/generations"), ("GET", "/v1/generations/x/events")]:
            reply = await client.request(method, path)
            assert (reply.status_code, reply.json()["error"]) == (401, "unauthorized"), path
            assert reply.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/")).status_code == 200
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 2}}, headers=bearer)
        assert reply.status_code == 202
        rid = reply.json()["id"]
        # ?token= for EventSource, which cannot set headers.
        events = await all_events(client, f"/v1/generations/{rid}/events?token={TOKEN}")
        assert events[-1]["event"] == "done"
        # With the token, the queue shows ids.
        listing = (await client.get("/v1/generations", headers=bearer)).json()
        assert [g["id"] for g in listing["generations"]] == [rid]


@pytest.mark.asyncio
async def test_without_a_token_the_queue_hides_other_peoples_ids() -> None:
    async with running() as server, http(server) as client:
        reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 2}})
        # Its own session's (the cookie this client kept, test_sessions.py); nobody else's.
        listing = (await client.get("/v1/generations")).json()
        assert [g["id"] for g in listing["generations"]] == [reply.json()["id"]]
        client.cookies.clear()
        listing = (await client.get("/v1/generations")).json()
        assert [g["id"] for g in listing["generations"]] == [None]
        # The id itself is the capability.
        assert (await client.get(f"/v1/generations/{reply.json()['id']}")).status_code == 200


@pytest.mark.asyncio
async def test_metrics_public_opens_metrics_only() -> None:
    async with running(token=TOKEN, metrics_public=True) as server, http(server) as client:
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/models")).status_code == 401


# -- the pure parts ------------------------------------------------------------------------


def test_queue_positions_follow_granted_priority_then_arrival() -> None:
    from omni_stream.core.gate import Gate
    from omni_stream.core.records import RequestRecord
    from omni_stream.core.rules import Rules

    records = []
    for rid, cross, created, step in [("a", 0, 1.0, 3), ("b", 0, 2.0, 0), ("c", 5, 3.0, 0), ("d", 0, 0.5, 0)]:
        record = RequestRecord(
            rid, owner="o", detach=True, total=9, preview={}, created_at=created, priority=cross,
            cross_priority=cross,
        )
        record.latest_step = step
        records.append(record)

    class Registry:
        def running(self) -> list[RequestRecord]:
            return records

    rules = Rules.__new__(Rules)
    rules.registry = Registry()  # type: ignore[assignment]
    rules.gate = Gate(lambda: 4)
    rules.paused = {}
    # a has started: not queued. c's granted priority outranks; then arrival order.
    assert rules.queue_positions() == {"c": 0, "d": 1, "b": 2}
    # Requests waiting in the gate come after those in the engine, in the gate's
    # order: y's own priority does not rank it before x (different principals).
    for rid, owner, priority in [("w1", "x", 0), ("w2", "y", 3)]:
        record = RequestRecord(rid, owner=owner, detach=True, total=9, preview={}, created_at=9.0, priority=priority)
        records.append(record)
        rules.gate.wait(rid, owner, priority, None)
    assert rules.queue_positions() == {"c": 0, "d": 1, "b": 2, "w1": 3, "w2": 4}


def test_sse_event_formats_and_skips_what_was_seen() -> None:
    progress = OutboxItem(protocol.Progress.build("r", step=3, total=5, eta_s=1.0), False)
    assert sse_event(progress) == (
        b'event: progress\nid: 3\ndata: {"type":"progress","id":"r","step":3,"total":5,"eta_s":1.0}\n\n'
    )
    assert sse_event(progress, after_step=3) is None
    assert sse_event(progress, after_step=2) is not None
    header = PreviewHeader(id="r", step=2, total=5, final=False, format="jpeg", width=4, height=2, mime="image/jpeg")
    frame = OutboxItem(protocol.Preview.build(header, b"\xff\xd8img"), False)
    text = sse_event(frame)
    assert text is not None and text.startswith(b"event: preview\nid: 2\ndata: ")
    data = json.loads(text.split(b"data: ", 1)[1])
    assert data["image"] == "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8img").decode()
    assert {k: v for k, v in data.items() if k != "image"} == header.to_dict()
    assert sse_event(frame, after_step=2) is None
    final_header = PreviewHeader(**{**header.to_dict(), "final": True})
    final = OutboxItem(protocol.Preview.build(final_header, b"x"), True)
    assert sse_event(final, after_step=9) is not None  # the result is never skipped
    accepted_message = protocol.Accepted.build("r", total=5, detach=False, attached=False, preview={})
    accepted = OutboxItem(accepted_message, True)
    assert sse_event(accepted) is not None and sse_event(accepted, after_step=0) is None
    done = OutboxItem(protocol.Done.build("r", total=5, elapsed_s=1.0), True)
    assert sse_event(done, after_step=5) == (
        b'event: done\nid: 5\ndata: {"type":"done","id":"r","total":5,"elapsed_s":1.0}\n\n'
    )
    # An event's data is the message's wire form, the websocket's text frame.
    error = OutboxItem(protocol.ErrorMessage.build("step_failed", "boom", request_id="r"), True)
    assert sse_event(error) == b"event: error\ndata: " + error.message.wire.encode() + b"\n\n"


# -- mounted in a host application ------------------------------------------------------------


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


@pytest.mark.asyncio
async def test_mounted_under_a_prefix_in_a_host_app() -> None:
    engine = om.Engine(Synthetic(), device="cpu")
    omni = create_app(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Starlette does not run a mounted app's lifespan: the host's runs it, inside its own.
        async with engine, omni.lifespan(app):
            yield

    async def hello(request: Any) -> PlainTextResponse:
        return PlainTextResponse("host app")

    host = Starlette(routes=[Route("/", hello), Mount("/omni", app=omni)], lifespan=lifespan)
    sock = _free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(host, lifespan="on", log_config=None, ws="websockets-sansio")
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        await wait_for(lambda: server.started, what="uvicorn to start")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                assert (await client.get("/")).text == "host app"
                assert (await client.get("/omni/health")).json()["ok"] is True
                reply = await client.post("/omni/v1/generations", json={"params": {**SMALL, "steps": 3}})
                assert reply.status_code == 202
                urls = reply.json()["urls"]
                assert urls["events"].startswith("/omni/v1/generations/")  # the prefix is kept
                events = await all_events(client, urls["events"])
                assert events[-1]["event"] == "done"
                assert (await client.get(urls["output"])).headers["content-type"] == "image/png"
            async with connect(f"ws://127.0.0.1:{port}/omni/ws") as ws:
                await send(ws, type="generate", id="m", params={**SMALL, "steps": 2})
                assert (await until_end(ws, "m"))[-1]["type"] == "done"
        finally:
            server.should_exit = True


@pytest.mark.asyncio
async def test_a_mounted_app_without_its_lifespan_says_what_is_missing() -> None:
    omni = create_app(om.Engine(Synthetic(), device="cpu"))
    transport = httpx.ASGITransport(app=omni)
    async with httpx.AsyncClient(transport=transport, base_url="http://omni") as client:
        reply = await client.post("/v1/generations", json={"params": {"steps": 2}})
    assert reply.status_code == 503 and reply.json()["error"] == "engine_unavailable"
    assert "omni.lifespan" in reply.json()["message"]


@pytest.mark.asyncio
async def test_a_host_that_runs_only_the_engine_is_not_healthy() -> None:
    # The zombie: the engine runs, the omni_stream app's lifespan never did, so every
    # generate gets 503; /health must say so rather than pass a probe with 200.
    engine = om.Engine(Synthetic(), device="cpu")
    omni = create_app(engine)
    host = Starlette(routes=[Mount("/omni", app=omni)])
    transport = httpx.ASGITransport(app=host)
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://h") as client:
        health = await client.get("/omni/health")
        refused = await client.post("/omni/v1/generations", json={"params": {"steps": 2}})
    body = health.json()
    assert health.status_code == 503 and (body["status"], body["ok"]) == ("not_started", False), body
    assert "lifespan=omni.lifespan" in body["reason"]
    assert refused.status_code == 503 and refused.json()["error"] == "engine_unavailable"


@contextlib.asynccontextmanager
async def _serve_host(host: Any) -> AsyncIterator[httpx.AsyncClient]:
    sock = _free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(host, lifespan="on", log_config=None, ws="websockets-sansio"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        await wait_for(lambda: server.started, what="uvicorn to start")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                yield client
        finally:
            server.should_exit = True


@pytest.mark.asyncio
@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
async def test_the_apps_lifespan_is_the_hosts_in_one_step(framework: str) -> None:
    # Given a model, the app owns its engine: its lifespan runs both.
    omni = create_app(Synthetic(), device="cpu")
    if framework == "fastapi":
        fastapi = pytest.importorskip("fastapi")
        host: Any = fastapi.FastAPI(lifespan=omni.lifespan)
        host.mount("/omni", omni)
    else:
        host = Starlette(routes=[Mount("/omni", app=omni)], lifespan=omni.lifespan)
    async with _serve_host(host) as client:
        health = await client.get("/omni/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        result = await client.post("/omni/v1/generations?wait=1", json={"params": {**SMALL, "steps": 2}})
        assert result.status_code == 200 and result.headers["content-type"] == "image/png"
    assert omni.engine.health().status == "closed"  # the host's shutdown closed the app's engine


@pytest.mark.asyncio
async def test_recv_helper_still_reads_websocket_previews() -> None:
    # The websocket and HTTP share one core: a websocket client sees HTTP-started requests' ids as unknown
    # unless it holds the id (detached: the id is the capability) and attaches.
    async with running() as server, http(server) as client:
        rid = (await client.post("/v1/generations", json={"params": {**SMALL, "steps": 40}})).json()["id"]
        async with connect(server.url) as ws:
            await send(ws, type="attach", id=rid)
            first = await recv(ws)
            assert first["type"] == "accepted" and first["attached"] is True
            assert (await until_end(ws, rid))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_the_mount_example_serves_both_apps() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "mount_app.py"
    spec = importlib.util.spec_from_file_location("mount_app", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    host = module.build(model="synthetic", device="cpu")
    sock = _free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(host, lifespan="on", log_config=None))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        await wait_for(lambda: server.started, what="uvicorn to start")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                assert (await client.get("/hello")).json()["engine"] == "ok"
                page = await client.get("/omni/")
                assert page.status_code == 200 and b"<!doctype html>" in page.content.lower()
                result = await client.post("/omni/v1/generations?wait=1", json={"params": {"steps": 2}})
                assert result.status_code == 200 and result.headers["content-type"] == "image/png"
        finally:
            server.should_exit = True


@pytest.mark.asyncio
async def test_an_event_stream_reader_hanging_up_early_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    # A closed browser tab: no traceback from the app, the request runs on (it is detached).
    async with running(Slow(0.01)) as server:
        reader, writer = await anyio_open(server)
        body = json.dumps({"params": {**SMALL, "steps": 100}}).encode()
        writer.write(
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        await reader.readuntil(b"event: progress")
        writer.close()
        record = next(iter(server.service.registry))
        await wait_for(lambda: record.ended, what="the request to end")
        await wait_for(lambda: not server.service.rules.clients, what="the stream to be let go")
    assert record.outcome == "done"
    problems = [r for r in caplog.records if r.levelno >= 40]
    assert not problems, [r.getMessage() for r in problems]


async def anyio_open(server: Any) -> Any:
    import asyncio

    return await asyncio.open_connection(server.host, server.port)


@pytest.mark.asyncio
async def test_a_caller_waiting_with_wait_true_is_a_reader_so_its_request_is_not_paced() -> None:
    # Without it the consumer took an unwatched request's frames every UNREAD_PACE_S and its
    # result reached the waiting caller up to that late.
    async with running(Slow(0.02)) as server, http(server) as client:
        async with anyio.create_task_group() as tg:
            replies: list[httpx.Response] = []

            async def wait() -> None:
                replies.append(await client.post(
                    "/v1/generations?wait=true", json={"id": "waited", "params": {**SMALL, "steps": 30}}
                ))

            tg.start_soon(wait)
            await wait_for(lambda: server.service.registry.get("waited") is not None)
            record = server.service.registry.get("waited")
            await wait_for(lambda: record.latest_step > 0)
            assert record.waiters == 1 and record.has_reader() and not record.watchers
        assert replies[0].status_code == 200 and record.waiters == 0


@pytest.mark.asyncio
async def test_the_server_makes_its_engine_with_the_scheduling_asked_and_refuses_it_for_yours() -> None:
    async with running(Synthetic(), scheduling="fcfs", quantum=2) as server:
        limits = server.engine._table.limits
        assert (limits.scheduling, limits.quantum) == ("fcfs", 2)
    engine = om.Engine(Synthetic(), device="cpu")
    with pytest.raises(om.ParamsError) as info:
        create_app(engine, scheduling="fcfs")
    assert info.value.field == "scheduling"
