"""serve --state-dir: requests, checkpoints and results written down, and brought back after a restart.

The tests marked ``needs_engine_resume`` need the engine's ``resume`` /
``checkpoint_every`` / ``on_checkpoint`` (issue #22, the engine side); they
are skipped where ``Engine.stream`` does not take them yet.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect

from omni_stream.engine import Engine
from omni_stream.errors import CheckpointError
from omni_stream.models.inputs import decode_image, load_image
from omni_stream.server.state import StateOptions
from omni_stream.store import Store

from .conftest import Slow, http_get, recv, running, send, until_end, wait_for
from .test_serve import omni_stream_serve

needs_engine_resume = pytest.mark.skipif(
    not {"resume", "checkpoint_every", "on_checkpoint"} <= set(inspect.signature(Engine.stream).parameters),
    reason="the engine side of issue #22 (Engine.stream(resume=, checkpoint_every=, on_checkpoint=)) "
    "has not landed",
)

PARAMS: dict[str, Any] = {"steps": 30, "shape": [3, 16, 16], "work": 0, "seed": 1234}


def _open(folder: Path) -> Store:
    return Store.open(folder, max_bytes=1 << 30, retention_s=600.0)


async def _result(msgs: list[dict[str, Any]]) -> bytes:
    finals = [m for m in msgs if m["type"] == "preview" and m["final"]]
    assert len(finals) == 1, msgs
    return bytes(finals[0]["image"])


async def _uninterrupted(params: dict[str, Any]) -> bytes:
    async with running(Slow(0.0)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="ref", params=params)
        return await _result(await until_end(ws, "ref"))


async def _run_until_checkpoint(
    folder: Path, rid: str, params: dict[str, Any], at_least: int, *, url_query: str = "", **generate: Any
) -> int:
    """Start ``rid`` detached on a server over ``folder``, shut it down once a checkpoint of at
    least ``at_least`` steps is written; that checkpoint's step. ``url_query``: the websocket
    URL's (a token), ``generate``: more of the message's fields; ``tokens_file`` is the server's."""
    options = {"state_dir": str(folder), "checkpoint_every": 3}
    if "tokens_file" in generate:
        options["tokens_file"] = generate.pop("tokens_file")
    async with running(Slow(0.05), **options) as server, connect(server.url + url_query) as ws:
        await send(ws, type="generate", id=rid, params=params, detach=True, **generate)
        keeper = server.service.state
        await wait_for(lambda: keeper.checkpoint_steps.get(rid, 0) >= at_least, what="a checkpoint")
        step: int = keeper.checkpoint_steps[rid]
    return step


# -- options -------------------------------------------------------------------------------


def test_state_options_come_from_keywords_then_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OMNI_STREAM_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("OMNI_STREAM_CHECKPOINT_EVERY", "7")
    monkeypatch.setenv("OMNI_STREAM_CHECKPOINT_SECONDS", "2.5")
    options = {"checkpoint_every": 3, "max_queued": 4}
    state = StateOptions.take(options)
    assert options == {"max_queued": 4}  # the rest are the limits'
    assert (state.path, state.checkpoint_every, state.checkpoint_seconds) == (tmp_path, 3, 2.5)
    monkeypatch.delenv("OMNI_STREAM_STATE_DIR")
    assert StateOptions.take({}).path is None


@pytest.mark.parametrize(
    ("name", "value"), [("checkpoint_every", 0), ("checkpoint_seconds", -1.0), ("state_max_bytes", "big")]
)
def test_a_bad_state_option_is_refused_naming_it(name: str, value: Any) -> None:
    from omni_stream.errors import ParamsError

    with pytest.raises(ParamsError) as caught:
        StateOptions.take({name: value})
    assert caught.value.field == name


# -- recording, and serving results after a restart ------------------------------------------


@pytest.mark.asyncio
async def test_requests_and_their_results_are_written_down(tmp_path) -> None:
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="kept", params={**PARAMS, "seed": -1}, detach=True)
        msgs = await until_end(ws, "kept")
        seed = msgs[0]["seed"]
        await server.service.state.flush()
    with _open(tmp_path) as store:
        entry = store.get("kept")
        assert entry is not None and entry.status == "done"
        generate = entry.message["generate"]
        assert generate["params"]["seed"] == seed == entry.seed  # the drawn seed, pinned
        assert (generate["detach"], entry.total, entry.principal.split(":")[0]) == (True, 30, "connection")
        assert entry.terminal is not None and entry.terminal["type"] == "done"
        results = store.load_results("kept")
        assert results is not None and bytes(results[0].data) == await _result(msgs)


