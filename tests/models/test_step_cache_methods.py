"""TaylorSeer and TeaCache per request in the native Flux and SD3 loops (issue #35).

TaylorSeer alone equals diffusers' own ``TaylorSeerCacheConfig`` hooks bit for
bit on Flux and SD3; TeaCache alone decides by the authors' rule (computed
here from the first block's modulated inputs) and at ``rel_l1`` 0 gives
today's frames bit for bit; requests of every method batched together keep
their solo decisions and frames; a failed step and a snapshot keep each
method's state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import TaylorSeerCacheConfig  # noqa: E402
from diffusers.hooks.hooks import CacheContext, _set_cache_context  # noqa: E402
from diffusers.hooks.taylorseer_cache import apply_taylorseer_cache  # noqa: E402

from omni_stream.errors import ParamsError  # noqa: E402
from omni_stream.models.diffusers.teacache import rescaled  # noqa: E402

from . import test_diffusers_flux as flux  # noqa: E402
from . import test_diffusers_sd3 as sd3  # noqa: E402
from .test_step_cache import (  # noqa: E402
    CPU, FLUX, SD3, fail_one_step, fbc, flux_model, sd3_model, sd3_transformer, solo,
)

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

TAYLOR = {"method": "taylorseer"}  # diffusers' defaults: interval 5, warmup 3, order 1


def tea(rel_l1: float) -> dict[str, Any]:
    return {"method": "teacache", "rel_l1": rel_l1}


@pytest.mark.parametrize("knobs", [{}, {"interval": 2, "warmup": 1, "order": 2}], ids=["defaults", "order2"])
def test_a_lone_flux_request_equals_diffusers_taylorseer_bit_for_bit(knobs: dict[str, int]) -> None:
    frames, cache = solo(flux_model(), dict(FLUX, cache=dict(TAYLOR, **knobs)))
    pipe = flux.flux_pipe()
    config = {"interval": "cache_interval", "warmup": "disable_cache_before_step", "order": "max_order"}
    pipe.transformer.enable_cache(TaylorSeerCacheConfig(**{config[k]: v for k, v in knobs.items()}))
    want = pipe(**flux.pipe_kwargs(FLUX), output_type="latent").images
    unpacked = pipe._unpack_latents(want, FLUX["height"], FLUX["width"], pipe.vae_scale_factor)[0]
    assert torch.equal(frames[-1], unpacked)
    assert cache.cached > 0 and cache.computed + cache.cached == FLUX["steps"]


def test_a_lone_sd3_request_equals_diffusers_taylorseer_bit_for_bit() -> None:
    frames, cache = solo(sd3_model(), dict(SD3, cache=TAYLOR))
    pipe = sd3.sd3_pipe()
    pipe.transformer = sd3_transformer()
    # SD3's transformer has no enable_cache and its pipeline sets no cache context (Flux's
    # both): diffusers' own functions, one context around the run, its calls in order.
    apply_taylorseer_cache(pipe.transformer, TaylorSeerCacheConfig())
    _set_cache_context(pipe.transformer, CacheContext("cond"))
    want = pipe(**sd3.pipe_kwargs(SD3), output_type="latent").images
    assert torch.equal(frames[-1], want[0])
    assert cache.cached > 0


def test_teacache_decides_by_the_authors_rule_and_at_zero_gives_todays_frames() -> None:
    model = flux_model()
    today = solo(model, FLUX)[0]
    frames, state = solo(model, dict(FLUX, cache=tea(0.0)))
    assert all(torch.equal(a, b) for a, b in zip(frames, today, strict=True)) and state.cached == 0
    # The rule, recomputed here from the modulated inputs the run saw, step by step.
    from omni_stream.models.diffusers.teacache import TeaCacheState

    seen: list[tuple[torch.Tensor, bool]] = []
    original = TeaCacheState.decide

    def spy(self: Any, head: Any) -> bool:
        seen.append((head.modulated().clone(), original(self, head)))
        return seen[-1][1]

    TeaCacheState.decide = spy  # type: ignore[method-assign]
    try:
        # 1.5 times a typical step's rescaled change: steps reuse and compute in turn.
        _, probe = solo(model, dict(FLUX, cache=tea(10.0)))
        changes = [rescaled(((b - a).abs().mean() / a.abs().mean()).item()) for (a, _), (b, _) in zip(seen, seen[1:])]
        rel_l1 = 1.5 * sorted(changes)[len(changes) // 2]
        seen.clear()
        _, state = solo(model, dict(FLUX, cache=tea(rel_l1)))
    finally:
        TeaCacheState.decide = original  # type: ignore[method-assign]
    total, accumulated, want = FLUX["steps"], 0.0, [True]
    for step in range(1, total):
        previous, current = seen[step - 1][0], seen[step][0]
        accumulated += rescaled(((current - previous).abs().mean() / previous.abs().mean()).item())
        compute = step == total - 1 or accumulated >= rel_l1
        want.append(compute)
        if compute:
            accumulated = 0.0
    assert [decided for _, decided in seen] == want
    assert want.count(False) >= 2 and want.count(True) >= 3  # both, more than once
    assert (state.computed, state.cached) == (want.count(True), want.count(False))


def test_sd3_refuses_teacache_saying_why() -> None:
    with pytest.raises(ParamsError, match="fitted for Flux only") as info:
        sd3_model().validate(dict(SD3, cache=tea(0.4)))
    assert info.value.field == "cache.method"


@pytest.mark.parametrize("make, raw", [(flux_model, FLUX), (sd3_model, SD3)], ids=["flux", "sd3"])
def test_every_method_batched_together_keeps_its_solo_decisions_and_frames(make: Any, raw: dict[str, Any]) -> None:
    model = make(max_batch_size=8)
    kinds: list[dict[str, Any] | None] = [None, fbc(1.0), TAYLOR, dict(TAYLOR, interval=2, warmup=1)]
    if raw is FLUX:
        kinds.append(tea(1.0))
    wanted = [dict(raw, seed=i, **({} if c is None else {"cache": c})) for i, c in enumerate(kinds)]
    alone = [solo(model, r) for r in wanted]
    states = [model.start(model.validate(r), CPU) for r in wanted]
    frames: list[list[torch.Tensor]] = [[] for _ in states]
    calls = []
    handle = model._denoiser.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for _ in range(states[0].total):
            for i, frame in enumerate(model.step(states)):
                frames[i].append(frame)
    finally:
        handle.remove()
    assert len(calls) == raw["steps"]  # one call a step for all of them: batched
    for (want, want_cache), got, state in zip(alone, frames, states, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if want_cache is not None:
            assert (state.cache.computed, state.cache.cached) == (want_cache.computed, want_cache.cached)
            assert state.cache.cached > 0


@pytest.mark.parametrize("cache", [TAYLOR, tea(1.0)], ids=["taylorseer", "teacache"])
def test_a_failed_step_and_a_snapshot_keep_taylorseer_and_teacache(cache: dict[str, Any]) -> None:
    model = flux_model(max_batch_size=4)
    raw = dict(FLUX, cache=cache)
    want, want_cache = solo(model, raw)
    state = model.start(model.validate(raw), CPU)
    got = [model.step([state])[0] for _ in range(4)]
    fail_one_step(model, state)
    from omni_stream.checkpoint import Checkpoint

    # Through its bytes, as a pause to the host and a restart's state dir keep it.
    resumed = model.restore(Checkpoint.from_bytes(model.snapshot(state).to_bytes()), CPU)
    assert type(resumed.cache) is type(state.cache)
    got += [model.step([resumed])[0] for _ in range(resumed.total - resumed.done)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert (resumed.cache.computed, resumed.cache.cached) == (want_cache.computed, want_cache.cached)


def test_serve_cache_names_each_methods_knobs() -> None:
    import argparse

    from omni_stream.cli.parser import _cache_spec

    assert _cache_spec("teacache:0.6") == {"method": "teacache", "rel_l1": 0.6}
    assert _cache_spec("fbcache:0.2") == {"method": "fbcache", "threshold": 0.2}
    assert _cache_spec("taylorseer:interval=4,order=2") == {"method": "taylorseer", "interval": 4, "order": 2}
    for bad, says in [("taylorseer:3", "name its knobs"), ("fbcache:x", "not a number"), ("teacache:rel_l1", "not")]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            _cache_spec(bad)
    # The model checks what the knobs mean: a default the model cannot take is refused by name.
    from omni_stream.cli.console import UsageError
    from omni_stream.cli.loader import ModelLoader

    with pytest.raises(UsageError, match="cache.interval"):
        ModelLoader.of("flux")._default_cache(flux_model(), {"method": "taylorseer", "interval": 0})
    model = sd3_model()
    with pytest.raises(UsageError, match="fitted for Flux only"):
        ModelLoader.of("sd3")._default_cache(model, _cache_spec("teacache:0.4"))


@pytest.mark.parametrize("cache", [fbc(0.5), tea(0.6), TAYLOR, dict(TAYLOR, order=2)], ids=lambda c: str(c))
def test_the_memory_a_requests_cache_holds_is_what_the_model_declares(cache: dict[str, Any]) -> None:
    """The server's memory bound counts a caching request's state (model.ModelMemory): the
    model's estimate equals the bytes the state holds at its fullest."""
    from omni_stream.model import model_memory

    model = flux_model()
    params = model.validate(dict(FLUX, cache=cache))
    state = model.start(params, CPU)
    model.text_tokens = state.conditioning.embeds.shape[1]  # the tiny encoder's, not Flux.1's 512
    peak = 0
    for _ in range(state.total):
        model.step([state])
        peak = max(peak, sum(t.nbytes for t in state.cache.tensors().values()))
    assert model_memory(model) is not None
    assert model.request_memory_bytes(params) == peak > 0
    assert model.request_memory_bytes(model.validate(FLUX)) == 0  # no cache: nothing more


def test_a_split_call_makes_its_row_indexes_on_the_device_once_a_call() -> None:
    """On CUDA a host tensor copied to the device is a synchronous copy, a stall of every call
    the caches split: the row indexes are made on the device (and once a call per layout)."""
    model = flux_model(max_batch_size=4)
    raws = [dict(FLUX, seed=i, cache=c) for i, c in enumerate([fbc(1.0), TAYLOR, {"method": "none"}])]
    states = [model.start(model.validate(r), CPU) for r in raws]
    moved, made = [], []
    real_to, real_arange = torch.Tensor.to, torch.arange

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.dtype == torch.int64:
            moved.append(args)
        return real_to(self, *args, **kwargs)

    def arange(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("device"))
        return real_arange(*args, **kwargs)

    torch.Tensor.to, torch.arange = to, arange  # type: ignore[method-assign, assignment]
    try:
        for _ in range(states[0].total):
            model.step(states)
    finally:
        torch.Tensor.to, torch.arange = real_to, real_arange  # type: ignore[method-assign]
    assert states[0].cache.cached and states[1].cache.cached  # both caches split calls
    assert not moved and made and all(device is not None for device in made)
