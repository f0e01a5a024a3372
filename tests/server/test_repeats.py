"""Exact repeats are not recomputed (issue #35): a request identical to a finished one gets its
results, without a step on the device; any other param, seed or cache setting runs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from websockets.asyncio.client import connect  # noqa: E402

from ..models.test_diffusers import fixed_embeddings as sd_embeddings  # noqa: E402
from ..models.test_diffusers import sd_pipe  # noqa: E402
from ..models.test_step_cache import FLUX, flux_model  # noqa: E402
from .conftest import running  # noqa: E402

pytestmark = [
    pytest.mark.one_loop,  # the core's bookkeeping, the same under every loop
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


async def _run(
    ws: Any, rid: str, params: dict[str, Any], **fields: Any
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """One request (``fields``: more of its message's): its text messages, and its results' bytes."""
    message = {"type": "generate", "id": rid, "params": params, "preview": {"every": 100}, **fields}
    await ws.send(json.dumps(message))
    msgs, results = [], []
    while True:
        raw = await ws.recv()
        if isinstance(raw, bytes):
            from omni_stream.protocol import unpack_preview

            header, image = unpack_preview(raw)
            if header.id == rid and header.final:
                results.append(bytes(image))
            continue
        msg = json.loads(raw)
        if msg.get("id") != rid:
            continue
        msgs.append(msg)
        if msg["type"] in ("done", "error", "cancelled"):
            return msgs, results


@pytest.mark.asyncio
async def test_an_exact_repeat_is_served_from_the_result_without_a_step() -> None:
    model = flux_model()
    calls = []
    model._denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    async with running(model) as server, connect(server.url, max_size=None) as ws:
        first, made = await _run(ws, "a", dict(FLUX, seed=5))
        ran = len(calls)
        assert first[-1]["type"] == "done" and "repeat" not in first[-1] and ran == FLUX["steps"]
        again, served = await _run(ws, "b", dict(FLUX, seed=5))
        assert len(calls) == ran  # not a step on the device
        assert served == made
        assert [m["type"] for m in again] == ["accepted", "progress", "done"]
        assert again[1]["step"] == again[1]["total"] == FLUX["steps"] and again[1]["cached"] is True
        assert again[-1]["repeat"] is True
        # Any other param, the seed, the cache's threshold, or results: false: it runs.
        for rid, params in [
            ("seed", dict(FLUX, seed=6)),
            ("steps", dict(FLUX, seed=5, steps=FLUX["steps"] - 1)),
            ("cache", dict(FLUX, seed=5, cache={"method": "fbcache", "threshold": 0.3})),
            ("off", dict(FLUX, seed=5, cache={"results": False})),
        ]:
            before = len(calls)
            msgs, _ = await _run(ws, rid, params)
            assert msgs[-1]["type"] == "done" and "repeat" not in msgs[-1] and len(calls) > before, rid
        # A drawn seed is a seed: naming the one drawn repeats that request.
        drawn, _ = await _run(ws, "drawn", dict(FLUX, seed=-1))
        before = len(calls)
        msgs, _ = await _run(ws, "named", dict(FLUX, seed=drawn[0]["seed"]))
        assert msgs[-1].get("repeat") is True and len(calls) == before
        # Another client's identical request runs: a principal repeats only its own (a quick
        # answer would tell it what another had asked for).
        async with connect(server.url, max_size=None) as stranger:
            before = len(calls)
            msgs, theirs = await _run(stranger, "theirs", dict(FLUX, seed=5))
        assert "repeat" not in msgs[-1] and len(calls) > before and theirs == made
        assert server.service.rules.repeats.hits == 2
        metrics = server.service.rules.metrics.render().decode()
        assert 'omni_stream_requests_total{model="diffusers",outcome="done"} 9.0' in metrics


@pytest.mark.asyncio
async def test_a_server_may_keep_no_results_and_a_model_says_what_repeats() -> None:
    model = flux_model()
    calls = []
    model._denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    async with running(model, repeat_cache_bytes=0) as server, connect(server.url, max_size=None) as ws:
        await _run(ws, "a", dict(FLUX, seed=5))
        msgs, _ = await _run(ws, "b", dict(FLUX, seed=5))
        assert "repeat" not in msgs[-1] and len(calls) == 2 * FLUX["steps"]
        assert len(server.service.rules.repeats) == 0
    # A sampler that draws noise outside the request's generator never repeats.
    sd = __import__("omni_stream").models.diffusers.Diffusers(sd_pipe(), encode_prompt=sd_embeddings)
    if "dpmpp_sde" in sd.sampler_names:
        assert not sd.repeatable(sd.validate({"sampler": "dpmpp_sde", "seed": 1}))
    assert sd.repeatable(sd.validate({"seed": 1}))
    assert not sd.repeatable(sd.validate({"seed": 1, "cache": {"results": False}}))
    torch.manual_seed(0)


@pytest.mark.asyncio
async def test_a_repeat_survives_a_restart_with_a_state_dir(tmp_path: Any) -> None:
    """Over HTTP (the caller's address is its principal, the same after the restart): a done
    request's repeat, after the server restarts on the same folder, is answered without a run."""
    import httpx

    body = {"params": dict(FLUX, seed=5)}
    async with running(flux_model(), state_dir=str(tmp_path)) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            made = await client.post("/v1/generations?wait=true", json=body)
    assert made.status_code == 200
    model = flux_model()  # a new process's model: the same weights under the same name
    calls = []
    model._denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    async with running(model, state_dir=str(tmp_path)) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            again = await client.post("/v1/generations?wait=true", json=body)
            other = await client.post("/v1/generations?wait=true", json={"params": dict(FLUX, seed=6)})
    assert again.status_code == 200 and again.content == made.content
    assert len(calls) == FLUX["steps"]  # only the other seed ran
    assert other.status_code == 200 and other.content != made.content


def test_a_request_holding_a_value_json_cannot_hold_has_no_key() -> None:
    from omni_stream.core.repeats import repeat_key

    class Always:
        def repeatable(self, params: Any) -> bool:
            return True

    assert repeat_key("p", "m", Always(), {"seed": 1}, {"format": "png"}) is not None
    # A decoded input image: never keyed (a repr would never match again), never an error.
    assert repeat_key("p", "m", Always(), {"seed": 1, "image": object()}, {"format": "png"}) is None


@pytest.mark.asyncio
async def test_a_browser_sessions_repeat_outlives_its_websocket_and_a_restart(tmp_path: Any) -> None:
    """Without a token a websocket's principal is its connection; the browser session it carries
    (its cookie) is whose repeats it shares: a new connection of the same browser, and the same
    after a restart on the state dir, get them; another connection without the session does not."""
    import httpx

    from omni_stream.server import sessions

    model = flux_model()
    calls: list[int] = []
    model._denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    params = dict(FLUX, seed=5)
    async with running(model, state_dir=str(tmp_path)) as server:
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            await http.get("/")
            headers = {"Cookie": f"{sessions.COOKIE}={http.cookies[sessions.COOKIE]}"}
        async with connect(server.url, additional_headers=headers, max_size=None) as ws:
            first, made = await _run(ws, "a", params, detach=True)
        ran = len(calls)
        assert first[-1]["type"] == "done" and ran == FLUX["steps"]
        async with connect(server.url, additional_headers=headers, max_size=None) as ws:
            again, served = await _run(ws, "b", params)
        assert len(calls) == ran and served == made and again[-1].get("repeat") is True
        async with connect(server.url, max_size=None) as ws:  # no session: not that browser's
            other, _ = await _run(ws, "c", params)
        assert len(calls) == 2 * ran and "repeat" not in other[-1]
    model = flux_model()  # a new process's model: the same weights under the same name
    calls.clear()
    model._denoiser.register_forward_pre_hook(lambda m, a: calls.append(1))
    async with running(model, state_dir=str(tmp_path)) as server:
        async with connect(server.url, additional_headers=headers, max_size=None) as ws:
            after, kept = await _run(ws, "d", params)
    assert not calls and kept == made and after[-1].get("repeat") is True
