"""Shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..conftest import one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield
