"""Engine(factory): the model built on the producer thread when the engine starts; wait_loaded."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

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


class FellOff(Synthetic):
    def load(self, device: torch.device) -> None:
        raise RuntimeError("this accelerator fell off the bus")


@pytest.mark.asyncio
async def test_wait_loaded_returns_once_a_model_instance_is_loaded():
    engine = om.Engine(Synthetic(), device="cpu")
    with pytest.raises(om.EngineClosedError, match="not started"):
        await engine.wait_loaded()
    async with engine:
        await engine.wait_loaded()
        await engine.wait_loaded()  # and at once, later
        assert engine.health().ok


@pytest.mark.asyncio
async def test_wait_loaded_raises_why_a_model_instance_did_not_load_and_is_the_one_to_tell(caplog):
    with caplog.at_level(logging.INFO, logger="omni_stream"):
        async with om.Engine(FellOff(), device="cpu") as engine:
            with pytest.raises(om.EngineDeadError, match="loading the model failed") as info:
                await engine.wait_loaded()
            assert isinstance(info.value.__cause__, RuntimeError)
            health = engine.health()
            assert health.status == "dead" and health.reason == (
                "loading the model failed: RuntimeError('this accelerator fell off the bus')"
            )
    # Raised to the one waiting, so not logged as well.
    assert "fell off the bus" not in caplog.text


@pytest.mark.asyncio
async def test_a_model_instance_that_fails_to_load_unawaited_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="omni_stream"):
        async with om.Engine(FellOff(), device="cpu") as engine:
            with pytest.raises(om.EngineDeadError):
                [f async for f in engine.stream({"shape": [3, 8, 8], "steps": 2})]
    assert [r.getMessage() for r in caplog.records] == [
        "engine dead: the producer failed: RuntimeError('this accelerator fell off the bus')"
    ]


def test_neither_a_model_nor_a_callable_is_refused():
    with pytest.raises(om.ParamsError, match="StepModel") as info:
        om.Engine(42, device="cpu")  # type: ignore[arg-type]
    assert info.value.field == "model"
