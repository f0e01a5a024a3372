"""``sampler`` per request on the native loops: each name equals ``pipe(...)`` with that scheduler.

The reference is diffusers' own documented switch, ``pipe.scheduler =
Class.from_config(pipe.scheduler.config, **options)``, then ``pipe(...)``
with the same seed; the engine side is one request through the model
interface (tiny random-weight pipelines, as in the other diffusers tests).
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.model import RequestStopped  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers import samplers as table  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from . import test_diffusers_callback as cb  # noqa: E402
from . import test_diffusers_flux as flux  # noqa: E402
from . import test_diffusers_sd3 as sd3  # noqa: E402


def with_sampler(pipe: Any, name: str, entries: tuple[table.Sampler, ...]) -> Any:
    """A copy of ``pipe`` whose scheduler is ``name``'s, switched the way diffusers' docs do."""
    entry = next(s for s in entries if s.name == name)
    cls = getattr(diffusers, entry.scheduler)
    takes = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in entry.options.items() if k in takes}
    switched = copy.copy(pipe)
    switched.scheduler = cls.from_config(pipe.scheduler.config, **options)
    return switched


# -- SD (noise prediction) --------------------------------------------------------------

SD_SAMPLERS = ["euler", "euler_a", "dpmpp_2m_karras", "ddim", "unipc", "heun", "dpmpp_2m_sde", "lms_karras"]


def pndm_pipe() -> Any:
    """The tiny SD pipeline with SD 1.5's own scheduler (PNDM), which no test sampler is."""
    return sd.sd_pipe(diffusers.PNDMScheduler(**sd.SCHEDULE, skip_prk_steps=True))


@pytest.mark.parametrize("name", SD_SAMPLERS)
def test_an_sd_request_with_a_sampler_equals_the_pipeline_with_that_scheduler(name: str) -> None:
    pipe = pndm_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    raw = dict(prompt="a cat", negative_prompt="blur", steps=4, seed=5, height=16, width=24, sampler=name)
    frames = sd.run(model, raw)
    final, per_step = sd.reference(with_sampler(pipe, name, table.NOISE), raw)
    assert len(frames) == len(per_step)  # heun: 2 * steps - 1 evaluations
    assert torch.equal(frames[-1], final)
    # And not what the pipeline's own scheduler gives: the sampler was used.
    default, _ = sd.reference(pipe, raw)
    assert not torch.equal(final, default)


def test_requests_on_different_samplers_step_side_by_side_and_never_batch_together() -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings, max_batch_size=4)
    a = dict(prompt="a cat", steps=3, seed=1, height=16, width=16, sampler="euler_a")
    b = dict(prompt="a dog", steps=3, seed=2, height=16, width=16, sampler="ddim")
    pa, pb = model.validate(a), model.validate(b)
    assert model.batch_key(pa) != model.batch_key(pb)
    # Interleaved one at a time, each equals its solo run (its own scheduler and generator).
    sa, sb = model.start(pa, sd.CPU), model.start(pb, sd.CPU)
    fa, fb = [], []
    for _ in range(3):
        fa.append(model.step([sa])[0])
        fb.append(model.step([sb])[0])
    assert torch.equal(fa[-1], sd.reference(with_sampler(pipe, "euler_a", table.NOISE), a)[0])
    assert torch.equal(fb[-1], sd.reference(with_sampler(pipe, "ddim", table.NOISE), b)[0])


def test_an_unknown_sampler_is_a_params_error_listing_the_known_ones() -> None:
    model = Diffusers(pndm_pipe(), encode_prompt=sd.fixed_embeddings)
    with pytest.raises(om.ParamsError) as info:
        model.validate({"sampler": "dpm_fast"})
    assert info.value.field == "sampler"
    assert "euler_a" in info.value.message and "dpmpp_2m_karras" in info.value.message
    (row,) = [r for r in om.params.describe(model.params) if r["name"] == "sampler"]
    assert row["default"] == "default" and {"euler", "ddim", "unipc", "lcm"} <= set(row["choices"])
    assert "PNDMScheduler" in row["help"]


def test_eta_is_for_the_samplers_that_take_it() -> None:
    model = Diffusers(pndm_pipe(), encode_prompt=sd.fixed_embeddings)
    assert model.validate({"sampler": "ddim", "eta": 0.5})["eta"] == 0.5
    assert model.validate({"sampler": "euler", "eta": 0.0})["sampler"] == "euler"
    with pytest.raises(om.ParamsError) as info:
        model.validate({"sampler": "euler", "eta": 0.5})
    assert info.value.field == "eta" and "ddim" in info.value.message


