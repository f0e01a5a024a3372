"""Hand-over without a cluster: the checkpoints kept, the decision, and a RemoteStream moving on.

The RemoteStream here reads scripted responses (what a replica would
yield, then what Ray raises when it dies); the cluster runs are in
test_ray_serve_handover_cluster.py. The server in front tells the
request's watchers of a hand-over (``restarted``, ``replica_lost``): its
consumer is driven here over such a stream, with no socket.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

from ray import exceptions as ray_errors  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.checkpoint import Checkpoint  # noqa: E402
from omni_stream.core.admission import OutputSpec  # noqa: E402
from omni_stream.core.records import RequestRecord  # noqa: E402
from omni_stream.integrations.ray_serve import RemoteEngine  # noqa: E402
from omni_stream.integrations.ray_serve.handover import (  # noqa: E402
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_MAX_HANDOVERS,
    CheckpointKeeper,
    Handover,
    HandoverSettings,
    redone,
    should_hand_over,
)
from omni_stream.integrations.ray_serve.replica import EngineReplica, ReplicaSettings, _Flow  # noqa: E402
from omni_stream.integrations.ray_serve.stream import RemoteStream  # noqa: E402
from omni_stream.integrations.ray_serve.wire import (  # noqa: E402
    CANCELLED_SEQ,
    Header,
    Item,
    Submit,
    WireBatch,
    WireCheckpoint,
    WireError,
    WireFrame,
)
from omni_stream.preview import EncodedImage, Previewer, PreviewSpec  # noqa: E402
from omni_stream.server.consumer import stream_request  # noqa: E402

pytestmark = pytest.mark.ray

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])

TOTAL = 10


def _wired(steps: Sequence[int], first_seq: int) -> tuple[WireFrame, ...]:
    return tuple(
        WireFrame.of(
            om.Frame("r", s, TOTAL, torch.full((1,), float(s)), om.StepTimings(0, 0, 0, 1, 0), False),
            first_seq + i,
        )
        for i, s in enumerate(steps)
    )


# -- the checkpoints kept ------------------------------------------------------------------


def test_the_keeper_holds_the_newest_checkpoint_per_request_and_forgets_it() -> None:
    keeper = CheckpointKeeper(max_bytes=100)
    assert keeper.put("a", 5, b"x" * 10) and keeper.put("a", 10, b"y" * 20)
    assert not keeper.put("a", 10, b"z")  # not newer: a late one never replaces the newest
    kept = keeper.get("a")
    assert kept is not None and (kept.step, kept.data) == (10, b"y" * 20)
    assert keeper.nbytes == 20 and len(keeper) == 1
    keeper.discard("a")
    keeper.discard("a")  # twice: no error
    assert keeper.get("a") is None and keeper.nbytes == 0


def test_the_keeper_stays_within_its_bytes_dropping_the_oldest_to_arrive() -> None:
    keeper = CheckpointKeeper(max_bytes=100)
    for rid in ("a", "b", "c"):
        keeper.put(rid, 1, b"x" * 40)
    assert keeper.nbytes <= 100 and keeper.get("a") is None  # the oldest made room
    assert keeper.get("b") is not None and keeper.get("c") is not None
    keeper.put("b", 2, b"x" * 40)  # b's newer one: now c is the oldest to arrive
    keeper.put("d", 1, b"x" * 40)
    assert keeper.get("c") is None and keeper.get("b") is not None and keeper.nbytes == 80
    assert not keeper.put("huge", 1, b"x" * 101) and keeper.get("huge") is None  # alone over the bound
    assert keeper.nbytes == 80


# -- the decision ----------------------------------------------------------------------------


def test_only_a_lost_replica_hands_over_uncancelled_and_under_the_limit() -> None:
    lost = ray_errors.ActorDiedError()
    assert should_hand_over(lost, cancelled=False, handovers=0, limit=2)
    assert should_hand_over(ray_errors.ActorUnavailableError("gone", None), cancelled=False,
                            handovers=1, limit=2)
    assert not should_hand_over(lost, cancelled=False, handovers=2, limit=2)  # the limit
    assert not should_hand_over(lost, cancelled=True, handovers=0, limit=2)  # its reader cancelled it
    assert not should_hand_over(lost, cancelled=False, handovers=0, limit=0)  # hand-overs off
    # A request failing on its own (its model raised) or cancelled by Ray is not a lost replica.
    assert not should_hand_over(om.StepFailedError("boom", request_id="r", step=3), cancelled=False,
                                handovers=0, limit=2)
    assert not should_hand_over(ray_errors.TaskCancelledError(), cancelled=False, handovers=0, limit=2)


def test_frames_the_reader_has_are_dropped_and_their_seq_acknowledged() -> None:
    fresh, dropped = redone(_wired([4, 5, 6, 7], 1), received=5)
    assert [f.step for f in fresh] == [6, 7] and dropped == 2
    fresh, dropped = redone(_wired([8], 3), received=5)
    assert [f.step for f in fresh] == [8] and dropped == 0


def test_settings_refuse_bad_values_naming_the_field() -> None:
    s = HandoverSettings()
    assert (s.checkpoint_every, s.max_handovers) == (DEFAULT_CHECKPOINT_EVERY, DEFAULT_MAX_HANDOVERS)
    assert s.sends_checkpoints
    assert not HandoverSettings(checkpoint_every=None).sends_checkpoints
    assert not HandoverSettings(max_handovers=0).sends_checkpoints
    bad: tuple[tuple[str, Any], ...] = (
        ("checkpoint_every", 0), ("max_handovers", -1), ("checkpoint_max_bytes", 1.5),
    )
    for field, value in bad:
        with pytest.raises(om.ParamsError, match=field) as err:
            HandoverSettings(**{field: value})
        assert err.value.field == field
    with pytest.raises(om.ParamsError, match="max_handovers"):
        RemoteEngine("x", max_handovers=True)
    assert Handover("rep", 5, 7).redone == 2 and Handover(None, 0, 0).redone == 0


# -- a RemoteStream moving on (scripted replicas) ------------------------------------------------


class _Response:
    """A replica's items, then what Ray raises (``then``); ``hang`` waits for a cancel instead."""

    def __init__(self, items: Sequence[Item], then: BaseException | None = None, hang: bool = False) -> None:
        self.items = list(items)
        self.then = then
        self.hang = hang
        self.cancelled = anyio.Event()

    async def __anext__(self) -> Item:
        if self.items:
            return self.items.pop(0)
        if self.hang:
            await self.cancelled.wait()
            raise ray_errors.TaskCancelledError()
        if self.then is not None:
            raise self.then
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled.set()


