"""The engine: a producer thread and a copier task in one task group, frames dispatched on the loop."""

from __future__ import annotations

from .engine import Engine
from .group import EngineGroup, GroupStatistics, GroupStream, engine_for
from .like import EngineLike, FrameStreamLike
from .stats import EngineStatistics, Health
from .stream import FrameStream

__all__ = [
    "Engine",
    "EngineStatistics",
    "Health",
    "FrameStream",
    "EngineLike",
    "FrameStreamLike",
    "EngineGroup",
    "GroupStatistics",
    "GroupStream",
    "engine_for",
]
