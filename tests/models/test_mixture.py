"""Mixture: the exact posterior, convergence of its samplers, and bitwise batching.

The mathematics is checked against an independent float64 reference (plain
squared distances and a log-sum-exp), and the batching guarantee with
``torch.equal`` over many batch compositions, positions, join times, thread
counts and the code paths that the exactness argument says must agree.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import omni_stream as om
from omni_stream.errors import ParamsError
from omni_stream.models import images, mixture, samplers
from omni_stream.models.mixture import Mixture
from omni_stream.preview.decode import decode_rgb

from ..conftest import gpu_torch_device

CPU = torch.device("cpu")
K = len(images.COMPONENTS)


@pytest.fixture(scope="module")
def model() -> Mixture:
    return Mixture()


def run(model: Mixture, **raw: Any) -> list[torch.Tensor]:
    """Every frame of one request run alone."""
    params = model.validate(raw)
    state = model.start(params, CPU)
    frames = [model.step([state])[0].clone() for _ in range(model.total_steps(params))]
    model.close(state)
    return frames


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).mean().sqrt())


def mus(size: int) -> torch.Tensor:
    return images.render_all(size).reshape(K, -1).double()


def index(name: str) -> int:
    return next(i for i, c in enumerate(images.COMPONENTS) if c.name == name)


# ---- params -----------------------------------------------------------------


def test_defaults_and_declared_params(model: Mixture) -> None:
    params = model.validate(None)
    assert 0 <= params["seed"] < 2**32  # drawn (tests/test_params.py)
    assert params == {
        "prompt": "", "seed": params["seed"], "num_images": 1, "steps": 30, "size": 256, "sampler": "ddim",
        "eta": None, "guidance": 1.0, "spread": 0.05,
    }
    assert model.total_steps(params) == 30
    assert Mixture.preview_decoder == "rgb"
    assert model.name == "mixture"
    assert "exact diffusion sampler" in model.describe()


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"size": 31}, "size"),
        ({"size": 2049}, "size"),
        ({"size": 64.5}, "size"),
        ({"steps": 0}, "steps"),
        ({"steps": 10_001}, "steps"),
        ({"sampler": "plms"}, "sampler"),
        ({"prompt": "red bicycle"}, "prompt"),
        ({"prompt": "the"}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"guidance": 20.5}, "guidance"),
        ({"guidance": -1}, "guidance"),
        ({"spread": 1.5}, "spread"),
        ({"eta": 2.0}, "eta"),
        ({"sampler": "dpmpp_2m", "eta": 0.5}, "eta"),
        ({"seed": -2}, "seed"),
        ({"num_images": 0}, "num_images"),
        ({"num_images": 5}, "num_images"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_params_name_the_field(model: Mixture, raw: dict, field: str) -> None:
    with pytest.raises(ParamsError) as info:
        model.validate(raw)
    assert info.value.field == field


def test_unknown_prompt_word_lists_the_known_words(model: Mixture) -> None:
    with pytest.raises(ParamsError) as info:
        model.validate({"prompt": "purple elephant"})
    message = str(info.value)
    assert "'elephant'" in message
    assert all(word in message for word in ("circle", "square", "stripes", "gradient"))


def test_batch_key_only_separates_sizes(model: Mixture) -> None:
    a = model.validate({"size": 64, "prompt": "red", "sampler": "euler_a", "steps": 5})
    b = model.validate({"size": 64, "prompt": "stripes", "sampler": "dpmpp_2m", "steps": 50})
    c = model.validate({"size": 96})
    assert model.batch_key(a) == model.batch_key(b) != model.batch_key(c)


# ---- frames -----------------------------------------------------------------


def test_frames_are_rgb_images_in_range(model: Mixture) -> None:
    frames = run(model, size=40, steps=4, seed=3)
    assert len(frames) == 4
    for f in frames:
        assert f.shape == (3, 40, 40) and f.dtype == torch.float32
        assert f.min() >= -1.0 and f.max() <= 1.0


def test_returned_frames_are_never_written_again(model: Mixture) -> None:
    # The engine copies a frame while later steps compute (model.py's rule).
    params = model.validate({"size": 32, "steps": 6, "seed": 1, "sampler": "euler_a"})
    state = model.start(params, CPU)
    kept = [(f, f.clone()) for f in (model.step([state])[0] for _ in range(6))]
    for f, copy in kept:
        assert torch.equal(f, copy)


def test_step_rejects_finished_and_mixed_size_states(model: Mixture) -> None:
    small = model.start(model.validate({"size": 32, "steps": 1}), CPU)
    other = model.start(model.validate({"size": 48, "steps": 1}), CPU)
    with pytest.raises(ValueError, match="different sizes"):
        model.step([small, other])
    model.step([small])
    with pytest.raises(ValueError, match="finished"):
        model.step([small])


# ---- the posterior ----------------------------------------------------------


def reference_x0(
    x: torch.Tensor, sigma: float, spread: float, log_w: torch.Tensor, guidance: float, size: int,
    m: torch.Tensor | None = None, log_all: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E[x0 | x] in float64 from plain squared distances; also the weights r.

    ``m`` are the components (default: COMPONENTS at ``size``), ``log_all``
    the unconditional model's log weights over them (default: all equal).
    """
    m = mus(size) if m is None else m.double()
    a = 1 / math.sqrt(1 + sigma**2)
    s = sigma * a
    v = a * a * spread * spread + s * s
    log_lik = -((x.double() - a * m) ** 2).sum(1) / (2 * v)
    r_all = torch.softmax(log_lik if log_all is None else log_lik + log_all, 0)
    r_prompt = torch.softmax(log_lik + log_w, 0)
    r = r_all + guidance * (r_prompt - r_all)
    per_component = m + (a * spread * spread / v) * (x.double() - a * m)
    return (r[:, None] * per_component).sum(0), r


