"""Signed webhooks (server/webhooks.py, docs/webhooks.md) against a real receiver on 127.0.0.1.

The receiver is a plain threaded HTTP server in the test: it answers what
each test scripts (a 500, then 200s) and keeps every request it got, which
the test verifies with ``standardwebhooks.Webhook(secret).verify``, as a
user's receiver would.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import httpx
import pytest
from standardwebhooks import Webhook
from websockets.asyncio.client import connect

from omni_stream.models import Synthetic

from .conftest import SMALL, Slow, recv, running, send, until_end, wait_for

SECRET = "whsec_" + base64.b64encode(b"omni-stream webhook test secret!").decode()


@dataclass
class Got:
    path: str
    headers: dict[str, str]
    body: bytes

    def verified(self, secret: str = SECRET) -> dict[str, Any]:
        """The payload, once its signature checks out (raises WebhookVerificationError otherwise)."""
        payload = Webhook(secret).verify(self.body, self.headers)
        assert isinstance(payload, dict)
        return payload


@dataclass
class Receiver:
    """What a receiver got, and the statuses it answers with (the last one repeats)."""

    url: str
    answers: list[int]
    got: list[Got] = field(default_factory=list)

    def types(self) -> list[str]:
        return [json.loads(g.body)["type"] for g in self.got]


@contextlib.contextmanager
def receiver(*answers: int) -> Iterator[Receiver]:
    state = Receiver("", list(answers) or [200])
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            with lock:
                state.got.append(Got(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = state.answers.pop(0) if len(state.answers) > 1 else state.answers[0]
            self.send_response(status)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def allowed(hook: Receiver) -> dict[str, Any]:
    return {"webhook_allow": [hook.url + "/hooks/*"], "webhook_secret": SECRET}


async def status_of(client: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    reply = await client.get(f"/v1/generations/{rid}")
    assert reply.status_code == 200
    body = reply.json()
    assert isinstance(body, dict)
    return body


async def wait_delivery(client: httpx.AsyncClient, rid: str, event: str) -> dict[str, Any]:
    """The request's delivery of ``event`` once it settled, as its status shows it."""
    found: dict[str, Any] = {}

    async def settled() -> bool:
        for delivery in (await status_of(client, rid))["webhook"]["deliveries"]:
            if delivery["event"] == event and delivery["status"] in ("delivered", "failed", "dropped"):
                found.update(delivery)
                return True
        return False

    with anyio.fail_after(60):
        while not await settled():
            await anyio.sleep(0.05)
    return found


@pytest.mark.asyncio
async def test_a_completed_request_is_delivered_signed_with_its_payload() -> None:
    with receiver(200) as hook:
        async with running(**allowed(hook)) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            body = {"id": "hooked", "params": {**SMALL, "steps": 3, "seed": 11},
                    "webhook": {"url": hook.url + "/hooks/one"}}
            reply = await client.post("/v1/generations", json=body)
            assert reply.status_code == 202, reply.text
            delivery = await wait_delivery(client, "hooked", "completed")
            status = await status_of(client, "hooked")
    [got] = hook.got
    assert got.path == "/hooks/one" and got.headers["content-type"] == "application/json"
    payload = got.verified()
    assert payload["type"] == "generation.completed" and payload["timestamp"].endswith("Z")
    assert payload["data"] == {
        "id": "hooked", "status": "done", "step": 3, "total": 3, "seed": 11, "model": None, "images": 1,
        "urls": {"self": "/v1/generations/hooked", "output": "/v1/generations/hooked/output"}, "error": None,
    }
    assert got.headers["webhook-id"] == delivery["webhook_id"]
    assert (delivery["attempts"], delivery["status"], delivery["response_status"]) == (1, "delivered", 200)
    assert status["webhook"]["url"] == hook.url + "/hooks/one"
    assert status["webhook"]["events"] == ["completed", "failed", "cancelled"]


@pytest.mark.asyncio
async def test_a_500_is_retried_with_the_same_webhook_id_and_counted_on_the_status() -> None:
    with receiver(500, 200) as hook:
        async with running(**allowed(hook)) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            body = {"id": "retried", "params": {**SMALL, "steps": 2},
                    "webhook": {"url": hook.url + "/hooks/r"}}
            assert (await client.post("/v1/generations", json=body)).status_code == 202
            delivery = await wait_delivery(client, "retried", "completed")
    first, second = hook.got
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == delivery["webhook_id"]
    assert first.body == second.body  # the same message, signed again for its try
    assert first.verified() == second.verified()
    assert (delivery["attempts"], delivery["status"], delivery["response_status"]) == (2, "delivered", 200)


