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


def test_the_queue_a_browser_steers_through_a_real_omni_stream_serve() -> None:
    """The command users run, in its own process, one place: a session's jobs are listed to it,
    a waiting one's events open with where it stands, and its priority-10 job takes the place
    of its priority-0 one (paused, then resumed: both end done)."""
    import json
    import signal

    from .test_serve import omni_stream_serve

    slow = {"shape": [3, 16, 16], "steps": 2_000, "work": 100}  # ~3 ms steps: ~6 s alone
    one_place = {"OMNI_STREAM_MAX_ACTIVE": "1"}
    with omni_stream_serve("--model", "synthetic", "--device", "cpu", env=one_place) as (
        proc, _, url,
    ), httpx.Client(base_url=url, timeout=60) as browser:
        browser.get("/")  # first contact: the session cookie
        first = browser.post("/v1/generations", json={"params": {**slow, "seed": 1}}).json()["id"]
        second = browser.post("/v1/generations", json={"params": {**slow, "seed": 2}}).json()["id"]
        opened = []
        with browser.stream("GET", f"/v1/generations/{second}/events") as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    opened.append(json.loads(line[6:]))
                if len(opened) == 2:
                    break
        # (1 while the first has not taken its first step: it is queued in the engine, first.)
        assert [m["type"] for m in opened] == ["accepted", "queued"] and opened[1]["position"] in (0, 1)
        # Waits for its result: it must not wait for the 400-step first one to end.
        urgent = browser.post(
            "/v1/generations?wait=true",
            json={"id": "urgent", "params": {**slow, "steps": 4, "seed": 3}, "priority": 10},
        )
        urgent_id = "urgent"
        done = urgent.status_code
        listing = browser.get("/v1/generations").json()["generations"]
        states = {g["id"]: g["status"] for g in listing}
        with httpx.Client(base_url=url) as stranger:
            assert {g["id"] for g in stranger.get("/v1/generations").json()["generations"]} == {None}
        for rid in (first, second):
            browser.delete(f"/v1/generations/{rid}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert done == 200
    # The urgent one ran while the first was paused for it; the second still waits or runs.
    assert states[urgent_id] == "done" and states[first] in ("running", "paused") and second in states