@pytest.mark.asyncio
async def test_a_request_that_is_not_detached_is_deleted_as_it_ends(tmp_path) -> None:
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="gone", params=PARAMS)
        await until_end(ws, "gone")
        await server.service.state.flush()
    with _open(tmp_path) as store:
        assert store.get("gone") is None


@pytest.mark.asyncio
async def test_a_restarted_server_serves_a_finished_result(tmp_path) -> None:
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="done1", params=PARAMS, detach=True)
        result = await _result(await until_end(ws, "done1"))
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server:
        reply = await http_get(server, "/v1/generations/done1/output")
        assert reply.status == 200 and reply.body == result
        async with connect(server.url) as ws:
            await send(ws, type="attach", id="done1")
            msgs = await until_end(ws, "done1")
        assert msgs[0]["type"] == "accepted" and msgs[-1]["type"] == "done"
        assert await _result(msgs) == result


@pytest.mark.asyncio
@pytest.mark.one_loop  # what is written down and read back, the same under every loop
async def test_a_ray_hand_over_is_written_down_and_said_by_a_later_start(tmp_path) -> None:
    # The consumer says a hand-over (a Ray replica died, another goes on from step 4) and tells
    # the rules' hook, as stream_request does for a RemoteStream; here the hook is the folder's.
    async with running(Slow(0.05), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="moved", params=PARAMS, detach=True)
        rules = server.service.rules
        await wait_for(lambda: (r := rules.registry.get("moved")) is not None and r.latest_step >= 5,
                       what="a few steps")
        record = rules.registry.get("moved")
        assert record is not None and rules.journal is not None
        assert record.publish_restarted(4, "replica_lost", rewind=False)
        rules.journal.handed_over(record, 4)
        assert (await until_end(ws, "moved"))[-1]["type"] == "done"
        await server.service.state.flush()
    with _open(tmp_path) as store:
        entry = store.get("moved")
        assert entry is not None and entry.message["restarted"] == {"from_step": 4, "reason": "replica_lost"}
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        status = json.loads((await http_get(server, "/v1/generations/moved")).body)
        await send(ws, type="attach", id="moved")
        msgs = await until_end(ws, "moved")
    assert status["status"] == "done" and status["restarted"] == {"from_step": 4, "reason": "replica_lost"}
    assert _restarts(msgs) == [(4, "replica_lost")] and msgs[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_forgotten_requests_leave_the_folder(tmp_path) -> None:
    async with running(Slow(0.0), state_dir=str(tmp_path), max_retained=1) as server:
        async with connect(server.url) as ws:
            for rid in ("a", "b"):
                await send(ws, type="generate", id=rid, params=PARAMS, detach=True)
                await until_end(ws, rid)
        await server.service.state.flush()
    with _open(tmp_path) as store:  # "a" was evicted by max_retained when "b" came
        assert (store.get("a"), store.get("b") is not None) == (None, True)


@pytest.mark.asyncio
async def test_a_second_server_on_the_same_folder_does_not_start(tmp_path) -> None:
    from omni_stream.errors import StoreError

    async with running(Slow(0.0), state_dir=str(tmp_path)):
        with pytest.raises(StoreError, match="in use"):
            async with running(Slow(0.0), state_dir=str(tmp_path)):
                pass


# -- resuming -------------------------------------------------------------------------------


@needs_engine_resume
@pytest.mark.asyncio
async def test_a_restart_resumes_from_the_checkpoint_to_the_same_result(tmp_path) -> None:
    expected = await _uninterrupted(PARAMS)
    await _run_until_checkpoint(tmp_path, "r1", PARAMS, at_least=6)
    with _open(tmp_path) as store:
        entry = store.get("r1")
        assert entry is not None and entry.status == "running" and entry.checkpoint_step is not None
        step = entry.checkpoint_step  # the latest written before the shutdown
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="attach", id="r1")
        msgs = await until_end(ws, "r1")
        status = json.loads((await http_get(server, "/v1/generations/r1")).body)
        events = (await http_get(server, "/v1/generations/r1/events")).body.decode()
        scraped = (await http_get(server, "/metrics")).body.decode()
    steps = [m["step"] for m in msgs if m["type"] == "progress"]
    assert steps and min(steps) > step >= 6
    assert msgs[-1]["type"] == "done"
    assert await _result(msgs) == expected
    # Said to every reader, not only in the log: where it went on from, and why.
    notice = {"type": "restarted", "id": "r1", "from_step": step, "reason": "checkpoint"}
    assert msgs[1] == notice, msgs[:3]  # right after accepted, before any progress
    assert status["restarted"] == {"from_step": step, "reason": "checkpoint"}
    assert f"event: restarted\ndata: {json.dumps(notice, separators=(',', ':'))}\n" in events
    assert 'omni_stream_requests_restarted_total{reason="checkpoint"} 1.0' in scraped
    # Its time from being said restarted to its first frame after, once.
    assert 'omni_stream_restart_first_frame_seconds_count{reason="checkpoint"} 1.0' in scraped


