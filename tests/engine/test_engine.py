"""The engine end to end on the CPU and the simulated accelerator."""

from __future__ import annotations

import random

import anyio
import pytest
import torch

import omni_stream as om
from omni_stream.engine.intake import check_request
from omni_stream.lifecycle import Lifecycle
from omni_stream.models import Synthetic

from .conftest import Counting, make_device, params, settled, wait_for


@pytest.mark.asyncio
async def test_frames_match_the_model_bit_for_bit(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        p = params(steps=12, seed=5)
        frames = [f async for f in engine.stream(p)]
    expected = model.expected_frames(p)
    assert [f.step for f in frames] == list(range(1, 13))
    assert [f.final for f in frames] == [False] * 11 + [True]
    assert all(f.total == 12 for f in frames)
    for got, want in zip(frames, expected, strict=True):
        assert torch.equal(got.data, want)


@pytest.mark.asyncio
async def test_sixteen_concurrent_requests_with_random_cancellations(device_kind):
    model = Synthetic()
    rng = random.Random(1234)
    plans = []
    for i in range(16):
        steps = rng.randint(4, 14)
        cancel_at = rng.choice([None, None, rng.randint(1, steps - 3)])
        plans.append((params(steps=steps, seed=100 + i), cancel_at))
    results: dict[int, list[torch.Tensor]] = {}
    outcomes: dict[int, str] = {}
    cancelled_at: dict[int, int] = {}

    # queue_size=2 keeps each request at most two frames ahead of its reader,
    # so a cancel at step k <= steps - 3 always lands before the final frame.
    async with om.Engine(
        model, device=make_device(device_kind), max_batch_size=4, queue_size=2
    ) as engine:

        async def run(i, p, cancel_at):
            stream = engine.stream(p, request_id=f"r{i}")
            got = results.setdefault(i, [])
            try:
                async for frame in stream:
                    assert frame.request_id == f"r{i}"
                    got.append(frame.data)
                    if cancel_at is not None and frame.step == cancel_at and not frame.final:
                        # False when the final frame was already computed:
                        # the request has finished, and the reader gets it.
                        if engine.cancel(f"r{i}"):
                            cancelled_at[i] = frame.step
                outcomes[i] = "done"
            except om.RequestCancelledError as exc:
                assert exc.request_id == f"r{i}"
                outcomes[i] = "cancelled"

        async with anyio.create_task_group() as tg:
            for i, (p, cancel_at) in enumerate(plans):
                tg.start_soon(run, i, p, cancel_at)
        stats = await settled(engine)

    for i, (p, cancel_at) in enumerate(plans):
        expected = model.expected_frames(p)
        got = results[i]
        if i in cancelled_at:
            assert outcomes[i] == "cancelled"
            assert len(got) == cancelled_at[i]
        else:
            assert outcomes[i] == "done"
            assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a, b), f"request {i} got another frame's data"
    assert cancelled_at, "the plan cancelled nothing"
    assert stats.buffers_in_use == 0
    assert stats.cancelled == len(cancelled_at)
    assert stats.completed == 16 - len(cancelled_at)
    assert max(stats.batch_sizes) > 1, "compatible requests were never batched"


@pytest.mark.asyncio
async def test_frames_do_not_alias_pooled_buffers(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind), max_buffers=2) as engine:
        a = [f async for f in engine.stream(params(steps=6, seed=1))]
        b = [f async for f in engine.stream(params(steps=6, seed=2))]
        clones = [f.data.clone() for f in a]
        # Run more traffic through the same (tiny) pool after the frames were taken.
        await engine.generate(params(steps=20, seed=3))
    for frame, clone in zip(a, clones):
        assert torch.equal(frame.data, clone)
    for fa, fb in zip(a, b):
        assert fa.data.data_ptr() != fb.data.data_ptr()
    assert torch.equal(a[-1].data, model.expected_frames(params(steps=6, seed=1))[-1])


@pytest.mark.asyncio
async def test_generate_returns_the_final_frame(device_kind):
    model = Synthetic()
    async with om.Engine(model, device=make_device(device_kind)) as engine:
        final = await engine.generate(params(steps=7, seed=9), request_id="g")
    assert final.final and final.step == 7 and final.request_id == "g"
    assert torch.equal(final.data, model.expected_frames(params(steps=7, seed=9))[-1])


