"""EngineGroup: routing, cancel, statistics, health with a dying member, ids, lifecycle."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream import config
from omni_stream.config import STEP_TIMEOUT_ENV
from omni_stream.engine import GroupStream, engine_for
from omni_stream.engine.intake import check_request_id
from omni_stream.models import Synthetic

from .conftest import make_device, params, wait_for


class Dies(Synthetic):
    """Raises SystemExit in step 2: not a step failure, it kills its engine's producer."""

    name = "synthetic"  # alike to the group: the same params as its siblings

    def step(self, states: Sequence[Any]) -> list[Any]:
        if any(s.step + 1 == 2 for s in states):
            raise SystemExit("the model called exit() at step 2")
        return super().step(states)


def factory_of(*kinds: type[Synthetic]):
    """A model factory returning ``kinds[i]()`` on its i-th call."""
    calls = iter(kinds)
    return lambda: next(calls)()


def group_on(device_kind: str, factory=Synthetic, **options: Any) -> om.EngineGroup:
    return om.EngineGroup(factory, devices=[make_device(device_kind), make_device(device_kind)], **options)


async def read_all(stream) -> list[om.Frame]:
    return [f async for f in stream]


# -- building ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, names",
    [
        ("cpu,cpu", ("cpu", "cpu")),
        (" cpu , sim ", ("cpu", "sim")),
        (["sim", "cpu"], ("sim", "cpu")),
        ("sim", ("sim",)),
        (om.device.SimDevice(), ("sim",)),
        (torch.device("cpu"), ("cpu",)),
    ],
)
def test_devices_are_named_as_a_list_or_a_comma_string(devices, names):
    group = om.EngineGroup(Synthetic, devices=devices)
    assert group.devices == names and len(group.members) == len(names)
    assert all(isinstance(m, om.Engine) for m in group.members)


@pytest.mark.parametrize("devices", ["", "cpu,", ",cpu", [], "tpu", ["cpu", 3]])
def test_bad_devices_are_refused_naming_the_field(devices):
    with pytest.raises(om.ParamsError) as info:
        om.EngineGroup(Synthetic, devices=devices)
    assert info.value.field == "devices"


def test_the_same_device_instance_twice_is_refused():
    sim = om.device.SimDevice()
    with pytest.raises(om.ParamsError, match="twice"):
        om.EngineGroup(Synthetic, devices=[sim, sim])


def test_all_without_cuda_says_none_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for spec in ("all", " ALL "):
        with pytest.raises(om.ParamsError, match="none exists") as info:
            om.EngineGroup(Synthetic, devices=spec)
        assert info.value.field == "devices"
    with pytest.raises(om.ParamsError, match="none exists"):
        om.EngineGroup(Synthetic)  # the default is every CUDA device


def test_all_takes_every_cuda_device(monkeypatch):
    from omni_stream.engine import group as group_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert group_module._cuda_devices() == ["cuda:0", "cuda:1", "cuda:2"]