def predict(model: Mixture, x: torch.Tensor, sigma: float, **raw: Any) -> torch.Tensor:
    """The model's x0 prediction for state ``x`` at noise level ``sigma``."""
    state = model.start(model.validate(raw), CPU)
    state.x = x.float()
    state.sigmas = [sigma, 0.0]
    model.step([state])
    assert state.x0_prev is not None
    return state.x0_prev


@pytest.mark.parametrize(
    "sigma, spread, prompt, guidance",
    [
        (1.5, 0.05, "", 1.0),
        (3.0, 0.2, "", 1.0),
        (6.0, 0.0, "red circle", 1.0),
        (2.0, 0.1, "stripes", 3.0),
        (2.0, 0.1, "stripes", 0.0),
    ],
)
def test_x0_prediction_is_the_exact_posterior_mean(
    model: Mixture, sigma: float, spread: float, prompt: str, guidance: float
) -> None:
    size = 32
    m = mus(size)
    a = 1 / math.sqrt(1 + sigma**2)
    gen = torch.Generator().manual_seed(7)
    # Halfway between two images plus a little noise: a genuinely mixed posterior.
    i, j = index("sunset gradient"), index("rainbow stripes")
    x = a * (m[i] + m[j]) / 2 + 0.02 * sigma * a * torch.randn(m.shape[1], generator=gen, dtype=torch.float64)
    # The state's own components and weights: a colour-and-shape prompt
    # ("red circle") adds its picture's variants, weighted by the prompt only.
    state = model.start(model.validate({"size": size, "prompt": prompt}), CPU)
    want_log_w = torch.full((state.bank.mu.shape[0],), -math.inf, dtype=torch.float64)
    if images.plain(prompt) is None:
        want_log_w[list(images.select(prompt))] = 0.0
    else:
        want_log_w[K:] = 0.0
    assert torch.equal(state.log_w, want_log_w)
    assert torch.equal(state.log_all[:K], torch.zeros(K, dtype=torch.float64))
    assert bool((state.log_all[K:] == -math.inf).all())
    expected, r = reference_x0(x.float(), sigma, spread, want_log_w, guidance, size,
                               state.bank.mu, state.log_all)
    got = predict(model, x, sigma, size=size, spread=spread, prompt=prompt, guidance=guidance)
    assert (got.double() - expected).abs().max() < 2e-5
    if prompt == "":
        entropy = float(-(r * r.clamp_min(1e-300).log()).sum())
        assert entropy > 0.1, "the case should exercise a mixed posterior"


def test_x0_prediction_far_from_every_image(model: Mixture) -> None:
    # Pure noise at the top of the schedule: weights spread over all images,
    # logits in the thousands; the log-sum-exp keeps it finite and exact.
    size = 32
    sigma = samplers.sigma_max(3 * size * size)
    x = torch.randn(3 * size * size, generator=torch.Generator().manual_seed(0))
    log_w = torch.zeros(K, dtype=torch.float64)
    expected, r = reference_x0(x, sigma, 0.05, log_w, 1.0, size)
    got = predict(model, x, sigma, size=size)
    assert torch.isfinite(got).all()
    assert (got.double() - expected).abs().max() < 2e-5
    assert int((r > 1e-3).sum()) > 5


def test_dot_products_are_exact_integers(model: Mixture) -> None:
    bank = model._banks.get(32, CPU)
    x = 3 * torch.randn(5, bank.dims, generator=torch.Generator().manual_seed(1))
    lim = 2.0**mixture.X_RANGE_BITS
    xq = x.clamp(-lim, lim).mul_(2.0**bank.x_bits).round_().to(torch.float64)
    exact = xq.long() @ (bank.mu * images.LEVELS).long().T  # int64: exact by construction
    assert torch.equal(mixture._dots(xq, bank), exact.double())


# ---- sampling ---------------------------------------------------------------


def test_one_component_converges_to_its_mean(model: Mixture) -> None:
    star = mus(32)[index("yellow star")]
    for spread in (0.05, 0.2):
        frames = run(model, size=32, steps=30, seed=2, prompt="star", spread=spread)
        # The sample is mu + spread * noise (clamped to [-1, 1]).
        assert 0.5 * spread < rms(frames[-1].flatten(), star) < 1.2 * spread
    exact = run(model, size=32, steps=5, seed=2, prompt="star", spread=0.0)
    for f in exact:
        assert torch.equal(f.flatten().double(), star)


def test_several_components_end_near_one_of_them(model: Mixture) -> None:
    m = mus(32)
    picked = set()
    for seed in range(6):
        final = run(model, size=32, steps=20, seed=seed)[-1].flatten().double()
        dist = ((m - final) ** 2).mean(1).sqrt()
        near, second = dist.sort().values[:2].tolist()
        assert near < 0.06 and second > 0.3
        picked.add(int(dist.argmin()))
    assert len(picked) >= 3  # different seeds, different images