def test_the_default_sampler_is_the_pipelines_own_scheduler_unchanged() -> None:
    pipe = pndm_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    raw = dict(prompt="a cat", steps=3, seed=4, height=16, width=16)
    assert torch.equal(sd.run(model, raw)[-1], sd.reference(pipe, raw)[0])
    assert type(pipe.scheduler).__name__ == "PNDMScheduler"  # never switched on the pipeline


def test_a_sampler_needing_a_missing_package_is_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def without_scipy(name: str, *args: Any) -> Any:
        if name == "scipy":
            raise ImportError("no scipy here")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_scipy)
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    assert "lms" not in model.sampler_names and "euler" in model.sampler_names


@pytest.fixture
def no_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    """scipy unimportable, as on a fresh machine: ``import scipy`` raises ImportError."""
    monkeypatch.setitem(sys.modules, "scipy", None)


def assert_names_what_installs_it(error: om.ParamsError, sampler: str, package: str, command: str) -> None:
    assert error.field == "sampler"
    assert f"{sampler!r} needs {package}, which is not installed here" in error.message, error.message
    assert f"{command} installs it" in error.message, error.message


# A fresh clone's `pip install -e ".[...,diffusers]"` had no scipy, and a request for lms got the
# choices list without lms in it (a 422 that never said why; issue #34).
@pytest.mark.parametrize("name", ["lms", "lms_karras"])
def test_a_sampler_whose_package_is_missing_is_refused_naming_the_package_and_the_extra(
    no_scipy: None, name: str
) -> None:
    model = Diffusers(pndm_pipe(), encode_prompt=sd.fixed_embeddings)
    assert name not in model.sampler_names
    with pytest.raises(om.ParamsError) as info:
        model.validate({"prompt": "a cat", "sampler": name})
    assert_names_what_installs_it(info.value, name, "scipy", 'pip install "omni-stream[diffusers]"')
    with pytest.raises(om.ParamsError) as unknown:  # a name no table has still gets the list
        model.validate({"sampler": "dpm_fast"})
    assert "needs" not in unknown.value.message and "euler_a" in unknown.value.message


def test_a_package_no_extra_declares_is_named_with_its_own_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchsde", None)
    model = Diffusers(pndm_pipe(), encode_prompt=sd.fixed_embeddings)
    with pytest.raises(om.ParamsError) as info:
        model.validate({"sampler": "dpmpp_sde_karras"})
    assert_names_what_installs_it(info.value, "dpmpp_sde_karras", "torchsde", "pip install torchsde")


@pytest.mark.asyncio
async def test_lms_without_scipy_is_refused_over_the_engine_and_the_http_door(no_scipy: None) -> None:
    import httpx

    from ..conftest import one_torch_thread, running

    model = Diffusers(pndm_pipe(), encode_prompt=sd.fixed_embeddings)
    raw = {"prompt": "a cat", "steps": 2, "height": 16, "width": 16, "sampler": "lms"}
    async with om.Engine(model, device="cpu") as engine:
        with pytest.raises(om.ParamsError) as info:
            await engine.generate(raw)
    assert_names_what_installs_it(info.value, "lms", "scipy", 'pip install "omni-stream[diffusers]"')
    with one_torch_thread():
        async with running(model) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
            refused = await http.post("/v1/generations", json={"params": raw})
    assert refused.status_code == 422
    body = refused.json()
    assert (body["error"], body["field"]) == ("bad_params", "sampler")
    assert "'lms' needs scipy" in body["message"] and "omni-stream[diffusers]" in body["message"], body


# -- SD3 and Flux (flow matching) -------------------------------------------------------


@pytest.mark.parametrize("name", ["euler", "euler_karras", "heun"])
def test_an_sd3_request_with_a_flow_sampler_equals_the_pipeline(name: str) -> None:
    pipe = sd3.sd3_pipe()
    model = Diffusers(pipe, encode_prompt=sd3.fixed_embeddings)
    assert name in model.sampler_names
    raw = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=5, height=16, width=24, sampler=name)
    _, latents = sd3.run(model, raw)
    want = sd3.reference(with_sampler(pipe, name, table.FLOW), raw)
    assert torch.equal(latents[-1], want[-1])


