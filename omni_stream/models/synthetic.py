"""Synthetic: a load-and-fault model for benchmarks and chaos tests.

Each step burns real compute (``work`` rounds of a 128x128 matmul per
request, batched across requests like a real network) and returns a frame
that is a pure elementwise function of ``seed`` and the step index, so the
same params give bit-identical frames alone or in any batch: the load never
feeds into the frame, because a batched matmul may round differently from
a solo one.

Faults: ``fail_at`` makes that step raise (before any state is touched, as
the model contract asks); ``hang_at`` with ``hang_s`` blocks the producer
thread inside that step, the way a wedged kernel would.

Snapshot and restore: a request's state is its frame so far, its load
operand and its step index (the pattern it relaxes towards is redrawn from
the seed), so a restored request goes on bit for bit.

Its params are bounded so that one request over the wire cannot take the
machine: a frame holds at most ``MAX_ELEMENTS`` values, a step at most
``MAX_WORK`` rounds, a hang at most ``MAX_HANG_S`` seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import Checkpoint, plain_params
from ..errors import CheckpointError, ParamsError
from ..model import StepModel
from ..params import Param, seed_param

__all__ = ["MAX_ELEMENTS", "MAX_HANG_S", "MAX_WORK", "Synthetic", "SyntheticFault"]

_WORK_DIM = 128
#: Values in one frame: 4 Mi, a [4, 1024, 1024] latent or a [3, 1024, 1024]
#: image (16 MiB in float32). A request holds several such tensors (its
#: state, its target, frames in flight, previews), so the product of the
#: sides is what must be bounded, not each side.
MAX_ELEMENTS = 4 * 1024 * 1024
#: Matmul rounds per step: ~0.1-0.2 s of one core at most. Not lower: the
#: benchmarks calibrate work for steps of tens of ms, a few hundred rounds
#: on a fast core. Every step of a batch waits for it, so 10,000 (~1 s)
#: made one client's request slow everyone's.
MAX_WORK = 1000
#: A hang holds the producer thread, so every request waits it out: ten
#: minutes is longer than any step timeout worth testing, not a day.
MAX_HANG_S = 600.0


class SyntheticFault(RuntimeError):
    """Raised by Synthetic at ``fail_at``."""


@dataclass
class _State:
    params: Mapping[str, Any]
    x: torch.Tensor  # the frame's evolving value, shape == params["shape"]
    base: torch.Tensor  # fixed per-seed pattern the frame relaxes towards
    load: torch.Tensor  # (_WORK_DIM, _WORK_DIM) matmul operand; never feeds a frame
    step: int = 0  # steps completed


class Synthetic(StepModel):
    """Synthetic load-and-fault model: tunable compute, exact frames, injected failures and hangs."""

    name = "synthetic"
    params = (
        Param("steps", "int", 20, "frames to produce", minimum=1, maximum=100_000),
        Param(
            "shape",
            "shape",
            [4, 64, 64],
            f"frame shape (at most {MAX_ELEMENTS} values in all)",
            minimum=1,
            maximum=4096,
            max_len=5,
        ),
        Param(
            "work",
            "int",
            1,
            "rounds of a 128x128 matmul per step (~0.05-0.2 ms each)",
            minimum=0,
            maximum=MAX_WORK,
        ),
        seed_param(),
        Param("fail_at", "int", None, "this step raises SyntheticFault", minimum=1),
        Param("hang_at", "int", None, "this step blocks for hang_s seconds", minimum=1),
        Param("hang_s", "float", MAX_HANG_S, "how long hang_at blocks", minimum=0.0, maximum=MAX_HANG_S),
    )

    def __init__(self, *, max_batch_size: int = 64, dtype: torch.dtype = torch.float32) -> None:
        self.max_batch_size = max_batch_size
        self.dtype = dtype
        self._weight: torch.Tensor | None = None
        self._device = torch.device("cpu")

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params; raises ParamsError naming the field (``shape`` over MAX_ELEMENTS values)."""
        out = super().validate(params)
        count = math.prod(out["shape"])
        if count > MAX_ELEMENTS:
            raise ParamsError(
                f"{self.name} param 'shape': {list(out['shape'])} holds {count} values; "
                f"at most {MAX_ELEMENTS} are allowed",
                field="shape",
            )
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        return int(params["steps"])

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        # Any step index batches with any other; shapes must match to stack.
        return (tuple(params["shape"]), int(params["work"]))

    def load(self, device: torch.device) -> None:
        gen = torch.Generator(device="cpu").manual_seed(12345)
        weight = torch.randn(_WORK_DIM, _WORK_DIM, generator=gen) / _WORK_DIM**0.5
        self._weight = weight.to(device=device, dtype=self.dtype)
        self._device = device

    def start(self, params: Mapping[str, Any], device: torch.device) -> _State:
        if self._weight is None or self._device != device:
            self.load(device)
        gen = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        shape = tuple(params["shape"])
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        base = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1
        load = torch.randn(_WORK_DIM, _WORK_DIM, generator=gen, dtype=torch.float32)
        return _State(
            params=params,
            x=x.to(device=device, dtype=self.dtype),
            base=base.to(device=device, dtype=self.dtype),
            load=load.to(device=device, dtype=self.dtype),
        )

    def step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        # Faults first: a raising step must leave every state untouched.
        for s in states:
            n = s.step + 1
            if s.params["fail_at"] == n:
                raise SyntheticFault(f"synthetic failure injected at step {n}")
        for s in states:
            if s.params["hang_at"] == s.step + 1:
                time.sleep(float(s.params["hang_s"]))
        work = int(states[0].params["work"])
        if work:
            assert self._weight is not None
            load = torch.stack([s.load for s in states])
            for _ in range(work):
                load = torch.tanh(load @ self._weight)
            for s, row in zip(states, load.unbind(0), strict=True):
                s.load = row
        # Frame i relaxes from noise towards `base`; elementwise only, so
        # batching cannot change a bit. Per-sample factors stay per sample.
        xs = torch.stack([s.x for s in states])
        total = torch.tensor([float(s.params["steps"]) for s in states], dtype=torch.float32)
        done = torch.tensor([float(s.step + 1) for s in states], dtype=torch.float32)
        alpha = (done / total).to(device=xs.device, dtype=xs.dtype)
        alpha = alpha.view(-1, *([1] * (xs.dim() - 1)))
        bases = torch.stack([s.base for s in states])
        new = xs * (1 - alpha) + bases * alpha
        frames = []
        for s, row in zip(states, new.unbind(0), strict=True):
            s.x = row
            s.step += 1
            frames.append(row)
        return frames

    # -- snapshot and restore (omni_stream.model) --------------------------------

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        return True

    def snapshot(self, state: _State) -> Checkpoint:
        """The request's frame, load operand and step index; raises CheckpointError for a closed state."""
        return Checkpoint(
            model=self.snapshot_kind,
            format=self.snapshot_format,
            step=state.step,
            total=self.total_steps(state.params),
            params=plain_params(state.params),
            # Copies: the state goes on stepping, and on the CPU .cpu() would alias it.
            tensors={"x": _host_copy(state.x), "load": _host_copy(state.load)},
        )

    def restore(self, checkpoint: Checkpoint, device: torch.device) -> _State:
        """The state ``checkpoint`` holds, on ``device``; raises CheckpointError (see StepModel.restore)."""
        params = self.restored_params(checkpoint)
        state = self.start(params, device)
        try:
            x, load = checkpoint.tensors["x"], checkpoint.tensors["load"]
        except KeyError as exc:
            raise CheckpointError(f"{self.name}: the checkpoint holds no {exc.args[0]!r} tensor") from None
        if x.shape != state.x.shape or load.shape != state.load.shape or x.dtype != self.dtype:
            raise CheckpointError(
                f"{self.name}: the checkpoint's tensors ({tuple(x.shape)} {x.dtype}) do not fit "
                f"{tuple(state.x.shape)} {self.dtype}"
            )
        state.x = x.to(device=device, copy=True)
        state.load = load.to(device=device, copy=True)
        state.step = checkpoint.step
        return state

    def expected_frames(self, params: Mapping[str, Any]) -> list[torch.Tensor]:
        """The frames a solo run must produce, computed on the CPU (for tests)."""
        params = self.validate(params)
        state = self.start(params, torch.device("cpu"))
        quiet = dict(params, fail_at=None, hang_at=None, work=0)
        state.params = quiet
        return [self.step([state])[0].clone() for _ in range(self.total_steps(params))]


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