def test_prompt_restricts_the_samples(model: Mixture) -> None:
    m = mus(32)
    allowed = set(images.select("stripes"))
    for seed in range(4):
        final = run(model, size=32, steps=15, seed=seed, prompt="stripes")[-1].flatten().double()
        assert int(((m - final) ** 2).mean(1).argmin()) in allowed


@pytest.mark.parametrize("sampler", ["ddim", "euler_a", "dpmpp_2m"])
def test_x0_prediction_error_falls_over_the_steps(model: Mixture, sampler: str) -> None:
    frames = run(model, size=32, steps=24, seed=4, sampler=sampler)
    errors = [rms(f, frames[-1]) for f in frames]
    checkpoints = [errors[i] for i in (0, 6, 12, 18, 23)]
    assert checkpoints == sorted(checkpoints, reverse=True)
    assert checkpoints[0] > 0.2 and checkpoints[-1] == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_more_ddim_steps_get_closer_to_the_exact_answer(model: Mixture, seed: int) -> None:
    # The ODE's solution, to within ~1e-4: DDIM with many steps from the same noise.
    exact = run(model, size=32, steps=1000, seed=seed)[-1]
    errors = {n: rms(run(model, size=32, steps=n, seed=seed)[-1], exact) for n in (10, 20, 40, 80)}
    assert errors[10] > errors[20] > errors[40] > errors[80]
    # First order: doubling the steps about halves the error.
    for n in (10, 20, 40):
        assert 1.6 < errors[n] / errors[2 * n] < 2.5
    # DPM-Solver++(2M) is second order: closer than DDIM at the same count.
    assert rms(run(model, size=32, steps=40, seed=seed, sampler="dpmpp_2m")[-1], exact) < errors[40] / 2


def test_euler_ancestral_is_random_per_seed_and_repeatable(model: Mixture) -> None:
    a = run(model, size=32, steps=10, seed=5, sampler="euler_a")
    b = run(model, size=32, steps=10, seed=5, sampler="euler_a")
    c = run(model, size=32, steps=10, seed=6, sampler="euler_a")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[-1], c[-1])
    # The same seed's initial noise, then fresh noise each step: not the DDIM path.
    assert not torch.equal(a[-1], run(model, size=32, steps=10, seed=5)[-1])


