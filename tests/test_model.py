"""from_generator and the StepModel contract."""

from __future__ import annotations

import pytest
import torch

import omni_stream as om
from omni_stream.model import ModelMemory, model_memory


def ramp(params):
    for i in range(params["steps"]):
        yield torch.full((2, 3), float(i))


@pytest.mark.asyncio
async def test_from_generator_streams_each_yield():
    model = om.from_generator(ramp)
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream({"steps": 4})]
    assert [f.step for f in frames] == [1, 2, 3, 4]
    assert [float(f.data[0, 0]) for f in frames] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.asyncio
async def test_from_generator_total_forms():
    def three(params):
        yield from (torch.zeros(1) for _ in range(3))

    async with om.Engine(om.from_generator(three, total=3), device="cpu") as engine:
        assert (await engine.generate({})).step == 3
    async with om.Engine(om.from_generator(three, total=lambda p: 3), device="cpu") as engine:
        assert (await engine.generate({})).total == 3


@pytest.mark.asyncio
async def test_a_generator_that_ends_early_fails_its_request():
    def short(params):
        yield torch.zeros(1)

    async with om.Engine(om.from_generator(short, total=3), device="cpu") as engine:
        with pytest.raises(om.StepFailedError, match="ended before its declared total"):
            await engine.generate({})
        engine.check_health()


@pytest.mark.asyncio
async def test_a_generator_yielding_a_non_tensor_fails_its_request():
    def bad(params):
        yield [1, 2, 3]

    async with om.Engine(om.from_generator(bad, total=1), device="cpu") as engine:
        with pytest.raises(om.StepFailedError, match="torch.Tensor"):
            await engine.generate({})


@pytest.mark.asyncio
async def test_the_generator_is_closed_when_its_request_is_cancelled():
    closed = []

    def gen(params):
        try:
            for _ in range(1000):
                yield torch.zeros(1)
        finally:
            closed.append(True)

    async with om.Engine(om.from_generator(gen, total=1000), device="cpu") as engine:
        async with engine.stream({}) as frames:
            await frames.__anext__()
        for _ in range(200):
            if closed:
                break
            import anyio

            await anyio.sleep(0.01)
    assert closed == [True]


def test_from_generator_rejects_bad_arguments():
    with pytest.raises(TypeError):
        om.from_generator(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        om.from_generator(ramp, total=0)
    model = om.from_generator(ramp)
    with pytest.raises(om.ParamsError, match="steps"):
        model.validate({})
    with pytest.raises(om.ParamsError, match="mapping"):
        model.validate([1])  # type: ignore[arg-type]


def test_params_validation_names_the_field():
    m = om.models.Synthetic()
    with pytest.raises(om.ParamsError) as info:
        m.validate({"shape": [4, 0]})
    assert info.value.field == "shape"
    with pytest.raises(om.ParamsError, match="integer"):
        m.validate({"steps": 2.5})
    with pytest.raises(om.ParamsError, match="object"):
        m.validate("steps=3")  # type: ignore[arg-type]
    assert m.validate({"steps": 3.0})["steps"] == 3


def test_model_memory_finds_a_models_optional_memory_methods():
    mixture = om.models.Mixture()
    assert model_memory(mixture) is mixture
    assert isinstance(mixture, ModelMemory)
    assert model_memory(om.models.Synthetic()) is None
    assert model_memory(om.from_generator(ramp)) is None

    class Own:  # any object with the three methods
        def request_memory_bytes(self, params):
            return 7

        def cache_bytes(self):
            return 3

        def trim_cache(self, keep_bytes=0):
            return 3

    own = Own()
    assert model_memory(own) is own


def test_model_memory_needs_methods_not_just_their_names():
    class Setting(om.models.Synthetic):
        cache_bytes = 1 << 20  # a setting of that name, not the method

        def request_memory_bytes(self, params):
            return 0

        def trim_cache(self, keep_bytes=0):
            return 0

    assert model_memory(Setting()) is None