@needs_engine_resume
@pytest.mark.asyncio
async def test_a_finished_request_served_after_another_restart_still_says_it_restarted(tmp_path) -> None:
    step = await _run_until_checkpoint(tmp_path, "twice", PARAMS, at_least=3)
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="attach", id="twice")
        assert (await until_end(ws, "twice"))[-1]["type"] == "done"
        await server.service.state.flush()
    # A third start serves the finished result, and what happened to it on the way.
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        status = json.loads((await http_get(server, "/v1/generations/twice")).body)
        await send(ws, type="attach", id="twice")
        msgs = await until_end(ws, "twice")
    assert status["status"] == "done" and status["restarted"]["reason"] == "checkpoint"
    assert status["restarted"]["from_step"] >= step
    assert _restarts(msgs) == [(status["restarted"]["from_step"], "checkpoint")] and msgs[-1]["type"] == "done"


@needs_engine_resume
@pytest.mark.asyncio
async def test_a_torn_checkpoint_restarts_from_step_0_with_one_warning(tmp_path, caplog) -> None:
    expected = await _uninterrupted(PARAMS)
    await _run_until_checkpoint(tmp_path, "torn", PARAMS, at_least=3)
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="omni_stream"):
        async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
            await send(ws, type="attach", id="torn")
            msgs = await until_end(ws, "torn")
            scraped = (await http_get(server, "/metrics")).body.decode()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "torn" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert msgs[-1]["type"] == "done" and await _result(msgs) == expected
    assert _restarts(msgs) == [(0, "checkpoint_unusable")]
    assert 'omni_stream_requests_restarted_total{reason="checkpoint_unusable"} 1.0' in scraped