@pytest.mark.asyncio
async def test_a_request_without_a_seed_gets_one_drawn_and_that_seed_reproduces_it():
    model = Synthetic()
    async with om.Engine(model, device="cpu") as engine:
        drawn = engine.stream(params(steps=3))
        finals = [f async for f in drawn]
        seed = drawn.params["seed"]
        again = await engine.generate(params(steps=3, seed=seed))
        other = engine.stream(params(steps=3, seed=-1))
        [f async for f in other]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    assert torch.equal(finals[-1].data, again.data)
    assert torch.equal(again.data, model.expected_frames(params(steps=3, seed=seed))[-1])
    assert other.params["seed"] != seed  # another draw (equal once in 2**32)


@pytest.mark.asyncio
async def test_latest_policy_replaces_intermediate_frames_but_never_the_final():
    model = Synthetic()
    async with om.Engine(model, device="cpu") as engine:
        stream = engine.stream(params(steps=30, seed=4), policy="latest")
        await wait_for(lambda: engine.statistics().completed == 1, what="the request to finish")
        frames = [f async for f in stream]
        stats = engine.statistics()
    assert frames[-1].final and frames[-1].step == 30
    assert len(frames) < 30
    assert stats.frames_dropped == 30 - len(frames)
    assert torch.equal(frames[-1].data, model.expected_frames(params(steps=30, seed=4))[-1])


@pytest.mark.asyncio
async def test_all_policy_pauses_a_request_whose_reader_lags():
    async with om.Engine(Synthetic(), device="cpu", queue_size=3) as engine:
        stream = engine.stream(params(steps=50))
        await wait_for(lambda: engine.statistics().steps >= 3, what="three steps")
        await anyio.sleep(0.1)
        assert engine.statistics().steps == 3  # paused: the reader took nothing
        # Another request is not held up by the lagging one.
        await engine.generate(params(steps=10, seed=8))
        got = [f async for f in stream]
    assert len(got) == 50


@pytest.mark.asyncio
async def test_params_errors_name_the_field_and_lose_nothing():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        running = engine.stream(params(steps=5), request_id="ok")
        with pytest.raises(om.ParamsError) as info:
            engine.stream({"steps": 0})
        assert info.value.field == "steps"
        with pytest.raises(om.ParamsError, match="policy"):
            engine.stream({}, policy="some")
        with pytest.raises(om.ParamsError, match="timeout"):
            engine.stream({}, timeout=-1)
        with pytest.raises(om.ParamsError, match="already running"):
            engine.stream({}, request_id="ok")
        with pytest.raises(om.ParamsError, match="unknown synthetic param"):
            engine.stream({"nope": 1})
        assert len([f async for f in running]) == 5


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [".", "..", "x" * 129, "a b"], ids=["dot", "dotdot", "129", "space"])
async def test_an_id_outside_the_rule_is_refused(bad):
    async with om.Engine(Synthetic(), device="cpu") as engine:
        with pytest.raises(om.ParamsError) as info:
            engine.stream(params(steps=2), request_id=bad)
        assert info.value.field == "request_id" and "A-Z a-z 0-9 . _ : -" in info.value.message
        assert engine.statistics().queued == 0
        assert (await engine.generate(params(steps=2), request_id="x" * 128)).final


@pytest.mark.asyncio
async def test_a_checked_request_is_submitted_as_checked():
    model = Synthetic()
    async with om.Engine(model, device="cpu") as engine:
        checked = check_request(model, params(steps=3, seed=4), request_id="c", policy="latest")
        frames = engine.submit(checked)
        with pytest.raises(om.ParamsError, match="already running"):
            engine.submit(checked)
        assert (frames.request_id, frames.total, frames.params) == ("c", 3, checked.params)
        assert [f.step async for f in frames][-1] == 3
    with pytest.raises(om.EngineClosedError) as info:
        engine.submit(checked)
    assert info.value.request_id == "c"


def test_bad_engine_options_raise_params_errors():
    with pytest.raises(om.ParamsError, match="max_batch_size"):
        om.Engine(Synthetic(), device="cpu", max_batch_size=0)
    with pytest.raises(om.ParamsError, match="unknown device"):
        om.Engine(Synthetic(), device="tpu")
    with pytest.raises(om.ParamsError, match="StepModel"):
        om.Engine(object())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_stream_outside_the_context_is_refused():
    engine = om.Engine(Synthetic(), device="cpu")
    with pytest.raises(om.EngineClosedError, match="not started"):
        engine.stream({})
    async with engine:
        pass
    with pytest.raises(om.EngineClosedError, match="shut down"):
        engine.stream({})
    with pytest.raises(om.EngineClosedError):
        engine.check_health()


