"""RemoteEngine over a local Ray cluster: streaming, cancellation, backpressure, errors, replica loss, the server.

One module-scoped cluster (``ray.init(num_cpus=2)``, Serve without its HTTP
proxy) runs two applications of the synthetic model: ``sim`` (two
replicas on simulated devices whose steps take ``STEP_S``, so a request
takes real time without burning the CPU) and ``cpu`` (one replica on the
CPU device). The replicas take no CPU reservation, so all fit on two cores.
"""

from __future__ import annotations

import gc
import io
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

import ray  # noqa: E402
from PIL import Image  # noqa: E402
from ray import serve  # noqa: E402

from .cluster import start_local_ray  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.device import SimDevice  # noqa: E402
from omni_stream.engine.intake import check_request, check_request_id  # noqa: E402
from omni_stream.engine.like import EngineLike, FrameStreamLike, RendersFrames  # noqa: E402
from omni_stream.integrations.ray_serve import (  # noqa: E402
    DEFAULT_WINDOW,
    RemoteEngine,
    RemoteStream,
    deploy,
)
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.models.synthetic import SyntheticFault  # noqa: E402
from omni_stream.preview import PreviewSpec, RenderRequest, render_sync  # noqa: E402
from omni_stream.server import Server  # noqa: E402

from ..server.conftest import RawClient, check_stream, send, until, until_end  # noqa: E402

pytestmark = pytest.mark.ray

#: These tests run under asyncio only (a cluster round trip costs more than
#: the loop under test); the streaming test also runs under uvloop.
ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])

#: Simulated compute per step on the ``sim`` replicas.
STEP_S = 0.02
SMALL: dict[str, Any] = {"shape": [3, 16, 16], "work": 0}
#: A request that would run for minutes unless stopped.
LONG: dict[str, Any] = {**SMALL, "steps": 5000}
#: Steps a stopped request may have computed past the frames its reader
#: took, with policy "all": the frames in transit (window), those queued in
#: the engine for the replica's pump (queue_size 8) and the producer's run
#: ahead (3), and one in hand.
FEW = DEFAULT_WINDOW + 8 + 3 + 1


@pytest.fixture(scope="module")
def cluster() -> Any:
    # ray.init installs a SIGTERM handler and ray.shutdown leaves it: put
    # back what the rest of the suite expects.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = not ray.is_initialized()
    if started:
        start_local_ray()
    serve.start(proxy_location="Disabled")
    yield
    if started:
        ray.shutdown()  # the whole local cluster, Serve included
    else:
        for app in ("sim", "cpu"):
            serve.delete(app)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def sim(cluster: Any) -> str:
    deploy(
        "synthetic",
        name="sim",
        replicas=2,
        num_cpus=0,
        engine_kwargs={"device": SimDevice(compute_s=STEP_S)},
        health_check_period_s=1.0,
    )
    return "sim"


@pytest.fixture(scope="module")
def cpu(cluster: Any) -> str:
    deploy("synthetic", name="cpu", replicas=1, num_cpus=0, engine_kwargs={"device": "cpu"})
    return "cpu"


async def wait_for(cond: Callable[[], Any], *, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.05)


def replica_stats(engine: RemoteEngine, replica: str) -> om.EngineStatistics:
    for v in engine.replicas():
        if v.replica == replica:
            return v.report.health.statistics
    raise AssertionError(f"no report from replica {replica}")


async def settled(engine: RemoteEngine, replica: str) -> om.EngineStatistics:
    """The replica's statistics once it runs no request (reports arrive every 0.25 s)."""

    async def idle() -> bool:
        await engine.refresh()
        s = replica_stats(engine, replica)
        return s.active == 0 and s.queued == 0

    deadline = time.monotonic() + 10
    while not await idle():
        assert time.monotonic() < deadline, f"replica {replica} still runs a request"
        await anyio.sleep(0.1)
    # One more report: the one before may predate the request's end.
    await anyio.sleep(0.3)
    await engine.refresh()
    return replica_stats(engine, replica)


