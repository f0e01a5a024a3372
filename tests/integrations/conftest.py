"""The integration tests: the ``ray`` marker (tests that need Ray Serve, the ``ray`` extra)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ray: needs Ray Serve (the ray extra); runs a local Ray cluster in this process"
    )
