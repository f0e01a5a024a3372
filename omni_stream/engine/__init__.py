"""The engine: a producer thread, a copier task and a consumer task in one task group."""

from __future__ import annotations

from .engine import Engine
from .stats import EngineStatistics, Health
from .stream import FrameStream

__all__ = ["Engine", "EngineStatistics", "Health", "FrameStream"]