async def steps_of(engine: RemoteEngine) -> dict[str, int]:
    await engine.refresh()
    return {v.replica: v.report.health.statistics.steps for v in engine.replicas() if not v.lost}


# -- streaming -------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("app", ["sim", "cpu"])
async def test_every_step_is_streamed_bit_exact_final_last(app: str, sim: str, cpu: str) -> None:
    params = {**SMALL, "steps": 12, "seed": 3}
    async with RemoteEngine(app) as engine:
        assert isinstance(engine, EngineLike)
        stream = engine.stream(params, request_id=f"all-{app}")
        assert isinstance(stream, FrameStreamLike) and stream.total == 12
        frames = [f async for f in stream]
        final = await engine.generate(params)
    assert [f.step for f in frames] == list(range(1, 13))
    assert [f.final for f in frames] == [False] * 11 + [True]
    assert all(f.request_id == f"all-{app}" and f.total == 12 for f in frames)
    for got, want in zip(frames, Synthetic().expected_frames(params)):
        assert got.data.dtype == want.dtype and bool(got.data.eq(want).all())
    assert bool(final.data.eq(frames[-1].data).all())
    assert stream.replica is not None and stream.params["shape"] == (3, 16, 16)



@ASYNCIO
async def test_a_seed_drawn_at_the_front_door_is_the_one_the_replica_runs(sim: str) -> None:
    params = {**SMALL, "steps": 3}
    async with RemoteEngine(sim) as engine:
        stream = engine.stream(params, request_id="drawn")
        frames = [f async for f in stream]
    seed = stream.params["seed"]
    assert 0 <= seed < 2**32
    # A second draw on the replica would make other frames.
    want = Synthetic().expected_frames({**params, "seed": seed})[-1]
    assert bool(frames[-1].data.eq(want).all())


@ASYNCIO
async def test_the_front_door_has_the_models_card_not_the_model(sim: str) -> None:
    async with RemoteEngine(sim) as engine:
        model = engine.model
        h = engine.health()
        assert engine.max_batch_size == 16  # two replicas of 8
    assert (model.name, model.describe()) == ("synthetic", Synthetic().describe())
    assert model.params == Synthetic.params and type(model).__name__ == "ModelCard"
    assert h.ok and h.device == "ray:sim" and len(h.statistics.members) == 2
    with pytest.raises(om.EngineClosedError):
        engine.stream(SMALL)


# -- cancellation ----------------------------------------------------------------------


async def _stop_by(how: str, engine: RemoteEngine, stream: RemoteStream) -> int:
    """Take some frames, then end the stream early ``how``; return the frames taken."""
    taken = 1  # the caller took the first
    if how == "break":
        async for frame in stream:
            taken += 1
            if frame.step == 3:
                break
        return taken  # the caller drops the last reference: the stream's __del__ cancels
    if how == "reader-timeout":
        with anyio.move_on_after(0.3):
            async for _ in stream:
                taken += 1
                await anyio.sleep(STEP_S)
        return taken
    for _ in range(2):
        await stream.__anext__()
        taken += 1
    if how == "cancel":
        assert engine.cancel(stream.request_id)
        with pytest.raises(om.RequestCancelledError) as err:
            async for _ in stream:
                taken += 1
        assert err.value.request_id == stream.request_id
        assert not engine.cancel(stream.request_id)
    elif how == "aclose":
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    return taken


@ASYNCIO
@pytest.mark.parametrize("how", ["cancel", "aclose", "break", "reader-timeout"])
async def test_ending_a_stream_early_stops_the_replicas_request(sim: str, how: str) -> None:
    async with RemoteEngine(sim) as engine:
        before = await steps_of(engine)
        stream = engine.stream(LONG, request_id=f"stop-{how}", policy="all")
        first = await stream.__anext__()  # its replica is known from here
        replica = stream.replica
        assert replica is not None and first.step == 1
        taken = await _stop_by(how, engine, stream)
        del stream
        gc.collect()
        stats = await settled(engine, replica)
    computed = stats.steps - before[replica]
    print(f"{how}: {taken} frames read, {computed} steps computed on replica {replica}")
    assert computed <= taken + FEW, f"{how}: the replica computed {computed} steps, {taken} read"
    assert stats.cancelled >= 1


