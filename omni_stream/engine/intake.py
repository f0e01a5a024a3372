"""The intake: every check of a request's ``stream()`` / ``generate()`` arguments, written once (pure).

``Engine``, ``EngineGroup`` and a Ray ``RemoteEngine`` take the same
arguments and must refuse the same ones with the same words; each used to
check them itself, and the rules drifted (a request id was 256 characters
of anything in one, unbounded in another, 128 from a charset on the wire).
So, as vLLM's ``InputProcessor`` sits in front of its engines, every
facade hands its arguments to :func:`check_request` and gets one
:class:`CheckedRequest` back::

    Engine.stream ──────▶ check_request(model) ──▶ Engine.submit ──▶ the table
    EngineGroup.stream ─▶ check_request(member 0's model) ──route──▶ member.submit
    RemoteEngine.stream ▶ check_request(the model card) ──Submit──▶ a replica (whose Engine checks again)

The params are validated once in a process (issue #36): :func:`check_params`
makes a :class:`CheckedParams`, and a facade of the model that made it takes
it as checked. The server validates what it admits and hands the engine
that; a caller of ``Engine.stream`` from Python hands plain params, which
are validated here.

What stays with a facade is what only it knows: whether it is open, which
ids it holds (:func:`already_running` words the refusal), where a request
goes (a group's routing), what else it takes (a remote engine's ``render``).
The facades check the id first (:func:`check_request_id`), so every later
error carries it; the id rule itself is :mod:`omni_stream.ids`, shared
with the wire and the client.

Every error is a ParamsError naming the field and carrying the request id,
except the id's own refusal: a refused id is not attached, as it may be
anything (megabytes, a newline) and the message quotes it shortened.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import CheckpointError, ParamsError
from ..ids import id_problem
from ..model import StepModel, split_output
from ..params import drawn, positive_int
from .delivery import POLICIES
from .scheduler import PRIORITY_MAX, PRIORITY_MIN

__all__ = [
    "CheckedParams",
    "CheckedRequest",
    "already_running",
    "as_params_error",
    "check_checkpointed",
    "check_params",
    "check_request",
    "check_request_id",
]


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request whose arguments passed :func:`check_request`: what a facade submits.

    ``params`` are the model's checked params (defaults filled in, with
    ``output`` unless the model declares it itself); ``total`` is its step
    count; ``timeout`` is in seconds (a float) or None for the default bound.
    """

    request_id: str
    params: dict[str, Any]
    total: int
    policy: str
    timeout: float | None
    preview_every: int | None
    priority: int
    #: The caller's params with the values validation drew put in (:class:`CheckedParams`): what
    #: a check of this request elsewhere is given (a Ray replica's model). Not compared: ``params``
    #: is what runs.
    pinned: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


class CheckedParams(Mapping[str, Any]):
    """A request's params that ``model.validate`` passed (:func:`check_params`): a facade of
    that same model takes them without validating them again.

    ``checked`` is what the model made of them (defaults filled in, a seed
    drawn, ``output``). As a mapping they read as the caller's params with
    the values validation drew put in: what any other check of the request
    is given, so that it runs with the same seed rather than a second draw
    (a Ray replica's model, as its card checks less; a server's state
    directory, checked again after a restart; an engine of another model or
    one that does not know this type). ``checked`` is not that: a model's
    ``validate`` need not take its own output back (its LoRAs come out as
    tuples that it refuses as input).
    """

    __slots__ = ("_pinned", "checked", "model")

    def __init__(self, model: StepModel, pinned: Mapping[str, Any], checked: dict[str, Any]) -> None:
        self.model = model
        self.checked = checked
        self._pinned = dict(pinned)

    def __getitem__(self, key: str) -> Any:
        return self._pinned[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pinned)

    def __len__(self) -> int:
        return len(self._pinned)

    def __repr__(self) -> str:
        return f"CheckedParams({self._pinned!r}, model={self.model.name!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to another process), they go as the plain dict they read as: trust stays in
        # the process whose model checked them, and the model (its weights) stays too.
        return (dict, (self._pinned,))


def check_params(model: StepModel, params: Mapping[str, Any] | None) -> CheckedParams:
    """``params`` validated by ``model`` (``output`` split off and put back: ``split_output``).

    CheckedParams that ``model`` itself made come back as they are: that is
    how a request is validated once (the server's, then its engine's
    intake). Others are validated as they read. Raises what
    ``model.validate`` raises (``as_params_error`` words it).
    """
    if isinstance(params, CheckedParams) and params.model is model:
        return params
    rest, output = split_output(model, params)
    checked = model.validate(rest)
    if output is not None:
        checked["output"] = output
    given = params if isinstance(params, Mapping) else {}
    return CheckedParams(model, {**given, **drawn(model.params, checked)}, checked)


