"""omni_stream: an async engine (anyio: asyncio, uvloop, trio) that streams every step of GPU generation.

>>> import omni_stream as om
>>> async with om.Engine(om.models.Synthetic()) as engine:       # doctest: +SKIP
...     async for frame in engine.stream({"steps": 30, "seed": 7}):
...         print(frame.step, frame.total, frame.data.shape)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from . import client, device, models, preview
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


#: Where each name of the package lives: imported on first use (PEP 562), so that
#: ``from omni_stream import client`` (a websocket client) does not import torch (1.4-2.3 s),
#: and ``import omni_stream`` on a GPU box with torch and anyio alone needs no websockets.
_LAZY: dict[str, str] = {
    "Checkpoint": ".checkpoint",
    "timeout": ".config",
    "Engine": ".engine",
    "EngineGroup": ".engine",
    "EngineLike": ".engine",
    "EngineStatistics": ".engine",
    "FrameStream": ".engine",
    "FrameStreamLike": ".engine",
    "GroupStatistics": ".engine",
    "Health": ".engine",
    "Frame": ".frame",
    "StepTimings": ".frame",
    "GeneratorModel": ".model",
    "StepModel": ".model",
    "from_generator": ".model",
    "Param": ".params",
    "seed_param": ".params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value: Any = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name.isidentifier() and not name.startswith("__"):
        # A submodule (``om.models``, ``om.client``, ``om.engine``): imported when first read.
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import: say why
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