# -- backpressure ------------------------------------------------------------------------


@ASYNCIO
async def test_a_slow_reader_gets_the_final_frame_and_a_bounded_few_others(sim: str) -> None:
    steps = 40
    async with RemoteEngine(sim) as engine:
        stream = engine.stream({**SMALL, "steps": steps}, policy="latest")
        first = await stream.__anext__()
        await anyio.sleep(steps * STEP_S + 0.6)  # the replica's engine finishes meanwhile
        await engine.refresh()
        held = next(v for v in engine.replicas() if v.replica == stream.replica).report.in_transit
        rest = [f async for f in stream]
    assert first.step < steps  # "latest": the newest when the pump took it, not always step 1
    assert held <= DEFAULT_WINDOW
    assert rest[-1].final and rest[-1].step == steps
    # The window's frames (sent before the reader paused), then the newest: the final one.
    assert len(rest) <= DEFAULT_WINDOW + 1, [f.step for f in rest]
    assert [f.step for f in rest] == sorted({f.step for f in rest})


# -- batched transit (issue #23) ---------------------------------------------------------


@ASYNCIO
async def test_frames_ready_together_cross_as_one_batch_every_one_in_order(cpu: str) -> None:
    params = {**SMALL, "steps": 60, "seed": 5}
    async with RemoteEngine(cpu, window=8) as engine:
        stream = engine.stream(params, policy="all")
        frames = [await stream.__anext__()]
        # The replica fills the window meanwhile; the engine queues the rest,
        # so each credit the reader gives back brings several frames at once.
        await anyio.sleep(0.5)
        batched = 0
        async for frame in stream:
            frames.append(frame)
            while (more := stream.poll()) is not None:  # only a batch's frames are ready here
                frames.append(more)
                batched += 1
    assert [f.step for f in frames] == list(range(1, 61))
    assert frames[-1].final and batched > 0
    for got, want in zip(frames, Synthetic().expected_frames(params)):
        assert bool(got.data.eq(want).all())


@ASYNCIO
async def test_batches_keep_the_window_a_paused_all_reader_holds_at_most_window_frames(cpu: str) -> None:
    window = 3  # odd: batches and the half-window acks must still add up to it
    async with RemoteEngine(cpu, window=window) as engine:
        stream = engine.stream({**SMALL, "steps": 400}, policy="all")
        taken = [(await stream.__anext__()).step for _ in range(5)]
        held = []
        for _ in range(4):  # reports every 0.25 s, while the reader pauses
            await anyio.sleep(0.3)
            await engine.refresh()
            held.append(next(v for v in engine.replicas() if v.replica == stream.replica).report.in_transit)
        taken += [f.step async for f in stream]
    assert max(held) <= window and max(held) > 0, held
    assert taken == list(range(1, 401))


@ASYNCIO
async def test_a_cancel_while_batching_stops_the_replicas_request(sim: str) -> None:
    window = 8
    async with RemoteEngine(sim, window=window) as engine:
        before = await steps_of(engine)
        stream = engine.stream(LONG, request_id="stop-batched", policy="all")
        await stream.__anext__()
        taken = 1
        replica = stream.replica
        assert replica is not None
        await anyio.sleep(10 * STEP_S)  # frames queue up: the next items are batches
        for _ in range(6):
            await stream.__anext__()
            taken += 1
        assert engine.cancel(stream.request_id)
        with pytest.raises(om.RequestCancelledError):
            async for _ in stream:
                taken += 1
        stats = await settled(engine, replica)
    computed = stats.steps - before[replica]
    assert computed <= taken + window + 8 + 3 + 1, f"the replica computed {computed} steps, {taken} read"
    assert stats.cancelled >= 1


# -- errors --------------------------------------------------------------------------------


