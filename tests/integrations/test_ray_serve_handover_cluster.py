"""A replica that dies mid-render hands its requests over (handover.py), on a local Ray cluster.

One module-scoped cluster runs the application ``handover``: two replicas
on the CPU device serving two tiny models, ``handy`` (Synthetic that
sleeps ``STEP_S`` a step, so a request takes real time without burning
the CPU, and that can kill its own replica at ``exit_at``) and ``nosnap``
(the same, unable to snapshot a request). The test that kills every
replica it lands on runs last. Each test starts once two replicas report
ok (a previous test's victim replaced).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

import ray  # noqa: E402
from ray import serve  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.integrations.ray_serve import RemoteEngine, RemoteStream, deploy  # noqa: E402
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.params import Param  # noqa: E402
from omni_stream.server import Server  # noqa: E402

from ..server.conftest import http_get, send, until, until_end  # noqa: E402
from .cluster import start_local_ray  # noqa: E402

pytestmark = pytest.mark.ray

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])

APP = "handover"
#: Seconds a step of ``handy`` takes (a sleep: the replicas share two cores).
STEP_S = 0.02
#: Steps between two checkpoints in these tests.
EVERY = 5
SMALL: dict[str, Any] = {"shape": [3, 8, 8], "work": 0}


class Handy(Synthetic):
    """Synthetic, each step ``STEP_S`` long; ``exit_at`` ends the replica's process at that step."""

    name = "handy"
    params = (  # type: ignore[assignment]  # one param more than Synthetic's tuple type
        *Synthetic.params, Param("exit_at", "int", None, "this step ends the process", minimum=1),
    )

    def step(self, states: Sequence[Any]) -> list[Any]:
        for s in states:
            if s.params["exit_at"] == s.step + 1:
                os._exit(17)  # a replica dying mid-render, as a segfault or an OOM kill would
        time.sleep(STEP_S)
        return super().step(states)


class NoSnap(Handy):
    """``handy`` that cannot snapshot a request (a callback-mode pipeline, say)."""

    name = "nosnap"

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        return False


def expected(params: Mapping[str, Any]) -> list[Any]:
    return Synthetic().expected_frames({k: v for k, v in params.items() if k != "exit_at"})


@pytest.fixture(scope="module")
def app() -> Any:
    # ray.init installs a SIGTERM handler and ray.shutdown leaves it: put
    # back what the rest of the suite expects.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = not ray.is_initialized()
    if started:
        # The replicas unpickle Handy by reference: Ray puts the driver's working
        # directory (the checkout, where pytest runs) on their path.
        start_local_ray()
    serve.start(proxy_location="Disabled")
    deploy(
        {"handy": Handy(), "nosnap": NoSnap()},
        name=APP,
        replicas=2,
        num_cpus=0,
        engine_kwargs={"device": "cpu"},
        health_check_period_s=1.0,
    )
    yield APP
    if started:
        ray.shutdown()
    else:
        serve.delete(APP)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


async def wait_for(cond: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.05)


def live(engine: RemoteEngine) -> list[str]:
    """The replicas reporting ok now. A fresh RemoteEngine counts a replica killed by the test
    before as ok until its last report is ``stale_after_s`` (3 s) old: here, 1 s (reports
    come every 0.25 s)."""
    return [v.replica for v in engine.replicas() if v.ok and v.age_s < 1.0]


async def two_replicas(engine: RemoteEngine) -> None:
    """Wait until two replicas report ok (a previous test's victim replaced)."""
    await wait_for(lambda: len(live(engine)) >= 2, what="two replicas ok")


def kill(engine: RemoteEngine, replica: str) -> None:
    pid = next(v.report.pid for v in engine.replicas() if v.replica == replica)
    os.kill(pid, signal.SIGKILL)


async def read_until(stream: RemoteStream, step: int) -> list[om.Frame]:
    frames = []
    async for frame in stream:
        frames.append(frame)
        if frame.step >= step:
            break
    return frames


