"""The Ray Serve integration's pure parts, without a cluster: card, wire, translate, report, board."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

from ray import exceptions as ray_errors  # noqa: E402
from ray.serve import exceptions as serve_errors  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.engine.stats import EngineStatistics, Health  # noqa: E402
from omni_stream.integrations.ray_serve import ModelCard, ReplicaSettings  # noqa: E402
from omni_stream.integrations.ray_serve.board import ReplicaBoard  # noqa: E402
from omni_stream.integrations.ray_serve.report import ReplicaReport, summarize, view  # noqa: E402
from omni_stream.integrations.ray_serve.translate import translate  # noqa: E402
from omni_stream.integrations.ray_serve.wire import WireError, WireFrame  # noqa: E402
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.models.synthetic import SyntheticFault  # noqa: E402

pytestmark = pytest.mark.ray

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])


# -- card ----------------------------------------------------------------------------


class PlusOne(om.StepModel):
    """A model whose scheduler adds a step (as PNDM does)."""

    name = "plus_one"
    params = (om.Param("steps", "int", 10, "steps", minimum=1, maximum=50),)
    produces_video = True
    preview_decoder = "sd15"

    def total_steps(self, params: Mapping[str, Any]) -> int:
        return int(params["steps"]) + 1

    def start(self, params: Mapping[str, Any], device: torch.device) -> Any:
        return None

    def step(self, states: Sequence[Any]) -> list[torch.Tensor]:
        return [torch.zeros(1) for _ in states]


def test_card_carries_what_the_server_reads_and_pickles_without_weights() -> None:
    card = pickle.loads(pickle.dumps(ModelCard.of(Synthetic(max_batch_size=5))))
    assert (card.name, card.max_batch_size, card.dtype) == ("synthetic", 5, torch.float32)
    assert card.describe() == Synthetic().describe()
    assert card.params == Synthetic.params
    assert (card.produces_video, card.runs_whole_requests, card.preview_decoder) == (False, False, None)
    assert isinstance(card, om.StepModel)
    assert len(pickle.dumps(card)) < 4096
    with pytest.raises(TypeError, match="cannot run"):
        card.start({}, torch.device("cpu"))


def test_card_validates_declared_params_only() -> None:
    card = ModelCard.of(Synthetic())
    assert card.validate({"steps": 3})["shape"] == (4, 64, 64)
    with pytest.raises(om.ParamsError) as err:
        card.validate({"stepz": 3})
    assert err.value.field == "stepz"
    with pytest.raises(om.ParamsError):
        card.validate({"steps": 0})
    # Synthetic's own cap on values is the replica's to check, not the card's.
    card.validate({"shape": [4096, 4096]})
    with pytest.raises(om.ParamsError):
        Synthetic().validate({"shape": [4096, 4096]})


def test_card_step_counts_come_from_the_model() -> None:
    card = pickle.loads(pickle.dumps(ModelCard.of(PlusOne())))
    assert card.total_steps({"steps": 7}) == 8
    assert card.total_steps(card.validate({})) == 11
    assert (card.produces_video, card.preview_decoder) == (True, "sd15")
    # Beyond the table (the model caps steps at 50): ``steps`` itself.
    assert card.total_steps({"steps": 500}) == 500


def test_card_of_a_diffusers_model_counts_each_samplers_steps_and_checks_loras(tmp_path: Any) -> None:
    # A request naming Heun runs 2 * steps - 1 UNet evaluations on the replica: the front
    # door's count (accepted.total, the gate's cost, max_steps) must say so; and the LoRAs
    # the replica loaded are accepted at the door, others refused naming the entry.
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from omni_stream.models.diffusers import Diffusers

    from ..models.test_diffusers import fixed_embeddings, sd_pipe
    from ..models.test_diffusers_loras import make_lora

    model = Diffusers(sd_pipe(), encode_prompt=fixed_embeddings)
    model.load_loras({"ink": make_lora(tmp_path / "ink", 7)})
    card = pickle.loads(pickle.dumps(ModelCard.of(model)))
    for sampler, steps in (("heun", 7), ("dpm_2_karras", 12), ("pndm", 9), ("euler", 9), ("default", 9)):
        params = {"steps": steps, "sampler": sampler}
        assert card.total_steps(card.validate(params)) == model.total_steps(model.validate(params)), sampler
    assert card.lora_names == ("ink",)
    assert card.validate({"loras": [{"name": "ink", "scale": 0.5}]})["loras"] == (("ink", 0.5),)
    with pytest.raises(om.ParamsError) as info:
        card.validate({"loras": [{"name": "oil"}]})
    assert info.value.field == "loras[0].name"
    assert not hasattr(ModelCard.of(Synthetic()), "lora_names")


class SnapsButNotAncestral(Synthetic):
    """Synthetic with a ``sampler`` param, unable to snapshot one choice (as ``dpmpp_sde``)."""

    params = (  # type: ignore[assignment]  # one param more than Synthetic's tuple type
        *Synthetic.params, om.Param("sampler", "str", "euler", "sampler", choices=("euler", "ancestral", "heun")),
    )

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        return params.get("sampler") != "ancestral"


def test_card_says_whether_the_model_snapshots_a_request_by_its_sampler() -> None:
    # A server's state directory asks the front door's card whether to ask for checkpoints.
    card = pickle.loads(pickle.dumps(ModelCard.of(SnapsButNotAncestral())))
    assert card.can_snapshot(card.validate({}))
    assert card.can_snapshot(card.validate({"sampler": "heun"}))
    assert not card.can_snapshot(card.validate({"sampler": "ancestral"}))
    assert ModelCard.of(Synthetic()).can_snapshot({})
    assert not ModelCard.of(PlusOne()).can_snapshot({"steps": 3})  # StepModel's default: no


def test_card_without_steps_uses_the_default_count() -> None:
    model = om.from_generator(lambda p: iter([torch.zeros(1)] * 4), total=4, name="four")
    card = ModelCard.of(model)
    assert card.total_steps({}) == 4


# -- wire ------------------------------------------------------------------------------


def test_a_frame_crosses_intact() -> None:
    frame = om.Frame("r", 2, 5, torch.arange(6.0).reshape(2, 3), om.StepTimings(0.1, 0.2, 0.3, 4, 0.05), True)
    item = pickle.loads(pickle.dumps(WireFrame.of(frame, seq=9)))
    back = item.frame("r")
    assert item.seq == 9 and not item.final
    assert (back.step, back.total, back.decoded, back.timings) == (2, 5, True, frame.timings)
    assert torch.equal(back.data, frame.data)


def test_an_error_crosses_with_its_cause_chain() -> None:
    try:
        try:
            raise SyntheticFault("injected")
        except SyntheticFault as inner:
            raise om.StepFailedError("the model raised", request_id="r", step=3) from inner
    except om.StepFailedError as exc:
        item = pickle.loads(pickle.dumps(WireError.of(exc)))
    error = item.error()
    assert isinstance(error, om.StepFailedError)
    assert (error.request_id, error.step) == ("r", 3)
    assert isinstance(error.__cause__, SyntheticFault) and str(error.__cause__) == "injected"


# -- translate ----------------------------------------------------------------------------


def _task_error(cause: BaseException) -> ray_errors.RayTaskError:
    return ray_errors.RayTaskError("stream", "Traceback: ...", cause).as_instanceof_cause()


def test_ray_task_errors_unwrap_to_ours() -> None:
    ours = om.StepTimeoutError("slow", request_id=None, step=4, bound_s=1.0)
    got = translate(_task_error(ours), request_id="r", replica="a1", step=3)
    assert got is ours and got.request_id == "r"
    other = translate(_task_error(KeyError("k")), request_id="r", replica="a1", step=3)
    assert isinstance(other, om.StepFailedError) and other.step == 4
    assert isinstance(other.__cause__, KeyError) and "replica a1" in other.message


def test_ray_cancellation_becomes_ours() -> None:
    for exc in (serve_errors.RequestCancelledError("x"), ray_errors.TaskCancelledError()):
        got = translate(exc, request_id="r", replica="a1")
        assert type(got) is om.RequestCancelledError and got.request_id == "r"
        assert got.__cause__ is exc


def test_a_lost_replica_is_a_dead_engine_naming_it() -> None:
    for exc in (ray_errors.ActorDiedError(), ray_errors.ActorUnavailableError("gone", None)):
        got = translate(exc, request_id="r", replica="a1")
        assert isinstance(got, om.EngineDeadError) and "replica a1 was lost" in got.message
        assert got.request_id == "r" and got.__cause__ is exc
    got = translate(_task_error(ray_errors.ActorDiedError()), request_id="r", replica=None)
    assert isinstance(got, om.EngineDeadError) and "its replica" in got.message


def test_a_full_deployment_is_an_engine_error() -> None:
    got = translate(serve_errors.BackPressureError(10, 10), request_id="r", replica=None)
    assert type(got) is om.EngineError and "max_queued_requests" in got.message


# -- report ------------------------------------------------------------------------------------


def _stats(active: int = 0, steps: int = 0) -> EngineStatistics:
    return EngineStatistics(active, 0, 0, 0, 0, 0, 0, 0, 0, steps, 0, 0, 0, {1: steps})


def _report(name: str, status: str = "ok", steps: int = 0) -> ReplicaReport:
    health = Health(status, None if status == "ok" else "why", _stats(steps=steps), "cpu")
    return ReplicaReport(name, health, 8, 0, 0, 1, "node")


def test_health_is_ok_while_any_replica_is() -> None:
    views = view({"a": (0.1, _report("a", steps=3)), "b": (0.2, _report("b", "stalled", steps=4))},
                 stale_after_s=3)
    h = summarize(views, name="app", state="running", unreachable_s=None, dead_after_s=30)
    assert h.status == "ok" and "replica b is stalled: why" in (h.reason or "")
    assert h.statistics.steps == 7 and h.statistics.batch_sizes == {1: 7}
    assert len(h.statistics.members) == 2 and h.device == "ray:app"


def test_a_silent_or_dead_replica_is_lost_and_none_ok_is_stalled_not_dead() -> None:
    views = view({"a": (5.0, _report("a")), "b": (0.1, _report("b"))}, stale_after_s=3, known_lost={"b"})
    assert [v.status for v in views] == ["lost", "lost"]
    h = summarize(views, name="app", state="running", unreachable_s=None, dead_after_s=30)
    assert h.status == "stalled" and "replica a is lost (no report for 5.0 s)" in (h.reason or "")
    assert h.statistics.members == ()  # lost replicas do not count
    assert view({"a": (31.0, _report("a"))}, stale_after_s=3) == []
    h = summarize([], name="app", state="running", unreachable_s=None, dead_after_s=30)
    assert h.status == "stalled" and "no replica" in (h.reason or "")


def test_an_unreachable_deployment_is_dead_and_a_closed_engine_closed() -> None:
    h = summarize([], name="app", state="running", unreachable_s=31, dead_after_s=30)
    assert h.status == "dead"
    assert summarize([], name="app", state="closed", unreachable_s=None, dead_after_s=30).status == "closed"
    assert summarize([], name="app", state="new", unreachable_s=None, dead_after_s=30).status == "closed"


# -- board ----------------------------------------------------------------------------------------


@ASYNCIO
async def test_board_wakes_a_waiting_replica_on_the_ack_it_needs() -> None:
    board = ReplicaBoard()
    waiter = asyncio.ensure_future(board.wait_acked("k", 3, timeout_s=5))
    await board.ack("k", 1)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await board.ack("k", 4)
    assert await asyncio.wait_for(waiter, 1) == 4
    await board.ack("k", 2)  # late and out of order: ignored
    assert await board.wait_acked("k", 1, timeout_s=0) == 4
    started = time.monotonic()
    assert await board.wait_acked("k", 9, timeout_s=0.05) == 4
    assert time.monotonic() - started < 1
    await board.forget("k")
    assert await board.wait_acked("k", 0, timeout_s=0) == 0


@ASYNCIO
async def test_board_keeps_each_replicas_latest_report() -> None:
    board = ReplicaBoard()
    await board.report("a", b"1")
    await board.report("a", b"2")
    await board.report("b", b"3")
    snap = await board.snapshot()
    assert {r: blob for r, (_, blob) in snap.items()} == {"a": b"2", "b": b"3"}
    assert all(0 <= age < 1 for age, _ in snap.values())
    await board.leave("a")
    assert set(await board.snapshot()) == {"b"}


# -- the replica's health check ---------------------------------------------------------------------


class _StalledEngine:
    def __init__(self) -> None:
        self.stalled = True
        self.cancelled: list[str] = []

    def check_health(self) -> None:
        if self.stalled:
            raise om.EngineStalledError("model code has been running for 9 s")

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


def _replica_with(engine: _StalledEngine) -> Any:
    from omni_stream.integrations.ray_serve.replica import EngineReplica, _Flow

    class Bare(EngineReplica):
        def __del__(self) -> None:  # Serve's shutdown hook; nothing to shut down here
            pass

    replica = Bare.__new__(Bare)  # no Serve here: only what check_health reads
    replica._replica = "r1"
    replica._engine = engine
    replica._flows = {"k": _Flow("k", "rid", 2)}
    replica._failed_checks = 0
    replica._stop = asyncio.Event()
    replica._closed = asyncio.Event()
    replica._failure = None
    replica._settings = ReplicaSettings()
    return replica


@ASYNCIO
async def test_a_replica_about_to_be_replaced_fails_its_requests_first() -> None:
    engine = _StalledEngine()
    replica = _replica_with(engine)
    for _ in range(2):  # Serve replaces a replica on its third failed check in a row
        with pytest.raises(om.EngineStalledError):
            await replica.check_health()
    assert replica._flows["k"].failure is None and engine.cancelled == []
    with pytest.raises(om.EngineStalledError):
        await replica.check_health()
    failure = replica._flows["k"].failure
    assert isinstance(failure, om.EngineDeadError) and failure.request_id == "rid"
    assert "replica r1 is being replaced" in failure.message
    assert isinstance(failure.__cause__, om.EngineStalledError)
    assert engine.cancelled == ["rid"]
    engine.stalled = False
    await replica.check_health()
    assert replica._failed_checks == 0


@ASYNCIO
async def test_a_replica_whose_engine_owner_ended_is_dead() -> None:
    replica = _replica_with(_StalledEngine())
    replica._engine.stalled = False
    replica._failure = RuntimeError("the producer exploded")
    replica._closed.set()
    with pytest.raises(om.EngineDeadError, match="owner task ended") as err:
        await replica.check_health()
    assert isinstance(err.value.__cause__, RuntimeError)


@ASYNCIO
async def test_a_replica_whose_model_failed_to_build_shuts_down_quietly() -> None:
    from omni_stream.integrations.ray_serve.replica import EngineReplica

    # Serve calls __del__ also on a replica whose __init__ raised before its engine
    # existed (a model that failed to build): it raised AttributeError there, logged
    # by Serve as a second failure hiding the first.
    class Unbuilt(EngineReplica):
        def __del__(self) -> None:  # the garbage collector's call; the test awaits Serve's
            pass

    replica = Unbuilt.__new__(Unbuilt)
    replica._settings = ReplicaSettings()
    await EngineReplica.__del__(replica)


class _SilentBoard:
    """A board whose reader never acknowledges anything."""

    class _Method:
        def remote(self, key: str, at_least: int, timeout_s: float) -> Any:
            async def wait() -> int:
                await asyncio.sleep(0.01)
                return 0

            return wait()

    wait_acked = _Method()


@ASYNCIO
async def test_a_reader_that_never_acknowledges_is_given_up_on() -> None:
    from omni_stream.integrations.ray_serve.replica import _Flow

    replica = _replica_with(_StalledEngine())
    replica._settings = ReplicaSettings(reader_timeout_s=0.1)
    replica._board = _SilentBoard()
    flow = _Flow("k", "rid", window=2, sent=2)
    started = time.monotonic()
    await replica._credit(flow)
    assert 0.1 <= time.monotonic() - started < 2
    assert isinstance(flow.failure, om.RequestCancelledError) and flow.failure.request_id == "rid"
    assert "took no frame" in flow.failure.message
