"""Param bounds as the error messages print them."""

from __future__ import annotations

import pytest

import omni_stream as om
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