def test_ddim_eta_one_is_euler_ancestral(model: Mixture) -> None:
    # The same update (see samplers.update); the noise is the same per (seed, step).
    a = run(model, size=32, steps=6, seed=9, sampler="euler_a")
    b = run(model, size=32, steps=6, seed=9, sampler="ddim", eta=1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_step_predicts_a_blend(model: Mixture) -> None:
    # At sigma_max the posterior is still spread over many images: its mean
    # is a blend, nearer the average image than any one image.
    m = mus(32)
    for seed in range(3):
        frame = run(model, size=32, steps=1, seed=seed)[0].flatten().double()
        nearest = float(((m - frame) ** 2).mean(1).sqrt().min())
        assert rms(frame, m.mean(0)) < nearest - 0.05


def test_guidance_zero_ignores_the_prompt(model: Mixture) -> None:
    a = run(model, size=32, steps=8, seed=3, prompt="heart", guidance=0.0)
    b = run(model, size=32, steps=8, seed=3, prompt="", guidance=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- the README's picture -----------------------------------------------------

# The README's command at seed 0 (it draws a seed per run: the disc sits and
# sizes differently; the checks below are this seed's picture).
README = {"prompt": "red circle", "steps": 30, "size": 256, "seed": 0}


@pytest.fixture(scope="module")
def readme_frames(model: Mixture) -> list[torch.Tensor]:
    return run(model, **README)


def test_red_circle_is_a_red_disc_on_a_plain_background(readme_frames) -> None:
    # It drew a red-and-white bullseye (the "target" image is tagged red and circle too).
    final = readme_frames[-1]
    side = final.shape[-1]
    centres = (torch.arange(side) + 0.5) / side * 2 - 1
    r = (centres[None, :] ** 2 + centres[:, None] ** 2).sqrt()
    red = (final[0] > 0.4) & (final[1] < -0.4) & (final[2] < -0.4)
    assert red[r < 0.35].float().mean() > 0.95  # the disc, wherever the variant put it
    outside = r > 0.9
    assert red[outside].float().mean() < 0.01
    background = final[:, outside]
    assert float((background - background.mean(1, keepdim=True)).abs().mean()) < 0.06  # plain


# The README's command draws its seed at random. With the schedule of the
# round before, seed 0 had 8 of 30 frames within 5% of the final image, but
# a random seed had 13 (issue #34): one pink blur until the disc came in
# within two frames. These are 20 seeds drawn at random once, fixed so that
# the test repeats.
README_SEEDS = [random.Random(i).randrange(2**63) for i in range(20)]


def shown(frame: torch.Tensor) -> torch.Tensor:
    """The 8-bit RGB picture the CLI's previews show (the rgb decoder), as float64."""
    return torch.from_numpy(decode_rgb(frame)).double()


def rms_within_5_percent(frame: torch.Tensor, final: torch.Tensor) -> bool:
    """The root mean square of the pixel differences is under 5% of 255."""
    return float((frame - final).pow(2).mean().sqrt()) / 255 < 0.05


def mean_within_5_percent(frame: torch.Tensor, final: torch.Tensor) -> bool:
    """The mean absolute pixel difference is under 5% of 255 (the issue's measure)."""
    return float((frame - final).abs().mean()) / 255 < 0.05


@pytest.fixture(scope="module")
def readme_previews(model: Mixture) -> list[list[torch.Tensor]]:
    """Every frame of the README's command at each of README_SEEDS, as shown."""
    # One batch: each request's frames are its solo run's bit for bit (see
    # the bitwise batching tests), in a fraction of the time.
    states = [model.start(model.validate({**README, "seed": seed}), CPU) for seed in README_SEEDS]
    frames: list[list[torch.Tensor]] = [[] for _ in states]
    for _ in range(README["steps"]):
        for shown_frames, frame in zip(frames, model.step(states), strict=True):
            shown_frames.append(shown(frame))
    return frames


def test_readme_previews_stay_apart_from_the_final_image_for_two_thirds_of_the_steps(readme_previews) -> None:
    # Within 5% per pixel (RMS), at each seed: the picture the preview shows is
    # the final one for at most the last third of the frames (it was up to 14
    # of 30). The mean absolute difference counts a disc drawn one variant off
    # (18 pixels at 256) as within 5% (3.8%: three quarters of the picture
    # is the same plain background), and the seed decides when the disc is
    # placed (see samplers.PLACED), so by that measure one seed in six still
    # has 11 to 21 of 30; over the 20 seeds it is at most a third of the
    # frames (it was 229 of 600).
    per_seed = []
    mean_near = 0
    for frames in readme_previews:
        final = frames[-1]
        per_seed.append(sum(rms_within_5_percent(f, final) for f in frames))
        mean_near += sum(mean_within_5_percent(f, final) for f in frames)
    third = README["steps"] // 3
    assert max(per_seed) <= third, per_seed
    assert mean_near <= third * len(README_SEEDS), mean_near


@pytest.mark.parametrize("prompt", ["blue square", "a green triangle", "red stripes", "purple heart"])
def test_a_colour_and_a_shape_draw_that_on_a_plain_background(model: Mixture, prompt: str) -> None:
    final = run(model, prompt=prompt, size=64, steps=12, seed=1)[-1]
    picture = images.plain(prompt)
    assert picture is not None
    # One of the picture's variants (that shape in that colour on white), plus its spread.
    variants = images.render_plain(picture, 64).reshape(len(images.VARIANTS), -1).double()
    assert float(((variants - final.flatten().double()) ** 2).mean(1).sqrt().min()) < 0.07
    colour = torch.tensor(images.PLAIN_COLOURS[picture.colour]).view(3, 1, 1) * 2 - 1
    white = torch.tensor(images.WHITE).view(3, 1, 1) * 2 - 1
    painted = ((final - colour).abs().amax(0) < 0.2).float().mean()
    plain = ((final - white).abs().amax(0) < 0.2).float().mean()
    assert painted > 0.1 and plain > 0.2 and painted + plain > 0.85


def test_batch_key_separates_plain_pictures(model: Mixture) -> None:
    key = lambda prompt: model.batch_key(model.validate({"prompt": prompt, "size": 32}))  # noqa: E731
    assert key("red circle") == key("a red circle") != key("blue circle") != key("red")
    assert key("red") == key("stripes")


# ---- several images a request (num_images: OpenAI's n) --------------------------


@pytest.mark.parametrize("sampler", ["ddim", "euler_a", "dpmpp_2m"])
def test_n_images_are_n_pictures_the_first_the_one_image_picture(model: Mixture, sampler: str) -> None:
    # 33 pixels: 3 * 33 * 33 values is no multiple of 16, where one [n, D] draw of normals
    # would not begin with the one-image draw (see _image_seed).
    raw = dict(prompt="red circle", size=33, steps=12, seed=7, sampler=sampler)
    one = run(model, **raw)
    three = run(model, **raw, num_images=3)
    assert [f.shape for f in three] == [torch.Size([3, 3, 33, 33])] * 12
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a.view(torch.int32), b[0].view(torch.int32))
    final = three[-1]
    assert not torch.equal(final[0], final[1]) and not torch.equal(final[1], final[2])
    assert float(final.abs().max()) <= 1.0
    # Each image a picture of the prompt: a variant of a red circle, plus its spread.
    variants = images.render_plain(images.plain("red circle"), 33).reshape(len(images.VARIANTS), -1).double()
    for image in final:
        assert float(((variants - image.flatten().double()) ** 2).mean(1).sqrt().min()) < 0.07


def test_max_images_bounds_num_images() -> None:
    assert Mixture().validate({"num_images": 4})["num_images"] == 4
    with pytest.raises(ParamsError) as info:
        Mixture().validate({"num_images": 5})
    assert info.value.field == "num_images"
    assert Mixture(max_images=8).validate({"num_images": 8})["num_images"] == 8
    wider = Mixture()
    wider.set_max_images(64)  # the CLI's --max-images
    assert wider.validate({"num_images": 64})["num_images"] == 64
    assert Mixture().validate({"num_images": 64 - 60})["num_images"] == 4  # another instance keeps 4
    for bad in (0, 65):
        with pytest.raises(ParamsError) as info:
            Mixture(max_images=bad)
        assert info.value.field == "max_images"


@pytest.mark.asyncio
async def test_the_engine_hands_out_the_n_images_in_each_frame() -> None:
    raw = dict(prompt="blue square", size=32, steps=4, seed=5, num_images=2)
    want = run(Mixture(), **raw)
    async with om.Engine(Mixture(), device="cpu") as engine:
        frames = [f async for f in engine.stream(dict(raw))]
    assert [f.image_count for f in frames] == [2] * 4
    assert all(torch.equal(f.data, w) for f, w in zip(frames, want, strict=True))
    assert [torch.equal(f.data, w) for f, w in zip(frames[-1].split(), want[-1], strict=True)] == [True, True]


# ---- bitwise batching -------------------------------------------------------

REQUESTS: list[dict[str, Any]] = [
    {"size": 32, "steps": 7, "seed": 1},
    {"size": 32, "steps": 5, "seed": 2, "sampler": "euler_a"},
    {"size": 32, "steps": 9, "seed": 3, "sampler": "dpmpp_2m", "prompt": "red"},
    {"size": 32, "steps": 6, "seed": 1, "prompt": "stripes", "guidance": 4.0},
    {"size": 32, "steps": 8, "seed": 4, "sampler": "ddim", "eta": 0.5, "spread": 0.3},
    {"size": 32, "steps": 3, "seed": 5, "prompt": "circle", "guidance": 0.0, "spread": 0.0},
    {"size": 32, "steps": 7, "seed": 1},  # a twin of the first, in the same batch
    {"size": 32, "steps": 12, "seed": 8, "sampler": "euler_a", "eta": 0.3, "prompt": "blue gradient"},
    # Several images a request: rows of their own in every batch (num_images).
    {"size": 32, "steps": 6, "seed": 11, "sampler": "euler_a", "num_images": 3},
    {"size": 32, "steps": 7, "seed": 12, "sampler": "dpmpp_2m", "num_images": 2, "prompt": "blue"},
]


@pytest.fixture(scope="module")
def solo_frames(model: Mixture) -> list[list[torch.Tensor]]:
    return [run(model, **raw) for raw in REQUESTS]


def run_scheduled(model: Mixture, requests: list[Mapping[str, Any]], rng: random.Random) -> list[list[torch.Tensor]]:
    """Run requests that join at random times, stepping random subsets in random orders."""
    pending = list(range(len(requests)))
    rng.shuffle(pending)
    live: dict[int, Any] = {}
    frames: list[list[torch.Tensor]] = [[] for _ in requests]
    while pending or live:
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop()
                live[i] = model.start(model.validate(requests[i]), CPU)
        if not live:
            continue
        batch = rng.sample(sorted(live), rng.randint(1, len(live)))
        for i, frame in zip(batch, model.step([live[i] for i in batch])):
            frames[i].append(frame.clone())
            if len(frames[i]) == model.total_steps(model.validate(requests[i])):
                model.close(live.pop(i))
    return frames


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), i
        for step, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"request {i} ({REQUESTS[i]}) step {step + 1} differs"
            # torch.equal ignores the sign of zero; the claim is bit-identical.
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"request {i} step {step + 1}"


