"""Several models on one server (issue #20): each request answered by the model it names,
lazily loaded ones say ``loading``, least recently used unloading under ``max_loaded``."""

from __future__ import annotations

import httpx
import pytest
import torch
from websockets.asyncio.client import connect

from omni_stream import client as omc
from omni_stream.engine.router import ModelRouter
from omni_stream.models import Synthetic

from ..engine.test_router import Counted
from .conftest import check_stream, recv, running, send, until_end

P = {"steps": 3, "shape": [3, 8, 8], "work": 0, "seed": 5}


class Wide(Synthetic):
    """Another model: frames twice as wide, so a result tells which model made it."""

    name = "wide"

    def validate(self, params):  # type: ignore[no-untyped-def]
        out = super().validate(params)
        out["shape"] = [out["shape"][0], out["shape"][1], 2 * out["shape"][2]]
        return out


@pytest.mark.asyncio
async def test_each_request_is_answered_by_the_model_it_names_on_every_door() -> None:
    a, b = Counted("a"), Wide()
    # (No quantum: these requests come one at a time and each may swap at once.)
    async with ModelRouter({"small": a, "wide": b}, max_loaded=1, device="cpu", min_residency_s=0) as router:
        async with running(router) as server:
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="w", params=P, model="wide")
                msgs = await until_end(ws, "w")
                await send(ws, type="generate", id="x", params=P, model="nope")
                refused = await recv(ws)
            async with omc.connect(server.url) as client:
                small = await client.generate(P, model="small").result()
                default = await client.generate(P).result()
            async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
                card = (await http.get("/models")).json()
                made = await http.post("/v1/generations?wait=true", json={"id": "hw", "params": P, "model": "wide"})
                status = (await http.get("/v1/generations/hw")).json()
                unknown = await http.post("/v1/generations", json={"params": P, "model": "nope"})
    # The websocket: accepted names the model, `loading` comes before the first progress
    # (nothing was loaded), then the frames.
    assert msgs[0]["type"] == "accepted" and msgs[0]["model"] == "wide"
    assert msgs[1] == {"type": "loading", "id": "w", "model": "wide"}
    check_stream([m for m in msgs if m["type"] != "loading"], "w", 3)
    final = [m for m in msgs if m["type"] == "preview"][-1]
    assert (final["width"], final["height"]) == (16, 8)
    assert (refused["type"], refused["code"], refused["field"]) == ("error", "bad_params", "model")
    assert "small, wide" in refused["message"]
    assert (small.width, default.width) == (8, 8)  # the first model is the default
    assert made.status_code == 200 and made.headers["x-omni-stream-width"] == "16"
    assert status["model"] == "wide" and status["status"] == "done"
    assert unknown.status_code == 422 and unknown.json()["field"] == "model"
    assert card["default"] == "small" and [m["name"] for m in card["models"]] == ["small", "wide"]
    assert [m["loaded"] for m in card["models"]] == [True, False]  # max_loaded=1: small was used last
    assert card["models"][0]["params"] == card["params"]
    assert (a.loads, a.unloads) == (1, 1)


@pytest.mark.asyncio
async def test_a_server_of_a_mapping_loads_every_model_at_start() -> None:
    async with running({"one": Synthetic(), "two": Wide()}) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            card = (await http.get("/models")).json()
            made = await http.post("/v1/generations?wait=true", json={"params": P, "model": "two"})
            health = (await http.get("/health")).json()
            metrics = (await http.get("/metrics")).text
    assert [m["loaded"] for m in card["models"]] == [True, True]
    assert made.headers["x-omni-stream-width"] == "16"
    assert health["ok"]
    # Request metrics by model (issue #38): the request ran on "two", and only there.
    for line in (
        'omni_stream_requests_total{model="two",outcome="done"} 1.0',
        'omni_stream_queue_wait_seconds_count{model="two"} 1.0',
        'omni_stream_first_preview_seconds_count{model="two"} 1.0',
        'omni_stream_request_seconds_count{model="two"} 1.0',
    ):
        assert line in metrics, line
    assert 'omni_stream_step_compute_seconds_count{model="two"}' in metrics
    assert 'model="one"' not in metrics


def test_wide_makes_wider_frames() -> None:
    # The fixture model the tests above tell results apart by.
    frames = Wide().expected_frames(P)
    assert frames[-1].shape == torch.Size([3, 8, 16])


def test_omni_stream_serve_serves_several_named_models_with_max_loaded() -> None:
    # The real command line, in its own process: `serve --model NAME=SPEC` twice, --max-loaded 1.
    import json
    import signal
    import urllib.request

    from websockets.sync.client import connect as sync_connect

    from .test_serve import _wait_line, omni_stream_serve

    args = ("--model", "a=synthetic", "--model", "b=synthetic", "--max-loaded", "1", "--device", "cpu")
    with omni_stream_serve(*args, env={"OMNI_STREAM_MIN_RESIDENCY": "0"}) as (proc, lines, url):
        kinds = {}
        with sync_connect(url.replace("http", "ws") + "/ws", open_timeout=20) as ws:
            for rid, model in (("first", "b"), ("second", "a"), ("third", "a")):
                ws.send(json.dumps({"type": "generate", "id": rid, "model": model, "params": P}))
                got: list[dict] = []
                while not got or got[-1]["type"] not in ("done", "error", "cancelled"):
                    data = ws.recv(timeout=30)
                    if isinstance(data, str):
                        got.append(json.loads(data))
                kinds[rid] = [m["type"] for m in got]
        with urllib.request.urlopen(url + "/models", timeout=10) as reply:
            card = json.loads(reply.read())
        _wait_line(lines, r"model b unloaded")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    # Each model loads when first named; "third" finds a loaded and says no `loading`.
    assert kinds["first"][:2] == ["accepted", "loading"] and kinds["first"][-1] == "done"
    assert kinds["second"][:2] == ["accepted", "loading"] and kinds["second"][-1] == "done"
    assert "loading" not in kinds["third"] and kinds["third"][-1] == "done"
    assert [(m["name"], m["loaded"]) for m in card["models"]] == [("a", True), ("b", False)]
