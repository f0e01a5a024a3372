"""The Mixture model's built-in images and the prompt words that pick them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_stream.errors import ParamsError
from omni_stream.models import images
from omni_stream.models.images import (
    COMPONENTS,
    LEVELS,
    VOCABULARY,
    render,
    render_all,
    select,
)


def _names(indices: tuple[int, ...]) -> set[str]:
    return {COMPONENTS[i].name for i in indices}


def _tagged(word: str) -> set[str]:
    return {c.name for c in COMPONENTS if word in c.tags}


# ---- rendering --------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 32, 33, 64])
def test_every_image_renders_at_any_size_on_the_level_grid(size: int) -> None:
    stack = render_all(size)
    assert stack.shape == (len(COMPONENTS), 3, size, size)
    assert stack.dtype == torch.float32
    assert torch.isfinite(stack).all()
    assert stack.min() >= -1.0 and stack.max() <= 1.0
    # Multiples of 1/128 exactly: the Mixture model's exact sums rely on it.
    scaled = stack * LEVELS
    assert torch.equal(scaled, scaled.round())


def test_no_negative_zero_in_images() -> None:
    # Rounding leaves -0.0 where a value rounds to zero from below; the
    # model's bitwise guarantees treat a zero's sign as data.
    stack = render_all(32)
    assert not torch.signbit(stack[stack == 0]).any()


def test_rendering_is_deterministic() -> None:
    assert torch.equal(render_all(40), render_all(40))


def test_sizes_agree_after_downsampling() -> None:
    # Edges are anti-aliased from exact coverage, so a 2x render averaged
    # down matches the 1x render: the picture does not depend on the size.
    small, large = render_all(48), render_all(96)
    diff = (F.avg_pool2d(large, 2) - small).abs().flatten(1).mean(1)
    assert diff.max() < 0.05, {COMPONENTS[i].name: round(float(d), 4) for i, d in enumerate(diff)}


def test_images_are_distinct_and_colourful() -> None:
    flat = render_all(32).flatten(1)
    assert len(COMPONENTS) >= 24
    rms = torch.cdist(flat, flat) / flat.shape[1] ** 0.5
    rms.fill_diagonal_(float("inf"))
    # Far apart, so every component is a distinct sample the mixture can produce.
    assert rms.min() > 0.3
    rgb = render_all(32)
    chroma = (rgb.amax(1) - rgb.amin(1)).flatten(1)  # per-pixel saturation proxy
    colourful = (chroma > 0.5).float().mean(1) > 0.25
    assert int(colourful.sum()) >= 20


def test_drawing_into_a_given_tensor_gives_the_same_bits() -> None:
    # The Mixture draws straight into its bank: no list of images stacked after.
    size = 33
    out = torch.full((len(COMPONENTS), 3, size, size), float("nan"))
    assert render_all(size, out=out) is out
    alone = torch.stack([render(c, size) for c in COMPONENTS])
    assert torch.equal(out.view(torch.int32), alone.view(torch.int32))
    picture = images.plain("green star")
    assert picture is not None
    variants = torch.full((len(images.VARIANTS), 3, size, size), float("nan"))
    assert images.render_plain(picture, size, out=variants) is variants
    assert torch.equal(variants.view(torch.int32), images.render_plain(picture, size).view(torch.int32))


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(len(COMPONENTS), 3, 8, 9),
        torch.empty(len(COMPONENTS) - 1, 3, 8, 8),
        torch.empty(len(COMPONENTS), 3, 8, 8, dtype=torch.float64),
        torch.empty(8, 8, 3, len(COMPONENTS)).permute(3, 2, 0, 1),  # not contiguous
    ],
)
def test_drawing_into_a_wrong_tensor_is_refused(out: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="out must be"):
        render_all(8, out=out)


def test_render_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        render(COMPONENTS[0], 0)
    with pytest.raises(ValueError):
        render(COMPONENTS[0], True)  # type: ignore[arg-type]


def test_names_are_unique_and_every_image_is_tagged() -> None:
    assert len({c.name for c in COMPONENTS}) == len(COMPONENTS)
    for c in COMPONENTS:
        assert len(c.tags) >= 2, c.name


# ---- prompts ----------------------------------------------------------------


def test_vocabulary_has_the_promised_words() -> None:
    for word in ("circle", "square", "stripes", "gradient", "red", "green", "blue", "yellow"):
        assert word in VOCABULARY
    assert list(VOCABULARY) == sorted(set(VOCABULARY))


def test_every_word_picks_its_images() -> None:
    for word in VOCABULARY:
        assert _names(select(word)) == _tagged(word), word


def test_empty_prompt_picks_everything() -> None:
    assert select("") == tuple(range(len(COMPONENTS)))
    assert select("  ,. ") == tuple(range(len(COMPONENTS)))


def test_words_combine_as_all_of_them() -> None:
    assert _names(select("red circle")) == _tagged("red") & _tagged("circle")
    assert _names(select("red circle")) == {"red circle", "target"}
    assert _names(select("vertical stripes")) == {"vertical stripes", "tricolour flag"}


def test_without_a_full_match_the_best_matches_win() -> None:
    # No image is green and a square: the green things and the squares tie.
    assert not (_tagged("green") & _tagged("square"))
    assert _names(select("green square")) == _tagged("green") | _tagged("square")
    # One word more matched beats one word fewer.
    assert _names(select("green hexagon star")) == {"hexagon"}


def test_case_punctuation_fillers_plurals_and_synonyms() -> None:
    assert select("RED, Circle!") == select("red circle")
    assert select("a red circle with the rings") == select("red circle rings")
    assert select("circles") == select("circle")
    assert select("striped") == select("stripes")
    assert select("stripe") == select("stripes")
    assert select("polka dot") == select("dots")
    assert select("violet") == select("purple")


def test_unknown_word_is_a_params_error_listing_the_known_words() -> None:
    with pytest.raises(ParamsError) as info:
        select("red bicycle")
    err = info.value
    assert err.field == "prompt"
    assert "'bicycle'" in str(err)
    for word in ("circle", "square", "stripes", "gradient"):
        assert word in str(err)


def test_a_prompt_of_fillers_names_nothing() -> None:
    with pytest.raises(ParamsError) as info:
        select("a the")
    assert info.value.field == "prompt"
    assert "names no image" in str(info.value)


def test_select_results_are_cached_and_immutable() -> None:
    assert select("blue") is select("blue")
    assert isinstance(select("blue"), tuple)
    assert images.select.cache_info().maxsize is not None
