"""A browser's own jobs without a token (issue #38): the session cookie (server/sessions.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omni_stream.server import sessions

from .conftest import SMALL, recv, running, send

PARAMS: dict[str, Any] = {**SMALL, "steps": 2}


def _ids(listing: dict[str, Any]) -> set[str]:
    return {g["id"] for g in listing["generations"] if g["id"] is not None}


@pytest.mark.asyncio
async def test_each_browser_session_lists_its_own_jobs_and_no_one_elses() -> None:
    async with running() as server:
        base = server.http_url
        async with httpx.AsyncClient(base_url=base) as a, httpx.AsyncClient(base_url=base) as b:
            page = await a.get("/")
            cookie = page.headers["set-cookie"]
            assert cookie.startswith(f"{sessions.COOKIE}=")
            assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
            session = a.cookies[sessions.COOKIE]
            mine = [(await a.post("/v1/generations", json={"params": PARAMS})).json()["id"] for _ in range(2)]
            assert "set-cookie" not in (await a.get("/v1/generations")).headers  # kept, not renewed
            theirs = (await b.post("/v1/generations", json={"params": PARAMS})).json()["id"]
            # The page's websocket carries the cookie: its requests are the session's too.
            headers = {"Cookie": f"{sessions.COOKIE}={session}"}
            async with connect(server.url, additional_headers=headers) as ws:
                await send(ws, type="generate", id="from-the-page", params=PARAMS, detach=True)
                assert (await recv(ws))["type"] == "accepted"
            # Same address, three views: each session its own ids; a caller without one, none.
            assert _ids((await a.get("/v1/generations")).json()) == {*mine, "from-the-page"}
            assert _ids((await b.get("/v1/generations")).json()) == {theirs}
            async with httpx.AsyncClient(base_url=base) as nobody:
                listing = (await nobody.get("/v1/generations")).json()
                assert _ids(listing) == set() and len(listing["generations"]) == 4
                # A cookie not of the server's form names no session: replaced, sees nothing.
                forged = {"Cookie": f"{sessions.COOKIE}=x"}
                reply = await nobody.get("/v1/generations", headers=forged)
                assert reply.headers["set-cookie"].startswith(f"{sessions.COOKIE}=")
                assert _ids(reply.json()) == set()


@pytest.mark.asyncio
async def test_a_server_with_tokens_sets_no_session_cookie() -> None:
    async with running(token="tok") as server, httpx.AsyncClient(base_url=server.http_url) as client:
        assert "set-cookie" not in (await client.get("/?token=tok")).headers
        reply = await client.get("/v1/generations", headers={"Authorization": "Bearer tok"})
        assert reply.status_code == 200 and "set-cookie" not in reply.headers
