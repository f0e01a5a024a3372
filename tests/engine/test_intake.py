"""The intake: every check of stream()'s arguments, without an engine or an event loop."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
from collections.abc import Mapping
from typing import Any

import pytest

import omni_stream as om
from omni_stream.checkpoint import plain_params
from omni_stream.engine.intake import (
    CheckedParams,
    CheckedRequest,
    already_running,
    as_params_error,
    check_checkpointed,
    check_params,
    check_request,
    check_request_id,
)
from omni_stream.ids import ID_RULE
from omni_stream.models import Synthetic

from .conftest import params

#: Ids every facade refuses (omni_stream/ids.py): path segments, too long, a space, nothing, not text.
BAD_IDS: list[Any] = [".", "..", "x" * 129, "a b", "", "a/b", "caf\u00e9", "line\nbreak", 7, b"id"]


# -- the request id -------------------------------------------------------------------------


def test_no_id_gets_a_fresh_uuid_hex_each_time():
    first, second = check_request_id(None), check_request_id(None)
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


@pytest.mark.parametrize("good", ["a", "x" * 128, "A-z_0.9:", "...", ".a", "req-1"])
def test_an_id_within_the_rule_is_kept_as_given(good):
    assert check_request_id(good) == good


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_an_id_outside_the_rule_is_refused_saying_the_rule(bad):
    with pytest.raises(om.ParamsError) as info:
        check_request_id(bad)
    assert info.value.field == "request_id"
    assert ID_RULE in info.value.message and info.value.message.startswith("request_id must be")
    # Not attached: a refused id may be anything, and str(error) would print it whole.
    assert info.value.request_id is None


def test_a_long_refused_id_is_quoted_shortened():
    with pytest.raises(om.ParamsError) as info:
        check_request_id("x" * 100_000)
    assert len(str(info.value)) < 300


def test_the_id_is_checked_before_anything_else():
    with pytest.raises(om.ParamsError) as info:
        check_request(Synthetic(), {"nope": 1}, request_id="a b", policy="some", priority=99)
    assert info.value.field == "request_id"


def test_a_running_id_is_refused_in_one_wording():
    error = already_running("dup")
    assert isinstance(error, om.ParamsError)
    assert (error.message, error.field, error.request_id) == (
        "request_id 'dup' is already running", "request_id", "dup",
    )


# -- the options ----------------------------------------------------------------------------


def test_a_good_request_comes_back_checked_with_its_defaults():
    checked = check_request(
        Synthetic(), params(steps=5), request_id="r", timeout=2, preview_every=3, priority=-10
    )
    seed = checked.params["seed"]  # none given: drawn (tests/test_params.py)
    assert checked == CheckedRequest(
        request_id="r",
        params=Synthetic().validate(params(steps=5, seed=seed)) | {"output": "image"},
        total=5,
        policy="all",
        timeout=2.0,
        preview_every=3,
        priority=-10,
    )
    assert isinstance(checked.timeout, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.total = 6  # type: ignore[misc]
    fresh = check_request(Synthetic(), None, policy="latest")
    assert len(fresh.request_id) == 32 and fresh.policy == "latest" and fresh.timeout is None


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("policy", "some", "policy must be one of all, latest, got 'some'"),
        ("policy", None, "policy must be one of all, latest, got None"),
        ("timeout", -1, "timeout must be a positive number of seconds, got -1"),
        ("timeout", 0, "timeout must be a positive number of seconds, got 0"),
        ("timeout", math.inf, "timeout must be a positive number of seconds, got inf"),
        ("timeout", math.nan, "timeout must be a positive number of seconds, got nan"),
        ("timeout", True, "timeout must be a positive number of seconds, got True"),
        ("timeout", "1", "timeout must be a positive number of seconds, got '1'"),
        ("preview_every", 0, "preview_every must be a positive integer, got 0"),
        ("preview_every", True, "preview_every must be a positive integer, got True"),
        ("preview_every", 1.5, "preview_every must be a positive integer, got 1.5"),
        ("priority", 11, "priority must be an int from -10 to 10, got 11"),
        ("priority", -11, "priority must be an int from -10 to 10, got -11"),
        ("priority", True, "priority must be an int from -10 to 10, got True"),
        ("priority", 1.5, "priority must be an int from -10 to 10, got 1.5"),
        ("priority", "1", "priority must be an int from -10 to 10, got '1'"),
    ],
)
def test_a_bad_option_is_refused_naming_it_with_the_request_id(option, value, message):
    with pytest.raises(om.ParamsError) as info:
        check_request(Synthetic(), params(steps=2), request_id="r", **{option: value})
    assert (info.value.message, info.value.field, info.value.request_id) == (message, option, "r")


# -- the params, through the model ----------------------------------------------------------


def test_the_models_refusal_carries_the_request_id():
    with pytest.raises(om.ParamsError) as info:
        check_request(Synthetic(), {"steps": 0}, request_id="r")
    assert (info.value.field, info.value.request_id) == ("steps", "r")
    with pytest.raises(om.ParamsError, match="unknown synthetic param") as info:
        check_request(Synthetic(), {"nope": 1}, request_id="r")
    assert info.value.request_id == "r"


def test_output_is_split_off_and_checked_unless_the_model_declares_it():
    assert check_request(Synthetic(), params(steps=2, output="latent")).params["output"] == "latent"
    with pytest.raises(om.ParamsError) as info:
        check_request(Synthetic(), params(steps=2, output="pixels"), request_id="r")
    assert (info.value.field, info.value.request_id) == ("output", "r")

    class OwnOutput(Synthetic):
        params = (*Synthetic.params, om.Param("output", "str", "mine"))

    assert check_request(OwnOutput(), params(steps=2)).params["output"] == "mine"


# -- validated once (issue #36) ---------------------------------------------------------------


class _Counted(Synthetic):
    """Synthetic counting its ``validate`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.validated = 0

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        self.validated += 1
        return super().validate(params)


def test_params_the_same_model_checked_are_not_validated_again():
    model = _Counted()
    checked = check_params(model, params(steps=3))
    assert model.validated == 1
    request = check_request(model, checked, request_id="r", policy="latest")
    assert model.validated == 1  # the server's check was the one
    assert check_params(model, checked) is checked
    assert request.params == checked.checked and request.params is not checked.checked  # its own dict
    assert request.total == 3 and request.pinned is checked
    # The checks that are not the params' still apply.
    with pytest.raises(om.ParamsError) as info:
        check_request(model, checked, request_id="r", priority=11)
    assert info.value.field == "priority" and model.validated == 1


def test_checked_params_read_as_the_callers_with_the_drawn_seed_pinned():
    model = _Counted()
    checked = check_params(model, params(steps=2))
    seed = checked.checked["seed"]  # none given: drawn
    assert dict(checked) == {**params(steps=2), "seed": seed}
    assert checked.checked == Synthetic().validate(params(steps=2, seed=seed)) | {"output": "image"}
    # Checked by another model (an engine that is not the server's), they are validated as they
    # read: once, with the seed drawn the first time, not a second draw.
    other = _Counted()
    again = check_request(other, checked, request_id="r")
    assert other.validated == 1 and again.params == checked.checked
    assert check_params(model, None).keys() == {"seed"}  # none given: only what was drawn
    with pytest.raises(TypeError):
        checked["seed"] = 1  # type: ignore[index]  # read-only: what was checked is what runs
    # Another process gets the plain params (its engine validates them), not the model.
    sent = pickle.loads(pickle.dumps(checked))
    assert type(sent) is dict and sent == dict(checked)


def test_a_resumed_request_runs_its_checkpoints_params_validated_once():
    model = _Counted()
    checked = check_params(model, params(steps=3))
    resume = om.Checkpoint(
        model=model.snapshot_kind, format=model.snapshot_format, step=1, total=3,
        params=plain_params({**checked.checked, "seed": 5}),
    )
    model.validated = 0
    request = check_checkpointed(model, checked, resume=resume, checkpoint_every=None, request_id="r")
    # The checkpoint's params (restored_params validates them), not the ones given.
    assert model.validated == 1 and request.params["seed"] == 5 and request.total == 3


class _Raises(Synthetic):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        raise self.exc


@pytest.mark.parametrize("exc", [ValueError("bad value"), TypeError("bad type"), KeyError("key")])
def test_what_a_model_raises_on_odd_params_is_a_params_error_naming_it(exc):
    with pytest.raises(om.ParamsError) as info:
        check_request(_Raises(exc), {}, request_id="r")
    assert info.value.message == f"synthetic: {exc}" and info.value.request_id == "r"
    assert info.value.__cause__ is exc


def test_anything_else_a_model_raises_propagates_as_it_is():
    boom = RuntimeError("a bug in the model")
    with pytest.raises(RuntimeError) as info:
        check_request(_Raises(boom), {}, request_id="r")
    assert info.value is boom


@pytest.mark.parametrize("total", [0, -1, 2.0, "3", None])
def test_a_step_count_that_is_not_a_positive_int_is_the_models_fault_said(total):
    class BadTotal(Synthetic):
        def total_steps(self, params: Mapping[str, Any]) -> Any:
            return total

    with pytest.raises(om.ParamsError) as info:
        check_request(BadTotal(), params(steps=2), request_id="r")
    assert info.value.message == f"synthetic.total_steps()'s count must be a positive integer, got {total!r}"
    assert (info.value.field, info.value.request_id) == ("steps", "r")


def test_as_params_error_translates_for_a_facades_own_model_calls():
    with pytest.raises(om.ParamsError) as info, as_params_error(Synthetic(), "r"):
        raise KeyError("shape")
    assert (info.value.message, info.value.request_id) == ("synthetic: 'shape'", "r")
    with as_params_error(Synthetic(), "r"):
        pass  # nothing raised, nothing done