@ASYNCIO
async def test_errors_arrive_as_this_projects_own(sim: str) -> None:
    async with RemoteEngine(sim) as engine:
        # The card refuses at once, as an Engine would.
        with pytest.raises(om.ParamsError) as refused:
            engine.stream({**SMALL, "stepz": 3}, request_id="bad")
        assert (refused.value.field, refused.value.request_id) == ("stepz", "bad")
        with pytest.raises(om.ParamsError):
            engine.stream(SMALL, policy="newest")
        # Only the real model refuses this: its replica says so on the first read.
        with pytest.raises(om.ParamsError) as late:
            await engine.generate({"shape": [4096, 4096]}, request_id="huge")
        assert (late.value.field, late.value.request_id) == ("shape", "huge")
        # The model raising: StepFailedError, its cause pickled across.
        with pytest.raises(om.StepFailedError) as failed:
            async for _ in engine.stream({**SMALL, "steps": 5, "fail_at": 3}, request_id="f"):
                pass
        assert (failed.value.step, failed.value.request_id) == (3, "f")
        assert isinstance(failed.value.__cause__, SyntheticFault)
        # A step over the request's own bound.
        with pytest.raises(om.StepTimeoutError) as slow:
            await engine.generate(
                {**SMALL, "steps": 3, "hang_at": 2, "hang_s": 1.0}, request_id="t", timeout=0.3
            )
        assert slow.value.request_id == "t" and slow.value.bound_s == pytest.approx(0.3)
        # A duplicate id while the first streams.
        async with engine.stream(LONG, request_id="dup") as first:
            await first.__anext__()
            with pytest.raises(om.ParamsError, match="already running"):
                engine.stream(SMALL, request_id="dup")


@ASYNCIO
async def test_the_front_door_refuses_what_an_engine_refuses_in_the_same_words(sim: str) -> None:
    async with RemoteEngine(sim) as engine:
        for bad in (".", "..", "x" * 129, "a b"):
            with pytest.raises(om.ParamsError) as expected:
                check_request_id(bad)
            with pytest.raises(om.ParamsError) as refused:
                engine.stream(SMALL, request_id=bad)
            assert (refused.value.field, str(refused.value)) == ("request_id", str(expected.value))
        for option, value in [("policy", "newest"), ("timeout", 0), ("preview_every", 0), ("priority", 11)]:
            with pytest.raises(om.ParamsError) as expected:
                check_request(engine.model, SMALL, request_id="o", **{option: value})
            with pytest.raises(om.ParamsError) as refused:
                engine.stream(SMALL, request_id="o", **{option: value})
            assert (refused.value.field, str(refused.value)) == (option, str(expected.value))
        assert engine._open_streams() == []  # nothing was sent to a replica
        assert (await engine.generate({**SMALL, "steps": 2}, request_id="x" * 128)).final


# -- the server in front ---------------------------------------------------------------------


def front_door(engine: RemoteEngine) -> Server:
    return Server(engine, host="127.0.0.1", port=0, shutdown_timeout_s=0.5, close_timeout_s=1.0)


def _cancelled(engine: RemoteEngine) -> int:
    return engine.statistics().cancelled


@ASYNCIO
async def test_a_render_request_brings_encoded_previews_and_result_not_tensors(cpu: str) -> None:
    params = {"shape": [3, 96, 128], "work": 0, "steps": 6, "seed": 5}
    spec = PreviewSpec(every=2, format="jpeg", max_size=48)
    render = RenderRequest.of(spec, "png")
    assert render is not None
    async with RemoteEngine(cpu) as engine:
        assert isinstance(engine, RendersFrames) and engine.renders_frames
        frames = [f async for f in engine.stream(params, request_id="rendered", render=render)]
    assert [f.step for f in frames] == list(range(1, 7))
    assert all(f.data.numel() == 0 for f in frames), "a tensor crossed"
    assert [f.step for f in frames if f.encoded is not None] == [2, 4, 6]
    want = Synthetic().expected_frames(params)
    for f in frames[1:-1:2]:
        assert f.encoded == render_sync(want[f.step - 1], spec)  # what the server would render
    result = frames[-1].encoded
    assert result is not None and (result.format, result.width, result.height) == ("png", 128, 96)
    image = Image.open(io.BytesIO(result.data))
    assert image.size == (128, 96) and "Seed: 5" in image.info["parameters"]


