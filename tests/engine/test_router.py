"""ModelRouter: several models behind one engine; lazy loading, LRU unloading, failures, cancel."""

from __future__ import annotations

import threading
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
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu") as router:
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
async def test_a_busy_model_unloads_only_once_its_requests_end_and_takes_no_new_ones_meanwhile() -> None:
    a, b = Counted("a"), Counted("b")
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu") as router:
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
    async with ModelRouter({"a": a, "b": b}, max_loaded=1, device="cpu") as router:
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
    async with ModelRouter({"a": a}, max_loaded=1, device="cpu") as router:
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
