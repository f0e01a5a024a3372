"""A retried submit is its job again, on every door (issue #38); another job under its id is not.

A client that timed out or lost its connection mid-submit sends the same
message again: it gets the job it made (no second run, no ``duplicate_id``).
The same id with other params is still ``duplicate_id``; another tenant's
id never returns that tenant's job. HTTP and the OpenAI doors take
``Idempotency-Key`` for callers that send no id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect

from omni_stream.models import Mixture

from .conftest import http_get, running, send, until, until_end, wait_for

openai = pytest.importorskip("openai")

PARAMS: dict[str, Any] = {"prompt": "red circle", "steps": 3, "size": 32, "seed": 5}


def tokens(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text("ann=ann-secret\nbob=bob-secret\n")
    return str(path)


@pytest.mark.asyncio
async def test_a_websocket_retry_after_a_reconnect_gets_its_job_and_other_params_get_duplicate_id(
    tmp_path: Path,
) -> None:
    async with running(Mixture(), tokens_file=tokens(tmp_path)) as server:
        async with connect(server.url + "?token=ann-secret") as ws:
            await send(ws, type="generate", id="job-1", params=PARAMS, detach=True)
            first = await until_end(ws, "job-1")
        async with connect(server.url + "?token=ann-secret") as ws:  # the connection dropped: again
            await send(ws, type="generate", id="job-1", params=PARAMS, detach=True)
            again = await until_end(ws, "job-1")
            await send(ws, type="generate", id="job-1", params={**PARAMS, "seed": 6}, detach=True)
            other = await until(ws, lambda m: m["type"] == "error")
        async with connect(server.url + "?token=bob-secret") as ws:  # another tenant: not its job
            await send(ws, type="generate", id="job-1", params=PARAMS, detach=True)
            bobs = await until(ws, lambda m: m["type"] in ("error", "accepted"))
        registry = server.service.registry
    assert first[-1]["type"] == "done" and again[-1] == first[-1]
    assert again[0]["type"] == "accepted" and again[0]["seed"] == first[0]["seed"]
    assert (other["code"], other["id"]) == ("duplicate_id", "job-1")
    assert (bobs["type"], bobs["code"]) == ("error", "duplicate_id")
    assert len(registry) == 1  # one job, run once


@pytest.mark.asyncio
async def test_http_retries_by_id_and_by_idempotency_key_return_the_job_they_made(tmp_path: Path) -> None:
    ann = {"Authorization": "Bearer ann-secret"}
    bob = {"Authorization": "Bearer bob-secret"}
    async with running(Mixture(), tokens_file=tokens(tmp_path)) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            body = {"id": "h-1", "params": PARAMS}
            one = await http.post("/v1/generations", json=body, headers=ann)
            two = await http.post("/v1/generations", json=body, headers=ann)
            changed = await http.post("/v1/generations", json={**body, "params": {**PARAMS, "steps": 4}}, headers=ann)
            keyed = {**ann, "Idempotency-Key": "order-77"}
            k1 = await http.post("/v1/generations?wait=true", json={"params": PARAMS}, headers=keyed)
            k2 = await http.post("/v1/generations?wait=true", json={"params": PARAMS}, headers=keyed)
            bobs = await http.post(
                "/v1/generations", json={"params": PARAMS}, headers={**bob, "Idempotency-Key": "order-77"}
            )
            empty = await http.post(
                "/v1/generations", json={"params": PARAMS}, headers={**ann, "Idempotency-Key": ""}
            )
        registry = server.service.registry
    assert (one.status_code, two.status_code) == (202, 202) and one.json()["id"] == two.json()["id"] == "h-1"
    assert (changed.status_code, changed.json()["error"]) == (409, "duplicate_id")
    assert k1.status_code == k2.status_code == 200 and k1.content == k2.content  # the same result
    assert bobs.status_code == 202  # bob's key names bob's own job (counted below)
    assert (empty.status_code, empty.json()["field"]) == (400, "Idempotency-Key")
    # h-1, ann's keyed job, bob's keyed job: three jobs for six submits.
    assert len(registry) == 3


@pytest.mark.asyncio
async def test_the_openai_sdk_retrying_with_an_idempotency_key_gets_one_job() -> None:
    # The retry arrives while the first call still waits (its caller timed out and tried again):
    # both answers come from one job, run once.
    async with running(Mixture()) as server:
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=30)
        extra = {"Idempotency-Key": "img-once"}
        body = {"steps": 40, "seed": 5}
        answers: list[Any] = []

        async def call() -> None:
            answers.append(await client.images.generate(prompt="red circle", extra_body=body, extra_headers=extra))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await wait_for(lambda: len(server.service.registry) == 1, what="the first call admitted")
            tg.start_soon(call)
        metrics = (await http_get(server, "/metrics")).body.decode()
    assert len(answers) == 2 and answers[0].data[0].b64_json == answers[1].data[0].b64_json
    assert 'omni_stream_requests_total{model="mixture",outcome="done"} 1.0' in metrics