def assert_identical(frames: Sequence[om.Frame], params: Mapping[str, Any]) -> None:
    want = expected(params)
    assert [f.step for f in frames] == list(range(1, len(want) + 1)), "a gap or a repeated frame"
    for got, w in zip(frames, want, strict=True):
        assert bool(got.data.eq(w).all()), f"step {got.step} differs from an uninterrupted run's"


@ASYNCIO
async def test_a_killed_replicas_request_completes_on_another_identical_with_one_interval_redone(
    app: str,
) -> None:
    params = {**SMALL, "steps": 60, "seed": 11}
    async with RemoteEngine(app, checkpoint_every=EVERY) as engine:
        await two_replicas(engine)
        stream = engine.stream(params, request_id="moved")
        frames = await read_until(stream, 22)
        victim = stream.replica
        assert victim is not None
        kill(engine, victim)
        killed = time.monotonic()
        resumed_after: float | None = None
        async for frame in stream:
            frames.append(frame)
            if resumed_after is None and stream.handovers and frame.step > stream.handovers[0].received:
                resumed_after = time.monotonic() - killed
        assert_identical(frames, params)
        # The uninterrupted run through the same deployment gives the same result.
        final = await engine.generate(params, request_id="unmoved")
        assert bool(final.data.eq(frames[-1].data).all())
    (handover,) = stream.handovers
    assert handover.lost == victim and stream.replica not in (None, victim)
    assert handover.step > 0 and handover.step % EVERY == 0, handover
    assert handover.redone <= EVERY, handover  # at most one checkpoint interval made again
    assert len(engine.checkpoints) == 0  # dropped as the request ended
    print(
        f"resumed after step {handover.step} ({handover.redone} steps redone); the first resumed frame "
        f"came {resumed_after * 1e3:.0f} ms after the kill" if resumed_after is not None else ""
    )


@ASYNCIO
async def test_a_request_of_a_model_that_cannot_snapshot_restarts_from_step_0_with_a_warning(
    app: str, caplog: pytest.LogCaptureFixture
) -> None:
    params = {**SMALL, "steps": 40, "seed": 12}
    caplog.set_level(logging.WARNING, logger="omni_stream.ray_serve")
    async with RemoteEngine(app, checkpoint_every=EVERY) as engine:
        await two_replicas(engine)
        stream = engine.stream(params, request_id="restarted", model="nosnap")
        frames = await read_until(stream, 15)
        victim = stream.replica
        assert victim is not None
        kill(engine, victim)
        frames += [f async for f in stream]
    assert_identical(frames, params)
    (handover,) = stream.handovers
    assert handover.lost == victim and handover.step == 0 and handover.redone >= 15
    assert any(
        "restarted" in r.getMessage() and "starts again from step 0" in r.getMessage() for r in caplog.records
    )


@ASYNCIO
async def test_a_cancel_during_the_hand_over_stops_the_request_on_the_replica_it_went_to(app: str) -> None:
    params = {**SMALL, "steps": 5000, "seed": 13}
    async with RemoteEngine(app, checkpoint_every=EVERY) as engine:
        await two_replicas(engine)
        stream = engine.stream(params, request_id="cancelled-moving", policy="latest")
        await read_until(stream, 8)
        victim = stream.replica
        assert victim is not None
        outcome: list[BaseException] = []

        async def reader() -> None:
            try:
                async for _ in stream:
                    pass
            except om.OmniStreamError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            kill(engine, victim)
            # Cancelled as soon as the request is handed over: before, or just after,
            # the new replica's first frame.
            await wait_for(lambda: stream.handovers, timeout=10, what="the hand-over")
            assert engine.cancel("cancelled-moving")
        (error,) = outcome
        assert isinstance(error, om.RequestCancelledError) and error.request_id == "cancelled-moving"
        assert not engine.cancel("cancelled-moving")  # ended
        # The replica it was handed over to runs it no more.

        async def idle() -> bool:
            await engine.refresh()
            went_to = set(live(engine)) - {victim}
            return bool(went_to) and all(
                v.report.health.statistics.active == 0 for v in engine.replicas() if v.replica in went_to
            )

        deadline = time.monotonic() + 10
        while not await idle():
            assert time.monotonic() < deadline, "the handed-over request still runs after its cancel"
            await anyio.sleep(0.1)
    assert len(stream.handovers) == 1


