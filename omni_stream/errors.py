"""Every error omni_stream raises, in one tree.

.. code-block:: text

    OmniStreamError                  root of everything raised here
    ├── ParamsError (ValueError)     a request's params, or an option, are invalid
    ├── RequestError                 one request ended badly; carries request_id
    │   ├── StepFailedError          the model raised; __cause__ is its exception
    │   ├── StepTimeoutError         a step's output did not arrive within the bound
    │   └── RequestCancelledError    engine.cancel(), a disconnect, or shutdown of that request
    └── EngineError                  the engine itself cannot serve
        ├── EngineDeadError          its own machinery died; every request fails
        ├── EngineStalledError       one step has run longer than timeout()
        └── EngineClosedError        the engine was shut down (or never started)

The caller's own cancellation (``asyncio.CancelledError`` and anyio's
cancel scopes) is never wrapped in, or swallowed by, any of these.
Every error raised while serving a request carries its ``request_id``.
"""

from __future__ import annotations

__all__ = [
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
]


class OmniStreamError(Exception):
    """Root of every error omni_stream raises.

    ``request_id`` names the request being served when the error arose, or
    is ``None`` where there is none (engine-wide errors raised outside any
    request, bad options).
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        if self.request_id is None:
            return self.message
        return f"[request {self.request_id}] {self.message}"


class ParamsError(OmniStreamError, ValueError):
    """A request's params (or an engine option) are invalid.

    ``field`` names the offending parameter where one can be named.
    """

    def __init__(
        self, message: str, *, field: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.field = field


class RequestError(OmniStreamError):
    """One request ended without its final frame."""


class StepFailedError(RequestError):
    """The model raised while computing a step; ``__cause__`` is its exception."""

    def __init__(self, message: str, *, request_id: str | None, step: int) -> None:
        super().__init__(message, request_id=request_id)
        self.step = step


class StepTimeoutError(RequestError):
    """A step's output did not arrive within the bound (see ``omni_stream.timeout``)."""

    def __init__(
        self, message: str, *, request_id: str | None, step: int, bound_s: float
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.step = step
        self.bound_s = bound_s


class RequestCancelledError(RequestError):
    """The request was cancelled by ``engine.cancel()`` or by its stream being dropped."""


class EngineError(OmniStreamError):
    """The engine cannot serve (any request)."""


class EngineDeadError(EngineError):
    """The engine's own machinery died; ``__cause__`` is what killed it."""


class EngineStalledError(EngineError):
    """One step has been running on the accelerator longer than ``timeout()``."""


class EngineClosedError(EngineError):
    """The engine was shut down, or was used outside ``async with``."""