class _Engine:
    """The RemoteEngine's side a RemoteStream calls: acks, submits, the kept checkpoints."""

    def __init__(self, responses: Sequence[_Response], **settings: Any) -> None:
        self.handover = HandoverSettings(**settings)
        self.checkpoints = CheckpointKeeper(1 << 20)
        self.responses = list(responses)
        self.submitted: list[tuple[Mapping[str, Any] | None, Submit]] = []
        self.acks: list[tuple[str, int]] = []
        self.lost: list[str] = []

    def _ack(self, key: str, seq: int) -> None:
        self.acks.append((key, seq))

    def _forget(self, stream: Any) -> None:
        self.checkpoints.discard(stream.request_id)

    def _mark_lost(self, replica: str) -> None:
        self.lost.append(replica)

    def _cancel_threadsafe(self, response: _Response) -> None:
        response.cancel()  # a stream dropped unfinished (its __del__)

    def _submit(self, params: Mapping[str, Any] | None, submit: Submit) -> _Response:
        self.submitted.append((params, submit))
        return self.responses.pop(0)


SUBMIT = Submit(
    key="k0", request_id="r", policy="all", timeout=None, preview_every=None, priority=0, window=2,
    checkpoint_every=5,
)
CKPT = Checkpoint("Synthetic", 1, 5, TOTAL, {"steps": TOTAL}, {"x": torch.zeros(2)}).to_bytes()


