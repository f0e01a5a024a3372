"""Who a client is over HTTP, against a real ``omni-stream serve`` (issue #39, attack 5).

The principal is the server's to compute (core/principal.py): the peer's
address, or what a ``--trusted-proxy`` forwarded. uvicorn's own
``proxy_headers`` (on by default) took any loopback peer's
``X-Forwarded-For`` as the client's address before the principal was
computed, so one client named itself anew in each POST, and 40 got in
where 16 may: every per-principal bound and fair share was bypassed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from .test_attacks import Serve, serve

#: A request that runs for the whole test (the mixture's steps take a while each).
LONG = {"steps": 5000}
BOUND = 4


def post(server: Serve, path: str, body: Any, forwarded_for: str) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", "X-Forwarded-For": forwarded_for}
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    ("loop", "trusted", "accepted"),
    [
        ("asyncio", False, BOUND),  # uvicorn
        ("trio", False, BOUND),  # hypercorn
        ("asyncio", True, 10),  # the one way a forwarded address counts
    ],
    ids=["uvicorn", "hypercorn", "trusted-proxy"],
)
def test_a_forwarded_address_counts_only_from_a_trusted_proxy(
    loop: str, trusted: bool, accepted: int
) -> None:
    if loop == "trio":
        pytest.importorskip("hypercorn")
    env = {
        "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL": str(BOUND),
        "OMNI_STREAM_SHUTDOWN_TIMEOUT": "0.5",
        "OMNI_STREAM_CLOSE_TIMEOUT": "0.5",
        "OMNI_STREAM_TRUSTED_PROXIES": "",  # only the command line's, not the environment's
    }
    args = ["--loop", loop, *(["--trusted-proxy", "127.0.0.1"] if trusted else [])]
    with serve(*args, env=env) as server:
        # Each POST names another client; the HTTP API and the OpenAI door alike.
        video = {"prompt": "red circle", "steps": LONG["steps"]}
        answers = [
            post(server, "/v1/generations", {"params": LONG}, f"203.0.113.{i}")
            if i % 2 == 0
            else post(server, "/v1/videos", video, f"203.0.113.{i}")
            for i in range(10)
        ]
    statuses = [status for status, _ in answers]
    assert statuses.count(200) + statuses.count(202) == accepted, answers
    refused = [body for status, body in answers if status not in (200, 202)]
    assert all(status == 429 for status in statuses if status not in (200, 202)), answers
    for body in refused:
        # Both doors' shapes: ours ({"error": code}) and OpenAI's ({"error": {"code": ...}}).
        code = body["error"] if isinstance(body["error"], str) else body["error"]["code"]
        assert code == "too_many_requests", body
