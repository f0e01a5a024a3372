"""Shared by the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # The models here are tiny: on a shared 2-core box two OpenMP threads
    # spend far longer waiting for each other (~40x measured) than computing;
    # one thread is also the engine producer's default, so results compare
    # bit for bit with pipe() run here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