def test_zeros_are_never_negative(model: Mixture) -> None:
    # The batching argument (see _advance) needs x0 never to be -0.0; with
    # spread 0 the frames are the images exactly, zeros included.
    for sampler in ("ddim", "euler_a"):
        frames = run(model, size=32, steps=6, seed=3, spread=0.0, prompt="hexagon", sampler=sampler)
        zeros = torch.cat([f[f == 0] for f in frames])
        assert zeros.numel() > 0
        assert not torch.signbit(zeros).any()


@pytest.mark.parametrize("schedule", range(6))
def test_batched_frames_are_bit_identical_to_solo(model: Mixture, solo_frames, schedule: int) -> None:
    assert_same(run_scheduled(model, REQUESTS, random.Random(schedule)), solo_frames)


def test_all_at_once_in_either_order_is_bit_identical(model: Mixture, solo_frames) -> None:
    for order in (list(range(len(REQUESTS))), list(reversed(range(len(REQUESTS))))):
        states = {i: model.start(model.validate(REQUESTS[i]), CPU) for i in order}
        frames: list[list[torch.Tensor]] = [[] for _ in REQUESTS]
        while states:
            batch = [i for i in order if i in states]
            for i, f in zip(batch, model.step([states[i] for i in batch])):
                frames[i].append(f.clone())
                if len(frames[i]) == REQUESTS[i]["steps"]:
                    del states[i]
        assert_same(frames, solo_frames)


def test_thread_count_does_not_change_a_bit(model: Mixture, solo_frames) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_same(run_scheduled(model, REQUESTS, random.Random(99)), solo_frames)
    finally:
        torch.set_num_threads(before)


def test_grouping_large_batches_does_not_change_a_bit(model: Mixture, solo_frames, monkeypatch) -> None:
    # Two requests per group, so every batch is split.
    monkeypatch.setattr(mixture, "CHUNK_VALUES", 2 * 3 * 32 * 32)
    assert_same(run_scheduled(model, REQUESTS, random.Random(5)), solo_frames)


