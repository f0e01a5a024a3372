"""Ray's errors, translated to this project's at two boundaries: the RemoteStream's reads, and
``deploy`` (:func:`startup_failed`: an application whose replicas failed to start).

=====================================================  ==========================================
what Ray raised                                        what the reader gets
=====================================================  ==========================================
``RayTaskError`` wrapping one of this project's        that error (the replica's, unwrapped)
``RayTaskError`` wrapping anything else                StepFailedError, ``__cause__`` the original
``ray.serve`` RequestCancelledError,                   RequestCancelledError
``TaskCancelledError`` (``.cancel()`` took effect)
``ActorDiedError``, ``ActorUnavailableError``,         EngineDeadError naming the replica; the
``WorkerCrashedError``, ``NodeDiedError``,             other replicas keep serving
``OwnerDiedError`` (the replica or its node is gone)
``BackPressureError`` (``max_queued_requests``)        EngineError: the deployment is full
``DeploymentUnavailableError``                         EngineClosedError: the application is gone
anything else from Ray (``RayError``)                  EngineError, ``__cause__`` the original
=====================================================  ==========================================

The reader's own cancellation (``asyncio.CancelledError``, anyio's cancel
scopes) is never translated: the caller re-raises it untouched. Every error
translated here carries the request's id, and ``__cause__`` is Ray's.
"""

from __future__ import annotations

import re

from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors

from ...errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    OmniStreamError,
    RequestCancelledError,
    StepFailedError,
)

__all__ = ["LOST", "startup_failed", "translate"]

#: Ray's ways of saying a replica (its process, or its node) is gone.
LOST: tuple[type[BaseException], ...] = (
    ray_errors.ActorDiedError,
    ray_errors.ActorUnavailableError,
    ray_errors.RayActorError,
    ray_errors.WorkerCrashedError,
    ray_errors.NodeDiedError,
    ray_errors.OwnerDiedError,
    ray_errors.LocalRayletDiedError,
)


#: Terminal colour codes: Ray colours the actor's name in a replica's traceback.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: A traceback's frame line; what follows the last one (and its source lines) is the exception.
_FRAME = re.compile(r"^\s*File \"")


def startup_failed(name: str, exc: BaseException, status: str | None) -> EngineDeadError:
    """EngineDeadError for ``serve.run``'s ``exc``: the application ``name`` failed to deploy.

    ``serve.run`` says only which deployment failed; ``status`` is that
    deployment's status message (``serve.status()``), which ends with the
    replica's traceback: the error names the exception that ended it (a
    model that failed to build, an option its model does not take).
    """
    cause = _raised(status) if status else None
    why = f": a replica raised {cause}" if cause else f": {_first_line(exc)}"
    err = EngineDeadError(f"the Serve application {name!r} failed to start{why}")
    err.__cause__ = exc
    return err


def _raised(status: str) -> str | None:
    """The exception line(s) ending a traceback in ``status`` ("Class: message"), or None."""
    lines = _ANSI.sub("", status).splitlines()
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if not frames:
        return None
    # After the last frame line: its source line(s), indented, then the exception.
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith("    "):
        rest = rest[1:]
    text = " ".join(line.strip() for line in rest if line.strip())
    if not text:
        return None
    # "omni_stream.cli.console.UsageError: ..." reads as "UsageError: ...".
    return re.sub(r"^(?:[A-Za-z_][\w]*\.)+(?=\w+(?::|$))", "", text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def translate(exc: BaseException, *, request_id: str, replica: str | None, step: int = 0) -> OmniStreamError:
    """This project's error for ``exc``, raised while reading request ``request_id``.

    ``replica`` names the replica running it where known (its Header came),
    ``step`` is the last step the reader got. Never call it with the
    reader's own cancellation.
    """
    where = f"replica {replica}" if replica else "its replica"
    if isinstance(exc, OmniStreamError) and not isinstance(exc, ray_errors.RayError):
        if exc.request_id is None:
            exc.request_id = request_id
        return exc
    if isinstance(exc, ray_errors.RayTaskError):
        cause = exc.cause
        if isinstance(cause, OmniStreamError):
            if cause.request_id is None:
                cause.request_id = request_id
            return cause
        if isinstance(cause, BaseException) and isinstance(cause, (*LOST, ray_errors.TaskCancelledError)):
            return translate(cause, request_id=request_id, replica=replica, step=step)
        err: OmniStreamError = StepFailedError(
            f"{where} raised {cause!r} while serving the request",
            request_id=request_id,
            step=step + 1,
        )
        err.__cause__ = cause if isinstance(cause, BaseException) else exc
        return err
    if isinstance(exc, ray_errors.TaskCancelledError):  # Serve's RequestCancelledError too
        err = RequestCancelledError("cancelled", request_id=request_id)
    elif isinstance(exc, LOST):
        err = EngineDeadError(f"{where} was lost: {_first_line(exc)}", request_id=request_id)
    elif isinstance(exc, serve_errors.BackPressureError):
        err = EngineError(
            f"the deployment is full (max_queued_requests): {_first_line(exc)}", request_id=request_id
        )
    elif isinstance(exc, serve_errors.DeploymentUnavailableError):
        err = EngineClosedError(
            f"the Serve application is unavailable: {_first_line(exc)}", request_id=request_id
        )
    else:
        err = EngineError(f"Ray failed the request: {exc!r}", request_id=request_id)
    err.__cause__ = exc
    return err
