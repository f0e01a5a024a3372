"""Webhooks between tenants, against a real ``omni-stream serve`` (issue #39, attacks 3 and 8).

Each test starts the command line's server (tests/server/test_attacks.py's
``serve``) and receivers in this process on 127.0.0.1: one that answers
200 and keeps what it got, and one that accepts a delivery and never
answers, noting when the server gives up on it (closes the connection).
The waits are shortened through the server's ``OMNI_STREAM_WEBHOOK_*``
variables; no test asserts a time, only what was accepted and in which
order things happened.
"""

from __future__ import annotations

import base64
import contextlib
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from .test_attacks import Serve, serve

pytest.importorskip("standardwebhooks")
from standardwebhooks import Webhook  # noqa: E402 - after the skip

SECRET = "whsec_" + base64.b64encode(b"omni-stream tenant webhook test!").decode()
#: One step of the synthetic model: done at once, so its webhook is what is held.
TINY = {"steps": 1, "shape": [3, 8, 8], "work": 0}
#: The server's waits, short: a test never waits on a hung receiver for long.
QUICK = {"OMNI_STREAM_CLOSE_TIMEOUT": "0.5", "OMNI_STREAM_SHUTDOWN_TIMEOUT": "0.5"}


@dataclass
class Got:
    path: str
    headers: dict[str, str]
    body: bytes
    #: What the other receiver had seen when this arrived (its ``ended`` count).
    others_ended: int = 0


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1: ``url``, what it got, the tries it holds open."""

    url: str = ""
    got: list[Got] = field(default_factory=list)
    #: Deliveries it accepted and did not answer (a hanging receiver's).
    opened: int = 0
    #: Of those, the ones the server gave up on (it closed the connection).
    ended: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextlib.contextmanager
def receiver(*, hang: bool = False, beside: Receiver | None = None) -> Iterator[Receiver]:
    """Answers 200 (or, ``hang``, never answers); ``beside``: a receiver whose ``ended``
    count each delivery notes when it arrives."""
    state = Receiver()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            with state.lock:
                seen = beside.ended if beside is not None else 0
                state.got.append(Got(self.path, headers, body, seen))
                state.opened += hang
            if not hang:
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            # Hold the try open until the server gives up on it (closes), or the test ends.
            while not release.is_set():
                readable, _, _ = select.select([self.connection], [], [], 0.05)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    with state.lock:
                        state.ended += 1
                    return
            self.close_connection = True

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.block_on_close = False
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def call(
    server: Serve, method: str, path: str, body: Any = None, *, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            raw, status, kind = reply.read(), reply.status, reply.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        raw, status, kind = err.read(), err.code, err.headers.get("content-type", "")
    return status, json.loads(raw) if "json" in kind else raw


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def allow(*receivers: Receiver) -> list[str]:
    out = ["--webhook-secret", SECRET]
    for hook in receivers:
        out += ["--webhook-allow", hook.url + "/hooks/*"]
    return out


def test_a_tenants_unanswering_receivers_leave_another_tenant_room_and_a_send_slot() -> None:
    # Attack 3: A's webhooks go to a receiver that never answers. With one book and 8
    # slots for all, A held every slot and the whole book: B's `completed` waited
    # 218.8 s, and B's webhook requests got 503 for about 1.8 h.
    with receiver(hang=True) as slow, receiver(beside=slow) as fast:
        args = ("--model", "synthetic", "--token", "a=tok-a", "--token", "b=tok-b", *allow(slow, fast))
        with serve(*args, env={**QUICK, "OMNI_STREAM_WEBHOOK_MAX_HELD": "16"}) as server:
            answers = [
                call(server, "POST", "/v1/generations", {
                    "id": f"a{i}", "params": TINY, "webhook": {"url": f"{slow.url}/hooks/a{i}"},
                }, token="tok-a")
                for i in range(12)
            ]
            # Alone, A holds half the book (16 // 2): the rest is kept for others.
            assert [status for status, _ in answers] == [202] * 8 + [503] * 4, answers
            refused = answers[8][1]
            assert (refused["error"], refused["id"]) == ("busy", "a8") and "share" in refused["message"]
            # A's deliveries hang in every slot but the last, which is kept.
            wait_until(lambda: slow.opened >= 7, "A's deliveries to reach its receiver")
            status, accepted = call(server, "POST", "/v1/generations", {
                "id": "b0", "params": TINY, "webhook": {"url": f"{fast.url}/hooks/b0"},
            }, token="tok-b")
            assert status == 202, accepted
            wait_until(lambda: bool(fast.got), "B's delivery")
            held_open = slow.opened
    [got] = fast.got
    payload = Webhook(SECRET).verify(got.body, got.headers)
    assert (got.path, payload["data"]["id"], payload["data"]["status"]) == ("/hooks/b0", "b0", "done")
    # B's went while A's tries were all still open: it waited for none of them.
    assert got.others_ended == 0
    assert held_open == 7  # 8 slots, one kept for a principal with none in flight


def test_a_receiver_that_never_answers_has_a_capped_time_per_delivery() -> None:
    # Attack 3: 5 tries of 30 s each, and the waits between, held a send slot per delivery
    # for minutes. Now its tries together take at most max_delivery_s.
    with receiver(hang=True) as slow:
        env = {**QUICK, "OMNI_STREAM_WEBHOOK_TRY_TIMEOUT": "0.5", "OMNI_STREAM_WEBHOOK_DELIVERY_TIMEOUT": "1"}
        with serve("--model", "synthetic", *allow(slow), env=env) as server:
            body = {"id": "hung", "params": TINY, "webhook": {"url": f"{slow.url}/hooks/hung"}}
            assert call(server, "POST", "/v1/generations", body)[0] == 202

            def settled() -> bool:
                deliveries = call(server, "GET", "/v1/generations/hung")[1]["webhook"]["deliveries"]
                return bool(deliveries) and deliveries[0]["status"] == "failed"

            wait_until(settled, "the delivery to be given up", timeout=30.0)
            [delivery] = call(server, "GET", "/v1/generations/hung")[1]["webhook"]["deliveries"]
            wait_until(lambda: slow.ended == slow.opened, "the receiver to see the server give up")
    # Two tries of 0.5 s (of the 5 allowed) used the receiver's 1 s; then it is given up.
    assert (delivery["status"], delivery["attempts"]) == ("failed", 2), delivery
    assert "max_delivery_s" in delivery["last_error"] and "1 s" in delivery["last_error"]
    assert (slow.opened, slow.ended) == (2, 2)


def test_a_webhook_url_is_matched_in_the_form_it_is_sent_in_on_every_door() -> None:
    # Attack 8: with the allow-list http://H/hooks/tenant-a/*, .../tenant-a/../tenant-b/steal
    # and ../../admin/delete were accepted: the pattern was matched on the string and
    # httpx removed the dot segments after. The receiver got /hooks/tenant-b/steal.
    from websockets.sync.client import connect

    with receiver() as hook:
        base = f"{hook.url}/hooks/tenant-a/"
        attacks = [
            base + "../tenant-b/steal",
            base + "../../admin/delete",
            base + "%2e%2e/tenant-b/steal",
            base + ".%2E/.%2e/admin/delete",
            base + "..;/tenant-b/steal",
            base + "..%2Ftenant-b/steal",
            base.replace("http://", "HTTP://") + "x",
        ]
        args = ("--webhook-secret", SECRET, "--webhook-allow", base + "*")
        with serve(*args, env=QUICK) as server:
            for i, url in enumerate(attacks):
                body = {"id": f"x{i}", "params": {"steps": 1}, "webhook": {"url": url}}
                status, refused = call(server, "POST", "/v1/generations", body)
                assert status == 422, (url, refused)
                assert (refused["error"], refused["field"]) == ("bad_params", "webhook")
                assert refused["id"] == f"x{i}"
            with connect(server.url.replace("http://", "ws://") + "/ws") as ws:
                ws.send(json.dumps({"type": "generate", "id": "w0", "params": {"steps": 1},
                                    "webhook": {"url": attacks[0]}}))
                reply = json.loads(ws.recv(timeout=30))
            assert (reply["type"], reply["code"], reply["field"], reply["id"]) == (
                "error", "bad_params", "webhook", "w0"
            )
            status, video = call(server, "POST", "/v1/videos", {
                "prompt": "red circle", "webhook": {"url": attacks[1]},
            })
            assert (status, video["error"]["param"]) == (400, "webhook"), video
            # What is in its form is matched and sent as it is.
            body = {"id": "ok", "params": {"steps": 1}, "webhook": {"url": base + "ok"}}
            assert call(server, "POST", "/v1/generations?wait=true", body)[0] == 200
            wait_until(lambda: bool(hook.got), "the allowed delivery")
    assert [g.path for g in hook.got] == ["/hooks/tenant-a/ok"]