class Recording(Synthetic):
    """Logs where it is built and loaded, and in what order."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.log = log
        log.append(("built", threading.current_thread().name))

    def load(self, device: torch.device) -> None:
        self.log.append(("loaded", threading.current_thread().name))
        super().load(device)


@pytest.mark.asyncio
async def test_member_models_are_built_on_their_producer_threads_one_at_a_time():
    log: list[tuple[str, str]] = []
    built: list[Recording] = []

    def factory() -> Recording:
        built.append(Recording(log))
        return built[-1]

    group = om.EngineGroup(factory, devices="cpu,sim,cpu")
    # Member 0's model is there at once: requests are checked against it.
    assert group.model is built[0] and len(built) == 1
    with pytest.raises(om.EngineClosedError, match="producer thread"):
        group.members[1].model  # noqa: B018
    async with group:
        assert [m.model for m in group.members] == built and len(built) == 3
        assert len({id(m) for m in built}) == 3
        final = await group.generate(params(steps=2))
        assert final.final
    here = threading.current_thread().name
    producer = "omni-stream-producer"
    # Each later member is built on its own producer thread, only once the one
    # before it had loaded its model onto its device.
    assert log == [
        ("built", here), ("loaded", producer),
        ("built", producer), ("loaded", producer),
        ("built", producer), ("loaded", producer),
    ]


@pytest.mark.asyncio
async def test_the_next_member_starts_only_once_member_0s_model_instance_is_loaded():
    release = threading.Event()

    class SlowLoad(Synthetic):
        def load(self, device: torch.device) -> None:
            release.wait(20)
            super().load(device)

    group = om.EngineGroup(factory_of(SlowLoad, Synthetic), devices="cpu,cpu")
    seen: list[str | None] = []

    async def watch() -> None:
        try:
            p = group.members[0]._producer
            await wait_for(lambda: p.busy_with == ("model.load",), what="member 0 loading")
            # Member 0 was given an instance, so its start() does not wait for
            # its load: the group itself must, before it starts member 1.
            await anyio.wait_all_tasks_blocked()
            seen.append(group.members[1].health().reason)
        finally:
            release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        async with group:
            assert [m.health().status for m in group.members] == ["ok", "ok"]
    assert seen == ["the engine was not started"]


@pytest.mark.asyncio
async def test_a_spec_string_loads_one_model_per_member():
    group = om.EngineGroup("synthetic", devices="cpu,cpu")
    async with group:
        a, b = (m.model for m in group.members)
        assert isinstance(a, Synthetic) and isinstance(b, Synthetic) and a is not b
    with pytest.raises(om.ParamsError, match="unknown model"):
        om.EngineGroup("no-such-model", devices="cpu,cpu")


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["raises", "not-a-model"])
async def test_a_member_whose_model_cannot_be_built_fails_the_start_and_closes_the_rest(failure: str):
    calls = 0
    first = Synthetic()

    def factory() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return first
        if failure == "raises":
            raise om.ParamsError("no weights for you", field="model_path")
        return "a string"

    group = om.EngineGroup(factory, devices="cpu,cpu")
    with pytest.raises(om.ParamsError) as info:
        async with group:
            raise AssertionError("started")
    assert info.value.field == {"raises": "model_path"}.get(failure, "model_factory")
    # Member 0 was started and closed again; member 1 died building its model.
    assert [m.health().status for m in group.members] == ["closed", "dead"]


def test_one_model_serves_one_device_only():
    model = Synthetic()
    assert om.EngineGroup(model, devices="cpu").model is model
    with pytest.raises(om.ParamsError, match="factory") as info:
        om.EngineGroup(model, devices="cpu,cpu")
    assert info.value.field == "model_factory"


@pytest.mark.parametrize(
    "factory, match",
    [(lambda: "not a model", "returned str"), (42, "callable"), (None, "callable")],
)
def test_a_bad_factory_is_refused(factory, match):
    with pytest.raises(om.ParamsError, match=match):
        om.EngineGroup(factory, devices="cpu,cpu")


@pytest.mark.asyncio
async def test_a_factory_returning_one_model_twice_is_refused():
    model = Synthetic()
    group = om.EngineGroup(lambda: model, devices="cpu,cpu")
    with pytest.raises(om.ParamsError, match="same model twice") as info:
        async with group:
            raise AssertionError("started")
    assert info.value.field == "model_factory"


def test_engine_options_reach_every_member():
    group = om.EngineGroup(Synthetic, devices="cpu,sim", max_batch_size=3)
    assert [m.max_batch_size for m in group.members] == [3, 3]
    assert group.max_batch_size == 6
    with pytest.raises(om.ParamsError, match="max_batch_size"):
        om.EngineGroup(Synthetic, devices="cpu,cpu", max_batch_size=0)


def test_engine_for_gives_a_group_only_for_several_devices(monkeypatch):
    assert isinstance(engine_for("synthetic", "cpu"), om.Engine)
    assert isinstance(engine_for(Synthetic(), "sim"), om.Engine)
    assert isinstance(engine_for(Synthetic, "cpu"), om.Engine)
    group = engine_for("synthetic", "cpu,sim", max_batch_size=2)
    assert isinstance(group, om.EngineGroup) and group.devices == ("cpu", "sim")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(om.ParamsError, match="none exists"):
        engine_for("synthetic", "all")


# -- torch threads ------------------------------------------------------------------


class _CountsThreads(Synthetic):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def step(self, states: Sequence[Any]) -> list[Any]:
        self.threads.append(torch.get_num_threads())  # on the producer thread
        return super().step(states)


@pytest.mark.asyncio
async def test_cpu_members_split_the_cores(monkeypatch):
    monkeypatch.delenv(config.TORCH_THREADS_ENV, raising=False)
    monkeypatch.setattr(config, "usable_cores", lambda: 16)
    before = torch.get_num_threads()
    # Two members compute on the CPU (cpu and sim), so each gets (16 - 2) // 2.
    async with om.EngineGroup(_CountsThreads, devices="cpu,sim") as group:
        a = group.stream(params(steps=1))
        b = group.stream(params(steps=1))
        assert {a.member, b.member} == {0, 1}
        await read_all(a)
        await read_all(b)
    assert [m.model.threads for m in group.members] == [[7], [7]]
    # The variable (or torch_threads=) sets each member's count as given.
    monkeypatch.setenv(config.TORCH_THREADS_ENV, "2")
    async with om.EngineGroup(_CountsThreads, devices="cpu,cpu") as group:
        await group.generate(params(steps=1))
    async with om.EngineGroup(_CountsThreads, devices="cpu", torch_threads=3) as single:
        await single.generate(params(steps=1))
    assert group.members[0].model.threads == [2] and single.model.threads == [3]
    assert torch.get_num_threads() == before


# -- streaming through the group -------------------------------------------------------


@pytest.mark.asyncio
async def test_stream_and_generate_through_the_group(device_kind):
    async with group_on(device_kind) as group:
        p = params(steps=4, seed=3)
        async with group.stream(p, request_id="s") as frames:
            assert isinstance(frames, GroupStream)
            assert frames.request_id == "s" and frames.total == 4 and frames.params["seed"] == 3
            got = [f async for f in frames]
        expected = group.model.expected_frames(p)
        assert [f.step for f in got] == [1, 2, 3, 4] and got[-1].final
        assert all(torch.equal(f.data, e) for f, e in zip(got, expected, strict=True))
        final = await group.generate(params(steps=3, seed=5), request_id="g")
        assert final.final and final.request_id == "g"
        assert torch.equal(final.data, group.model.expected_frames(params(steps=3, seed=5))[-1])
        with pytest.raises(om.ParamsError) as info:
            group.stream(params(steps=0))
        assert info.value.field == "steps" and group.statistics().queued == 0


@pytest.mark.asyncio
async def test_new_requests_go_to_the_least_loaded_member_ties_to_the_lowest(device_kind):
    async with group_on(device_kind) as group:
        streams = [group.stream(params(steps=50), request_id=f"r{i}") for i in range(4)]
        assert [s.member for s in streams] == [0, 1, 0, 1]
        assert [group.member_of(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
        # Member 0 frees both of its requests: the next two go there.
        await streams[0].aclose()
        await streams[2].aclose()
        nxt = [group.stream(params(steps=50)) for _ in range(3)]
        assert [s.member for s in nxt] == [0, 0, 0]  # 0 then 1 vs 2, then 2 vs 2: the lowest
        per_member = [m.statistics() for m in group.members]
        assert [s.active + s.queued for s in per_member] == [3, 2]
        for s in [*streams, *nxt]:
            await s.aclose()


@pytest.mark.asyncio
async def test_polling_through_the_group_frees_the_id_at_the_final_frame():
    async with om.EngineGroup(Synthetic, devices="cpu,cpu") as group:
        stream = group.stream(params(steps=2), request_id="p", policy="latest")
        frames: list[om.Frame] = []
        with anyio.fail_after(10):
            while not (frames and frames[-1].final):
                frame = stream.poll()
                if frame is None:
                    await anyio.sleep(0.005)
                else:
                    frames.append(frame)
        assert group.member_of("p") is None
        assert [f.step async for f in stream] == []


@pytest.mark.asyncio
async def test_cancel_finds_the_request_on_its_member(device_kind):
    async with group_on(device_kind) as group:
        first = group.stream(params(steps=200), request_id="on0")
        second = group.stream(params(steps=200), request_id="on1")
        assert (first.member, second.member) == (0, 1)
        assert (await second.__anext__()).step == 1
        assert group.cancel("on1") is True
        with pytest.raises(om.RequestCancelledError) as info:
            await read_all(second)
        assert info.value.request_id == "on1"
        assert group.member_of("on1") is None and group.cancel("on1") is False
        assert group.cancel("never-submitted") is False
        # From another thread, as Engine.cancel allows.
        answers: list[bool] = []
        t = threading.Thread(target=lambda: answers.append(group.cancel("on0")))
        t.start()
        t.join()
        assert answers == [True]
        with pytest.raises(om.RequestCancelledError):
            await read_all(first)
        await wait_for(lambda: group.statistics().active == 0, what="both ended")
        assert group.statistics().cancelled == 2
        assert [m.statistics().cancelled for m in group.members] == [1, 1]


@pytest.mark.asyncio
async def test_statistics_sum_the_members_and_list_each(device_kind):
    async with group_on(device_kind) as group:
        streams = [group.stream(params(steps=3, seed=i)) for i in range(4)]
        for s in streams:
            await read_all(s)
        with pytest.raises(om.StepFailedError):
            await group.generate(params(steps=3, fail_at=2))  # to member 0: a failure counted
        stats = group.statistics()
        per_member = [m.statistics() for m in group.members]
    assert isinstance(stats, om.GroupStatistics) and isinstance(stats, om.EngineStatistics)
    assert stats.members == tuple(per_member)
    for f in dataclasses.fields(om.EngineStatistics):
        values = [getattr(s, f.name) for s in per_member]
        if f.name == "batch_sizes":
            merged: dict[int, int] = {}
            for v in values:
                for k, n in v.items():
                    merged[k] = merged.get(k, 0) + n
            assert stats.batch_sizes == merged
        else:
            assert getattr(stats, f.name) == sum(values), f.name
    assert stats.completed == 4 and [s.completed for s in per_member] == [2, 2]
    assert stats.failed == 1 and stats.frames_delivered == 4 * 3 + 1
    as_dict = stats.to_dict()
    assert as_dict["completed"] == 4 and [m["completed"] for m in as_dict["members"]] == [2, 2]
    assert all(isinstance(k, str) for m in as_dict["members"] for k in m["batch_sizes"])


# -- ids -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_running_id_is_refused_on_any_member_with_the_engines_error():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        held = engine.stream(params(steps=50), request_id="dup")
        with pytest.raises(om.ParamsError) as engine_error:
            engine.stream(params(steps=2), request_id="dup")
        await held.aclose()
    async with om.EngineGroup(Synthetic, devices="cpu,cpu") as group:
        held = group.stream(params(steps=50), request_id="dup")
        assert held.member == 0  # so a second "dup" would go to member 1 but for the group
        with pytest.raises(om.ParamsError) as group_error:
            group.stream(params(steps=2), request_id="dup")
        for a, b in [(engine_error.value, group_error.value)]:
            assert (type(a), str(a), a.field, a.request_id) == (type(b), str(b), b.field, b.request_id)
        assert group.statistics().queued + group.statistics().active == 1
        # Free again once the stream ends, whichever way it ends.
        await held.aclose()
        assert await group.generate(params(steps=2), request_id="dup")
        dropped = group.stream(params(steps=50), request_id="dup")
        del dropped
        gc.collect()
        assert group.member_of("dup") is None
        # ... and dropping it cancelled the request on its member, as for one engine.
        await wait_for(lambda: group.statistics().cancelled == 2, what="the dropped request cancelled")
        again = group.stream(params(steps=2), request_id="dup")
        await read_all(again)
        with pytest.raises(om.ParamsError, match="request_id"):
            group.stream(params(steps=2), request_id="")


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [".", "..", "x" * 129, "a b"], ids=["dot", "dotdot", "129", "space"])
async def test_an_id_outside_the_rule_is_refused_as_one_engine_refuses_it(bad):
    with pytest.raises(om.ParamsError) as expected:
        check_request_id(bad)
    async with om.EngineGroup(Synthetic, devices="cpu,cpu") as group:
        with pytest.raises(om.ParamsError) as info:
            group.stream(params(steps=2), request_id=bad)
        assert (info.value.field, str(info.value)) == ("request_id", str(expected.value))
        assert group.statistics().queued + group.statistics().active == 0 and not group._where


class CountsChecks(Synthetic):
    """Synthetic counting validate() calls across every instance (each member has its own)."""

    checks = 0

    def validate(self, params: Any) -> dict[str, Any]:
        CountsChecks.checks += 1
        return super().validate(params)


@pytest.mark.asyncio
async def test_a_request_is_checked_once_by_the_group_not_again_by_its_member():
    CountsChecks.checks = 0
    async with om.EngineGroup(CountsChecks, devices="cpu,cpu") as group:
        streams = [group.stream(params(steps=2, seed=i)) for i in range(2)]
        assert [s.member for s in streams] == [0, 1]
        for s in streams:
            assert (await read_all(s))[-1].final
        assert CountsChecks.checks == 2
        # Options are refused before routing: neither member saw these.
        for bad in ({"policy": "some"}, {"priority": 11}, {"preview_every": 0}, {"timeout": 0}):
            with pytest.raises(om.ParamsError):
                group.stream(params(steps=2), **bad)
        assert group.statistics().completed == 2 and CountsChecks.checks == 2


# -- health, and a member that dies -----------------------------------------------------


@pytest.mark.asyncio
async def test_a_dead_member_fails_its_requests_takes_no_work_and_the_other_serves():
    async with om.EngineGroup(factory_of(Synthetic, Dies), devices="cpu,cpu") as group:
        survivor = group.stream(params(steps=6, seed=1), request_id="a")
        doomed = group.stream(params(steps=6), request_id="b")
        assert (survivor.member, doomed.member) == (0, 1)
        with anyio.fail_after(20), pytest.raises(om.EngineDeadError) as info:
            await read_all(doomed)
        assert info.value.request_id == "b" and "SystemExit" in str(info.value)
        assert group.member_of("b") is None
        health = group.health()
        assert health.status == "ok" and health.ok
        assert health.reason is not None and "member 1 (cpu) is dead" in health.reason
        assert "member 0" not in health.reason and health.device == "cpu,cpu"
        group.check_health()  # ok while any member is
        # Member 0 is the busier one, and still it takes every new request.
        more = [group.stream(params(steps=3, seed=i)) for i in range(3)]
        assert [s.member for s in more] == [0, 0, 0]
        for s in more:
            assert (await read_all(s))[-1].final
        got = await read_all(survivor)
        assert [f.step for f in got] == [1, 2, 3, 4, 5, 6]
        assert torch.equal(got[-1].data, group.model.expected_frames(params(steps=6, seed=1))[-1])
        assert group.statistics().failed == 1 and group.statistics().completed == 4


class FellOff(Synthetic):
    """A model whose device is gone: ``load`` raises."""

    def load(self, device: torch.device) -> None:
        raise RuntimeError("this accelerator fell off the bus")


@pytest.mark.asyncio
@pytest.mark.parametrize("dead", [0, 1])  # 0: given a model instance; 1: built on its thread
async def test_a_member_whose_model_fails_to_load_is_left_out_and_the_rest_serve(caplog, dead: int):
    kinds = [Synthetic, Synthetic]
    kinds[dead] = FellOff
    group = om.EngineGroup(factory_of(*kinds), devices="cpu,sim")
    device = ("cpu", "sim")[dead]
    with caplog.at_level(logging.DEBUG, logger="omni_stream"):
        async with group:
            streams = [group.stream(params(steps=3, seed=i)) for i in range(4)]
            assert {s.member for s in streams} == {1 - dead}
            for s in streams:
                assert (await read_all(s))[-1].final
            health = group.health()
            assert health.status == "ok"
            assert health.reason == (
                f"degraded: member {dead} ({device}) is dead: "
                "loading the model failed: RuntimeError('this accelerator fell off the bus')"
            )
            group.check_health()
            assert group.statistics().completed == 4
    told = [r for r in caplog.records if r.levelno >= logging.INFO and "fell off the bus" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in told]
    assert told[0].levelno == logging.ERROR
    assert f"member {dead} ({device}) could not start" in told[0].getMessage()


@pytest.mark.asyncio
async def test_when_no_member_loads_the_start_raises_with_every_cause():
    group = om.EngineGroup(factory_of(FellOff, FellOff), devices="cpu,sim")
    with pytest.raises(om.EngineDeadError, match="no member of the engine group could start") as info:
        async with group:
            raise AssertionError("started")
    message = str(info.value)
    cause = "loading the model failed: RuntimeError('this accelerator fell off the bus')"
    for name in ("member 0 (cpu)", "member 1 (sim)"):
        assert f"{name}: {cause}" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert [m.health().status for m in group.members] == ["dead", "dead"]
    assert group.health().status == "closed"
    await group.aclose()  # idempotent


@pytest.mark.asyncio
async def test_when_every_member_is_dead_the_group_is_dead():
    async with om.EngineGroup(factory_of(Dies, Dies), devices="cpu,sim") as group:
        streams = [group.stream(params(steps=3)) for _ in range(2)]
        for s in streams:
            with anyio.fail_after(20), pytest.raises(om.EngineDeadError):
                await read_all(s)
        health = group.health()
        assert health.status == "dead" and not health.ok
        assert "member 0 (cpu) is dead" in health.reason and "member 1 (sim) is dead" in health.reason
        with pytest.raises(om.EngineDeadError, match="member 1") as info:
            group.check_health()
        assert info.value.__cause__ is not None
        with pytest.raises(om.EngineDeadError) as info:
            group.stream(params(steps=2), request_id="late")
        assert info.value.request_id == "late" and "every member" in str(info.value)
        assert group.member_of("late") is None


@pytest.mark.asyncio
async def test_a_stalled_member_is_named_and_skipped(monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "0.2")
    async with om.EngineGroup(Synthetic, devices="cpu,sim") as group:
        filler = group.stream(params(steps=100), request_id="filler")
        hung = group.stream(params(steps=3, hang_at=1, hang_s=1.5), request_id="hung")
        assert (filler.member, hung.member) == (0, 1)
        await wait_for(lambda: group.health().reason is not None, what="member 1 stalled")
        health = group.health()
        assert health.status == "ok" and "member 1 (sim) is stalled" in health.reason
        # Member 0 has more work, and gets the new request all the same.
        assert group.stream(params(steps=2), request_id="next").member == 0
        await filler.aclose()
        await hung.aclose()
        await group.members[0].generate(params(steps=1))  # member 0 keeps serving directly too


@pytest.mark.asyncio
async def test_health_before_and_after(device_kind):
    group = group_on(device_kind)
    assert group.health().status == "closed" and "not started" in group.health().reason
    with pytest.raises(om.EngineClosedError):
        group.check_health()
    with pytest.raises(om.EngineClosedError, match="not started") as info:
        group.stream(params(steps=2), request_id="early")
    assert info.value.request_id == "early"
    async with group:
        assert group.health().status == "ok" and group.health().reason is None
        group.check_health()
    assert group.health().status == "closed"
    assert all(m.health().status == "closed" for m in group.members)
    with pytest.raises(om.EngineClosedError, match="shut down"):
        group.stream(params(steps=2))
    with pytest.raises(om.EngineClosedError):
        await group.start()


# -- lifecycle -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_closing_ends_pending_streams_on_every_member(device_kind):
    outcomes: list[str] = []
    group = group_on(device_kind)
    async with anyio.create_task_group() as tg:
        await group.start()

        async def reader(stream) -> None:
            try:
                await read_all(stream)
            except om.EngineClosedError as exc:
                outcomes.append(exc.request_id)

        for name in ("x", "y"):
            tg.start_soon(reader, group.stream(params(steps=5000), request_id=name))
        await wait_for(lambda: all(m.statistics().steps > 0 for m in group.members), what="both stepping")
        await group.aclose()
    assert sorted(outcomes) == ["x", "y"]
    assert group.member_of("x") is None and group.member_of("y") is None


@pytest.mark.asyncio
async def test_a_member_failing_to_start_closes_the_ones_started(monkeypatch):
    group = om.EngineGroup(Synthetic, devices="cpu,cpu,sim")

    async def broken_start() -> None:
        raise RuntimeError("member 2 cannot start")

    monkeypatch.setattr(group.members[2], "start", broken_start)
    with pytest.raises(RuntimeError, match="cannot start"):
        async with group:
            raise AssertionError("not reached")
    assert [m.health().status for m in group.members] == ["closed"] * 3
    assert group.health().status == "closed"
    await group.aclose()  # idempotent


@pytest.mark.asyncio
async def test_cancelling_the_owner_still_closes_every_member():
    group = om.EngineGroup(Synthetic, devices="cpu,sim")
    with anyio.move_on_after(0.3):
        async with group:
            stream = group.stream(params(steps=100000))
            await stream.__anext__()
            await anyio.sleep(10)
    assert [m.health().status for m in group.members] == ["closed", "closed"]


@pytest.mark.asyncio
async def test_pause_and_resume_reach_the_member_running_the_request_and_refuse_as_it_does() -> None:
    # Issue #34: the group had no pause at all; each door now pauses as Engine.pause does.
    gate = threading.Event()

    class Held(Synthetic):
        def step(self, states: Sequence[Any]) -> list[Any]:
            if any(s.step >= 1 for s in states):
                gate.wait(10)
            return super().step(states)

    async with om.EngineGroup(Held, devices="cpu,cpu") as group:
        first = group.stream(params(steps=3), request_id="on0")
        second = group.stream(params(steps=3), request_id="on1")
        assert (first.member, second.member) == (0, 1)
        assert (await second.__anext__()).step == 1
        assert group.pause("on1", to_host=True) and group.is_paused("on1") and not group.pause("on1")
        assert group.members[1].is_paused("on1") and group.pause_refusal("on1") is None
        gate.set()
        assert [f.step for f in await read_all(first)] == [1, 2, 3]
        assert group.resume("on1") and not group.resume("on1") and not group.is_paused("on1")
        assert [f.step for f in await read_all(second)] == [2, 3]
        assert not group.pause("on1") and not group.pause("nobody") and not group.resume("nobody")

    looped = threading.Event()

    def loop(params: Any) -> Any:
        for i in range(1, 4):
            if i == 2:
                looped.wait(10)
            yield torch.full((2,), float(i))

    async with om.EngineGroup(lambda: om.from_generator(loop, total=3, name="loop"), devices="cpu,cpu") as group:
        stream = group.stream({}, request_id="g")
        assert (await stream.__anext__()).step == 1  # step 2 waits: it is running
        assert not group.pause("g") and not group.is_paused("g")
        assert "request g cannot be paused: model loop cannot snapshot" in (group.pause_refusal("g") or "")
        looped.set()
        assert [f.step for f in await read_all(stream)] == [2, 3]