def test_sliced_levels_do_not_change_a_bit(solo_frames, monkeypatch) -> None:
    # Large sizes keep no float64 copy and sum slice by slice; force that path
    # at 32 pixels, with slices that do not divide the image.
    monkeypatch.setattr(mixture, "LEVELS64_MAX_DIMS", 0)
    monkeypatch.setattr(mixture, "_SLICE_DIMS", 1000)
    sliced = Mixture()
    assert sliced._banks.get(32, CPU).levels is None
    assert_same(run_scheduled(sliced, REQUESTS, random.Random(6)), solo_frames)


def test_mixture_mean_shortcuts_agree_with_the_plain_product(model: Mixture) -> None:
    bank = model._banks.get(32, CPU)
    gen = torch.Generator().manual_seed(3)
    full = 2.0**mixture.R_BITS
    rows = [
        torch.softmax(torch.randn(K, generator=gen, dtype=torch.float64) * 4, 0) * full,  # mixed
        torch.nn.functional.one_hot(torch.tensor(5), K).double() * full,  # decided
        torch.nn.functional.one_hot(torch.tensor(9), K).double() * full,
        torch.nn.functional.one_hot(torch.tensor(9), K).double() * (full * 3),  # one, guided
        (torch.nn.functional.one_hot(torch.tensor(2), K) * 4 - torch.nn.functional.one_hot(torch.tensor(7), K) * 3).double() * full,
    ]
    rq = torch.stack(rows).round()
    plain = mixture._mixture_mean(rq, bank, shortcuts=False)
    for subset in ([0, 1, 2, 3, 4], [1, 2], [1], [0], [3, 4], [4, 1, 0]):
        got = mixture._mixture_mean(rq[subset], bank, shortcuts=True)
        assert torch.equal(got.view(torch.int32), plain[subset].view(torch.int32)), subset


def test_a_raising_step_leaves_every_state_unchanged(model: Mixture, solo_frames, monkeypatch) -> None:
    states = [model.start(model.validate(raw), CPU) for raw in REQUESTS[:3]]
    for _ in range(2):
        model.step(states)
    before = [(s.x.clone(), s.step, None if s.x0_prev is None else s.x0_prev.clone()) for s in states]

    def broken(seed: int, step: int, dims: int) -> torch.Tensor:
        raise RuntimeError("noise failed")

    monkeypatch.setattr(mixture, "_noise", broken)  # request 1 is euler_a: it needs noise
    with pytest.raises(RuntimeError, match="noise failed"):
        model.step(states)
    for s, (x, n, prev) in zip(states, before):
        assert torch.equal(s.x, x) and s.step == n
        assert prev is not None and torch.equal(s.x0_prev, prev)
    monkeypatch.undo()
    # Retried (one at a time, as the engine does), each carries on exactly.
    for i, s in enumerate(states):
        for step in range(2, REQUESTS[i]["steps"]):
            assert torch.equal(model.step([s])[0], solo_frames[i][step])


# ---- caching and lifecycle --------------------------------------------------


def test_image_cache_is_a_bounded_lru() -> None:
    small = Mixture(cache_sizes=2)
    for size in (32, 40, 48, 40):
        small.start(small.validate({"size": size, "steps": 1}), CPU)
    assert small.cached_sizes() == [48, 40]
    tight = Mixture(cache_bytes=0)  # the newest size always stays
    for size in (32, 40):
        tight.start(tight.validate({"size": size, "steps": 1}), CPU)
    assert tight.cached_sizes() == [40]
    with pytest.raises(ValueError):
        Mixture(cache_sizes=0)
    with pytest.raises(ValueError):
        Mixture(max_batch_size=0)


def test_a_bank_is_shared_and_survives_eviction() -> None:
    small = Mixture(cache_sizes=1)
    a = small.start(small.validate({"size": 32, "steps": 2}), CPU)
    b = small.start(small.validate({"size": 32, "steps": 2}), CPU)
    assert a.bank is b.bank
    small.start(small.validate({"size": 40, "steps": 1}), CPU)  # evicts 32
    assert len(small.step([a, b])) == 2  # running requests keep their images


def test_load_prerenders_the_default_size() -> None:
    fresh = Mixture()
    fresh.load(CPU)
    assert fresh.cached_sizes() == [256]


def test_loads_bank_is_kept_outside_the_bounds() -> None:
    # It was the first to go: a 1-size cache dropped it for the next request's size.
    fresh = Mixture(cache_sizes=1, cache_bytes=0)
    fresh.load(CPU)
    for size in (32, 40):
        fresh.start(fresh.validate({"size": size, "steps": 1}), CPU)
    assert fresh.cached_sizes() == [256, 40]


# ---- memory: the banks, their building peak, the cache (model.ModelMemory) ----


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def whole_array_bank(size: int, picture: images.PlainPicture | None) -> tuple[torch.Tensor, ...]:
    """(mu, levels, norms) as the bank was built before it was chunked: whole-array float64 products."""
    rendered = torch.stack([images.render(c, size) for c in images.COMPONENTS])
    if picture is not None:
        rendered = torch.cat([rendered, images.render_plain(picture, size)])
    mu = rendered.reshape(rendered.shape[0], -1)
    levels = mu.to(torch.float64) * images.LEVELS
    return mu, levels, (levels * levels).sum(1)