@pytest.mark.asyncio
async def test_a_receiver_that_keeps_failing_is_given_up_on_after_the_last_try() -> None:
    with receiver(503) as hook:
        async with running(**allowed(hook)) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            # Two tries, 0.1 s apart (admission stamps max_attempts; the sender waits).
            quick = dataclasses.replace(server.service.rules.webhooks, max_attempts=2, first_retry_s=0.1)
            server.service.rules.webhooks = server.service.webhooks.config = quick
            body = {"id": "down", "params": {**SMALL, "steps": 2}, "webhook": {"url": hook.url + "/hooks/d"}}
            assert (await client.post("/v1/generations", json=body)).status_code == 202
            delivery = await wait_delivery(client, "down", "completed")
            assert server.service.rules.webhook_book.held == 0  # settled: no longer held
    assert (delivery["status"], delivery["attempts"], delivery["last_error"]) == ("failed", 2, "HTTP 503")
    assert len(hook.got) == 2


@pytest.mark.asyncio
async def test_over_the_websocket_progress_and_the_end_are_delivered_with_a_generated_secret(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMNI_STREAM_WEBHOOK_SECRET", raising=False)
    with receiver(200) as hook:
        async with running(Slow(0.02), webhook_allow=hook.url + "/hooks/*") as server:
            secret = server.service.webhooks.config.secret
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="ws1", params={**SMALL, "steps": 4},
                           webhook={"url": hook.url + "/hooks/ws", "events": ["progress", "completed"]})
                assert (await until_end(ws, "ws1"))[-1]["type"] == "done"
            await wait_for(lambda: "generation.completed" in hook.types(), what="the completed delivery")
            await wait_for(lambda: "generation.progress" in hook.types(), what="a progress delivery")
    made_up = [r for r in caplog.records if "signing with this one" in r.getMessage()]
    assert len(made_up) == 1 and made_up[0].levelno == logging.WARNING and secret in made_up[0].getMessage()
    payloads = [g.verified(secret) for g in hook.got]
    progress = [p for p in payloads if p["type"] == "generation.progress"]
    assert progress and all(p["data"]["id"] == "ws1" and 0 < p["data"]["step"] < 4 for p in progress)
    assert [p["data"]["status"] for p in payloads if p["type"] == "generation.completed"] == ["done"]


@pytest.mark.asyncio
async def test_a_url_outside_the_allow_list_is_refused_at_admission_over_both_doors() -> None:
    with receiver(200) as hook:
        async with running(**allowed(hook)) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            for url in (hook.url + "/elsewhere", "http://169.254.169.254/latest/meta-data/",
                        hook.url.replace("127.0.0.1", "user@127.0.0.1") + "/hooks/x"):
                reply = await client.post(
                    "/v1/generations", json={"id": "out", "params": SMALL, "webhook": {"url": url}}
                )
                assert reply.status_code == 422
                assert (reply.json()["error"], reply.json()["field"], reply.json()["id"]) == (
                    "bad_params", "webhook", "out"
                )
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="out", params=SMALL, webhook={"url": hook.url + "/nope"})
                refused = await recv(ws)
            assert (refused["type"], refused["code"], refused["field"]) == ("error", "bad_params", "webhook")
            assert (await client.get("/v1/generations/out")).status_code == 404
    assert hook.got == []


@pytest.mark.asyncio
async def test_without_an_allow_list_every_webhook_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_STREAM_WEBHOOK_ALLOW", raising=False)
    with receiver(200) as hook:
        async with running(webhook_secret=SECRET) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            assert server.service.webhooks is None
            reply = await client.post(
                "/v1/generations", json={"params": SMALL, "webhook": {"url": hook.url + "/hooks/x"}}
            )
            assert reply.status_code == 422
            assert (reply.json()["error"], reply.json()["field"]) == ("bad_params", "webhook")
            assert "webhook_allow" in reply.json()["message"]
            malformed = await client.post(
                "/v1/generations", json={"params": SMALL, "webhook": {"url": hook.url, "events": ["x"]}}
            )
            assert (malformed.status_code, malformed.json()["field"]) == (400, "webhook.events")
    assert hook.got == []