@ASYNCIO
async def test_the_server_in_front_gets_previews_rendered_on_the_replica(cpu: str) -> None:
    params = {"shape": [3, 64, 64], "work": 0, "steps": 4}
    async with RemoteEngine(cpu) as engine, front_door(engine) as server:
        rendered: list[Any] = []
        original = engine.stream

        def spy(*args: Any, **kw: Any) -> Any:
            rendered.append(kw.get("render"))
            return original(*args, **kw)

        engine.stream = spy  # type: ignore[method-assign]
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="p", params=params,
                       preview={"format": "jpeg", "max_size": 32}, output={"format": "jpeg"})
            msgs = await until_end(ws, "p")
    check_stream(msgs, "p", 4)
    previews = [m for m in msgs if m["type"] == "preview"]
    # Latest-wins on the replica may skip steps; the result is never skipped.
    assert {(m["format"], max(m["width"], m["height"]), m["final"]) for m in previews[:-1]} <= {("jpeg", 32, False)}
    assert (previews[-1]["step"], previews[-1]["format"], previews[-1]["width"], previews[-1]["final"]) == (
        4, "jpeg", 64, True)
    assert all(Image.open(io.BytesIO(m["image"])).format == "JPEG" for m in previews)
    assert rendered and isinstance(rendered[0], RenderRequest)
    assert (rendered[0].output_format, rendered[0].max_size) == ("jpeg", 32)


@ASYNCIO
async def test_the_server_in_front_streams_every_message_type(cpu: str) -> None:
    async with RemoteEngine(cpu) as engine, front_door(engine) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="one", params={**SMALL, "steps": 6})
        msgs = await until_end(ws, "one")
        check_stream(msgs, "one", 6)
        await send(ws, type="generate", id="boom", params={**SMALL, "steps": 4, "fail_at": 2})
        failed = await until_end(ws, "boom")
        await send(ws, type="generate", id="nope", params={**SMALL, "stepz": 4})
        refused = await until(ws, lambda m: m.get("id") == "nope")
    assert {m["type"] for m in msgs} == {"accepted", "progress", "preview", "done"}
    assert failed[-1]["type"] == "error" and failed[-1]["code"] == "step_failed"
    assert "SyntheticFault" in failed[-1]["message"]
    assert (refused["type"], refused["code"], refused["field"]) == ("error", "bad_params", "stepz")


@ASYNCIO
async def test_the_server_in_front_validates_against_the_card_once(cpu: str, monkeypatch: Any) -> None:
    # Issue #36: the server's check, then RemoteEngine's, made two in the front door's process.
    # The replica's model validates once more in its own (the card checks less than the model).
    from omni_stream.integrations.ray_serve.card import ModelCard

    calls: list[Any] = []
    original = ModelCard.validate

    def counted(self: ModelCard, params: Any) -> dict[str, Any]:
        calls.append(params)
        return original(self, params)

    monkeypatch.setattr(ModelCard, "validate", counted)
    async with RemoteEngine(cpu) as engine, front_door(engine) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="once", params={**SMALL, "steps": 3})
        msgs = await until_end(ws, "once")
    check_stream(msgs, "once", 3)
    assert len(calls) == 1


@ASYNCIO
@pytest.mark.parametrize("how", ["cancel-message", "tcp-drop"])
async def test_the_server_in_front_cancels_on_the_replica(sim: str, how: str) -> None:
    async with RemoteEngine(sim) as engine, front_door(engine) as server:
        before = _cancelled(engine)
        if how == "cancel-message":
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="c", params=LONG)
                await until(ws, lambda m: m["type"] == "progress")
                await send(ws, type="cancel", id="c")
                msgs = await until_end(ws, "c")
            assert msgs[-1] == {"type": "cancelled", "id": "c", "reason": "client"}
        else:
            raw = await RawClient.connect(server)
            await raw.send_text(json.dumps({"type": "generate", "id": "d", "params": LONG}))
            await wait_for(lambda: engine.statistics().active >= 1, what="the request on a replica")
            raw.close()
        await wait_for(lambda: _cancelled(engine) > before, what="the replica's request cancelled")
        await wait_for(lambda: engine.statistics().active == 0, what="the replica idle")