@pytest.mark.parametrize("columns", [None, 1000])
@pytest.mark.parametrize("size, prompt", [(32, ""), (61, "red circle"), (61, "white stripes")])
def test_a_bank_is_built_bit_identical_to_whole_array_products(
    size: int, prompt: str, columns: int | None, monkeypatch
) -> None:
    # 61 pixels: 11,163 values an image, chunks that do not divide them.
    if columns is not None:
        monkeypatch.setattr(mixture, "_BUILD_COLUMNS", columns)
    picture = images.plain(prompt)
    mu, levels, norms = whole_array_bank(size, picture)
    bank = mixture._make_bank(size, picture, CPU)
    assert bank.levels is not None
    assert torch.equal(bits(bank.mu), bits(mu))
    assert torch.equal(bits(bank.levels), bits(levels))
    assert torch.equal(bits(bank.norms), bits(norms))
    monkeypatch.setattr(mixture, "LEVELS64_MAX_DIMS", 0)  # large sizes: no float64 copy kept
    sliced = mixture._make_bank(size, picture, CPU)
    assert sliced.levels is None
    assert torch.equal(bits(sliced.mu), bits(mu)) and torch.equal(bits(sliced.norms), bits(norms))


@pytest.mark.gpu
@pytest.mark.parametrize("keep_levels", [True, False])
def test_a_bank_built_on_cuda_has_the_cpu_banks_bits(gpu_kind: str, keep_levels: bool, monkeypatch) -> None:
    # The float64 levels and norms are made on the device, chunk by chunk (on the simulated
    # GPU, whose tensors are the CPU's, this checks the device path runs).
    if not keep_levels:
        monkeypatch.setattr(mixture, "LEVELS64_MAX_DIMS", 0)
    picture = images.plain("red circle")
    device = gpu_torch_device(gpu_kind)
    cpu = mixture._make_bank(61, picture, CPU)
    cuda = mixture._make_bank(61, picture, device)
    assert cuda.mu.device.type == cuda.norms.device.type == device.type
    assert torch.equal(bits(cuda.mu.cpu()), bits(cpu.mu))
    assert torch.equal(bits(cuda.norms.cpu()), bits(cpu.norms))
    if keep_levels:
        assert cuda.levels is not None and cpu.levels is not None
        assert torch.equal(bits(cuda.levels.cpu()), bits(cpu.levels))
    assert cuda.nbytes == cpu.nbytes


@pytest.mark.parametrize("keep_levels", [True, False])
@pytest.mark.parametrize("prompt", ["", "green star"])
def test_bank_bytes_are_exact(prompt: str, keep_levels: bool, monkeypatch) -> None:
    if not keep_levels:
        monkeypatch.setattr(mixture, "LEVELS64_MAX_DIMS", 0)
    picture = images.plain(prompt)
    bank = mixture._make_bank(40, picture, CPU)
    assert (bank.levels is not None) == keep_levels
    tensors = [t for t in (bank.mu, bank.levels, bank.norms) if t is not None]
    # Whole storages: a view of a larger tensor would hold more than it counts.
    assert bank.nbytes == sum(t.untyped_storage().nbytes() for t in tensors)
    assert bank.nbytes == mixture._bank_bytes(40, picture)


def test_request_memory_counts_a_bank_until_it_is_cached() -> None:
    fresh = Mixture()
    circle = fresh.validate({"size": 48, "prompt": "red circle"})
    everything = fresh.validate({"size": 48})
    want = fresh.request_memory_bytes(circle)
    assert want >= mixture._bank_bytes(48, images.plain("red circle")) > 0
    assert 0 < fresh.request_memory_bytes(everything) < want  # 30 images, not 62
    state = fresh.start(circle, CPU)
    assert fresh.request_memory_bytes(circle) == 0
    assert fresh.request_memory_bytes(dict(circle, seed=5, steps=3, sampler="euler_a")) == 0
    # Other banks: another size, no plain picture, another picture.
    assert fresh.request_memory_bytes(fresh.validate({"size": 56, "prompt": "red circle"})) > 0
    assert fresh.request_memory_bytes(everything) > 0
    assert fresh.request_memory_bytes(fresh.validate({"size": 48, "prompt": "blue circle"})) > 0
    fresh.close(state)


def test_cache_bytes_and_trim_cache_never_take_loads_bank() -> None:
    fresh = Mixture()
    fresh.load(CPU)
    default = fresh.validate({"steps": 2})
    assert fresh.cache_bytes() == 0 and fresh.request_memory_bytes(default) == 0
    a = fresh.start(fresh.validate({"size": 40, "steps": 3}), CPU)
    assert fresh.cache_bytes() == a.bank.nbytes
    b = fresh.start(fresh.validate({"size": 48, "steps": 3, "prompt": "red circle"}), CPU)
    assert fresh.cache_bytes() == a.bank.nbytes + b.bank.nbytes
    assert fresh.cached_sizes() == [256, 40, 48]
    assert fresh.trim_cache(b.bank.nbytes) == a.bank.nbytes  # least recently used first
    assert fresh.cached_sizes() == [256, 48]
    assert fresh.trim_cache() == b.bank.nbytes
    assert fresh.cache_bytes() == 0 and fresh.cached_sizes() == [256]
    assert fresh.trim_cache() == 0
    assert fresh.request_memory_bytes(fresh.validate({"size": 40})) > 0  # to be built again
    # Running requests keep their trimmed banks; load's bank still serves.
    assert len(fresh.step([a])) == 1 and len(fresh.step([b])) == 1
    c = fresh.start(default, CPU)
    assert len(fresh.step([c])) == 1
    assert fresh.cache_bytes() == 0 and fresh.request_memory_bytes(default) == 0
    with pytest.raises(ValueError, match="keep_bytes"):
        fresh.trim_cache(-1)