@pytest.mark.asyncio
async def test_a_delivery_still_pending_at_shutdown_is_dropped_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with receiver(500) as hook:
        async with running(**allowed(hook), close_timeout_s=0.5) as server, httpx.AsyncClient(
            base_url=server.http_url, timeout=30
        ) as client:
            sender = server.service.webhooks
            # Its retry still waits when the shutdown comes.
            sender.config = dataclasses.replace(sender.config, first_retry_s=60.0)
            body = {"id": "late", "params": {**SMALL, "steps": 2}, "webhook": {"url": hook.url + "/hooks/l"}}
            assert (await client.post("/v1/generations", json=body)).status_code == 202
            await wait_for(lambda: len(hook.got) >= 1, what="the first try")
            record = server.service.registry.get("late")
        # Out of the block: shut down while the delivery waits for its retry.
    assert record is not None and record.webhook is not None
    [delivery] = record.webhook.view()["deliveries"]
    assert delivery["status"] == "dropped" and delivery["last_error"].startswith("still pending")
    assert any("dropped 1 webhook deliveries" in r.getMessage() and "late" in r.getMessage()
               for r in caplog.records)
    assert server.service.rules.webhook_book.held == 0


def test_omni_stream_serve_delivers_with_its_webhook_options() -> None:
    # The real command line, in its own process: --webhook-allow and --webhook-secret.
    from .test_serve import omni_stream_serve

    with receiver(200) as hook:
        args = ("--model", "synthetic", "--device", "cpu", "--webhook-allow", hook.url + "/hooks/*",
                "--webhook-allow", "https://hooks.example.com/*", "--webhook-secret", SECRET)
        # Only the command line configures it: not the variables of whoever runs the tests.
        env: dict[str, str | None] = {"OMNI_STREAM_WEBHOOK_SECRET": None, "OMNI_STREAM_WEBHOOK_ALLOW": None}
        with omni_stream_serve(*args, env=env) as (proc, _, url):
            body = json.dumps({"id": "cli", "params": {**SMALL, "steps": 2},
                               "webhook": {"url": hook.url + "/hooks/cli"}}).encode()
            request = urllib.request.Request(url + "/v1/generations?wait=true", data=body, method="POST")
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200
            start = time.monotonic()
            while not hook.got and time.monotonic() - start < 60.0:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    [got] = hook.got
    payload = got.verified()
    assert (payload["type"], payload["data"]["id"], payload["data"]["status"]) == (
        "generation.completed", "cli", "done"
    )


def test_the_server_refuses_a_malformed_secret_or_pattern_at_construction() -> None:
    from omni_stream.errors import ParamsError
    from omni_stream.server import Server

    with pytest.raises(ParamsError) as caught:
        Server(Synthetic(), port=0, device="cpu", webhook_allow=["https://a.example/*"],
               webhook_secret="nope")
    assert caught.value.field == "webhook_secret"
    with pytest.raises(ParamsError) as caught:
        Server(Synthetic(), port=0, device="cpu", webhook_allow=["https://a.example*"])
    assert caught.value.field == "webhook_allow"


@pytest.mark.asyncio
async def test_a_url_httpx_would_send_in_another_form_is_never_sent() -> None:
    # Issue #39, attack 8: the allow-list matched one string and httpx sent another (it
    # removes dot segments). The core admits only URLs in their sent form; the sender
    # still checks that httpx agrees, and sends nothing where it does not.
    from omni_stream.core.webhooks import Delivery, WebhookConfig
    from omni_stream.server.webhooks import WebhookSender

    calls: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200)

    sender = WebhookSender(WebhookConfig(secret=SECRET, allow=()), transport=httpx.MockTransport(answer))
    odd = Delivery("r1", "completed", "http://hooks.example.com/a/../admin", b"{}", "msg_1", 5, principal="p")
    fine = Delivery("r2", "completed", "http://hooks.example.com/a/ok", b"{}", "msg_2", 5, principal="p")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.run)
        sender.submit(odd)
        sender.submit(fine)
        await wait_for(lambda: odd.settled and fine.settled, what="both deliveries to settle")
        tg.cancel_scope.cancel()
    assert (odd.status, odd.attempts) == ("failed", 0) and "not sent" in (odd.last_error or "")
    assert fine.status == "delivered" and [str(r.url) for r in calls] == ["http://hooks.example.com/a/ok"]