@pytest.mark.parametrize("name", ["euler", "euler_karras"])
def test_a_flux_request_with_a_flow_sampler_equals_the_pipeline(name: str) -> None:
    pipe = flux.flux_pipe()
    model = Diffusers(pipe, encode_prompt=flux.fixed_embeddings)
    raw = dict(prompt="a cat", steps=3, seed=5, height=16, width=32, sampler=name)
    _, latents = flux.run(model, raw)
    want = flux.reference(with_sampler(pipe, name, table.FLOW), raw)
    assert torch.equal(latents[-1], want[-1])


def test_flux_offers_only_the_flow_samplers_its_timesteps_fit() -> None:
    model = Diffusers(flux.flux_pipe(), encode_prompt=flux.fixed_embeddings)
    # FlowMatchHeun's set_timesteps takes no sigmas or mu, which FluxPipeline passes.
    assert "heun" not in model.sampler_names
    assert {"default", "euler", "euler_karras"} <= set(model.sampler_names)
    assert not set(model.sampler_names) & {"ddim", "euler_a", "dpmpp_2m"}


# -- callback mode: the pipeline's own call, with the request's scheduler ----------------


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cb.make_text_encoder(tmp_path_factory.mktemp("clip"))


@pytest.mark.parametrize("name", ["euler_a", "dpmpp_2m_karras", "heun"])
def test_a_callback_mode_request_runs_the_pipeline_with_its_samplers_scheduler(text_encoder: Any, name: str) -> None:
    pipe = cb.img2img_pipe(text_encoder)  # DDIM of its own
    model = Diffusers(pipe, mode="callback")
    assert name in model.sampler_names
    image = cb.picture()
    raw = dict(cb.IMG2IMG, image=cb.data_url(image), sampler=name)
    got = cb.run_direct(model, raw, output="latent")
    own = pipe.scheduler
    expected, seen = cb.img2img_reference(with_sampler(pipe, name, table.NOISE), cb.IMG2IMG, image, "latent")
    assert pipe.scheduler is own, "the pipeline's own scheduler is put back after the call"
    assert model.total_steps(model.validate(raw)) == len(seen) == len(got.frames)
    assert torch.equal(got.frames[-1], expected.images[0])
    # The default is the pipeline's DDIM, which gives another picture.
    plain, _ = cb.img2img_reference(pipe, cb.IMG2IMG, image, "latent")
    assert not torch.equal(plain.images[0], expected.images[0])


def test_a_callback_mode_request_that_fails_still_gives_the_pipeline_its_scheduler_back(text_encoder: Any) -> None:
    pipe = cb.img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    own = pipe.scheduler
    raw = dict(cb.IMG2IMG, image=cb.data_url(cb.picture()), sampler="euler")
    with pytest.raises(RequestStopped):
        cb.run_direct(model, raw, emit=cb.Recorder(stop_after=1))
    assert pipe.scheduler is own


def test_a_request_counted_while_another_runs_its_sampler_is_counted_with_its_own(text_encoder: Any) -> None:
    # While run() has a Heun request's scheduler on the pipeline, a default request checked
    # on the event loop was counted with Heun (2 * steps - 1) and then failed when it ran
    # (the review of issue #20's first part).
    model = Diffusers(cb.img2img_pipe(text_encoder), mode="callback")
    plain = dict(cb.IMG2IMG, image=cb.data_url(cb.picture()), steps=10, strength=1.0)
    idle = model.total_steps(model.validate(plain))
    seen: list[int] = []

    def emit(frame: torch.Tensor, *, decoded: bool = False) -> None:
        if not seen:
            seen.append(model.total_steps(model.validate(plain)))  # what the event loop does meanwhile

    params = model.validate(dict(plain, sampler="heun"))
    params["output"] = "latent"
    state = model.start(params, sd.CPU)
    model.run(state, emit)
    model.close(state)
    assert seen == [idle] == [10]
    assert state.total == 19  # the Heun request's own count


def test_a_callback_mode_request_for_a_sampler_whose_package_is_missing_names_it(
    text_encoder: Any, no_scipy: None
) -> None:
    model = Diffusers(cb.img2img_pipe(text_encoder), mode="callback")
    assert "lms" not in model.sampler_names and "euler" in model.sampler_names
    with pytest.raises(om.ParamsError) as info:
        model.validate(dict(cb.IMG2IMG, image=cb.data_url(cb.picture()), sampler="lms"))
    assert_names_what_installs_it(info.value, "lms", "scipy", 'pip install "omni-stream[diffusers]"')
