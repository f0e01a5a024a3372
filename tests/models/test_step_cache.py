"""Step caching per request in the native Flux and SD3 loops (issue #35): First-Block Cache.

A request alone equals diffusers' own First-Block Cache hooks bit for bit; a
request with ``none`` (or threshold 0) equals today's loop bit for bit;
batched beside an uncached request and one of another threshold, each
request makes its own decisions and equals its solo run within the native
loops' batching tolerance; a failed step and a snapshot keep the cache.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import FirstBlockCacheConfig, SD3Transformer2DModel  # noqa: E402

from omni_stream.errors import ParamsError  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402

from . import test_diffusers_flux as flux  # noqa: E402
from .test_diffusers import fixed_embeddings as sd_embeddings  # noqa: E402
from .test_diffusers import sd_pipe  # noqa: E402
from . import test_diffusers_sd3 as sd3  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

CPU = torch.device("cpu")
FLUX = dict(prompt="a cat", steps=8, seed=3, height=16, width=16)
SD3 = dict(prompt="a cat", negative_prompt="blur", steps=8, seed=3, height=16, width=16, guidance_scale=5.0)


def fbc(threshold: float) -> dict[str, Any]:
    return {"method": "fbcache", "threshold": threshold}


def flux_model(**options: Any) -> Any:
    return Diffusers(flux.flux_pipe(), encode_prompt=flux.fixed_embeddings, **options)


def sd3_transformer() -> SD3Transformer2DModel:
    # Three blocks: First-Block Cache needs a head, blocks between, a tail.
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=sd3.CHANNELS, out_channels=sd3.CHANNELS, num_layers=3,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=sd3.EMBED_DIM,
        caption_projection_dim=16, pooled_projection_dim=sd3.POOLED_DIM, pos_embed_max_size=16,
    )


def sd3_model(**options: Any) -> Any:
    pipe = sd3.sd3_pipe()
    pipe.transformer = sd3_transformer()
    return Diffusers(pipe, encode_prompt=sd3.fixed_embeddings, **options)


def solo(model: Any, raw: dict[str, Any]) -> tuple[list[torch.Tensor], Any]:
    """One request alone: its frames, and its cache state at the end."""
    state = model.start(model.validate(raw), CPU)
    frames = [model.step([state])[0] for _ in range(state.total)]
    return frames, state.cache


@pytest.mark.parametrize("threshold", [0.05, 0.3, 1.0])
def test_a_lone_flux_request_equals_diffusers_first_block_cache_bit_for_bit(threshold: float) -> None:
    frames, cache = solo(flux_model(), dict(FLUX, cache=fbc(threshold)))
    pipe = flux.flux_pipe()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    want = pipe(**flux.pipe_kwargs(FLUX), output_type="latent").images
    height, width = FLUX["height"], FLUX["width"]
    unpacked = pipe._unpack_latents(want, height, width, pipe.vae_scale_factor)[0]
    assert torch.equal(frames[-1], unpacked)
    assert cache.computed + cache.cached == FLUX["steps"]
    if threshold >= 0.3:
        assert cache.cached > 0  # it did skip: the equality is not only today's loop's


@pytest.mark.parametrize("make, raw", [(flux_model, FLUX), (sd3_model, SD3)], ids=["flux", "sd3"])
def test_none_and_threshold_zero_give_todays_frames_bit_for_bit(make: Any, raw: dict[str, Any]) -> None:
    model = make()
    today = solo(model, raw)[0]
    for cache in ({"method": "none"}, fbc(0.0)):
        frames, state = solo(model, dict(raw, cache=cache))
        assert all(torch.equal(a, b) for a, b in zip(frames, today, strict=True))
    assert state.cached == 0 and state.computed == raw["steps"]
    # And caching at a threshold does skip steps there (SD3: diffusers' own hooks cannot run
    # its last block, which returns no text states, so only these checks stand for it).
    assert solo(model, dict(raw, cache=fbc(1.0)))[1].cached > 0


@pytest.mark.parametrize("make, raw", [(flux_model, FLUX), (sd3_model, SD3)], ids=["flux", "sd3"])
def test_batched_requests_decide_alone_and_match_their_solo_runs(make: Any, raw: dict[str, Any]) -> None:
    model = make(max_batch_size=4)
    kinds = [None, fbc(0.3), fbc(1.0)]
    wanted = [dict(raw, seed=i, **({} if c is None else {"cache": c})) for i, c in enumerate(kinds)]
    alone = [solo(model, r) for r in wanted]
    states = [model.start(model.validate(r), CPU) for r in wanted]
    frames: list[list[torch.Tensor]] = [[] for _ in states]
    rows = []
    handle = model._denoiser.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        for _ in range(states[0].total):
            for i, frame in enumerate(model.step(states)):
                frames[i].append(frame)
    finally:
        handle.remove()
    assert len(rows) == raw["steps"]  # one call a step for the three: batched
    for (want, want_cache), got, state in zip(alone, frames, states, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if want_cache is not None:  # the same decisions as alone
            assert (state.cache.computed, state.cache.cached) == (want_cache.computed, want_cache.cached)
    assert states[0].cache is None and states[2].cache.cached > states[1].cache.cached


def fail_one_step(model: Any, state: Any) -> None:
    """A step of ``state`` that fails after the transformer ran: undone, its cache included."""
    real_step = state.scheduler.step

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        state.scheduler.step = real_step
        raise RuntimeError("simulated")

    state.scheduler.step = fail_once
    with pytest.raises(RuntimeError, match="simulated"):
        model.step([state])
    vars(state.scheduler).pop("step")  # (the rollback put the stand-in back: the class's again)


def test_a_failed_step_and_a_snapshot_keep_the_cache() -> None:
    model = flux_model(max_batch_size=4)
    raw = dict(FLUX, cache=fbc(0.3))
    want, _ = solo(model, raw)
    state = model.start(model.validate(raw), CPU)
    got = [model.step([state])[0] for _ in range(3)]
    fail_one_step(model, state)
    # Snapshot, restore into a new state, go on: the uninterrupted run's frames.
    resumed = model.restore(model.snapshot(state), CPU)
    assert (resumed.cache.computed, resumed.cache.cached) == (state.cache.computed, state.cache.cached)
    got += [model.step([resumed])[0] for _ in range(resumed.total - resumed.done)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_cache_param_is_checked_and_listed() -> None:
    model = flux_model()
    checked = model.validate(dict(FLUX, cache={"method": "fbcache"}))
    knobs = {"threshold": 0.05, "rel_l1": 0.4, "interval": 5, "warmup": 3, "order": 1, "results": True}
    assert checked["cache"] == {"method": "fbcache", **knobs}
    assert model.validate(FLUX)["cache"] == {"method": "none", **knobs}
    for bad, field in [({"method": "magcache"}, "cache.method"), ({"threshold": -1}, "cache.threshold"),
                       ({"interval": 0}, "cache.interval"), ({"order": 4}, "cache.order"),
                       ({"ratio": 1}, "cache.ratio"), ("fbcache", "cache")]:
        with pytest.raises(ParamsError) as info:
            model.validate(dict(FLUX, cache=bad))
        assert info.value.field == field
    from omni_stream.params import describe

    row = next(r for r in describe(model.params) if r["name"] == "cache")
    assert [f["name"] for f in row["fields"]] == [
        "method", "threshold", "rel_l1", "interval", "warmup", "order", "results"
    ]
    assert row["fields"][0]["choices"] == ["none", "fbcache", "teacache", "taylorseer"]


def test_a_unet_model_says_why_it_cannot_cache() -> None:
    model = Diffusers(sd_pipe(), encode_prompt=sd_embeddings)
    with pytest.raises(ParamsError, match="UNet has no transformer blocks") as info:
        model.validate({"prompt": "a", "cache": {"method": "fbcache"}})
    assert info.value.field == "cache.method"


def test_serve_cache_sets_the_default_of_the_models_that_can_cache() -> None:
    from omni_stream.cli.console import UsageError
    from omni_stream.cli.loader import ModelLoader

    model = flux_model()
    ModelLoader.of("flux", cache={"method": "fbcache", "threshold": 0.2})._default_cache(
        model, {"method": "fbcache", "threshold": 0.2}
    )
    assert model.validate(FLUX)["cache"]["threshold"] == 0.2
    assert model.validate(dict(FLUX, cache={"method": "none"}))["cache"]["method"] == "none"  # its own wins
    # The only model, or a bad value: an error naming why; one of several: passed over.
    unet = Diffusers(sd_pipe(), encode_prompt=sd_embeddings)
    with pytest.raises(UsageError, match="--cache: .*'cache.method' must be one of none"):
        ModelLoader.of("sd")._default_cache(unet, {"method": "fbcache"})
    ModelLoader.of("sd", cache_required=False)._default_cache(unet, {"method": "fbcache"})
    assert unet.validate({})["cache"]["method"] == "none"
    with pytest.raises(UsageError, match="cache.threshold"):
        ModelLoader.of("flux")._default_cache(flux_model(), {"method": "fbcache", "threshold": -1})


def test_metrics_count_each_models_computed_and_reused_steps() -> None:
    from omni_stream.core.metrics import ServerMetrics

    model = flux_model()
    solo(model, dict(FLUX, cache=fbc(1.0)))
    solo(model, FLUX)  # no cache: not counted
    totals = dict(model.step_cache_totals)
    assert totals["computed"] + totals["cached"] == FLUX["steps"] and totals["cached"] > 0

    import omni_stream as om

    metrics = ServerMetrics(om.Engine(model, device="cpu"), running=lambda: 0, models=("flux",))
    metrics.watch_models({"flux": model})
    text = metrics.render().decode()
    for outcome in ("computed", "cached"):
        line = f'omni_stream_step_cache_steps_total{{model="flux",outcome="{outcome}"}} {float(totals[outcome])}'
        assert line in text


@pytest.mark.asyncio
@pytest.mark.one_loop  # what each step says, the same under every loop
async def test_each_step_says_whether_it_reused_the_cache() -> None:
    """A reused step still yields its frame; the frame's StepTimings.cached says so (every frame,
    from the engine), and so does its ``progress`` over the websocket (latest-wins: the ones
    that reach a client)."""
    import json

    from websockets.asyncio.client import connect

    import omni_stream as om

    from ..conftest import running

    params = dict(FLUX, cache=fbc(1.0))
    model = flux_model()
    async with om.Engine(model, device="cpu") as engine:
        frames = [f async for f in engine.stream(params)]
    assert [f.step for f in frames] == list(range(1, FLUX["steps"] + 1))  # every step, reused or not
    flags = [f.timings.cached for f in frames]
    assert sum(flags) == model.step_cache_totals["cached"] > 0 and not flags[0]  # the first computes
    async with running(flux_model()) as server, connect(server.url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "c", "params": params, "preview": {"format": "raw"}}))
        said = {}
        while True:
            raw = await ws.recv()
            msg = {} if isinstance(raw, bytes) else json.loads(raw)
            if msg.get("type") == "progress":
                said[msg["step"]] = msg.get("cached", False)
            if msg.get("type") in ("done", "error", "cancelled"):
                assert msg["type"] == "done", msg
                break
        # The OpenAI SDK's partial images say it too (ours, beside OpenAI's fields: present when true).
        openai = pytest.importorskip("openai")
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
        stream = await client.images.generate(
            prompt="a cat", size="16x16", stream=True, partial_images=3,
            extra_body={k: v for k, v in params.items() if k not in ("prompt", "height", "width")},
        )
        partials = [e for e in [event async for event in stream] if e.type.endswith("partial_image")]
    assert any(said.values()) and all(flag == flags[step - 1] for step, flag in said.items())
    assert partials and any((e.model_extra or {}).get("cached") for e in partials)
