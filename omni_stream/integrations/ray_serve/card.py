"""ModelCard: what the front door needs of a model that runs somewhere else.

A replica builds a card from its model (``ModelCard.of(model)``) and the
front door gets it pickled: the name, ``describe()``, the declared params
and the attributes the server and the preview code read
(``produces_video``, ``runs_whole_requests``, ``preview_decoder``,
``dtype``, ``max_batch_size``) and whether it can snapshot a request
(``can_snapshot``: for the default params and each ``sampler``; a state
directory in front asks for checkpoints by it). No weights, no tensors: a card of a
diffusers pipeline is a few kilobytes.

A card is a StepModel, so the server's own checks run on it unchanged, but
it checks less than the model: ``validate`` applies the declared params
(types, bounds, choices, unknown names) and nothing a model's own
``validate`` adds (Synthetic's value cap, a diffusers size multiple, an
input image's contents). The replica's engine validates again with the
real model, and what it refuses reaches the reader as the replica's
ParamsError on the first ``__anext__``. ``total_steps`` reads a table the
replica filled in from the real model (schedulers whose step count differs
from ``steps``: PNDM gives steps + 1, Heun 2 * steps - 1), else ``steps``;
for a request naming another ``sampler`` than the default, the rule
``a * steps + b`` the replica found for that sampler (checked at three
counts);
the replica's figure, sent ahead of the first frame, is the one a
RemoteStream reports once it has it. A card never computes: ``start`` and
``step`` raise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ParamsError
from ...model import StepModel
from ...models.diffusers.loras import check_request_loras, split_loras
from ...params import Param

__all__ = ["ModelCard"]

logger = logging.getLogger("omni_stream.ray_serve")

#: How long a replica spends filling in the step-count table, at most.
_TOTALS_BUDGET_S = 0.5
#: How long a replica spends finding the samplers' step rules, at most.
_RULES_BUDGET_S = 2.0
#: How long a replica spends asking its model which samplers it can snapshot, at most.
_SNAPSHOT_BUDGET_S = 1.0
#: The largest ``steps`` value the table covers.
_TOTALS_MAX_STEPS = 250


@dataclass(frozen=True, slots=True)
class _Facts:
    """The picklable part of a card (one object, so the card pickles as one)."""

    name: str
    description: str
    params: tuple[Param, ...]
    max_batch_size: int
    produces_video: bool
    runs_whole_requests: bool
    preview_decoder: str | None
    dtype: torch.dtype | None
    #: ``steps`` -> the model's total_steps, only where the two differ.
    totals: dict[int, int] = field(default_factory=dict)
    #: total_steps of the default params, for a model with no ``steps`` param.
    default_total: int | None = None
    #: Whether the replica's model decodes previews with a tiny autoencoder.
    has_preview_vae: bool = False
    #: sampler -> (a, b): its total_steps is a * steps + b (other samplers than the default).
    sampler_rules: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The LoRAs a request may name (None: the model takes no ``loras``).
    lora_names: tuple[str, ...] | None = None
    #: Whether the model can snapshot a request of its default params, and the
    #: ``sampler`` choices for which the answer is the other one.
    snapshots: bool = False
    snapshot_samplers: frozenset[str] = frozenset()


class ModelCard(StepModel):
    """A stand-in for a model running on a replica: its metadata, no weights (see the module docstring)."""

    def __init__(self, facts: _Facts) -> None:
        self._facts = facts
        self.name = facts.name
        self.params = facts.params
        self.max_batch_size = facts.max_batch_size
        self.produces_video = facts.produces_video
        self.runs_whole_requests = facts.runs_whole_requests
        self.preview_decoder = facts.preview_decoder
        # Read by preview.check_decoder ("taesd" needs one): a flag standing
        # for the replica's autoencoder, which stays on the replica.
        self.preview_vae: bool | None = True if facts.has_preview_vae else None
        if facts.dtype is not None:
            self.dtype = facts.dtype
        if facts.lora_names is not None:
            self.lora_names = facts.lora_names

    @classmethod
    def of(cls, model: StepModel) -> ModelCard:
        """The card of ``model`` (on the replica, after loading it); reads, never steps it."""
        dtype = getattr(model, "dtype", None)
        params = tuple(getattr(model, "params", ()))
        facts = _Facts(
            name=str(model.name),
            description=str(model.describe()),
            params=params,
            max_batch_size=int(getattr(model, "max_batch_size", 1)),
            produces_video=bool(getattr(model, "produces_video", False)),
            runs_whole_requests=bool(getattr(model, "runs_whole_requests", False)),
            preview_decoder=getattr(model, "preview_decoder", None),
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            totals=_step_counts(model, params),
            default_total=_default_total(model, params),
            has_preview_vae=getattr(model, "preview_vae", None) is not None,
            sampler_rules=_sampler_rules(model, params),
            lora_names=tuple(model.lora_names) if hasattr(model, "lora_names") else None,
            **_snapshot_facts(model, params),
        )
        return cls(facts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelCard, (self._facts,))

    def __repr__(self) -> str:
        return f"<ModelCard {self.name!r}: {len(self.params)} params>"

    # -- what the front door calls ---------------------------------------------

    def describe(self) -> str:
        return self._facts.description

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """The declared params' checks; ``loras`` against the replica's loaded names, where it takes them."""
        if self._facts.lora_names is None:
            return super().validate(params)
        params, loras = split_loras(params)
        out = super().validate(params)
        # The prompt's <lora:name:weight> tags too, as the replica's model reads them: refused
        # here, at the front door, with the words the replica would use.
        out["prompt"], out["loras"] = check_request_loras(
            out.get("prompt"), loras, self._facts.lora_names, model=self.name
        )
        if out["prompt"] is None:
            del out["prompt"]
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        """The replica model's step count for ``params``: its table (its sampler's rule), else ``steps``.

        Raises ParamsError when the model has no ``steps`` param and its
        default count is unknown.
        """
        steps = params.get("steps") if isinstance(params, Mapping) else None
        if isinstance(steps, int) and not isinstance(steps, bool):
            rule = self._facts.sampler_rules.get(str(params.get("sampler")))
            if rule is not None:
                return rule[0] * steps + rule[1]
            return self._facts.totals.get(steps, steps)
        if self._facts.default_total is not None:
            return self._facts.default_total
        raise ParamsError(
            f"{self.name}: the step count is unknown at the front door; pass params['steps']",
            field="steps",
        )

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        return None

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        """What the replica's model answers for the default params, or for the request's
        ``sampler`` (the only param the card tells apart). The replica asks its model for each
        request and says in its Header whether it sends checkpoints."""
        sampler = params.get("sampler") if isinstance(params, Mapping) else None
        differs = isinstance(sampler, str) and sampler in self._facts.snapshot_samplers
        return self._facts.snapshots != differs

    def start(self, params: Mapping[str, Any], device: torch.device) -> Any:
        raise TypeError(f"ModelCard {self.name!r} stands in for a remote model; it cannot run")

    def step(self, states: Sequence[Any]) -> Sequence[torch.Tensor]:
        raise TypeError(f"ModelCard {self.name!r} stands in for a remote model; it cannot run")


def _defaults(params: Sequence[Param]) -> dict[str, Any]:
    return {p.name: p.default for p in params}


def _step_counts(model: StepModel, params: Sequence[Param]) -> dict[int, int]:
    """``steps`` -> total_steps where they differ, for the model's ``steps`` range, time-bounded."""
    spec = next((p for p in params if p.name == "steps" and p.kind == "int"), None)
    if spec is None:
        return {}
    low = max(1, int(spec.minimum or 1))
    high = min(int(spec.maximum or _TOTALS_MAX_STEPS), _TOTALS_MAX_STEPS)
    base = _defaults(params)
    out: dict[int, int] = {}
    deadline = time.monotonic() + _TOTALS_BUDGET_S
    for steps in range(low, high + 1):
        if time.monotonic() > deadline:
            logger.info("%s: step counts tabled up to steps=%d (time budget)", model.name, steps - 1)
            break
        try:
            total = model.total_steps({**base, "steps": steps})
        except Exception:  # noqa: BLE001 - a count the model refuses: the replica says so per request
            continue
        if isinstance(total, int) and total != steps:
            out[steps] = total
    return out