def check_request_id(value: object) -> str:
    """``value`` if it is a request id, a fresh one (uuid4 hex) for None.

    Raises ParamsError (field ``request_id``) saying the rule (omni_stream/ids.py)
    for anything else.
    """
    if value is None:
        return uuid.uuid4().hex
    problem = id_problem(value, name="request_id")
    if problem is not None:
        raise ParamsError(problem, field="request_id")
    assert isinstance(value, str)  # id_problem refuses every non-string
    return value


def already_running(request_id: str) -> ParamsError:
    """The error refusing ``request_id`` while a request of that id runs: every facade raises this one."""
    return ParamsError(
        f"request_id {request_id!r} is already running", field="request_id", request_id=request_id
    )


@contextmanager
def as_params_error(model: StepModel, request_id: str) -> Iterator[None]:
    """Inside, what ``model`` raises about a request's params becomes a ParamsError carrying ``request_id``.

    Its own ParamsError gets the id; ValueError, TypeError and KeyError
    (what a model's ``validate``, ``total_steps`` or ``batch_key`` raises
    on params it did not expect) become ParamsError naming the model, the
    original as the cause. Anything else propagates as it is.
    """
    try:
        yield
    except ParamsError as exc:
        exc.request_id = request_id
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ParamsError(f"{model.name}: {exc}", request_id=request_id) from exc


def check_request(
    model: StepModel,
    params: Mapping[str, Any] | None,
    *,
    request_id: str | None = None,
    policy: str = "all",
    timeout: float | None = None,
    preview_every: int | None = None,
    priority: int = 0,
) -> CheckedRequest:
    """Check every argument of ``stream()`` (its defaults are these) against ``model``.

    In order: the id (None gets a fresh one), ``policy`` ("all" or
    "latest"), ``timeout`` (a positive finite number of seconds, or None),
    ``preview_every`` (a positive int, or None), ``priority`` (an int from
    -10 to 10), the params through :func:`check_params` (not validated again
    when ``model`` made them: a server's), and the step count
    ``model.total_steps`` gives (a positive int).
    Raises ParamsError naming the field, carrying the request id.
    """
    request_id = check_request_id(request_id)
    if policy not in POLICIES:
        raise ParamsError(
            f"policy must be one of {', '.join(POLICIES)}, got {policy!r}",
            field="policy",
            request_id=request_id,
        )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ParamsError(
            f"timeout must be a positive number of seconds, got {timeout!r}",
            field="timeout",
            request_id=request_id,
        )
    if preview_every is not None:
        positive_int(preview_every, "preview_every", request_id=request_id)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise ParamsError(
            f"priority must be an int from {PRIORITY_MIN} to {PRIORITY_MAX}, got {priority!r}",
            field="priority",
            request_id=request_id,
        )
    with as_params_error(model, request_id):
        pinned = check_params(model, params)
        # Its own dict: the server that made ``pinned`` keeps reading its ``checked``.
        checked = dict(pinned.checked)
        total = model.total_steps(checked)
    positive_int(total, "steps", what=f"{model.name}.total_steps()'s count", request_id=request_id)
    return CheckedRequest(
        request_id=request_id,
        params=checked,
        total=total,
        policy=policy,
        timeout=None if timeout is None else float(timeout),
        preview_every=preview_every,
        priority=priority,
        pinned=pinned,
    )


def check_checkpointed(
    model: StepModel,
    params: Mapping[str, Any] | None,
    *,
    resume: Checkpoint | None,
    checkpoint_every: int | None,
    **options: Any,
) -> CheckedRequest:
    """:func:`check_request` for a request that resumes from ``resume`` or is checkpointed every
    ``checkpoint_every`` steps (``options``: the rest of check_request's keywords).

    A resumed request runs with the checkpoint's params (``params`` is not
    read) and must make its step count. Raises CheckpointError (a checkpoint
    the model refuses, or checkpoints of a model or request that cannot be
    snapshot), ParamsError as check_request does and for a bad
    ``checkpoint_every``.
    """
    request_id = options.get("request_id")
    if resume is not None:
        # CheckpointError: not this model's, or stale. Validated there (with ``output``), so
        # check_request takes them as checked: still one validation for the request.
        restored = model.restored_params(resume)
        params = CheckedParams(model, restored, restored)
    checked = check_request(model, params, **options)
    if resume is not None and checked.total != resume.total:
        raise CheckpointError(
            f"the checkpoint is of a {resume.total}-step request; these params make {checked.total} steps",
            request_id=checked.request_id,
        )
    if (resume is not None or checkpoint_every is not None) and not model.can_snapshot(checked.params):
        raise CheckpointError(
            f"{model.name} cannot snapshot this request (docs/models.md, 'Snapshot and restore')",
            request_id=checked.request_id,
        )
    if checkpoint_every is not None:
        positive_int(checkpoint_every, "checkpoint_every", request_id=request_id)
    return checked
