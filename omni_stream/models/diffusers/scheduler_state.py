"""A diffusers scheduler's per-request state as checkpoint data, and back.

``scheduler.step`` reads and writes attributes that differ by class: the
step index, the earlier model outputs of multistep solvers
(``model_outputs``, ``lower_order_nums``, ``last_sample``: DPM-Solver++,
UniPC, DEIS), the half-step of second-order ones (``prev_derivative``,
``dt``, ``sample``: Heun, DPM2), PNDM's ``ets`` and ``counter``, LMS's
``derivatives``. Rather than list them per class (and miss the next
diffusers release's), :func:`capture` compares the request's scheduler with
a *fresh* one, built and set the way the loop builds it for the same
request, and keeps every attribute whose value differs; :func:`apply` sets
those on another fresh one. What ``set_timesteps`` made (timesteps, sigmas)
is equal in both and is not written down.

Values are tagged JSON so that types come back as they were (a tuple stays
a tuple, a numpy scalar stays one, a CPU tensor stays on the CPU while
device tensors go to the restoring device). An attribute of any other type
(torchsde's Brownian tree in DPMSolverSDEScheduler, a user's object) makes
:func:`capture` raise CheckpointError: a snapshot is exact or refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointError

__all__ = ["apply", "capture"]


def capture(scheduler: Any, fresh: Any, prefix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``scheduler``'s attributes that differ from ``fresh``'s: ``(values, tensors)`` for a Checkpoint.

    Tensors are copied to the CPU under names starting ``prefix + "."``.
    Raises CheckpointError for an attribute of a type a checkpoint cannot
    hold.
    """
    state, base = vars(scheduler), vars(fresh)
    tensors: dict[str, torch.Tensor] = {}
    changed = {}
    for name, value in state.items():
        if name in base and _same(value, base[name]):
            continue
        try:
            changed[name] = _encode(value, f"{prefix}.{name}", tensors)
        except CheckpointError as exc:
            raise CheckpointError(
                f"{type(scheduler).__name__}.{name} cannot be written down: {exc.message}"
            ) from None
    removed = sorted(set(base) - set(state))
    return {"changed": changed, "removed": removed}, tensors


def apply(
    scheduler: Any, values: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Set what :func:`capture` wrote on a fresh ``scheduler`` (built as that one's fresh one was).

    Raises CheckpointError for values that are not :func:`capture`'s.
    """
    try:
        changed, removed = values["changed"], values["removed"]
        attrs = vars(scheduler)
        decoded = {name: _decode(value, tensors, device) for name, value in changed.items()}
        for name in removed:
            attrs.pop(name, None)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed values: the checkpoint is not ours
        raise CheckpointError(f"the checkpoint's scheduler state cannot be read: {exc!r:.200}") from exc
    # Into the instance dict, as the loop's undo does (loop.Saved): a property
    # such as step_index has no setter, its backing _step_index does.
    attrs.update(decoded)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are equal values of one type (tensors: also dtype and device)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality: treat as changed
        return False


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    # Every value is a tagged list: [tag, ...]. JSON keeps lists and strings only.
    if value is None or type(value) in (bool, int, float, str):
        return ["v", value]
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu", copy=True)
        return ["t", key, value.device.type == "cpu"]
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise CheckpointError("a numpy array of Python objects")
        tensors[key] = torch.from_numpy(np.array(value, copy=True))
        return ["n", key]
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return ["s", value.dtype.str, value.item()]
    if type(value) in (list, tuple):
        items = [_encode(item, f"{key}.{i}", tensors) for i, item in enumerate(value)]
        return ["l" if type(value) is list else "u", items]
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return ["d", {k: _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}]
    raise CheckpointError(f"a {type(value).__module__}.{type(value).__qualname__}")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    tag = value[0]
    if tag == "v":
        return value[1]
    if tag == "t":
        tensor = tensors[value[1]]
        # The scheduler keeps some tensors on the CPU on purpose (sigmas:
        # no device sync per step); those stay there.
        return tensor.clone() if value[2] else tensor.to(device, copy=True)
    if tag == "n":
        return tensors[value[1]].numpy().copy()
    if tag == "s":
        return np.dtype(value[1]).type(value[2])
    if tag in ("l", "u"):
        items = [_decode(item, tensors, device) for item in value[1]]
        return items if tag == "l" else tuple(items)
    if tag == "d":
        return {k: _decode(v, tensors, device) for k, v in value[1].items()}
    raise CheckpointError(f"unknown scheduler value tag {tag!r}")