def test_memory_calls_do_not_wait_for_a_bank_being_built(monkeypatch) -> None:
    # The event loop asks while the producer thread draws; it must not block
    # on the drawing, and a bank not built yet is not there.
    fresh = Mixture()
    drawing, release = threading.Event(), threading.Event()
    draw = images.render_all

    def held(size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        drawing.set()
        assert release.wait(60)  # a bound on a hang, not a timing assertion
        return draw(size, out=out)

    monkeypatch.setattr(images, "render_all", held)
    params = fresh.validate({"size": 40, "steps": 1})
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(fresh.start, params, CPU)
        try:
            assert drawing.wait(60)
            assert fresh.request_memory_bytes(params) > 0
            assert fresh.cache_bytes() == 0 and fresh.trim_cache() == 0
        finally:
            release.set()
        state = started.result(60)
    assert fresh.cache_bytes() == state.bank.nbytes and fresh.request_memory_bytes(params) == 0


#: Builds banks in a fresh process and reports the peak RSS increase of each
#: (Linux: /proc/self/clear_refs resets the peak, VmHWM, to the current RSS).
PEAK_SCRIPT = r"""
import json, re, sys
import torch
from omni_stream.models import images, mixture
from omni_stream.models.mixture import Mixture

def status(field):
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+) kB", f.read()).group(1)) * 1024

size, prompt = int(sys.argv[1]), sys.argv[2]
picture = images.plain(prompt)
model = Mixture()
estimate = model.request_memory_bytes(model.validate({"size": size, "prompt": prompt}))
mixture._make_bank(32, picture, torch.device("cpu"))  # first-call allocations out of the way
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError as exc:
    print(json.dumps({"skip": f"cannot reset the peak RSS: {exc}"}))
    sys.exit(0)
before = status("VmRSS")
bank = mixture._make_bank(size, picture, torch.device("cpu"))
print(json.dumps({"peak": status("VmHWM") - before, "bank": bank.nbytes, "estimate": estimate}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize(
    "size, prompt",
    [
        (512, ""),  # the float64 copy kept; built at 1.66x the bank before
        (640, "red circle"),  # none kept, a plain picture; 5x the bank before
    ],
)
def test_building_a_bank_peaks_near_the_bank_and_within_the_estimate(size: int, prompt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(size), prompt],
        capture_output=True, text=True, check=True, timeout=600,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    peak, bank, estimate = got["peak"], got["bank"], got["estimate"]
    assert peak <= estimate, got  # admission never counts less than the build takes
    assert peak <= 1.3 * bank, got  # no whole-bank float64 temporaries
    assert estimate <= 1.3 * bank + (16 << 20), got  # and the estimate is not a blanket


def test_close_drops_the_state_tensors(model: Mixture) -> None:
    state = model.start(model.validate({"size": 32, "steps": 2}), CPU)
    model.step([state])
    model.close(state)
    assert state.x is None and state.x0_prev is None


# ---- through the engine -----------------------------------------------------


@pytest.mark.asyncio
async def test_engine_streams_the_models_frames(solo_frames) -> None:
    async with om.Engine(Mixture(), device="cpu", max_batch_size=4) as engine:
        async def collect(raw: Mapping[str, Any]) -> list[torch.Tensor]:
            return [frame.data async for frame in engine.stream(dict(raw))]

        import asyncio

        got = await asyncio.gather(*(collect(raw) for raw in REQUESTS))
        final = await engine.generate(dict(REQUESTS[2]))
        assert engine.statistics().batch_sizes.keys() - {1}, "the requests should have shared steps"
    assert_same(got, solo_frames)
    assert final.final and torch.equal(final.data, solo_frames[2][-1])


@pytest.mark.gpu
def test_cuda_matches_cpu_and_batches_bitwise(gpu_kind: str) -> None:
    model = Mixture()
    cuda = gpu_torch_device(gpu_kind)

    def on_cuda(raws: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
        states = [model.start(model.validate(r), cuda) for r in raws]
        out: list[list[torch.Tensor]] = [[] for _ in raws]
        live = list(range(len(raws)))
        while live:
            for i, f in zip(live, model.step([states[i] for i in live])):
                assert f.device.type == cuda.type
                out[i].append(f.cpu().clone())
            live = [i for i in live if len(out[i]) < raws[i]["steps"]]
        return out

    raws = [dict(r, size=64) for r in REQUESTS]
    batched = on_cuda(raws)
    for i, raw in enumerate(raws):
        solo = on_cuda([raw])[0]
        assert all(torch.equal(a, b) for a, b in zip(solo, batched[i])), raw
    # Same mathematics as the CPU; exp and float32 rounding may differ slightly.
    cpu = run(model, **raws[0])
    assert rms(cpu[-1], batched[0][-1]) < 1e-3
