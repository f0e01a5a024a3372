"""The engine's promises on every anyio backend: asyncio, asyncio with uvloop, and trio.

The rest of tests/engine runs under pytest-asyncio (asyncio and uvloop);
these run the essential promises through anyio's pytest plugin, over the
three backends as anyio's own suite parametrises them. On trio, everything
that crosses from a thread to the loop (frames, a cancel from another
thread, a garbage-collected stream, a model built on the producer thread)
goes through trio's token, not asyncio's loop. The parts that stay
asyncio-only (the client, the server) refuse trio with an error of ours.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.config import STEP_TIMEOUT_ENV
from omni_stream.models import Synthetic

from .conftest import make_device, params, settled, wait_for

pytestmark = pytest.mark.anyio


def running_on(anyio_backend: tuple[str, dict[str, Any]]) -> str:
    """The backend's name as the test reads it: asyncio, uvloop or trio."""
    name, options = anyio_backend
    return "uvloop" if options.get("use_uvloop") else name


async def test_the_backend_is_the_one_asked_for(anyio_backend):
    # Guards the parametrisation itself: uvloop really runs, trio really runs.
    import sniffio

    name = sniffio.current_async_library()
    assert name == anyio_backend[0]
    if running_on(anyio_backend) == "uvloop":
        import asyncio

        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")


async def test_every_frame_streams_bit_for_bit(anyio_backend, device_kind):
    model = Synthetic()
    p = params(steps=12, seed=5)
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        frames = [f async for f in engine.stream(p)]
        assert engine.health().status == "ok"
        stats = await settled(engine)
    assert [f.step for f in frames] == list(range(1, 13))
    assert frames[-1].final and not any(f.final for f in frames[:-1])
    for got, want in zip(frames, model.expected_frames(p), strict=True):
        assert torch.equal(got.data, want)
    assert stats.completed == 1 and stats.buffers_in_use == 0


async def test_a_model_built_on_the_producer_thread_serves(anyio_backend):
    # start() waits for the producer thread to call back onto the loop.
    async with om.Engine(Synthetic, device="cpu") as engine:
        final = await engine.generate(params(steps=3, seed=2))
    assert final.final and final.step == 3


async def test_latest_replaces_unread_frames_but_never_the_final(anyio_backend):
    model = Synthetic()
    p = params(steps=30, seed=4)
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream(p, policy="latest")
        await wait_for(lambda: engine.statistics().completed == 1, what="the request to finish")
        frames = [f async for f in stream]
        stats = engine.statistics()
    assert frames[-1].final and frames[-1].step == 30
    assert len(frames) < 30
    assert stats.frames_dropped == 30 - len(frames)
    assert torch.equal(frames[-1].data, model.expected_frames(p)[-1])


async def test_all_delivers_every_frame_to_a_reader_that_lags(anyio_backend):
    model = Synthetic()
    p = params(steps=20, seed=6)
    async with om.Engine(model, device="cpu", queue_size=3) as engine:
        stream = engine.stream(p, policy="all")
        # The reader takes nothing yet: the request pauses at queue_size frames.
        await wait_for(lambda: engine.statistics().steps >= 3, what="three steps")
        await anyio.wait_all_tasks_blocked()
        assert engine.statistics().steps < 20
        frames = [f async for f in stream]
        stats = engine.statistics()
    assert [f.step for f in frames] == list(range(1, 21))
    assert stats.frames_dropped == 0
    for got, want in zip(frames, model.expected_frames(p), strict=True):
        assert torch.equal(got.data, want)


async def test_a_reader_that_stops_cancels_only_its_own_request(anyio_backend, device_kind):
    model = Synthetic()
    kept = params(steps=10, seed=7)
    async with om.Engine(model, device=make_device(device_kind), queue_size=2) as engine:
        got: list[torch.Tensor] = []

        async def quitter() -> None:
            async with engine.stream(params(steps=40, seed=8), request_id="quits") as stream:
                async for frame in stream:
                    if frame.step == 2:
                        break  # leaving the block closes the stream: the request is cancelled

        async def keeper() -> None:
            got.extend([f.data async for f in engine.stream(kept, request_id="keeps")])

        async with anyio.create_task_group() as tg:
            tg.start_soon(quitter)
            tg.start_soon(keeper)
        stats = await settled(engine)
    assert len(got) == 10
    assert all(torch.equal(a, b) for a, b in zip(got, model.expected_frames(kept), strict=True))
    assert stats.cancelled == 1 and stats.completed == 1 and stats.buffers_in_use == 0