def _stream(engine: _Engine, first: _Response) -> RemoteStream:
    return RemoteStream(
        engine, first, key="k0", request_id="r", total=TOTAL, params={},  # type: ignore[arg-type]
        resubmit=({"steps": TOTAL}, SUBMIT),
    )


@ASYNCIO
async def test_a_lost_replicas_request_goes_on_from_its_checkpoint_no_frame_missing_or_repeated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="omni_stream.ray_serve")
    a = _Response(
        [Header("A", "r", TOTAL, window=2, checkpoints=True), *_wired([1, 2, 3, 4, 5], 1),
         WireCheckpoint(5, CKPT), WireBatch(_wired([6, 7], 6))],
        then=ray_errors.ActorDiedError(),
    )
    b = _Response([Header("B", "r", TOTAL, window=2, checkpoints=True, step=5), WireBatch(_wired([6, 7], 1)),
                   *_wired([8, 9, 10], 3)])
    engine = _Engine([b])
    stream = _stream(engine, a)
    frames = [f async for f in stream]
    assert [f.step for f in frames] == list(range(1, 11))
    assert [float(f.data[0]) for f in frames] == [float(s) for s in range(1, 11)]
    assert stream.handovers == (Handover("A", 5, 7),) and stream.replica == "B" and engine.lost == ["A"]
    ((params, submit),) = engine.submitted
    assert params == {"steps": TOTAL} and submit.resume == CKPT and submit.key not in ("k0", "")
    # The frames B made again are acknowledged to B (its window), under B's key.
    assert (submit.key, 2) in engine.acks and all(seq <= 5 for key, seq in engine.acks if key == submit.key)
    assert a.cancelled.is_set()  # the lost request is cancelled whatever Ray said
    assert len(engine.checkpoints) == 0  # dropped as the request ended
    assert "goes on on another replica after step 5" in caplog.text


@ASYNCIO
async def test_without_a_checkpoint_the_request_starts_again_from_step_0_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="omni_stream.ray_serve")
    a = _Response([Header("A", "r", TOTAL, window=2), *_wired([1, 2, 3], 1)],
                  then=ray_errors.ActorDiedError())
    b = _Response([Header("B", "r", TOTAL, window=2), WireBatch(_wired(range(1, 11), 1))])
    engine = _Engine([b])
    stream = _stream(engine, a)
    assert [f.step async for f in stream] == list(range(1, 11))
    assert stream.handovers == (Handover("A", 0, 3),)
    assert engine.submitted[0][1].resume is None
    assert "starts again from step 0" in caplog.text and "sent no checkpoints" in caplog.text


@ASYNCIO
async def test_a_request_failing_on_its_own_is_not_handed_over() -> None:
    error = om.StepFailedError("the model raised", request_id="r", step=3)
    a = _Response([Header("A", "r", TOTAL, window=2), *_wired([1, 2], 1), WireError.of(error)])
    engine = _Engine([])
    stream = _stream(engine, a)
    with pytest.raises(om.StepFailedError, match="the model raised"):
        async for _ in stream:
            pass
    assert stream.handovers == () and engine.submitted == []


@ASYNCIO
async def test_the_limit_ends_the_request_with_engine_dead_error_naming_it() -> None:
    responses = [
        _Response([Header(name, "r", TOTAL, window=2), *_wired([1], 1)], then=ray_errors.ActorDiedError())
        for name in ("B", "C")
    ]
    a = _Response([Header("A", "r", TOTAL, window=2)], then=ray_errors.ActorDiedError())
    engine = _Engine(responses, max_handovers=2)
    stream = _stream(engine, a)
    with pytest.raises(om.EngineDeadError, match="handed over 2 times already") as err:
        async for _ in stream:
            pass
    assert err.value.request_id == "r" and len(stream.handovers) == 2 and engine.lost == ["A", "B", "C"]


