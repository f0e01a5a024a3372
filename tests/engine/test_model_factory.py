"""Engine(factory): the model built on the producer thread when the engine starts."""

from __future__ import annotations

import threading

import pytest

import omni_stream as om
from omni_stream.models import Synthetic


@pytest.mark.asyncio
async def test_the_model_is_built_on_the_producer_thread_and_ready_when_start_returns():
    where: list[str] = []

    def factory() -> Synthetic:
        where.append(threading.current_thread().name)
        return Synthetic()

    engine = om.Engine(factory, device="cpu")
    with pytest.raises(om.EngineClosedError, match="producer thread"):
        engine.model  # noqa: B018
    assert where == []
    async with engine:
        assert where == ["omni-stream-producer"]
        assert isinstance(engine.model, Synthetic)
        frame = await engine.generate({"shape": [3, 8, 8], "steps": 2})
        assert frame.final and engine.health().ok


@pytest.mark.asyncio
async def test_a_factory_returning_something_else_fails_the_start_naming_it():
    engine = om.Engine(lambda: "not a model", device="cpu")
    with pytest.raises(om.ParamsError, match="not an omni_stream.StepModel") as info:
        async with engine:
            raise AssertionError("started")
    assert info.value.field == "model"
    with pytest.raises(om.EngineError):  # it died building its model, and was closed
        engine.stream({})
    assert engine.health().status == "dead"


@pytest.mark.asyncio
async def test_a_factory_that_raises_fails_the_start_with_its_cause():
    def factory() -> Synthetic:
        raise RuntimeError("weights not found")

    engine = om.Engine(factory, device="cpu")
    with pytest.raises(om.EngineDeadError, match="building the model failed") as info:
        await engine.start()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "weights not found" in str(info.value)


def test_neither_a_model_nor_a_callable_is_refused():
    with pytest.raises(om.ParamsError, match="StepModel") as info:
        om.Engine(42, device="cpu")  # type: ignore[arg-type]
    assert info.value.field == "model"