def _sampler_rules(model: StepModel, params: Sequence[Param]) -> dict[str, tuple[int, int]]:
    """For each non-default ``sampler`` choice whose count is not ``steps``: ``(a, b)`` with
    total_steps = a * steps + b at steps 4, 8 and 12 (Heun and DPM2: (2, -1); PNDM with its
    Runge-Kutta warm-up: (1, 9)). Small counts: each is a dry run of the scheduler."""
    spec = next((p for p in params if p.name == "sampler" and p.choices), None)
    if spec is None or not any(p.name == "steps" for p in params):
        return {}
    base = _defaults(params)
    rules: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + _RULES_BUDGET_S
    for name in spec.choices or ():
        if name == spec.default:
            continue
        if time.monotonic() > deadline:
            logger.info("%s: sampler step rules stopped before %r (time budget)", model.name, name)
            break
        try:
            counts = [model.total_steps({**base, "sampler": name, "steps": n}) for n in (4, 8, 12)]
        except Exception:  # noqa: BLE001 - the replica says so per request
            continue
        a = (counts[1] - counts[0]) // 4
        b = counts[0] - 4 * a
        if counts[2] == 12 * a + b and (a, b) != (1, 0):
            rules[name] = (a, b)
    return rules


def _snapshot_facts(model: StepModel, params: Sequence[Param]) -> dict[str, Any]:
    """Whether ``model`` can snapshot a request of its default params, and the samplers that
    answer otherwise (``can_snapshot`` is cheap: a look at the params)."""

    def can(given: Mapping[str, Any]) -> bool:
        try:
            return bool(model.can_snapshot(model.validate(given)))
        except Exception:  # noqa: BLE001 - a request it cannot check cannot be snapshot either
            return False

    default = can({})
    spec = next((p for p in params if p.name == "sampler" and p.choices), None)
    choices = (spec.choices or ()) if spec is not None else ()
    others: set[str] = set()
    deadline = time.monotonic() + _SNAPSHOT_BUDGET_S
    for name in choices:
        if time.monotonic() > deadline:
            # The rest are taken to answer as the default does; the replica asks its model per request.
            logger.info("%s: snapshot facts stopped before sampler %r (time budget)", model.name, name)
            break
        if can({"sampler": name}) != default:
            others.add(str(name))
    return {"snapshots": default, "snapshot_samplers": frozenset(others)}


def _default_total(model: StepModel, params: Sequence[Param]) -> int | None:
    try:
        total = model.total_steps(_defaults(params))
    except Exception:  # noqa: BLE001 - no default count: the card then asks for ``steps``
        return None
    return total if isinstance(total, int) and total >= 1 else None