@ASYNCIO
async def test_a_checkpoint_the_new_replica_refuses_restarts_the_request_from_step_0() -> None:
    a = _Response([Header("A", "r", TOTAL, window=2, checkpoints=True), *_wired([1, 2, 3, 4, 5], 1),
                   WireCheckpoint(5, CKPT)], then=ray_errors.ActorDiedError())
    refused = om.CheckpointError("the checkpoint is of another model", request_id="r")
    b = _Response([WireError.of(refused)])
    c = _Response([Header("C", "r", TOTAL, window=2), WireBatch(_wired(range(1, 11), 1))])
    engine = _Engine([b, c])
    stream = _stream(engine, a)
    assert [f.step async for f in stream] == list(range(1, 11))
    assert [s.resume for _, s in engine.submitted] == [CKPT, None]
    assert len(stream.handovers) == 1  # the restart is the same hand-over, now from step 0
    assert stream.handovers[0] == Handover("A", 0, 5)


# -- a request resumed from a checkpoint it was submitted with (a restarted server's) -----------------


def _resumed(engine: _Engine, first: _Response, **kw: Any) -> RemoteStream:
    """A stream as RemoteEngine.stream(resume=<CKPT, step 5>) makes it."""
    submit = dataclasses.replace(SUBMIT, resume=CKPT)
    engine.checkpoints.put("r", 5, CKPT)
    return RemoteStream(
        engine, first, key="k0", request_id="r", total=TOTAL, params={},  # type: ignore[arg-type]
        resubmit=({"steps": TOTAL}, submit), resumed_from=5, **kw,
    )


@ASYNCIO
async def test_a_resumed_request_hands_its_checkpoints_to_on_checkpoint_and_over_from_the_resumed_one() -> None:
    kept: list[tuple[str, int, bytes]] = []
    newer = CKPT + b"-8"
    a = _Response([Header("A", "r", TOTAL, window=2, checkpoints=True, step=5), *_wired([6, 7], 1)],
                  then=ray_errors.ActorDiedError())
    b = _Response([Header("B", "r", TOTAL, window=2, checkpoints=True, step=5), *_wired([6, 7, 8], 1),
                   WireCheckpoint(8, newer), *_wired([9, 10], 4)])
    engine = _Engine([b])
    stream = _resumed(engine, a, on_checkpoint=lambda rid, c: kept.append((rid, c.step, c.to_bytes())))
    # Its frames go on after the checkpoint's step; lost before a newer one came, it is handed
    # over from the one it resumed from (the reader had 7: 6 and 7 are made again, not sent).
    assert [f.step async for f in stream] == [6, 7, 8, 9, 10]
    assert stream.handovers == (Handover("A", 5, 7),)
    assert [s.resume for _, s in engine.submitted] == [CKPT]
    assert kept == [("r", 8, newer)]  # as it came, in bytes


@ASYNCIO
@pytest.mark.parametrize("told", [True, False])
async def test_a_checkpoint_refused_at_resume_starts_again_from_0_only_for_a_caller_that_asked(told: bool) -> None:
    refused = om.CheckpointError("written by another version of this model", request_id="r")
    a = _Response([WireError.of(refused)])
    b = _Response([Header("B", "r", TOTAL, window=2), WireBatch(_wired(range(1, 11), 1))])
    engine = _Engine([b])
    stream = _resumed(engine, a)
    heard: list[om.CheckpointError] = []
    if told:
        stream.on_resume_refused = heard.append
        # Every step again: the reader has none of them (they were made before the restart).
        assert [f.step async for f in stream] == list(range(1, 11))
        assert [str(e) for e in heard] == [str(refused)] and [s.resume for _, s in engine.submitted] == [None]
        assert stream.handovers == ()  # not a hand-over: no replica was lost
    else:
        with pytest.raises(om.CheckpointError, match="another version"):
            await stream.__anext__()
        assert engine.submitted == []


