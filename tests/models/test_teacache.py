"""TeaCache's per-request state, without a model: the authors' rescaling and their rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_stream.models.diffusers.block_cache import Head
from omni_stream.models.diffusers.teacache import FLUX_COEFFICIENTS, TeaCacheState, rescaled


@pytest.mark.parametrize("change", [0.0, 0.01, 0.05, 0.2, 1.0])
def test_the_rescaling_is_numpys_poly1d_of_the_authors_coefficients(change: float) -> None:
    assert rescaled(change) == pytest.approx(float(np.poly1d(FLUX_COEFFICIENTS)(change)), rel=1e-12)


def _head(modulated: torch.Tensor) -> Head:
    zeros = torch.zeros(1, 2)
    return Head(zeros, zeros, None, lambda: modulated)


def test_it_adds_changes_up_reuses_under_the_threshold_and_always_computes_the_ends() -> None:
    # Each step's input 1% further from the last: rescaled, about 0.24 a step.
    inputs = [torch.full((1, 2), 1.01**k) for k in range(8)]
    step_change = rescaled(0.01)
    state = TeaCacheState(rel_l1=2.5 * step_change, total=len(inputs))
    decided = []
    for x in inputs:
        computed = state.decide(_head(x))
        if computed:
            state.keep(_head(x), torch.ones(1, 2), None)  # (its residual, for the steps after)
        decided.append(computed)
    # Step 0 computes; then 1, 2 add up to under 2.5 steps' change, 3 reaches it; ...; the last computes.
    assert decided == [True, False, False, True, False, False, True, True]
    assert (state.computed, state.cached) == (4, 4)
    reused, _ = state.reused(_head(inputs[0]))
    assert torch.equal(reused, torch.ones(1, 2))  # its input (zeros) plus the stack's residual