# -- a lost replica ---------------------------------------------------------------------------


@ASYNCIO
async def test_a_killed_replica_fails_its_requests_and_another_serves(sim: str) -> None:
    # Hand-overs off: the requests of a lost replica fail (test_ray_serve_handover_cluster.py
    # has them go on on another replica, the default).
    async with RemoteEngine(sim, max_handovers=0) as engine:
        streams = [engine.stream(LONG, request_id=f"k{i}", policy="latest") for i in range(4)]
        for s in streams:
            await s.__anext__()
        victim = streams[0].replica
        assert victim is not None
        pid = next(v.report.pid for v in engine.replicas() if v.replica == victim)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            if s.replica != victim:
                continue
            with pytest.raises(om.EngineDeadError, match=f"replica {victim} was lost") as err:
                async for _ in s:
                    pass
            assert err.value.request_id == s.request_id
        noticed = time.monotonic() - killed
        assert noticed < 3.0
        # The other replica's requests go on; health stays ok and names the lost one.
        for s in streams:
            if s.replica != victim:
                await s.__anext__()
                await s.aclose()
        h = engine.health()
        assert h.ok and f"replica {victim} is lost" in (h.reason or "")
        # New requests go to live replicas.
        for i in range(3):
            final = await engine.generate({**SMALL, "steps": 3}, request_id=f"after{i}")
            assert final.final
        # Serve starts a replacement.
        await wait_for(
            lambda: len([v for v in engine.replicas() if v.ok and v.replica != victim]) == 2,
            timeout=30,
            what="a replacement replica",
        )
        replaced = time.monotonic() - killed
    print(f"readers told in {noticed * 1e3:.0f} ms; a replacement reported ok {replaced:.1f} s after the kill")
    assert replaced < 30


@ASYNCIO
async def test_a_stalled_engine_gets_its_replica_replaced(cluster: Any) -> None:
    # Its own application: a replica whose step bound is 1 s (the variable,
    # read by the replica's process), checked every 0.5 s.
    deploy(
        "synthetic",
        name="stall",
        replicas=1,
        num_cpus=0,
        engine_kwargs={"device": "cpu", "shutdown_timeout": 1.0},
        ray_actor_options={"runtime_env": {"env_vars": {"OMNI_STREAM_STEP_TIMEOUT": "1"}}},
        health_check_period_s=0.5,
        graceful_shutdown_timeout_s=1.0,
    )
    try:
        async with RemoteEngine("stall") as engine:
            stream = engine.stream({**SMALL, "steps": 5, "hang_at": 2, "hang_s": 20.0}, request_id="wedged")
            await stream.__anext__()
            stalled_replica = stream.replica
            hung = time.monotonic()
            # The request ends with its step's bound (or, had the bound been
            # longer than three failed checks, the replica ends it, naming
            # itself, before Serve stops it).
            with pytest.raises((om.StepTimeoutError, om.EngineDeadError)):
                async for _ in stream:
                    pass
            told = time.monotonic() - hung
            # Another replica takes its place and serves.
            deadline = time.monotonic() + 40
            while True:
                try:
                    final = await engine.generate({**SMALL, "steps": 3}, request_id="after-stall")
                    break
                except (om.EngineError, om.RequestError):
                    assert time.monotonic() < deadline, "no replacement served within 40 s"
                    await anyio.sleep(0.5)
            served = time.monotonic() - hung
            assert final.final
            await wait_for(
                lambda: any(v.ok and v.replica != stalled_replica for v in engine.replicas()),
                what="the replacement's report",
            )
            assert stalled_replica not in {v.replica for v in engine.replicas() if v.ok}
    finally:
        serve.delete("stall")
    print(f"the reader was told after {told:.1f} s; a replacement served {served:.1f} s after the hang")
    assert told < 10