@ASYNCIO
@pytest.mark.parametrize("when", ["before the death is seen", "during the hand-over"])
async def test_a_cancel_ends_the_request_with_request_cancelled_error_and_no_further_hand_over(
    when: str,
) -> None:
    a = _Response([Header("A", "r", TOTAL, window=2, checkpoints=True), *_wired([1, 2, 3, 4, 5], 1),
                   WireCheckpoint(5, CKPT)], then=ray_errors.ActorDiedError())
    b = _Response([], hang=True)  # restoring: no item yet
    engine = _Engine([b])
    stream = _stream(engine, a)
    assert [(await stream.__anext__()).step for _ in range(5)] == [1, 2, 3, 4, 5]
    if when == "before the death is seen":
        assert stream._cancel()
        with pytest.raises(om.RequestCancelledError) as err:
            await stream.__anext__()
        assert engine.submitted == [] and stream.handovers == ()
    else:
        async with anyio.create_task_group() as tg:

            async def cancel_once_handed_over() -> None:
                while not stream.handovers:
                    await anyio.sleep(0)
                assert stream._cancel()

            tg.start_soon(cancel_once_handed_over)
            with pytest.raises(om.RequestCancelledError) as err:
                await stream.__anext__()
        assert b.cancelled.is_set() and len(engine.submitted) == 1
        # Serve's cancel can miss a request it is still assigning: the board tells the replica too.
        assert (engine.submitted[0][1].key, CANCELLED_SEQ) in engine.acks
    assert err.value.request_id == "r"
    assert not stream._cancel()  # ended


# -- the server in front tells the request's watchers ------------------------------------------------

PNG = EncodedImage(b"png", "png", 1, 1, "image/png")


def _rendered(steps: Sequence[int], first_seq: int) -> tuple[WireFrame, ...]:
    """Frames as a replica sends them to a server (rendered there: the consumer renders nothing)."""
    return tuple(
        WireFrame(first_seq + i, s, TOTAL, torch.empty(0), (0, 0, 0, 1, 0), False, encoded=PNG)
        for i, s in enumerate(steps)
    )


class _Watcher:
    """A watcher's outbox that keeps every text message in order (a real one replaces an unsent
    progress with the next), with the record's step as each ``restarted`` came."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.messages: list[dict[str, Any]] = []
        self.step_at_restarted: list[int] = []

    def put(self, message: Any, **_: Any) -> None:
        if isinstance(message.wire, str):  # a text message (a preview's wire is bytes)
            self.messages.append(json.loads(message.wire))
        if message.kind == "restarted":
            self.step_at_restarted.append(self.record.latest_step)

    def held_since(self, key: Any) -> None:
        return None

    def discard(self, key: Any) -> None:
        pass


class _Metrics:
    def __init__(self) -> None:
        # As the server's (core/metrics.py), in a registry of its own.
        registry = CollectorRegistry()
        self.restarts = Counter("restarted", "restarts", ["reason"], registry=registry)
        self.restart_first_frame = Histogram("first", "first frame", ["reason"], registry=registry)

        self.first_preview = Histogram("first_preview", "first preview", ["model"], registry=registry)

    def observe_timings(self, timings: Any, model: str | None = None) -> None:
        pass

    def model(self, name: str | None) -> str:
        return name or "model"


def _shown(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each progress as its step, each restarted as (from_step, reason), the others by type."""
    return [
        m["step"] if m["type"] == "progress" else
        (m["from_step"], m["reason"]) if m["type"] == "restarted" else m["type"]
        for m in messages
    ]


