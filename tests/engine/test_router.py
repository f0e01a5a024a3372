"""ModelRouter: several models behind one engine; lazy loading, LRU unloading, failures, cancel."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.engine.router import ModelRouter, check_model_name
from omni_stream.models import Synthetic

P = {"steps": 3, "shape": [2, 4, 4], "work": 0, "seed": 1}


class Counted(Synthetic):
    """A Synthetic model that counts its loads and unloads; ``fail_loads`` loads raise first."""

    def __init__(self, name: str, *, fail_loads: int = 0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.name = name
        self.loads = 0
        self.unloads = 0
        self.fail_loads = fail_loads
        self.gate = gate

    def load(self, device: torch.device) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError(f"{self.name}: the weights are not there")
        self.loads += 1
        super().load(device)

    def unload(self) -> None:
        self.unloads += 1


async def frames_of(router: ModelRouter, model: str | None, **params: Any) -> list[om.Frame]:
    async with router.stream({**P, **params}, model=model) as stream:
        return [f async for f in stream]


@pytest.mark.asyncio
async def test_each_request_runs_on_the_model_it_names() -> None:
    a, b = Counted("a"), Counted("b")
    async with ModelRouter({"a": a, "b": b}, device="cpu") as router:
        assert router.loaded == ("a", "b") and router.default == "a" and router.model is a
        first = await frames_of(router, None)
        second = await frames_of(router, "b", seed=2)
        with pytest.raises(om.ParamsError) as info:
            router.stream(P, model="c")
        assert info.value.field == "model" and "a, b" in str(info.value)
        with pytest.raises(om.ParamsError) as info:
            router.stream({**P, "steps": 0}, model="b")
        assert info.value.field == "steps"
        assert router.health().ok and router.statistics().completed == 2
    assert [f.step for f in first] == [1, 2, 3] and torch.equal(first[-1].data, a.expected_frames(P)[-1])
    assert torch.equal(second[-1].data, b.expected_frames({**P, "seed": 2})[-1])
    assert (a.loads, b.loads) == (1, 1)


@pytest.mark.asyncio
async def test_with_max_loaded_1_models_load_on_demand_and_the_least_recently_used_unloads() -> None:
    a, b = Counted("a"), Counted("b")
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0) as router:
        assert router.loaded == ()
        stream = router.stream(P, model="b")
        assert stream.loading  # nothing loaded: the first frame waits for the load
        async with stream:
            frames = [f async for f in stream]
        assert len(frames) == 3 and router.loaded == ("b",) and not stream.loading
        await frames_of(router, "a")
        assert router.loaded == ("a",) and (b.unloads, a.unloads) == (1, 0)
        await frames_of(router, "a")  # loaded: no reload
        await frames_of(router, "b")
        assert router.loaded == ("b",)
        assert (a.loads, a.unloads, b.loads, b.unloads) == (1, 1, 2, 1)
        load_s, unload_s = router.load_times()["a"]
        assert load_s > 0 and unload_s > 0
        assert router.statistics().completed == 4  # the unloaded engines' counts stay


@pytest.mark.asyncio
async def test_under_fcfs_a_busy_model_unloads_once_its_requests_end_taking_no_new_ones_meanwhile() -> None:
    a, b = Counted("a"), Counted("b")
    async with ModelRouter(
        {"a": a, "b": b}, max_loaded=1, device="cpu", scheduling="fcfs", min_residency_s=0
    ) as router:
        long = router.stream({**P, "steps": 40, "hang_at": 2, "hang_s": 0.3}, model="a")
        first = await long.__anext__()  # a is loaded and busy
        assert first.step == 1
        wanting_b = router.stream(P, model="b")
        got: list[om.Frame] = []

        async def run_b() -> None:
            async with wanting_b:
                got.extend([f async for f in wanting_b])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_b)
            await anyio.sleep(0.05)
            # b waits for a to drain; a new request for a waits too (a is draining).
            late_a = router.stream(P, model="a")
            assert wanting_b.loading and late_a.loading and router.loaded == ("a",)
            rest = [f async for f in long]
            await long.aclose()
        assert rest[-1].final and len(got) == 3 and router.loaded == ("b",)
        async with late_a:
            assert len([f async for f in late_a]) == 3  # a loaded again, b unloaded
        assert router.loaded == ("a",) and a.loads == 2


@pytest.mark.asyncio
async def test_a_model_that_fails_to_load_fails_its_waiting_requests_and_the_next_one_retries() -> None:
    a, b = Counted("a"), Counted("b", fail_loads=1)
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0) as router:
        with pytest.raises(om.EngineDeadError, match="'b' failed to load"):
            await frames_of(router, "b")
        health = router.health()
        assert health.ok and "failed to load" in (health.reason or "")
        assert len(await frames_of(router, "a")) == 3  # the other model still serves
        assert len(await frames_of(router, "b")) == 3  # and b loads on the next try


@pytest.mark.asyncio
async def test_a_request_cancelled_while_its_model_loads_ends_cancelled_and_the_load_goes_on() -> None:
    gate = threading.Event()
    a = Counted("a", gate=gate)
    async with ModelRouter({"a": a}, max_loaded=1, device="cpu", min_residency_s=0) as router:
        stream = router.stream(P, request_id="waits")
        caught: list[BaseException] = []

        async def read() -> None:
            try:
                async with stream:
                    await stream.__anext__()
            except om.RequestCancelledError as exc:
                caught.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.05)
            assert stream.loading and router.cancel("waits")
            await anyio.sleep(0.05)
            gate.set()
        assert len(caught) == 1 and caught[0].request_id == "waits"
        assert not router.cancel("waits")
        assert len(await frames_of(router, None)) == 3
        assert a.loads == 1


@pytest.mark.asyncio
async def test_a_failing_model_at_start_closes_the_router() -> None:
    router = ModelRouter({"a": Counted("a", fail_loads=1)}, device="cpu")
    with pytest.raises(om.EngineDeadError, match="'a' failed to load"):
        async with router:
            pass
    assert router.health().status == "closed"


def test_names_and_options_are_checked() -> None:
    assert check_model_name("sd-1.5_turbo") == "sd-1.5_turbo"
    for bad in ("", "-x", "a b", "x" * 65, 3):
        with pytest.raises(om.ParamsError) as info:
            check_model_name(bad)
        assert info.value.field == "model"
    with pytest.raises(om.ParamsError):
        ModelRouter({})
    with pytest.raises(om.ParamsError):
        ModelRouter({"a": Synthetic()}, max_loaded=0)
    with pytest.raises(om.ParamsError):
        ModelRouter({"a": object()})  # type: ignore[dict-item]


@pytest.mark.asyncio
async def test_pause_reaches_the_engine_of_the_requests_model_and_is_refused_where_it_cannot_stop() -> None:
    # Issue #34: a from_generator model cannot snapshot; its requests are never paused.
    gate = threading.Event()

    class Held(Counted):
        def step(self, states: Any) -> list[torch.Tensor]:
            if any(s.step >= 1 for s in states):
                gate.wait(10)
            return super().step(states)

    def loop(params: Any) -> Any:
        for i in range(1, 4):
            if i == 2:
                gate.wait(10)
            yield torch.full((2,), float(i))

    models = {"snap": Held("snap"), "loop": om.from_generator(loop, total=3, name="loop")}
    async with ModelRouter(models, device="cpu") as router:
        snap = router.stream(P, model="snap", request_id="s")
        looping = router.stream({}, model="loop", request_id="l")
        assert (await snap.__anext__()).step == 1 and (await looping.__anext__()).step == 1
        assert router.pause_refusal("s") is None and router.pause("s", to_host=True)
        assert not router.pause("l")
        assert "request l cannot be paused: model loop cannot snapshot" in (router.pause_refusal("l") or "")
        gate.set()
        assert [f.step async for f in looping] == [2, 3]
        assert router.resume("s") and not router.resume("s")
        assert [f.step async for f in snap] == [2, 3]
        assert router.pause_refusal("s") is None and not router.pause("nobody")


# -- residency (issue #39, attack 6) ------------------------------------------------------


class Paced(Counted):
    """A Counted model whose steps take ``step_s`` each: a request long enough to be seen running."""

    def __init__(self, name: str, step_s: float = 0.01) -> None:
        super().__init__(name)
        self.step_s = step_s

    def step(self, states: Any) -> list[torch.Tensor]:
        time.sleep(self.step_s)
        return super().step(states)


async def frames_until(stream: Any, step: int) -> list[om.Frame]:
    got = []
    async for frame in stream:
        got.append(frame)
        if frame.step >= step:
            break
    return got


@pytest.mark.asyncio
async def test_a_model_in_use_past_its_residency_hands_its_requests_over_and_they_run_on_unchanged() -> None:
    # B's long request on b held the device until its end: A's short request on a waited its
    # whole run. Past b's quantum its requests go to the host, a runs, and b's go on after.
    a, b = Counted("a"), Paced("b", step_s=0.004)
    long = {**P, "steps": 60}
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0) as router:
        stream = router.stream(long, model="b", request_id="long")
        async with stream:
            frames = await frames_until(stream, 2)
            short = await frames_of(router, "a")  # while b's request runs
            assert router.loaded == ("a",) and b.unloads == 1
            frames += [f async for f in stream]  # b loads again; the request goes on
    assert [f.step for f in short] == [1, 2, 3]
    assert [f.step for f in frames] == list(range(1, 61))  # policy "all": none lost, none twice
    assert all(torch.equal(f.data, e) for f, e in zip(frames, b.expected_frames(long), strict=True))
    assert router.swaps == 2 and router.loads() == {"a": 1, "b": 2}
    assert router.statistics().cancelled == 0


async def read_all(stream: Any, into: list[om.Frame], done: anyio.Event | None = None) -> None:
    try:
        async with stream:
            into.extend([f async for f in stream])
    except om.RequestCancelledError:
        pass
    finally:
        if done is not None:
            done.set()


@pytest.mark.asyncio
async def test_a_model_keeps_the_device_for_its_quantum_in_use_and_after_its_last_request() -> None:
    a, b = Paced("a"), Counted("b")
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=60) as router:
        stream = router.stream({**P, "steps": 400}, model="a", request_id="long")
        await stream.__anext__()
        wanting_b = router.stream(P, model="b", request_id="b")
        got: list[om.Frame] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, wanting_b, got)
            await frames_until(stream, 30)  # a keeps running, within its quantum
            assert wanting_b.loading and router.swaps == 0 and router.loaded == ("a",)
            await stream.aclose()
            # Unused now, but it served a request a moment ago: the next may come for it.
            await anyio.sleep(0.2)
            assert wanting_b.loading and router.swaps == 0 and router.loaded == ("a",)
            assert router.cancel("b")
        assert got == [] and router.swaps == 0


@pytest.mark.asyncio
async def test_under_the_preemptive_policy_a_long_run_gives_way_to_a_shorter_request_only() -> None:
    a, b = Counted("a"), Paced("b", step_s=0.005)
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0.3) as router:
        long = router.stream({**P, "steps": 200}, model="b", request_id="long")
        await long.__anext__()
        longer, short = [], []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, router.stream({**P, "steps": 1000}, model="a", request_id="longer"), longer)
            # Past b's quantum (0.3 s, 60 steps of 5 ms), well within the longer one's wait bound
            # (ten quanta): it has more steps than b has left, so it waits.
            await frames_until(long, 100)
            assert router.swaps == 0 and router.loaded == ("b",)
            ended = anyio.Event()
            tg.start_soon(read_all, router.stream({**P, "steps": 2}, model="a", request_id="short"), short, ended)
            frames = await frames_until(long, 200)  # b gives way to the short one, then goes on
            await ended.wait()
            assert router.swaps >= 1 and [f.step for f in short] == [1, 2]
            assert [f.step for f in frames] == list(range(101, 201))
            router.cancel("longer")
            await long.aclose()


@pytest.mark.asyncio
async def test_alternating_requests_cannot_swap_past_the_budget() -> None:
    # 40 alternating one-step requests forced 40 loads and 39 unloads in 4.5 s.
    a, b = Counted("a"), Counted("b")
    async with ModelRouter(
        {"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0, max_swaps_per_min=2
    ) as router:
        for model in ("a", "b", "a"):
            await frames_of(router, model, steps=1)
        assert router.swaps == 2
        stream = router.stream({**P, "steps": 1}, model="b")
        async with stream:
            with anyio.move_on_after(0.3):
                await stream.__anext__()
                raise AssertionError("a third swap within the minute")
            assert stream.loading and router.loaded == ("a",)
        assert router.swaps == 2 and (a.loads, b.loads) == (2, 1)


@pytest.mark.asyncio
async def test_two_clients_alternating_models_at_once_all_finish() -> None:
    # Two tenants alternating at once livelocked the router: about 21,000 swaps in 30 s,
    # 2 of 40 requests done, the rest `loading` (each load took the other's model before
    # its requests ran).
    a, b = Counted("a"), Counted("b")
    done: list[str] = []
    async with ModelRouter(
        {"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0.01, max_swaps_per_min=10_000
    ) as router:

        async def client(first: str, second: str) -> None:
            for i in range(10):
                model = first if i % 2 == 0 else second
                assert len(await frames_of(router, model, steps=1)) == 1
                done.append(model)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client, "a", "b")
                tg.start_soon(client, "b", "a")
    assert len(done) == 20
    assert router.swaps <= 20


@pytest.mark.asyncio
async def test_a_paused_request_keeps_no_model_loaded_and_resumed_goes_on() -> None:
    # One paused request kept every other model `loading` for 60 s.
    a, b = Counted("a"), Paced("b", step_s=0.002)
    long = {**P, "steps": 8}
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu", min_residency_s=0.05) as router:
        stream = router.stream(long, model="b", request_id="held")
        async with stream:
            frames = await frames_until(stream, 2)
            assert router.pause("held", to_host=False) and not router.pause("held")
            assert len(await frames_of(router, "a")) == 3  # b holds nothing: a loads at once
            assert router.loaded == ("a",) and router.swaps == 1
            assert router.resume("held") and not router.resume("held")
            frames += [f async for f in stream]
    assert [f.step for f in frames] == list(range(1, 9))
    assert all(torch.equal(f.data, e) for f, e in zip(frames, b.expected_frames(long), strict=True))


def test_residency_options_are_checked_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_MIN_RESIDENCY", "0.5")
    monkeypatch.setenv("OMNI_STREAM_MAX_SWAPS_PER_MIN", "3")
    router = ModelRouter({"a": Synthetic()}, max_loaded=1)
    assert (router.min_residency_s, router.max_swaps_per_min) == (0.5, 3)
    for bad in ({"min_residency_s": -1}, {"min_residency_s": float("nan")}, {"max_swaps_per_min": 0}):
        with pytest.raises(om.ParamsError) as info:
            ModelRouter({"a": Synthetic()}, **bad)  # type: ignore[arg-type]
        assert info.value.field == next(iter(bad))
