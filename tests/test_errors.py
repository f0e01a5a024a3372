"""errors.py: the tree, and every error's pickle round trip (a new class cannot be left out)."""

from __future__ import annotations

import copy
import inspect
import pickle
import threading

import pytest

import omni_stream as om
from omni_stream import errors

#: Every exception class defined in errors.py, found by looking, not listed by hand.
ERROR_CLASSES = sorted(
    (
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)

#: A value for each constructor argument any error takes. A new class with an
#: argument not here fails test_every_error_can_be_built, naming it.
SAMPLE_ARGS = {
    "message": "step 3/8 went wrong",
    "request_id": "req-7",
    "field": "steps",
    "step": 3,
    "bound_s": 2.5,
    "code": "step_failed",
    "status": 503,
    "close_code": 1011,
    "close_reason": "server going away",
    "reason": "disconnect",
    "limit": "max_pending",
    "retry_after_s": 4.0,
    "param": "size",
    "type": "invalid_request_error",
}


def build(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` with every argument its constructor accepts set."""
    kwargs = {}
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name not in SAMPLE_ARGS:
            raise AssertionError(f"{cls.__name__}({name}=...): add a sample value to SAMPLE_ARGS")
        kwargs[name] = SAMPLE_ARGS[name]
    return cls(**kwargs)  # by keyword: MessageError takes ``code`` before ``message``


def caused(exc: BaseException) -> BaseException:
    """``exc`` raised from a chain of two foreign exceptions, as ``raise ... from`` leaves it."""
    try:
        try:
            try:
                raise KeyError("the bottom")
            except KeyError as bottom:
                raise ValueError("the middle") from bottom
        except ValueError as middle:
            raise exc from middle
    except BaseException as raised:
        return raised
    raise AssertionError("unreachable")


def chain(exc: BaseException | None) -> list[tuple[type, str]]:
    out = []
    while exc is not None:
        out.append((type(exc), str(exc)))
        exc = exc.__cause__
    return out


def test_the_classes_found_are_the_public_ones():
    assert {cls.__name__ for cls in ERROR_CLASSES} == set(errors.__all__)
    assert all(issubclass(cls, errors.OmniStreamError) for cls in ERROR_CLASSES)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_can_be_built(cls):
    exc = build(cls)
    assert exc.message == SAMPLE_ARGS["message"]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_survives_pickle_with_its_attributes_and_cause_chain(cls, protocol):
    original = caused(build(cls))
    if hasattr(original, "add_note"):  # Python 3.11+: notes live in __dict__ and travel with it
        original.add_note("seen by the test")
    back = pickle.loads(pickle.dumps(original, protocol=protocol))
    assert type(back) is cls
    assert str(back) == str(original) and back.args == original.args
    assert vars(back) == vars(original)  # message, request_id, step, reason, notes...
    assert back.request_id == original.request_id
    assert chain(back) == chain(original)
    assert chain(back)[1:] == [(ValueError, "the middle"), (KeyError, "'the bottom'")]
    assert back.__suppress_context__


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_copy_uses_the_same_path(cls):
    original = caused(build(cls))
    for twin in (copy.copy(original), copy.deepcopy(original)):
        assert type(twin) is cls and vars(twin) == vars(original)
        assert chain(twin) == chain(original)


def test_a_chain_through_our_own_errors_keeps_every_link():
    bottom = om.StepFailedError("the model raised", request_id="a", step=2)
    bottom.__cause__ = RuntimeError("CUDA error: device-side assert")
    middle = RuntimeError("wrapped by user code")
    middle.__cause__ = bottom
    top = om.EngineDeadError("the engine died", request_id="a")
    top.__cause__ = middle
    back = pickle.loads(pickle.dumps(top))
    assert chain(back) == chain(top)
    assert back.__cause__.__cause__.step == 2


class _KeywordOnly(Exception):
    def __init__(self, *, detail: str) -> None:
        super().__init__(f"detail: {detail}")


def test_a_cause_that_cannot_travel_arrives_as_a_stand_in():
    # Unpicklable state, and an __init__ its args do not satisfy: either one
    # would otherwise fail the whole round trip (the second only on loads).
    holding_a_lock = RuntimeError("holds a lock")
    holding_a_lock.lock = threading.Lock()
    for cause, kind in [(holding_a_lock, "RuntimeError"), (_KeywordOnly(detail="x"), "_KeywordOnly")]:
        exc = om.StepFailedError("the model raised", request_id="r", step=1)
        exc.__cause__ = cause
        back = pickle.loads(pickle.dumps(exc))
        assert back.step == 1 and back.request_id == "r"
        assert type(back.__cause__) is Exception
        assert kind in str(back.__cause__) and str(cause) in str(back.__cause__)


def test_a_cyclic_cause_chain_does_not_loop():
    a = om.EngineDeadError("a")
    b = RuntimeError("b")
    a.__cause__ = b
    b.__cause__ = a
    back = pickle.loads(pickle.dumps(a))
    assert str(back.__cause__) == "b"


def test_one_error_for_the_wrong_state_and_it_is_still_a_runtime_error():
    # Server and Client raised RuntimeError before LifecycleError existed.
    assert issubclass(errors.LifecycleError, RuntimeError)
    assert issubclass(errors.EngineClosedError, errors.LifecycleError)
    assert issubclass(errors.EngineClosedError, errors.EngineError)
    assert issubclass(errors.PoolClosedError, errors.LifecycleError)


def test_the_old_homes_of_moved_errors_still_import():
    from omni_stream.client import BusyError
    from omni_stream.device import PoolClosedError
    from omni_stream.protocol import MessageError
    from omni_stream.server.app import ServerFailedError
    from omni_stream.core.outbox import OutboxOverflowError
    from omni_stream.openai import OpenAIError
    from omni_stream.preview import NonFiniteFrameError
    from omni_stream.server.bodies import BodyRefused

    assert (BusyError, PoolClosedError, MessageError, ServerFailedError, OutboxOverflowError) == (
        errors.BusyError, errors.PoolClosedError, errors.MessageError,
        errors.ServerFailedError, errors.OutboxOverflowError,
    )
    assert (OpenAIError, NonFiniteFrameError, BodyRefused) == (
        errors.OpenAIError, errors.NonFiniteFrameError, errors.BodyRefused,
    )


def test_the_errors_that_joined_the_tree_are_caught_and_read_as_before():
    from omni_stream.openai.errors import error_body

    # Callers caught NonFiniteFrameError as a ValueError, and built an OpenAI
    # answer from str(BodyRefused) and OpenAIError's fields.
    assert issubclass(errors.NonFiniteFrameError, ValueError)
    assert str(errors.BodyRefused(413, "limit_exceeded", "too big")) == "too big"
    refused = errors.OpenAIError(400, "bad size", "invalid_field", param="size")
    assert (refused.status, refused.code, refused.param, refused.type) == (
        400, "invalid_field", "size", "invalid_request_error"
    )
    # One shape, spelled twice (errors.py imports nothing of the package): kept equal here.
    assert refused.body() == error_body(
        "bad size", type="invalid_request_error", param="size", code="invalid_field"
    )


def test_every_class_in_the_tree_is_drawn_in_the_docstring():
    drawn = errors.__doc__ or ""
    missing = [cls.__name__ for cls in ERROR_CLASSES if f" {cls.__name__} " not in drawn]
    assert not missing, f"errors.py's docstring does not draw {missing}"