class _SlowSynthetic(Synthetic):
    """Synthetic whose steps sleep a little, so concurrent requests meet in batches."""

    def step(self, states):
        import time

        time.sleep(0.01)
        return super().step(states)


async def _largest_batch(engine: om.Engine, n: int) -> int:
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(lambda i=i: engine.generate(params(steps=8, seed=i), timeout=20))
    return max(engine.statistics().batch_sizes)


@pytest.mark.asyncio
async def test_max_buffers_does_not_cap_the_batch_on_the_cpu():
    # The CPU device hands frames over without a pool buffer (copy_owned),
    # so a small pool must not shrink its batches.
    async with om.Engine(_SlowSynthetic(), device="cpu", max_batch_size=4, max_buffers=2) as engine:
        assert await _largest_batch(engine, 4) > 2


@pytest.mark.asyncio
async def test_a_cpu_batch_of_outputs_it_cannot_own_grows_the_pool_instead_of_wedging():
    class Declining(om.device.CpuDevice):
        def copy_owned(self, src):
            return None  # every output goes through a pool buffer

    engine = om.Engine(_SlowSynthetic(), device=Declining(), max_batch_size=4, max_buffers=2)
    async with engine:
        assert await _largest_batch(engine, 4) > 2
        assert engine.statistics().buffers_total <= 4


@pytest.mark.asyncio
async def test_max_buffers_still_caps_the_batch_where_frames_go_through_the_pool():
    async with om.Engine(_SlowSynthetic(), device="sim", max_batch_size=4, max_buffers=2) as engine:
        assert await _largest_batch(engine, 4) <= 2


@pytest.mark.asyncio
async def test_a_batch_larger_than_the_pool_cannot_wedge_the_producer():
    async with om.Engine(Synthetic(), device="sim", max_batch_size=4, max_buffers=2) as engine:
        results = []

        async def run(i):
            results.append(await engine.generate(params(steps=5, seed=i), timeout=10))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
        assert len(results) == 4
        assert max(engine.statistics().batch_sizes) <= 2


@pytest.mark.asyncio
async def test_aclose_under_an_outer_cancellation_still_closes_the_engine():
    model = Counting()
    engine = om.Engine(model, device="cpu")
    with anyio.move_on_after(0.2):
        async with engine:
            held = engine.stream(params(steps=10_000))  # noqa: F841
            await anyio.sleep(1)  # cancelled here; aclose runs under cancellation
    assert engine.health().status == "closed"
    assert engine._state is Lifecycle.CLOSED
    assert engine.statistics().buffers_in_use == 0
    assert model.closed == model.started == 1


class _BadTotal(Synthetic):
    def total_steps(self, params):
        return 0


@pytest.mark.asyncio
async def test_an_invalid_total_is_refused_at_submission():
    async with om.Engine(_BadTotal(), device="cpu") as engine:
        with pytest.raises(om.ParamsError, match=r"total_steps\(\).*must be a positive integer, got 0"):
            engine.stream(params())


class _NoEventDevice(om.device.CpuDevice):
    def copy_owned(self, src):
        return None  # take the pool path, where the missing event matters

    def copy_to_host(self, src, dst):
        dst.copy_(src)
        return None  # the copier treats a missing event as complete


@pytest.mark.asyncio
async def test_a_device_without_events_still_delivers_frames():
    async with om.Engine(Synthetic(), device=_NoEventDevice()) as engine:
        frames = [f async for f in engine.stream(params(steps=3))]
    assert len(frames) == 3


@pytest.mark.asyncio
async def test_two_readers_of_one_stream_both_make_progress():
    async with om.Engine(Synthetic(), device="cpu") as engine:
        stream = engine.stream(params(steps=6, hang_at=1, hang_s=0.1))
        got = []

        async def reader():
            try:
                while True:
                    got.append(await stream.__anext__())
            except StopAsyncIteration:
                pass

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                tg.start_soon(reader)
        assert sorted(f.step for f in got) == list(range(1, 7))