def _front_door(engine: RemoteEngine, **options: Any) -> Server:
    # A short grace at shutdown: the request must still be running when the server goes.
    return Server(engine, host="127.0.0.1", port=0, shutdown_timeout_s=0.1, close_timeout_s=1.0, **options)


def _final_image(msgs: Sequence[Mapping[str, Any]]) -> bytes:
    (final,) = [m for m in msgs if m["type"] == "preview" and m["final"]]
    return bytes(final["image"])


@ASYNCIO
async def test_a_server_over_ray_with_a_state_dir_resumes_its_request_from_a_replicas_checkpoint(
    app: str, tmp_path: Any
) -> None:
    params = {**SMALL, "steps": 100, "seed": 15}
    folder = {"state_dir": str(tmp_path), "checkpoint_every": EVERY}
    async with RemoteEngine(app, checkpoint_every=EVERY) as engine:
        await two_replicas(engine)
        async with _front_door(engine) as server, connect(server.url) as ws:
            await send(ws, type="generate", id="ref", params=params)
            expected_image = _final_image(await until_end(ws, "ref"))
        async with _front_door(engine, **folder) as server:
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="kept", params=params, detach=True)
                await until(ws, lambda m: m.get("type") == "accepted")
            # Detached, it renders on with nobody watching. The replica's checkpoints, as the
            # front door received them, are written to the folder:
            keeper = server.service.state
            await wait_for(lambda: keeper.checkpoint_steps.get("kept", 0) >= 2 * EVERY, what="a checkpoint")
        # The server shut down mid-render (as a deploy does): the request stays in the folder.
    # A new front door (its RemoteEngine too), as after a crash.
    async with (
        RemoteEngine(app, checkpoint_every=EVERY) as engine,
        _front_door(engine, **folder) as server,
        connect(server.url) as ws,
    ):
        await send(ws, type="attach", id="kept")
        msgs = await until_end(ws, "kept")
        scraped = (await http_get(server, "/metrics")).body.decode()
    (restarted,) = [m for m in msgs if m["type"] == "restarted"]
    step = restarted["from_step"]
    assert restarted["reason"] == "checkpoint" and step >= 2 * EVERY and step % EVERY == 0, restarted
    steps = [m["step"] for m in msgs if m["type"] == "progress"]
    assert steps and min(steps) > step  # went on from the checkpoint, not from step 0
    assert msgs[-1]["type"] == "done" and _final_image(msgs) == expected_image
    assert 'omni_stream_requests_restarted_total{reason="checkpoint"} 1.0' in scraped


@ASYNCIO
async def test_a_request_that_kills_every_replica_is_handed_over_at_most_max_handovers_times(
    app: str,
) -> None:
    # Last in the module: it kills both replicas (Serve replaces them).
    # Its process ends at step 14, three steps after the checkpoint of step 10 went out
    # (what a replica yielded just before dying may die in transit with it).
    params = {**SMALL, "steps": 30, "seed": 14, "exit_at": 14}
    async with RemoteEngine(app, checkpoint_every=EVERY, max_handovers=1) as engine:
        await two_replicas(engine)
        stream = engine.stream(params, request_id="killer")
        frames: list[om.Frame] = []
        with pytest.raises(om.EngineDeadError, match="handed over 1 times already") as err:
            async for frame in stream:
                frames.append(frame)
    assert err.value.request_id == "killer"
    (handover,) = stream.handovers
    assert handover.step == 10  # the checkpoint before the fatal step
    # Every frame before the fatal step once (the last ones may die in transit with the
    # replica), at least those up to the checkpoint.
    assert [f.step for f in frames] == list(range(1, len(frames) + 1)) and 10 <= len(frames) <= 13
