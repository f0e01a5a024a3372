"""One refusal, one answer and one count, whichever door it came through (issue #36).

The same ``generate`` refused for the same reason (an unknown ``model``, a
bad param, a full server) through the websocket, HTTP, HTTP's event stream
and the OpenAI door of one real server: each door answers with the core's
error code (the OpenAI door in OpenAI's shape: its ``code`` is ours, but an
unknown model is OpenAI's own ``model_not_found``), and each adds exactly
one to ``omni_stream_rejections_total{code}`` and to
``omni_stream_requests_total{outcome="rejected"}``. Before one submit per
door, an unknown ``model`` counted 1 over the websocket and 0 over HTTP.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omni_stream.models import Mixture

from .conftest import running, send, until

openai = pytest.importorskip("openai")

#: Tiny and quick: a refusal never runs a step, an accepted filler runs slowly on purpose.
PARAMS: dict[str, Any] = {"prompt": "a red circle", "steps": 2, "size": 16}

Door = Callable[[Any, dict[str, Any]], Awaitable[tuple[str, int]]]


async def over_websocket(server: Any, message: dict[str, Any]) -> tuple[str, int]:
    async with connect(server.url) as ws:
        await send(ws, type="generate", id="parity", **message)
        reply = await until(ws, lambda m: m["type"] in ("accepted", "error"))
    assert reply["type"] == "error", reply
    return reply["code"], 0


async def over_http(server: Any, message: dict[str, Any]) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        reply = await http.post("/v1/generations", json=message)
    return reply.json()["error"], reply.status_code


async def over_sse(server: Any, message: dict[str, Any]) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        reply = await http.post("/v1/generations", json=message, headers={"Accept": "text/event-stream"})
    return reply.json()["error"], reply.status_code


async def over_openai(server: Any, message: dict[str, Any]) -> tuple[str, int]:
    client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=30)
    params = dict(message.get("params", {}))
    prompt = params.pop("prompt", "a red circle")
    params.pop("size", None)  # OpenAI's own field: "auto" is the model's default
    try:
        await client.images.generate(
            prompt=prompt, model=message.get("model", "mixture"), size="auto", extra_body=params
        )
    except openai.APIStatusError as exc:
        return exc.body["code"], exc.status_code  # type: ignore[index]
    raise AssertionError("the OpenAI door accepted what it should refuse")


DOORS: dict[str, Door] = {
    "websocket": over_websocket, "http": over_http, "sse": over_sse, "openai": over_openai,
}


def counts(text: str, code: str) -> tuple[float, float]:
    """(rejections with ``code``, requests rejected) from /metrics' text."""

    def value(pattern: str) -> float:
        # Summed over the ``model`` label: whichever model a refusal was counted against.
        return sum(float(v) for v in re.findall(pattern + r" ([0-9.e+]+)", text))

    return (
        value(rf'omni_stream_rejections_total\{{code="{code}",model="[^"]*"\}}'),
        value(r'omni_stream_requests_total\{model="[^"]*",outcome="rejected"\}'),
    )


async def metrics(server: Any) -> str:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        return (await http.get("/metrics")).text


async def refused_alike(server: Any, message: dict[str, Any], code: str, *, openai_code: str) -> None:
    for name, door in DOORS.items():
        before = counts(await metrics(server), code)
        answered, _ = await door(server, message)
        after = counts(await metrics(server), code)
        assert answered == (openai_code if name == "openai" else code), name
        assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0), (name, before, after)


@pytest.mark.asyncio
async def test_an_unknown_model_is_refused_and_counted_alike_by_every_door() -> None:
    async with running(Mixture()) as server:
        await refused_alike(
            server, {"model": "nope", "params": PARAMS}, "bad_params", openai_code="model_not_found"
        )
        # Counted under "unknown": a client cannot grow the metrics by inventing model names.
        text = await metrics(server)
        assert 'omni_stream_rejections_total{code="bad_params",model="unknown"} 4.0' in text
        assert 'model="nope"' not in text


@pytest.mark.asyncio
async def test_a_bad_param_is_refused_and_counted_alike_by_every_door() -> None:
    async with running(Mixture()) as server:
        await refused_alike(server, {"params": {**PARAMS, "steps": 0}}, "bad_params", openai_code="bad_params")


@pytest.mark.asyncio
async def test_a_full_server_is_refused_and_counted_alike_by_every_door() -> None:
    async with running(Mixture(), max_active=1, max_queued=1) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            for i in range(2):  # one running, one queued: the server is full
                reply = await http.post(
                    "/v1/generations", json={"id": f"fill{i}", "params": {**PARAMS, "steps": 10_000, "size": 256}}
                )
                assert reply.status_code == 202, reply.text
            await refused_alike(server, {"params": PARAMS}, "busy", openai_code="busy")
            for i in range(2):
                assert (await http.delete(f"/v1/generations/fill{i}")).status_code == 200


def test_the_doors_share_one_submit() -> None:
    # The structural half of the finding: no door calls the core's generate, or prepares a
    # message, by itself; each goes through Service.submit.
    from pathlib import Path

    import omni_stream.server as server_package

    root = Path(server_package.__file__).parent
    doors = ("websocket.py", "http_api.py", "openai_api.py", "openai_videos.py", "asgi.py", "a1111_api.py",
             "comfyui_api.py", "comfyui_ws.py")
    for name in doors:
        text = (root / name).read_text()
        assert "rules.generate(" not in text and ".prepare(" not in text, name
    assert json.dumps  # (json is used by the doors' helpers above)
