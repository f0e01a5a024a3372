"""Every async test runs twice: under asyncio's default loop and under uvloop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import pytest


# optionalhook: the GPU machine runs the GPU tests without pytest-asyncio.
@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config, item) -> Mapping[str, object]:
    factories: dict[str, object] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(autouse=True)
def _omni_stream_logs(caplog):
    caplog.set_level(logging.INFO, logger="omni_stream")
    yield