async def test_a_dropped_stream_and_a_cancel_from_another_thread_reach_the_loop(anyio_backend):
    # Both schedule their cancel onto the loop from outside it: __del__ (the
    # garbage collector may run it on any thread) and engine.cancel on a thread.
    async with om.Engine(Synthetic(), device="cpu", queue_size=2) as engine:
        dropped = engine.stream(params(steps=40, seed=1), request_id="dropped")
        assert (await dropped.__anext__()).step == 1
        del dropped
        gc.collect()
        await wait_for(lambda: engine.statistics().cancelled == 1, what="the dropped stream's cancel")

        other = engine.stream(params(steps=40, seed=2), request_id="other")
        assert (await other.__anext__()).step == 1
        called_from: list[int] = []

        def cancel() -> bool:
            called_from.append(threading.get_ident())
            return engine.cancel("other")

        assert await anyio.to_thread.run_sync(cancel)
        assert called_from[0] != threading.get_ident()
        with pytest.raises(om.RequestCancelledError):
            async for _ in other:
                pass
        assert (await engine.generate(params(steps=3, seed=3))).final
        stats = await settled(engine)
    assert stats.cancelled == 2 and stats.completed == 1


async def test_a_hung_step_times_out_and_health_says_stalled(anyio_backend, monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.25")
    async with om.Engine(Synthetic(), device="cpu") as engine:
        assert engine.health().status == "ok"
        stream = engine.stream(params(steps=4, hang_at=2, hang_s=1.2), request_id="hung")
        assert (await stream.__anext__()).step == 1
        with pytest.raises(om.StepTimeoutError) as info:
            await stream.__anext__()
        assert info.value.request_id == "hung" and info.value.step == 2
        await wait_for(lambda: engine.health().status == "stalled", what="a stalled health")
        with pytest.raises(om.EngineStalledError):
            engine.check_health()
        await wait_for(lambda: engine._producer.busy_since is None, what="the hang to end")
        engine.check_health()
        assert (await engine.generate(params(steps=2, seed=9))).final
        stats = await settled(engine)
    assert stats.timed_out == 1
    assert engine.health().status == "closed"


async def test_the_per_request_timeout_bounds_a_step(anyio_backend, monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "600")
    async with om.Engine(Synthetic(), device="sim") as engine:
        with pytest.raises(om.StepTimeoutError, match="timeout="):
            await engine.generate(params(steps=3, hang_at=1, hang_s=0.6), timeout=0.1)


async def test_a_dead_engine_says_so(anyio_backend):
    class Dies(Synthetic):
        def step(self, states: Any) -> Any:
            raise SystemExit("the model called exit()")

    async with om.Engine(Dies(), device="cpu") as engine:
        with pytest.raises(om.EngineDeadError):
            await engine.generate(params(steps=3))
        await wait_for(lambda: engine.health().status == "dead", what="a dead health")
        with pytest.raises(om.EngineDeadError):
            engine.check_health()


async def test_an_engine_group_routes_streams_and_cancels(anyio_backend):
    model = Synthetic()
    group = om.EngineGroup(Synthetic, devices=[make_device("cpu"), make_device("sim")])
    async with group:
        assert group.health().status == "ok"
        ps = [params(steps=6, seed=20 + i) for i in range(4)]
        results: dict[int, list[torch.Tensor]] = {}

        async def read(i: int) -> None:
            results[i] = [f.data async for f in group.stream(ps[i], request_id=f"g{i}")]

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(read, i)
        for i, p in enumerate(ps):
            assert all(torch.equal(a, b) for a, b in zip(results[i], model.expected_frames(p), strict=True))
            assert len(results[i]) == 6
        assert {m.statistics().completed > 0 for m in group.members} == {True}

        stream = group.stream(params(steps=40, seed=1), request_id="stop")
        assert (await stream.__anext__()).step == 1
        assert group.cancel("stop")
        with pytest.raises(om.RequestCancelledError):
            async for _ in stream:
                pass
    assert group.health().status == "closed"


async def test_the_client_runs_on_every_backend(anyio_backend):
    # On asyncio websockets' own client, under trio websockets' Sans-I/O protocol over anyio
    # (client/anyio_socket.py): either way it runs, and says in our words that nothing listens.
    client = om.client.Client("ws://127.0.0.1:9/ws", open_timeout=2)
    with pytest.raises(om.client.ConnectError, match="cannot connect"):
        async with client:
            pass


# The client against a real server under trio: tests/test_client_trio.py.
# The server runs under trio too (on hypercorn): tests/server/test_trio_server.py.