@ASYNCIO
@pytest.mark.parametrize("case", ["from its checkpoint", "without a checkpoint", "the checkpoint refused"])
async def test_the_requests_watchers_get_restarted_replica_lost_from_the_step_it_resumes_after(
    case: str,
) -> None:
    header = Header("A", "r", TOTAL, window=2, checkpoints=case != "without a checkpoint")
    kept = () if case == "without a checkpoint" else (WireCheckpoint(5, CKPT),)
    a = _Response([header, *_rendered([1, 2, 3, 4, 5], 1), *kept, WireBatch(_rendered([6, 7], 6))],
                  then=ray_errors.ActorDiedError())
    b = _Response([Header("B", "r", TOTAL, window=2, checkpoints=True, step=5),
                   WireBatch(_rendered([6, 7], 1)), *_rendered([8, 9, 10], 3)])
    responses = [b]
    if case == "the checkpoint refused":
        responses = [_Response([WireError.of(om.CheckpointError("another model", request_id="r"))]),
                     _Response([Header("C", "r", TOTAL, window=2), WireBatch(_rendered(range(1, 11), 1))])]
    stream = _stream(_Engine(responses), a)
    record = RequestRecord("r", owner="c", detach=False, total=TOTAL, preview={}, created_at=time.monotonic())
    watcher = _Watcher(record)
    record.watch("c", watcher, attached=False)  # type: ignore[arg-type]
    metrics = _Metrics()
    noted: list[tuple[str, int]] = []
    message = await stream_request(
        record, stream, PreviewSpec(format="png"), output=OutputSpec("png"), previewer=Previewer(),
        metrics=metrics, paced=False,  # type: ignore[arg-type]
        on_handed_over=lambda rec, step: noted.append((rec.id, step)),
    )
    assert message.kind == "done"
    told = {
        "from its checkpoint": [(5, "replica_lost")],
        "without a checkpoint": [(0, "replica_lost")],
        "the checkpoint refused": [(5, "replica_lost"), (0, "replica_lost")],
    }[case]
    # Told as the request is handed over, after the last step the watchers had; the steps
    # made again are not sent again, and the request's step is not wound back meanwhile.
    assert _shown(watcher.messages) == ["accepted", *range(1, 8), *told, 8, 9, 10]
    assert watcher.step_at_restarted == [7] * len(told)
    # Each one said is handed to the rules' hook (a state directory writes it down).
    assert noted == [("r", step) for step, _ in told]
    # Counted on /metrics, once a hand-over (omni_stream_requests_restarted_total{reason="replica_lost"}).
    assert metrics.restarts.labels("replica_lost")._value.get() == len(told)
    # And the time from the (last) hand-over said to the first frame after it, once.
    observed = metrics.restart_first_frame.labels("replica_lost")
    assert observed._sum.get() > 0 and sum(b.get() for b in observed._buckets) == 1
    assert record.latest_step == TOTAL
    # Kept for an attach (and the HTTP status): the latest, right after accepted.
    later = _Watcher(record)
    record.watch("d", later, attached=True)  # type: ignore[arg-type]
    assert _shown(later.messages)[:3] == ["accepted", told[-1], TOTAL]


class _Board:
    """The ReplicaBoard's ``wait_acked`` as a replica calls it (``.remote`` returns an awaitable)."""

    def __init__(self, acked: int) -> None:
        self.acked = acked
        self.wait_acked = self

    async def remote(self, key: str, at_least: int, timeout_s: float) -> int:
        return self.acked


class _BareReplica(EngineReplica):
    """An EngineReplica never started (no Serve): only what ``_credit`` reads is set."""

    def __del__(self) -> None:  # type: ignore[override]  # nothing to shut down
        pass


@ASYNCIO
async def test_a_replica_out_of_credit_ends_a_request_its_reader_cancelled_through_the_board() -> None:
    replica = object.__new__(_BareReplica)
    replica._settings = ReplicaSettings()
    replica._replica = "rep"
    flow = _Flow("k", "r", window=2, sent=2)
    replica._board = _Board(CANCELLED_SEQ)
    await replica._credit(flow)
    assert isinstance(flow.failure, om.RequestCancelledError) and flow.failure.request_id == "r"
    assert flow.acked == 0  # not taken for credit: the window still holds
    flow = _Flow("k", "r", window=2, sent=2)
    replica._board = _Board(1)
    await replica._credit(flow)
    assert flow.failure is None and flow.acked == 1
