"""Every door applies the same rules (issue #19): on a real uvicorn server, over HTTP and the websocket.

Each test is one finding of the issue, and fails on the code before its
fix: the Origin and Host checks on every door, HTTP callers as principals,
a tenant's priority within its own work, input images checked before they
are decoded, non-finite results, ids a URL would lose, and queued work
during a graceful shutdown.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import struct
import zlib
import time
from typing import Any

import anyio
import httpx
import pytest
import torch
from PIL import Image
from websockets.asyncio.client import connect

import omni_stream as om
from omni_stream.models import Synthetic

from .conftest import SMALL, Slow, running, send, until, until_end, wait_for
from .test_http import raw_http

FAST = {**SMALL, "steps": 2}


def http(server: Any, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.http_url, timeout=30, **kwargs)


# -- Origin, Host, CORS --------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_cross_site_post_or_delete_is_refused_as_the_websocket_is() -> None:
    # Finding 8: a text/plain POST from any page got 202 on a server without a token.
    async with running() as server, http(server) as client:
        evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        reply = await client.post("/v1/generations", content=json.dumps({"params": FAST}), headers=evil)
        assert (reply.status_code, reply.json()["error"]) == (403, "forbidden_origin")
        assert "OMNI_STREAM_ALLOW_ORIGINS" in reply.json()["message"]
        assert len(server.service.registry) == 0
        own = await client.post("/v1/generations", json={"params": FAST, "id": "mine"},
                                headers={"Origin": server.http_url})
        assert own.status_code == 202
        assert (await client.delete("/v1/generations/mine", headers=evil)).status_code == 403
        # Reading is not refused for an Origin (the browser keeps the answer from the page: no CORS).
        read = await client.get("/v1/generations/mine", headers=evil)
        assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
        # No Origin: not a browser.
        assert (await client.post("/v1/generations", json={"params": FAST})).status_code == 202


@pytest.mark.asyncio
async def test_a_loopback_server_answers_only_to_loopback_host_names() -> None:
    # Finding 8: a page on a rebound name (evil.example -> 127.0.0.1) could read every answer.
    async with running() as server, http(server) as client:
        for path in ("/v1/generations", "/models", "/health", "/"):
            reply = await client.get(path, headers={"Host": f"evil.example:{server.port}"})
            assert (reply.status_code, reply.json()["error"]) == (421, "forbidden_host"), path
            assert "OMNI_STREAM_ALLOWED_HOSTS" in reply.json()["message"]
        for host in ("127.0.0.1", "localhost", f"localhost:{server.port}", f"127.0.0.2:{server.port}"):
            assert (await client.get("/health", headers={"Host": host})).status_code == 200, host
        # The websocket's handshake too.
        handshake = (
            "GET /ws HTTP/1.1\r\nHost: evil.example\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert (await raw_http(server, handshake.encode())).startswith(b"HTTP/1.1 421")


@pytest.mark.asyncio
async def test_allowed_hosts_add_names_a_server_answers_to() -> None:
    async with running(allowed_hosts=["omni.example", "*.farm.example"]) as server, http(server) as client:
        for host in ("omni.example", "gpu1.farm.example:8765", "127.0.0.1"):
            assert (await client.get("/health", headers={"Host": host})).status_code == 200, host
        assert (await client.get("/health", headers={"Host": "other.example"})).status_code == 421


@pytest.mark.asyncio
async def test_cors_answers_only_configured_origins() -> None:
    page = "https://app.example"
    async with running(allow_origins=[page]) as server, http(server) as client:
        preflight = await client.options(
            "/v1/generations", headers={"Origin": page, "Access-Control-Request-Method": "POST"}
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == page
        assert "POST" in preflight.headers["access-control-allow-methods"]
        reply = await client.post("/v1/generations", json={"params": FAST}, headers={"Origin": page})
        assert reply.status_code == 202 and reply.headers["access-control-allow-origin"] == page
        other = await client.options("/v1/generations", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    async with running() as server, http(server) as client:
        # Not configured: no CORS at all (an OPTIONS is a method this route does not take).
        reply = await client.options("/v1/generations", headers={"Origin": page})
        assert reply.status_code == 405 and "access-control-allow-origin" not in reply.headers


# -- HTTP callers are principals ----------------------------------------------------------


@pytest.mark.asyncio
async def test_one_http_client_cannot_take_every_place_from_a_websocket_client() -> None:
    # Finding 5: each POST was its own client; one HTTP client filled all 132
    # places in 0.65 s and every websocket client got busy.
    async with running(Slow(0.05), max_active=2, max_queued=20) as server, http(server) as client:
        codes = []
        for i in range(24):
            reply = await client.post("/v1/generations", json={"params": {**SMALL, "steps": 400}, "id": f"h{i}"})
            codes.append(reply.status_code)
        assert codes.count(202) == 16 and set(codes[16:]) == {429}  # max_requests_per_principal
        assert "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL" in reply.json()["message"]
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="honest", params=FAST)
            accepted = await until(ws, lambda m: m.get("id") == "honest")
            assert accepted["type"] == "accepted"
        for i in range(16):
            await client.delete(f"/v1/generations/h{i}")


@pytest.mark.asyncio
async def test_a_tenant_flooding_with_a_high_priority_does_not_go_before_anothers_request(tmp_path) -> None:
    # Finding 9: behind a priority-10 flood from 4 connections an honest
    # priority-0 request waited 9-12 s for its first step.
    tokens = tmp_path / "tokens"
    tokens.write_text("flood=fff\nhonest=hhh\n")
    async with running(Slow(0.01), max_active=1, tokens_file=str(tokens)) as server:
        floods = [await connect(server.url + "?token=fff").__aenter__() for _ in range(4)]
        try:
            for i in range(12):
                await send(floods[i % 4], type="generate", id=f"f{i}", priority=10,
                           params={**SMALL, "steps": 30}, preview={"format": "raw"})
            await wait_for(lambda: server.service.gate.waiting == 11, what="the flood to queue")
            async with connect(server.url + "?token=hhh") as ws:
                await send(ws, type="generate", id="honest", params=FAST, preview={"format": "raw"})
                await until_end(ws, "honest")
                # It went in at the first free place: at most one flood request ended before it did.
                ended = [r for r in server.service.registry if r.id.startswith("f") and r.ended]
                assert len(ended) <= 1, [r.id for r in ended]
        finally:
            for ws in floods:
                ws.transport.abort()  # they never read: a close handshake would wait out its timeout


# -- input images ----------------------------------------------------------------


class Img2Img(Synthetic):
    """Synthetic with an input image its validate decodes, as img2img pipelines do."""

    name = "img2img"
    params = (*Synthetic.params, om.Param("image", "str", None))
    decodes = 0

    def validate(self, params: Any) -> dict[str, Any]:
        from omni_stream.models.inputs import load_image

        params = dict(params or {})
        image = params.pop("image", None)
        out = super().validate(params)
        if isinstance(image, str):
            type(self).decodes += 1
            image = load_image(image)
        return {**out, "image": image}


def bomb_url(side: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 8)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def png_url(side: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.asyncio
async def test_an_image_bomb_is_refused_from_its_header_and_a_fit_image_is_decoded_off_the_loop() -> None:
    # Finding 6: an 87 KB PNG declaring 4096x4096 was decoded in full on the
    # event loop (250-380 ms each) before max_image_size was checked.
    Img2Img.decodes = 0
    async with running(Img2Img(), max_image_size=512) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="bomb", params={**FAST, "image": bomb_url(4096)})
        err = await until(ws, lambda m: m.get("id") == "bomb")
        assert (err["code"], err["field"]) == ("limit_exceeded", "image") and "4096x4096" in err["message"]
        assert Img2Img.decodes == 0
        await send(ws, type="generate", id="fits", params={**FAST, "image": png_url(64)})
        assert (await until_end(ws, "fits"))[-1]["type"] == "done"
        # Decoded by the door, off the loop: the model's validate had no URL left to decode.
        assert Img2Img.decodes == 0
        record = server.service.registry.get("fits")
        assert record is None or record.ended


@pytest.mark.asyncio
async def test_an_image_the_server_has_no_memory_for_is_refused_before_it_is_decoded() -> None:
    # Finding 7 and the doors benchmark: a 1024x1024 input (a PNG of a few KB)
    # reserved 0.25 MiB; now it counts at its decoded size, from its header,
    # and a request refused for it costs no decode.
    Img2Img.decodes = 0
    async with running(Img2Img(), max_memory_bytes=64 << 20) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="big", params={**FAST, "image": png_url(1024)})
        err = await until(ws, lambda m: m.get("id") == "big")
        assert (err["code"], err["field"]) == ("limit_exceeded", "image") and "MiB" in err["message"]
        assert Img2Img.decodes == 0
        assert server.service.memory.reserved == 0


# -- results without a picture ----------------------------------------------------------


class Diverges(Synthetic):
    """Synthetic whose frames from step ``nan_from`` on are NaN (a model that diverged)."""

    name = "diverges"

    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.nan_from = nan_from

    def step(self, states: Any) -> list[torch.Tensor]:
        # 20 ms a step: the server's consumer (latest-wins) takes some of the
        # NaN frames before the final one even on a loaded machine.
        time.sleep(0.02)
        frames = super().step(states)
        return [f.fill_(float("nan")) if s.step >= self.nan_from else f for f, s in zip(frames, states, strict=True)]


@pytest.mark.asyncio
async def test_a_final_frame_of_nan_fails_its_request_and_its_previews_are_skipped_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="omni_stream.server")
    async with running(Diverges(nan_from=2)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="nan", params={**SMALL, "steps": 10}, preview={"format": "raw"})
        messages = await until_end(ws, "nan")
    end = messages[-1]
    assert (end["type"], end["code"]) == ("error", "step_failed") and "non-finite" in end["message"]
    previews = [m for m in messages if m["type"] == "preview"]
    assert all(p["step"] < 2 for p in previews)  # only frames with a picture (latest-wins may skip step 1)
    skipped = [r for r in caplog.records if "skipping previews of non-finite frames" in r.getMessage()]
    assert len(skipped) == 1


# -- odd paths and bodies -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_path_is_a_404_never_a_redirect_and_an_odd_id_is_echoed_clipped() -> None:
    async with running() as server, http(server) as client:
        for method, path in [("GET", "/v1/generations/"), ("DELETE", "/v1/generations/%2F"), ("GET", "/models/")]:
            reply = await client.request(method, path)
            assert reply.status_code in (404, 405) and reply.status_code != 307, (method, path)
        reply = await client.get("/v1/generations/" + "x" * 5000)
        assert (reply.status_code, reply.json()["error"]) == (404, "not_found")
        assert len(reply.content) < 1000 and len(reply.json()["id"]) < 100


@pytest.mark.asyncio
async def test_a_body_declared_over_the_bound_is_refused_before_anything_is_read_or_paced() -> None:
    async with running(max_message_bytes=1000, max_messages_per_s=1) as server:
        reply = await raw_http(
            server,
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000000\r\n\r\n{",
        )
        assert reply.startswith(b"HTTP/1.1 413") and b"max_message_bytes" in reply
        # Nothing was paced: the principal's one message a second is unspent.
        assert server.service.rules.rates.take("address:127.0.0.1", 1, server.service.rules.clock()) == 0.0


@pytest.mark.asyncio
async def test_a_request_refused_at_the_door_with_a_broken_body_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The fuzz: a chunked POST from a foreign Origin whose chunk framing is
    # broken. uvicorn answers 400 itself; the app's 403 must not be sent after it.
    async with running() as server:
        reply = await raw_http(
            server,
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 4")
        await anyio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


# -- ids ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("rid", [".", ".."])
async def test_an_id_a_url_would_normalise_away_is_refused_at_every_door(rid: str) -> None:
    async with running() as server, http(server) as client:
        reply = await client.post("/v1/generations", json={"params": FAST, "id": rid})
        assert (reply.status_code, reply.json()["error"], reply.json()["field"]) == (400, "invalid_field", "id")
        async with connect(server.url) as ws:
            await send(ws, type="generate", id=rid, params=FAST)
            err = await until(ws, lambda m: m["type"] == "error")
            assert (err["code"], err["field"]) == ("invalid_field", "id")
        assert len(server.service.registry) == 0


# -- shutting down ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_queued_requests_still_start_during_a_graceful_shutdown() -> None:
    # Finding: during the SIGTERM grace period queued requests never started,
    # even with the engine idle; they were cancelled at its end.
    async with running(Slow(0.01), max_active=1, shutdown_timeout_s=20) as server, http(server) as client:
        await client.post("/v1/generations", json={"id": "first", "params": {**SMALL, "steps": 20}})
        await client.post("/v1/generations", json={"id": "queued", "params": {**SMALL, "steps": 5}})
        await wait_for(lambda: server.service.gate.waiting == 1, what="the second to queue")
        first, queued = (server.service.registry.get(r) for r in ("first", "queued"))
        with anyio.fail_after(30):
            await server.shutdown()
        assert (first.outcome, queued.outcome) == ("done", "done")