@pytest.mark.asyncio
async def test_a_request_without_a_checkpoint_restarts_from_step_0_and_finishes(tmp_path, caplog) -> None:
    # checkpoint_every past its steps: never checkpointed (also the case of an engine without them).
    options = {"state_dir": str(tmp_path), "checkpoint_every": 1000}
    async with running(Slow(0.05), **options) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="zero", params=PARAMS, detach=True)
        await until(ws, lambda m: m.get("type") == "progress" and m["step"] >= 2)
    expected = await _uninterrupted(PARAMS)
    with caplog.at_level(logging.WARNING, logger="omni_stream"):
        async with running(Slow(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
            await send(ws, type="attach", id="zero")
            msgs = await until_end(ws, "zero")
    assert any("step 0" in r.getMessage() and "zero" in r.getMessage() for r in caplog.records)
    assert msgs[-1]["type"] == "done" and await _result(msgs) == expected
    assert _restarts(msgs) == [(0, "no_checkpoint")]


class CannotSnapshot(Slow):
    """Slow whose requests cannot be snapshot (as callback mode or a from_generator model)."""

    def can_snapshot(self, params: Any) -> bool:
        return False


class RefusesCheckpoints(Slow):
    """Slow that refuses every checkpoint it is asked to resume from (another version of a model)."""

    def restored_params(self, checkpoint: Any) -> dict[str, Any]:
        raise CheckpointError("written by another version of this model")


@pytest.mark.asyncio
async def test_a_model_that_cannot_snapshot_says_its_request_restarts_from_step_0(tmp_path) -> None:
    async with running(CannotSnapshot(0.05), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="nosnap", params=PARAMS, detach=True)
        await until(ws, lambda m: m.get("type") == "progress" and m["step"] >= 4)
    async with running(CannotSnapshot(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="attach", id="nosnap")
        msgs = await until_end(ws, "nosnap")
        status = json.loads((await http_get(server, "/v1/generations/nosnap")).body)
    assert msgs[-1]["type"] == "done" and _restarts(msgs) == [(0, "cannot_resume")]
    assert status["restarted"] == {"from_step": 0, "reason": "cannot_resume"}


@needs_engine_resume
@pytest.mark.asyncio
async def test_a_checkpoint_the_model_refuses_is_said_to_restart_from_step_0(tmp_path) -> None:
    expected = await _uninterrupted(PARAMS)
    await _run_until_checkpoint(tmp_path, "refused", PARAMS, at_least=3)
    async with running(RefusesCheckpoints(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="attach", id="refused")
        msgs = await until_end(ws, "refused")
        scraped = (await http_get(server, "/metrics")).body.decode()
    assert msgs[-1]["type"] == "done" and await _result(msgs) == expected
    assert _restarts(msgs) == [(0, "checkpoint_unusable")]
    # Said twice as it went in (from the checkpoint, then from 0), so counted under both.
    assert 'omni_stream_requests_restarted_total{reason="checkpoint"} 1.0' in scraped
    assert 'omni_stream_requests_restarted_total{reason="checkpoint_unusable"} 1.0' in scraped


@needs_engine_resume
@pytest.mark.asyncio
@pytest.mark.one_loop  # the restore path is the core's, the same under every loop
@pytest.mark.parametrize("as_bytes", [False, True], ids=["local-engine", "engine-sends-bytes"])
async def test_a_request_waiting_for_a_place_after_a_restart_says_where_it_will_start(
    tmp_path, monkeypatch, as_bytes: bool
) -> None:
    if as_bytes:
        # An engine that sends a checkpoint on as bytes (a Ray front door's RemoteEngine says so).
        monkeypatch.setattr(Engine, "resume_as_bytes", True, raising=False)
    # Two requests in the folder (the second run resumes "older" and writes "newer" down).
    await _run_until_checkpoint(tmp_path, "older", {**PARAMS, "steps": 400}, at_least=3)
    await _run_until_checkpoint(tmp_path, "newer", PARAMS, at_least=3)
    older, newer = (_checkpoint_step(tmp_path, rid) for rid in ("older", "newer"))
    assert older is not None and newer is not None
    async with running(Slow(0.05), state_dir=str(tmp_path), max_active=1) as server:
        # "older" comes back first and takes the one place; "newer" waits in the gate,
        # not in the engine yet, and says already where it will start.
        waiting = json.loads((await http_get(server, "/v1/generations/newer")).body)
        assert waiting["status"] == "queued", waiting
        assert waiting["restarted"] == {"from_step": newer, "reason": "checkpoint"}
        # Its checkpoint waits with it as tensors alone where the engine is never sent bytes
        # (the file's bytes kept beside them held every such state twice); with its bytes
        # where the engine sends them on, so that none is encoded again on the loop.
        kept = server.service.state._resume["newer"]
        assert kept.step == newer and ("_source" in kept.__dict__) is as_bytes
        async with connect(server.url) as ws:
            await send(ws, type="attach", id="newer")
            msgs = await until(ws, lambda m: m.get("type") == "restarted")
    assert msgs == {"type": "restarted", "id": "newer", "from_step": newer, "reason": "checkpoint"}


@pytest.mark.asyncio
async def test_the_python_client_sees_that_its_request_restarted(tmp_path) -> None:
    from omni_stream import client as omc
    from omni_stream.protocol import Restarted

    async with running(Slow(0.05), state_dir=str(tmp_path), checkpoint_every=1000) as server:
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="py", params=PARAMS, detach=True)
            await until(ws, lambda m: m.get("type") == "progress" and m["step"] >= 2)
    async with running(Slow(0.0), state_dir=str(tmp_path)) as server, omc.connect(server.url) as client:
        stream = client.attach("py")
        async with stream:
            results = [frame async for frame in stream if frame.final]
        assert stream.restarted == Restarted("py", 0, "no_checkpoint")
    assert len(results) == 1


def _restarts(msgs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(m["from_step"], m["reason"]) for m in msgs if m["type"] == "restarted"]


# -- what a request keeps across a restart ---------------------------------------------------


@needs_engine_resume
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("grant_after", "expected"), [(5, 5), (2, 2), (None, 0)],
    ids=["kept", "capped-by-the-token-now", "token-gone"],
)
async def test_a_resumed_request_keeps_its_tokens_priority_grant(
    tmp_path, grant_after: int | None, expected: int
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ops=s3cret priority=5\nother=0ther\n")
    folder = tmp_path / "state"
    await _run_until_checkpoint(
        folder, "granted", {**PARAMS, "steps": 400}, at_least=3, url_query="?token=s3cret", priority=7,
        tokens_file=str(tokens),
    )
    with _open(folder) as store:
        entry = store.get("granted")
        assert entry is not None and entry.message["cross_priority"] == 5  # 7, as far as granted
    granted = "" if grant_after is None else f"ops=s3cret priority={grant_after}\n"
    tokens.write_text(granted + "other=0ther\n")
    async with running(Slow(0.05), state_dir=str(folder), tokens_file=str(tokens)) as server:
        record = server.service.rules.registry.get("granted")
        assert record is not None and not record.ended
        # What ranks it against other principals, in the gate and in the engine.
        assert (record.priority, record.cross_priority) == (7, expected)
        assert server.engine._by_id["granted"].priority == expected


@pytest.mark.asyncio
async def test_a_jpeg_input_image_is_written_down_as_the_jpeg_it_came_as(tmp_path) -> None:
    picture = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (24, 16), (200, 30, 90)).save(picture, format="JPEG", quality=70)
    jpeg = picture.getvalue()
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    params = {**PARAMS, "image": url}
    async with running(TakesImage(0.0), state_dir=str(tmp_path)) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="jpg", params=params, detach=True)
        msgs = await until_end(ws, "jpg")
        await server.service.state.flush()
    assert msgs[-1]["type"] == "done"
    with _open(tmp_path) as store:
        entry = store.get("jpg")
        assert entry is not None
        stored = entry.message["generate"]["params"]["image"]
    # The bytes as given: the same JPEG (not the PNG of its pixels), so a restart decodes
    # the same pixels.
    assert stored == url
    assert decode_image(base64.b64decode(stored.split(",", 1)[1])).tobytes() == decode_image(jpeg).tobytes()


class TakesImage(Slow):
    """Slow with an input image (decoded by the server's door, or a data: URL after a restart)."""

    image_params = ("image",)

    def validate(self, params: Any) -> dict[str, Any]:
        rest = dict(params or {})
        image = rest.pop("image", None)
        out = super().validate(rest)
        out["image"] = None if image is None else load_image(image, allow_paths=False)
        return out

    def can_snapshot(self, params: Any) -> bool:
        return False  # an image is no checkpoint value


# -- kill -9 of a real process ---------------------------------------------------------------------

KILL_PARAMS: dict[str, Any] = {"steps": 80, "shape": [3, 16, 16], "work": 1000, "seed": 77}


async def _ws_run(url: str, message: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    async with connect(url.replace("http", "ws", 1) + "/ws") as ws:
        await send(ws, **message)
        out: list[dict[str, Any]] = []
        with anyio.fail_after(600.0):
            while True:
                msg = await recv(ws, timeout=120.0)
                out.append(msg)
                if msg["type"] in ("done", "cancelled", "error"):  # an error of any kind fails fast
                    return out


@needs_engine_resume
@pytest.mark.one_loop
@pytest.mark.asyncio
async def test_kill_9_mid_render_then_restart_completes_the_request_from_its_checkpoint(tmp_path) -> None:
    folder = tmp_path / "state"
    args = ("--model", "synthetic", "--device", "cpu", "--state-dir", str(folder), "--checkpoint-every", "5")
    env = {"OMNI_STREAM_TORCH_THREADS": "1"}
    with omni_stream_serve("--model", "synthetic", "--device", "cpu", env=env) as (_, _, url):
        reference = await _ws_run(url, {"type": "generate", "id": "ref", "params": KILL_PARAMS}, "ref")
    expected = await _result(reference)

    with omni_stream_serve(*args, env=env) as (proc, _, url):
        async with connect(url.replace("http", "ws", 1) + "/ws") as ws:
            await send(ws, type="generate", id="k9", params=KILL_PARAMS, detach=True)
            # Past two checkpoints (steps 5 and 10): the folder has one to resume from.
            await until(ws, lambda m: m.get("type") == "progress" and m["step"] >= 12, timeout=300.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    step = await anyio.to_thread.run_sync(lambda: _checkpoint_step(folder, "k9"))
    assert step is not None and step >= 5

    with omni_stream_serve(*args, env=env) as (_, _, url):
        msgs = await _ws_run(url, {"type": "attach", "id": "k9"}, "k9")
    progress = [m["step"] for m in msgs if m["type"] == "progress"]
    assert msgs[-1]["type"] == "done"
    # Redone: at most one checkpoint interval (what came after `step` before the kill).
    assert progress and min(progress) > step
    assert await _result(msgs) == expected
    # And the client is told so: it goes on from the checkpoint's step.
    assert _restarts(msgs) == [(step, "checkpoint")]


def _checkpoint_step(folder: Path, rid: str) -> int | None:
    with _open(folder) as store:
        entry = store.get(rid)
        return None if entry is None else entry.checkpoint_step


async def until(ws: Any, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        while True:
            msg = await recv(ws)
            if pred(msg):
                return msg

