"""Declared params: bounds as the error messages print them, random seeds."""

from __future__ import annotations

from typing import Any

import pytest

import omni_stream as om
from omni_stream.errors import ParamsError
from omni_stream.models import Synthetic
from omni_stream.params import Param


def test_an_integer_bound_prints_as_an_integer():
    # The seed's 2**63 - 1 used to read "<= 9.22337e+18": not a number to type back in.
    with pytest.raises(om.ParamsError, match=r"must be <= 9223372036854775807, got") as info:
        om.params.validate(Synthetic.params, {"seed": 2**63}, model="synthetic")
    assert info.value.field == "seed"
    shape = Param("shape", "shape", None, minimum=1, maximum=2048.0)
    with pytest.raises(om.ParamsError, match=r"must be <= 2048, got 4096"):
        shape.check([3, 4096], model="m")
    steps = Param("steps", "int", 1, minimum=1.0, maximum=10**7)
    with pytest.raises(om.ParamsError, match=r"must be >= 1, got 0"):
        steps.check(0, model="m")
    with pytest.raises(om.ParamsError, match=r"must be <= 10000000, got"):
        steps.check(10**7 + 1, model="m")


def test_a_float_bound_keeps_its_digits():
    fine = Param("g", "float", 1.0, minimum=0.1234567891, maximum=7.5)
    with pytest.raises(om.ParamsError, match=r"must be >= 0\.1234567891, got 0\.1"):
        fine.check(0.1, model="m")
    with pytest.raises(om.ParamsError, match=r"must be <= 7\.5, got 8"):
        fine.check(8, model="m")


# -- square_size: `size` for both sides ---------------------------------------------


def _sides(raw: dict, defaults: dict | None = None) -> dict:
    from omni_stream.params import square_size

    out = {"height": 512, "width": 768, "size": None, **(defaults or {}), **raw}
    square_size(out, raw, model="m")
    return out


def test_square_size_sets_both_sides_and_agrees_with_an_equal_side():
    assert _sides({"size": 256})["height"] == _sides({"size": 256})["width"] == 256
    assert (_sides({"size": 256, "width": 256})["height"]) == 256
    assert _sides({"height": 64}) == {"height": 64, "width": 768, "size": None}


def test_square_size_with_a_different_side_names_both():
    from omni_stream.params import square_size

    with pytest.raises(om.ParamsError) as info:
        square_size({"size": 256, "height": 128, "width": 768}, {"size": 256, "height": 128}, model="m")
    assert info.value.field == "size"
    assert "'size' (256)" in info.value.message and "'height' (128)" in info.value.message


def test_a_default_size_never_overrides_a_side_the_caller_gave():
    assert _sides({"height": 64}, {"size": 256}) == {"height": 64, "width": 768, "size": 256}
    assert _sides({}, {"size": 256})["width"] == 256


# ---- random params (a seed) -----------------------------------------------------------


@pytest.mark.parametrize("given", [{}, {"seed": -1}, {"seed": None}, {"seed": -1.0}])
def test_a_seed_left_out_or_minus_one_is_drawn_per_call(given: dict[str, Any]) -> None:
    specs = (om.params.seed_param(),)
    draws = {om.params.validate(specs, given, model="m")["seed"] for _ in range(8)}
    assert all(isinstance(d, int) and 0 <= d < 2**32 for d in draws)
    assert len(draws) > 1  # 8 draws of 32 bits all equal: about 2**-224


@pytest.mark.parametrize("bad", [-2, 2**63, 1.5, "7", True])
def test_a_seed_outside_its_range_names_the_field(bad: Any) -> None:
    with pytest.raises(ParamsError) as info:
        om.params.validate((om.params.seed_param(),), {"seed": bad}, model="m")
    assert info.value.field == "seed"


def test_a_named_seed_is_kept_and_the_description_admits_minus_one() -> None:
    specs = (om.params.seed_param(),)
    assert om.params.validate(specs, {"seed": 0}, model="m")["seed"] == 0
    (row,) = om.params.describe(specs)
    assert (row["default"], row["minimum"], row["maximum"], row["random"]) == (-1, -1, 2**63 - 1, True)


def test_only_an_int_param_can_be_random() -> None:
    with pytest.raises(ValueError, match="only an int param"):
        om.params.Param("x", "float", 0.0, random=True)


def test_a_number_too_large_for_a_float_is_a_params_error_not_a_crash() -> None:
    # math.isfinite(10**400) raises OverflowError: the server answered `internal`.
    with pytest.raises(ParamsError) as info:
        om.params.validate((om.params.Param("g", "float", 1.0),), {"g": 10**400}, model="m")
    assert info.value.field == "g" and "finite number" in info.value.message
