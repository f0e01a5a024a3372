"""omni_stream: an async engine (anyio: asyncio, uvloop, trio) that streams every step of GPU generation.

>>> import omni_stream as om
>>> async with om.Engine(om.models.Synthetic()) as engine:       # doctest: +SKIP
...     async for frame in engine.stream({"steps": 30, "seed": 7}):
...         print(frame.step, frame.total, frame.data.shape)
"""

from __future__ import annotations

from . import device, models, preview
from .checkpoint import Checkpoint
from .config import timeout
from .engine import (
    Engine,
    EngineGroup,
    EngineLike,
    EngineStatistics,
    FrameStream,
    FrameStreamLike,
    GroupStatistics,
    Health,
)
from .errors import (
    CheckpointError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineStalledError,
    LifecycleError,
    OmniStreamError,
    ParamsError,
    RequestCancelledError,
    RequestError,
    StepFailedError,
    StepTimeoutError,
    StoreError,
    UnsupportedBackendError,
)
from .frame import Frame, StepTimings
from .model import GeneratorModel, StepModel, from_generator
from .params import Param, seed_param

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "models",
    "client",
    "device",
    "preview",
    "Engine",
    "EngineStatistics",
    "FrameStream",
    "Health",
    "EngineLike",
    "FrameStreamLike",
    "EngineGroup",
    "GroupStatistics",
    "timeout",
    "Frame",
    "StepTimings",
    "StepModel",
    "GeneratorModel",
    "from_generator",
    "Param",
    "OmniStreamError",
    "ParamsError",
    "RequestError",
    "StepFailedError",
    "StepTimeoutError",
    "RequestCancelledError",
    "EngineError",
    "EngineDeadError",
    "EngineStalledError",
    "EngineClosedError",
    "LifecycleError",
    "UnsupportedBackendError",
    "Checkpoint",
    "CheckpointError",
    "StoreError",
    "seed_param",
]


def __getattr__(name: str) -> object:
    # The client needs websockets; importing it lazily keeps `import
    # omni_stream` working where only the engine is wanted (a GPU box with
    # torch and anyio alone runs scripts/gpu_check.sh that way).
    if name == "client":
        import importlib

        return importlib.import_module(".client", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
