"""The server over real websockets on 127.0.0.1: protocol, lifetimes, slow clients, security, routes."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from PIL import Image
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

import omni_stream as om
from omni_stream.engine import Health
from omni_stream.models import Synthetic
from omni_stream.preview import Previewer
from omni_stream.server import Server
from omni_stream.server.http11 import transport_of

from .conftest import (
    SMALL,
    RawClient,
    Slow,
    check_stream,
    http_get,
    recv,
    running,
    send,
    until,
    until_end,
    wait_for,
)

# -- the protocol ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_generate_streams_progress_previews_and_result() -> None:
    async with running() as server, connect(server.url) as ws:
        await send(ws, type="generate", id="one", params={**SMALL, "steps": 6})
        msgs = await until_end(ws, "one")
    check_stream(msgs, "one", 6)
    accepted = msgs[0]
    assert accepted == {
        "type": "accepted",
        "id": "one",
        "total": 6,
        "detach": False,
        "attached": False,
        "preview": {
            "every": 1, "format": "jpeg", "max_size": 512, "quality": 85, "decoder": "auto",
            "video": "strip",
        },
        "output": {"format": "png", "quality": None},
        "seed": accepted["seed"],  # none given: drawn (the seed tests: tests/core/test_rules.py)
    }
    assert isinstance(accepted["seed"], int)
    # The result is a PNG that says how it was made, whatever the previews are.
    final = msgs[-2]
    assert (final["format"], final["width"], final["height"], final["mime"]) == ("png", 16, 16, "image/png")
    image = Image.open(io.BytesIO(final["image"]))
    assert image.size == (16, 16)
    assert json.loads(image.text["omni_stream"])["steps"] == 6
    assert "Steps: 6" in image.text["parameters"]
    progress = [m for m in msgs if m["type"] == "progress"]
    assert progress[-1]["step"] == 6 and progress[-1]["eta_s"] == 0.0
    assert msgs[-1]["total"] == 6 and msgs[-1]["elapsed_s"] >= 0


@pytest.mark.asyncio
async def test_preview_options_raw_every_and_max_size() -> None:
    async with running() as server, connect(server.url) as ws:
        await send(
            ws,
            type="generate",
            id="raw",
            params={**SMALL, "steps": 9, "shape": [3, 40, 20]},
            preview={"every": 4, "format": "raw", "max_size": 10},
        )
        msgs = await until_end(ws, "raw")
    check_stream(msgs, "raw", 9)
    previews = [m for m in msgs if m["type"] == "preview"]
    # "every" means at most every 4th step: a step the preview thread was
    # too busy for is skipped, never the result.
    assert {p["step"] for p in previews[:-1]} <= {4, 8} and previews[-1]["step"] == 9
    for p in previews[:-1]:
        # max_size only shrinks, aspect kept: 20x40 -> 5x10.
        assert (p["width"], p["height"]) == (5, 10)
        assert len(p["image"]) == 5 * 10 * 3
    # The result is never shrunk by the preview's max_size.
    assert (previews[-1]["final"], previews[-1]["format"]) == (True, "png")
    assert Image.open(io.BytesIO(previews[-1]["image"])).size == (20, 40)
    # max_size never enlarges.
    async with running() as server, connect(server.url) as ws:
        await send(ws, type="generate", id="big", params={**SMALL, "steps": 1},
                   preview={"format": "png", "max_size": 4096})
        msgs = await until_end(ws, "big")
    assert msgs[0]["preview"]["max_size"] == 2048  # capped at max_image_size
    assert (msgs[-2]["width"], msgs[-2]["height"]) == (16, 16)


@pytest.mark.asyncio
async def test_previews_are_never_deflated() -> None:
    async with running() as server, connect(server.url, compression="deflate") as ws:
        # The client offered permessage-deflate; the server must decline it.
        assert ws.request.headers.get("Sec-WebSocket-Extensions")
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None


@pytest.mark.asyncio
async def test_server_makes_unguessable_ids() -> None:
    async with running() as server, connect(server.url) as ws:
        await send(ws, type="generate", params={**SMALL, "steps": 2})
        accepted = await recv(ws)
        assert uuid.UUID(hex=accepted["id"]).version == 4
        await until_end(ws, accepted["id"])


@pytest.mark.asyncio
async def test_several_requests_on_one_connection() -> None:
    formats = {"a": "jpeg", "b": "png", "c": "raw"}
    async with running() as server, connect(server.url) as ws:
        for rid, fmt in formats.items():
            await send(ws, type="generate", id=rid, params={**SMALL, "steps": 5, "seed": ord(rid)},
                       preview={"format": fmt}, output={"format": fmt})
        by_id: dict[str, list[dict[str, Any]]] = {rid: [] for rid in formats}
        ended: set[str] = set()
        with anyio.fail_after(30):
            while ended != set(formats):
                msg = await recv(ws)
                by_id[msg["id"]].append(msg)
                if msg["type"] == "done":
                    ended.add(msg["id"])
    for rid, fmt in formats.items():
        check_stream(by_id[rid], rid, 5)
        assert by_id[rid][-2]["format"] == fmt


@pytest.mark.asyncio
async def test_model_errors_end_the_request_and_the_connection_stays() -> None:
    async with running() as server, connect(server.url) as ws:
        await send(ws, type="generate", id="boom", params={**SMALL, "steps": 5, "fail_at": 3})
        msgs = await until_end(ws, "boom")
        end = msgs[-1]
        assert end["type"] == "error" and end["code"] == "step_failed"
        assert "synthetic failure injected at step 3" in end["message"]
        await send(ws, type="generate", id="after", params={**SMALL, "steps": 2})
        assert (await until_end(ws, "after"))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_undecodable_frames_end_with_preview_failed() -> None:
    async with running() as server, connect(server.url) as ws:
        # 5 channels: the sd15 decoder cannot make RGB out of that ("auto" could).
        await send(ws, type="generate", id="odd", params={**SMALL, "steps": 3, "shape": [5, 8, 8]},
                   preview={"decoder": "sd15"})
        msgs = await until_end(ws, "odd")
    assert msgs[-1]["code"] == "preview_failed"
    await wait_for(lambda: server.engine.statistics().active == 0, what="the request to be dropped")


# -- bad input -------------------------------------------------------------------

BAD_MESSAGES: list[tuple[Any, str, str | None]] = [
    ("{not json", "bad_json", None),
    (b"\x00\x01binary", "bad_message", None),
    ("[]", "bad_message", None),
    ('{"id": "x"}', "invalid_field", "type"),
    ('{"type": "fly"}', "unknown_type", "type"),
    ('{"type": "generate"}', "invalid_field", "params"),
    ('{"type": "generate", "params": "steps=3"}', "invalid_field", "params"),
    ('{"type": "generate", "params": {}, "colour": 1}', "invalid_field", "colour"),
    ('{"type": "generate", "params": {}, "id": "has space"}', "invalid_field", "id"),
    ('{"type": "generate", "params": {"steps": "many"}}', "bad_params", "steps"),
    ('{"type": "generate", "params": {"stpes": 3}}', "bad_params", "stpes"),
    ('{"type": "generate", "params": {"steps": 20000}}', "limit_exceeded", "steps"),
    ('{"type": "generate", "params": {"shape": [3, 4000, 8]}}', "limit_exceeded", "shape"),
    ('{"type": "generate", "params": {}, "preview": {"format": "gif"}}', "invalid_field", "preview.format"),
    ('{"type": "generate", "params": {}, "preview": {"every": 0}}', "invalid_field", "preview.every"),
    ('{"type": "generate", "params": {}, "preview": {"colour": 1}}', "invalid_field", "preview.colour"),
    ('{"type": "generate", "params": {}, "preview": {"decoder": "os:system"}}', "invalid_field", "preview.decoder"),
    ('{"type": "cancel", "id": "nobody"}', "not_found", "id"),
    ('{"type": "attach", "id": "nobody"}', "not_found", "id"),
    ('{"type": "cancel"}', "invalid_field", "id"),
]


@pytest.mark.asyncio
async def test_malformed_messages_get_errors_and_the_connection_stays_open() -> None:
    async with running(Slow(0.01)) as server, connect(server.url) as ws:
        for data, code, field in BAD_MESSAGES:
            await ws.send(data)
            reply = await recv(ws)
            assert reply["type"] == "error", (data, reply)
            assert (reply["code"], reply.get("field")) == (code, field), (data, reply)
            assert reply["message"]
        # Duplicate id and double attach need a request that is running.
        await send(ws, type="generate", id="live", params={**SMALL, "steps": 2000})
        assert (await recv(ws))["type"] == "accepted"
        await send(ws, type="generate", id="live", params={**SMALL})
        dup = await until(ws, lambda m: m["type"] == "error")
        assert (dup["code"], dup["id"]) == ("duplicate_id", "live")
        await send(ws, type="attach", id="live")
        again = await until(ws, lambda m: m["type"] == "error")
        assert again["code"] == "already_attached"
        await send(ws, type="cancel", id="live")
        end = await until(ws, lambda m: m["type"] == "cancelled")
        assert end == {"type": "cancelled", "id": "live", "reason": "client"}
        # Still open and serving.
        await send(ws, type="generate", id="fine", params={**SMALL, "steps": 2})
        assert (await until_end(ws, "fine"))[-1]["type"] == "done"
    text = server.metrics.render().decode()
    # Rejected requests: well-formed generates refused (8 above, the duplicate);
    # messages that are not a well-formed generate are not requests.
    assert 'omni_stream_requests_total{model="slow",outcome="rejected"} 9.0' in text


@pytest.mark.asyncio
async def test_oversize_message_closes_with_1009() -> None:
    async with running(max_message_bytes=1024) as server, connect(server.url) as ws:
        await ws.send(json.dumps({"type": "generate", "params": {}, "id": "x", "pad": "y" * 2000}))
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


@pytest.mark.asyncio
async def test_per_connection_request_limit() -> None:
    async with running(Slow(0.01), max_requests_per_principal=1) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="a", params={**SMALL, "steps": 2000})
        await send(ws, type="generate", id="b", params={**SMALL, "steps": 2})
        err = await until(ws, lambda m: m["type"] == "error")
        assert (err["code"], err["id"]) == ("too_many_requests", "b")
        assert "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL" in err["message"]
        async with connect(server.url) as other:  # the limit is per connection
            await send(other, type="generate", id="c", params={**SMALL, "steps": 2})
            assert (await until_end(other, "c"))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_connection_limit_refuses_with_503() -> None:
    async with running(max_connections=1) as server, connect(server.url):
        with pytest.raises(InvalidStatus) as info:
            async with connect(server.url):
                pass
        assert info.value.response.status_code == 503
        assert json.loads(info.value.response.body)["error"] == "too_many_connections"


# -- lifetimes -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_disconnect_cancels_its_requests() -> None:
    async with running(Slow(0.01)) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="mine", params={**SMALL, "steps": 5000})
            await until(ws, lambda m: m["type"] == "progress")
        await wait_for(lambda: server.engine.statistics().cancelled == 1, what="cancel on disconnect")
        assert server.engine.statistics().active == 0


@pytest.mark.asyncio
async def test_other_watchers_hear_why_a_request_ended() -> None:
    async with running(Slow(0.01), token="t") as server:
        auth = {"Authorization": "Bearer t"}
        async with connect(server.url, additional_headers=auth) as watcher:
            async with connect(server.url, additional_headers=auth) as owner:
                await send(owner, type="generate", id="shared", params={**SMALL, "steps": 5000})
                await until(owner, lambda m: m["type"] == "progress")
                await send(watcher, type="attach", id="shared")
                assert (await recv(watcher))["attached"] is True
            msgs = await until_end(watcher, "shared")
    assert msgs[-1] == {"type": "cancelled", "id": "shared", "reason": "disconnect"}


@pytest.mark.asyncio
async def test_detached_request_survives_and_can_be_attached_after_reconnect() -> None:
    async with running(Slow(0.01)) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="kept", params={**SMALL, "steps": 150}, detach=True)
            assert (await recv(ws))["detach"] is True
            await until(ws, lambda m: m["type"] == "preview")
        # Reconnect: the latest progress and preview, then the rest, then the result.
        async with connect(server.url) as ws:
            await send(ws, type="attach", id="kept")
            msgs = await until_end(ws, "kept")
        assert msgs[0]["attached"] is True
        assert [m["type"] for m in msgs[1:3]] == ["progress", "preview"]
        assert msgs[1]["step"] >= 1
        # The replayed preview may be older than the replayed progress; after it, order holds
        # (counting the replayed progress: a preview of its step may be rendering as we attach).
        assert msgs[2]["step"] <= msgs[1]["step"]
        check_stream([msgs[0], msgs[1], *msgs[3:]], "kept", 150)
        assert server.engine.statistics().cancelled == 0
        # After it ended: the result is replayed at once.
        async with connect(server.url) as ws:
            await send(ws, type="attach", id="kept")
            replay = [await recv(ws) for _ in range(4)]
        assert [m["type"] for m in replay] == ["accepted", "progress", "preview", "done"]
        assert replay[1]["step"] == 150 and replay[2]["final"] is True
        assert replay[2]["image"] == msgs[-2]["image"]


@pytest.mark.asyncio
async def test_retention_is_bounded_in_time() -> None:
    async with running(retention_s=0.2) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="brief", params={**SMALL, "steps": 2}, detach=True)
        await until_end(ws, "brief")
        assert len(server.service.registry) == 1
        await wait_for(lambda: len(server.service.registry) == 0, what="retention to expire")
        await send(ws, type="attach", id="brief")
        assert (await recv(ws))["code"] == "not_found"


@pytest.mark.asyncio
async def test_without_token_others_cannot_touch_undetached_requests() -> None:
    async with running(Slow(0.01)) as server, connect(server.url) as owner, connect(
        server.url
    ) as other:
        await send(owner, type="generate", id="private", params={**SMALL, "steps": 5000})
        await until(owner, lambda m: m["type"] == "progress")
        for kind in ("attach", "cancel"):
            await send(other, type=kind, id="private")
            err = await recv(other)
            assert (err["code"], err["id"]) == ("not_found", "private")
        # The owner's request was not touched.
        await send(owner, type="cancel", id="private")
        end = await until(owner, lambda m: m["type"] == "cancelled")
        assert end["reason"] == "client"


@pytest.mark.asyncio
async def test_without_token_a_detached_id_is_a_capability_to_cancel() -> None:
    async with running(Slow(0.01)) as server:
        async with connect(server.url) as owner:
            await send(owner, type="generate", id="d", params={**SMALL, "steps": 5000}, detach=True)
            await until(owner, lambda m: m["type"] == "progress")
        async with connect(server.url) as ws:
            await send(ws, type="attach", id="d")
            await recv(ws)
            await send(ws, type="cancel", id="d")
            end = await until(ws, lambda m: m["type"] == "cancelled")
    assert end["reason"] == "client"


@pytest.mark.asyncio
async def test_one_encode_per_step_shared_by_watchers() -> None:
    class Counting(Previewer):
        def __init__(self) -> None:
            super().__init__()
            self.rendered: list[tuple[str, int]] = []

        async def render(self, frame: Any, spec: Any) -> Any:
            self.rendered.append((frame.request_id, frame.step))
            return await super().render(frame, spec)

    previewer = Counting()
    async with running(Slow(0.005), token="t", previewer=previewer) as server:
        auth = {"Authorization": "Bearer t"}
        async with connect(server.url, additional_headers=auth) as a, connect(
            server.url, additional_headers=auth
        ) as b:
            await send(a, type="generate", id="twice", params={**SMALL, "steps": 60})
            await until(a, lambda m: m["type"] == "progress")
            await send(b, type="attach", id="twice")
            got_a = await until_end(a, "twice")
            got_b = await until_end(b, "twice")
    assert len(previewer.rendered) == len(set(previewer.rendered))
    assert got_a[-2]["raw"] == got_b[-2]["raw"]


# -- slow clients ----------------------------------------------------------------


def _stalled(server: Server) -> Any:
    (conn,) = [c for c in server.connections.values()]
    return conn


FLOOD = {
    "type": "generate",
    "id": "flood",
    "params": {"steps": 400, "shape": [3, 512, 512], "work": 0},
    "preview": {"format": "raw"},
}


@pytest.mark.asyncio
async def test_a_stalled_client_never_delays_another_and_is_disconnected() -> None:
    async with running(send_timeout_s=60, max_pending=8, close_timeout_s=0.5) as server:
        raw = await RawClient.connect(server)
        try:
            await raw.send_text(json.dumps(FLOOD))
            # Wait until the server's socket to it is backed up (writer blocked in drain).
            conn = _stalled(server)
            await wait_for(
                lambda: transport_of(conn.ws).get_write_buffer_size() > 64 * 1024,
                what="the stalled client's socket to back up",
            )
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="quick", params={**SMALL, "steps": 20})
                check_stream(await until_end(ws, "quick"), "quick", 20)
                # Everything reached the healthy client while the stalled one stayed stuck.
                assert conn.id in server.connections
                assert transport_of(conn.ws).get_write_buffer_size() > 64 * 1024
                # The stalled client keeps sending; the replies it never reads
                # pile up until max_pending, and it is disconnected.
                for _ in range(12):
                    await raw.send_text("not json")
                await wait_for(lambda: conn.id not in server.connections, what="the disconnect")
                # The close frame the server sent (the client never reads it).
                assert conn.close_text().startswith("1008 client not reading")
                # Its request was cancelled; the server still serves.
                await send(ws, type="generate", id="again", params={**SMALL, "steps": 3})
                assert (await until_end(ws, "again"))[-1]["type"] == "done"
        finally:
            raw.close()
    text = server.metrics.render().decode()
    assert "omni_stream_slow_client_disconnects_total 1.0" in text
    assert 'omni_stream_messages_dropped_total{kind="preview"}' in text


@pytest.mark.asyncio
async def test_a_send_blocked_too_long_disconnects() -> None:
    async with running(send_timeout_s=0.3, close_timeout_s=0.3) as server:
        raw = await RawClient.connect(server)
        try:
            await raw.send_text(json.dumps(FLOOD))
            conn = _stalled(server)
            await wait_for(lambda: conn.id not in server.connections, what="the disconnect")
            assert conn.close_text().startswith("1008 ") and "blocked" in conn.close_text()
        finally:
            raw.close()
        await wait_for(lambda: server.engine.statistics().active == 0, what="its request to end")


# -- security --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_token_is_required_before_the_upgrade() -> None:
    async with running(token="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url, additional_headers=headers):
                    pass
            response = info.value.response
            assert response.status_code == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert json.loads(response.body)["error"] == "unauthorized"
        async with connect(server.url, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            await send(ws, type="generate", id="ok", params={**SMALL, "steps": 1})
            assert (await until_end(ws, "ok"))[-1]["type"] == "done"
        async with connect(server.url + "?token=s3cret") as ws:
            await ws.ping()
        # The HTTP routes stay open: probes and the page need no token.
        assert (await http_get(server, "/health")).status == 200


@pytest.mark.asyncio
async def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_TOKEN", "env-token")
    async with running() as server:
        with pytest.raises(InvalidStatus) as info:
            async with connect(server.url):
                pass
        assert info.value.response.status_code == 401
        async with connect(server.url + "?token=env-token") as ws:
            await ws.ping()


@pytest.mark.asyncio
async def test_foreign_origins_are_refused_with_403() -> None:
    async with running(allow_origins=["https://app.example"]) as server:
        with pytest.raises(InvalidStatus) as info:
            async with connect(server.url, origin="http://evil.example"):
                pass
        assert info.value.response.status_code == 403
        assert json.loads(info.value.response.body)["error"] == "forbidden_origin"
        for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}",
                       "https://app.example"):
            async with connect(server.url, origin=origin) as ws:
                await ws.ping()
    text = server.metrics.render().decode()
    assert 'omni_stream_handshakes_refused_total{reason="forbidden_origin"} 1.0' in text


# -- HTTP routes -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_models_route_describes_the_params() -> None:
    async with running() as server:
        reply = await http_get(server, "/models")
    assert reply.status == 200 and reply.headers["Content-Type"] == "application/json"
    body = reply.json()
    assert body["name"] == "synthetic"
    names = [p["name"] for p in body["params"]]
    assert names[:3] == ["steps", "shape", "work"]
    assert body["preview"]["default"]["format"] == "jpeg"
    assert body["limits"]["max_steps"] == 10_000
    # The result formats a request may ask for (output.format), the default first.
    assert body["output"] == {"formats": ["png", "jpeg", "webp", "raw"], "default": {"format": "png", "quality": None}}


@pytest.mark.asyncio
async def test_page_route_serves_the_page_or_404(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from omni_stream.server import responses

    page = tmp_path / "index.html"
    page.write_text("<!doctype html><title>omni</title>")
    monkeypatch.setattr(responses, "PAGE", page)
    async with running() as server:
        reply = await http_get(server, "/")
        assert reply.status == 200 and reply.body.startswith(b"<!doctype html>")
        assert reply.headers["Content-Type"] == "text/html; charset=utf-8"
        page.unlink()
        missing = await http_get(server, "/")
        assert missing.status == 404 and missing.json()["error"] == "not_found"
        unknown = await http_get(server, "/nope")
        assert unknown.status == 404 and "/nope" in unknown.json()["message"]


def test_an_error_response_keeps_what_it_says_beside_its_body() -> None:
    # The OpenAI doors rebuild our error in their shape from these fields, not from the body.
    from omni_stream.server.responses import ErrorResponse, error_response

    reply = error_response(429, "busy", "full", extra={"Retry-After": "2"}, retry_after_s=1.5, id="r")
    assert isinstance(reply, ErrorResponse) and reply.status_code == 429
    assert (reply.code, reply.message, reply.fields) == ("busy", "full", {"retry_after_s": 1.5, "id": "r"})
    assert json.loads(reply.body) == {"error": "busy", "message": "full", "retry_after_s": 1.5, "id": "r"}
    assert reply.headers["Retry-After"] == "2" and reply.headers["Cache-Control"] == "no-store"
    assert reply.headers["Content-Type"] == "application/json"


@pytest.mark.asyncio
async def test_health_reports_statistics_and_turns_503_when_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    # stay_dead: otherwise the server shuts itself down once it sees the engine dead.
    async with running(stay_dead=True) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="h", params={**SMALL, "steps": 2})
        await until_end(ws, "h")
        reply = await http_get(server, "/health")
        assert reply.status == 200
        body = reply.json()
        assert (body["status"], body["ok"], body["reason"]) == ("ok", True, None)
        assert body["completed"] == 1 and body["active"] == 0 and body["cancelled"] == 0
        assert body["server"] == {"connections": 1, "principals": 1, "requests": 0, "retained": 0}

        stats = server.engine.statistics()
        monkeypatch.setattr(
            server.engine, "health", lambda: Health("dead", "the producer thread exited", stats)
        )
        reply = await http_get(server, "/health")
        assert reply.status == 503
        assert (reply.json()["status"], reply.json()["reason"]) == ("dead", "the producer thread exited")
        # A dead engine takes no work; the connection stays open.
        await send(ws, type="generate", id="late", params=SMALL)
        err = await recv(ws)
        assert (err["code"], err["id"]) == ("engine_unavailable", "late")
        assert "dead" in err["message"]
        metrics = (await http_get(server, "/metrics")).body.decode()
        assert "omni_stream_engine_up 0.0" in metrics


@pytest.mark.asyncio
async def test_health_turns_503_when_a_step_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_STEP_TIMEOUT", "0.2")
    async with running(Synthetic()) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="hang",
                   params={**SMALL, "steps": 3, "hang_at": 2, "hang_s": 2.0})
        msgs = await until_end(ws, "hang")
        assert (msgs[-1]["type"], msgs[-1]["code"]) == ("error", "step_timeout")
        replies = []

        async def stalled() -> bool:
            replies.append(await http_get(server, "/health"))
            return replies[-1].status == 503

        with anyio.fail_after(20):
            while not await stalled():
                await anyio.sleep(0.05)
        body = replies[-1].json()
        assert body["status"] == "stalled" and "OMNI_STREAM_STEP_TIMEOUT" in body["reason"]


@pytest.mark.asyncio
async def test_health_turns_503_when_the_engine_is_closed() -> None:
    engine = om.Engine(Synthetic(), device="cpu")
    await engine.start()
    await engine.aclose()
    # The caller owns an engine it passes in; the server reports what it sees.
    async with running(engine) as server:
        reply = await http_get(server, "/health")
        assert (reply.status, reply.json()["status"]) == (503, "closed")
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="x", params=SMALL)
            assert (await recv(ws))["code"] == "engine_unavailable"


@pytest.mark.asyncio
async def test_a_bug_in_one_request_or_connection_never_kills_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from omni_stream.server import consumer, websocket as connection

    real_publish, real_result = consumer._publish, consumer._publish_result

    async def publish(record: Any, frame: Any, spec: Any, **kwargs: Any) -> Any:
        if record.id == "buggy":
            raise RuntimeError("bug while streaming")
        return await real_publish(record, frame, spec, **kwargs)

    async def publish_result(record: Any, *args: Any, **kwargs: Any) -> None:
        if record.id == "buggy":  # a fast request's first frame may be its result
            raise RuntimeError("bug while streaming")
        await real_result(record, *args, **kwargs)

    monkeypatch.setattr(consumer, "_publish", publish)
    monkeypatch.setattr(consumer, "_publish_result", publish_result)
    async with running() as server:
        def attach(client: Any, request_id: Any) -> None:
            raise RuntimeError("bug while handling a message")

        monkeypatch.setattr(server.service.rules, "attach", attach)
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="buggy", params={**SMALL, "steps": 3})
            end = (await until_end(ws, "buggy"))[-1]
            assert (end["type"], end["code"]) == ("error", "internal")
            await send(ws, type="attach", id="x")
            err = await recv(ws)
            assert (err["code"], err["id"]) == ("internal", "x")
            await send(ws, type="generate", id="fine", params={**SMALL, "steps": 2})
            assert (await until_end(ws, "fine"))[-1]["type"] == "done"

        async def broken_writer(self: Any) -> None:
            raise RuntimeError("bug in a connection")

        monkeypatch.setattr(connection.ClientConnection, "_write", broken_writer)
        async with connect(server.url) as ws:
            with pytest.raises(ConnectionClosed):
                await recv(ws)
        assert (ws.close_code, ws.close_reason) == (1011, "internal error")
        monkeypatch.undo()
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="still", params={**SMALL, "steps": 2})
            assert (await until_end(ws, "still"))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_metrics_count_what_happened() -> None:
    async with running() as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="m", params={**SMALL, "steps": 4})
            await until_end(ws, "m")
            await send(ws, type="generate", params={"steps": -1})
            rejected = await recv(ws)
            # No id in the message, so none in the reply (not one the server made up).
            assert rejected["code"] == "bad_params" and "id" not in rejected
        reply = await http_get(server, "/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.body.decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    assert all(name.startswith("omni_stream_") for name in names)
    for expected in (
        'omni_stream_requests_total{model="synthetic",outcome="done"} 1.0',
        'omni_stream_requests_total{model="synthetic",outcome="rejected"} 1.0',
        'omni_stream_queue_wait_seconds_count{model="synthetic"} 1.0',
        'omni_stream_first_preview_seconds_count{model="synthetic"} 1.0',
        'omni_stream_request_seconds_count{model="synthetic"} 1.0',
        'omni_stream_messages_sent_total{kind="accepted"} 1.0',
        'omni_stream_messages_sent_total{kind="done"} 1.0',
        'omni_stream_messages_sent_total{kind="error"} 1.0',
        "omni_stream_connections_opened_total 1.0",
        "omni_stream_engine_up 1.0",
        "omni_stream_engine_queued 0.0",
        "omni_stream_requests_running 0.0",
    ):
        assert expected in text, expected
    compute = [line for line in text.splitlines() if line.startswith("omni_stream_step_compute_seconds_count")]
    assert float(compute[0].split()[-1]) >= 1
    assert "omni_stream_step_copy_seconds_count" in text
    assert "omni_stream_preview_encode_seconds_count" in text


# -- shutdown --------------------------------------------------------------------


async def read_all(ws: Any, into: list[dict[str, Any]]) -> None:
    try:
        while True:
            into.append(await recv(ws))
    except ConnectionClosed:
        pass


@pytest.mark.asyncio
async def test_shutdown_cancels_in_flight_requests_and_closes_with_1001() -> None:
    server = Server(Slow(0.01), host="127.0.0.1", port=0, device="cpu",
                    shutdown_timeout_s=0.2, close_timeout_s=1.0)
    await server.start()
    msgs: list[dict[str, Any]] = []
    try:
        ws = await connect(server.url)
        await send(ws, type="generate", id="busy", params={**SMALL, "steps": 5000})
        await until(ws, lambda m: m["type"] == "progress")
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_all, ws, msgs)
                await server.shutdown()
    finally:
        # aclose from the task that started the server, outside other scopes.
        await server.aclose()
    assert msgs[-1] == {"type": "cancelled", "id": "busy", "reason": "shutdown"}
    assert (ws.close_code, ws.close_reason) == (1001, "server shutting down")
    assert server.engine.statistics().cancelled == 1


@pytest.mark.asyncio
async def test_shutdown_lets_short_requests_finish_and_refuses_new_ones() -> None:
    server = Server(Slow(0.02), host="127.0.0.1", port=0, device="cpu", shutdown_timeout_s=20)
    await server.start()
    msgs: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    try:
        ws = await connect(server.url)
        other = await connect(server.url)
        await send(ws, type="generate", id="short", params={**SMALL, "steps": 60})
        await until(ws, lambda m: m["type"] == "progress")

        async def while_closing() -> None:
            await wait_for(lambda: server.closing)
            await send(other, type="generate", id="new", params=SMALL)
            checks["refused"] = await recv(other)
            # Probes see it; new websockets are refused.
            checks["health"] = await http_get(server, "/health")
            try:
                await connect(server.url)
            except InvalidStatus as exc:
                checks["handshake"] = exc.response.status_code
            await read_all(ws, msgs)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(while_closing)
                await anyio.lowlevel.checkpoint()
                await server.shutdown()
    finally:
        await server.aclose()
    refused = checks["refused"]
    assert (refused["code"], refused["id"]) == ("shutting_down", "new")
    assert (checks["health"].status, checks["health"].json()["status"]) == (503, "shutting_down")
    assert checks["handshake"] == 503
    assert [m["type"] for m in msgs][-2:] == ["preview", "done"]
    assert ws.close_code == 1001


def test_bad_server_options_name_the_option() -> None:
    with pytest.raises(om.ParamsError) as info:
        Server(Synthetic(), port=-1)
    assert info.value.field == "port"
    with pytest.raises(om.ParamsError) as info:
        Server(Synthetic(), max_pending=0)
    assert info.value.field == "max_pending"
    with pytest.raises(om.ParamsError) as info:
        Server("synthetic")  # type: ignore[arg-type]
    assert info.value.field == "engine_or_model"


@pytest.mark.asyncio
async def test_a_connection_accepted_before_close_is_not_answered_after_it():
    # Browsers preconnect idle sockets; after aclose nothing may answer on them
    # (a page then reported "shutting down" for a server that was gone).
    import asyncio

    async with Server(
        Synthetic(), host="127.0.0.1", port=0, device="cpu", shutdown_timeout_s=0.5, close_timeout_s=1.0
    ) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        await anyio.sleep(0.05)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        await writer.drain()
        with anyio.fail_after(5):
            answer = await reader.read(100)
    except ConnectionError:
        answer = b""
    writer.close()
    assert answer == b""
