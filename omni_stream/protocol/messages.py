"""The server's names for the wire, as functions over the message classes (pure).

The messages themselves are defined once, for both sides, in
``client_messages.py``, ``server_messages.py`` and ``frames.py``. The
functions here keep the signatures the server was written against:
:func:`accepted`, :func:`progress`, :func:`done`, :func:`cancelled` and
:func:`error` return the message's ``to_dict()`` (a dict the caller may
extend, as the server adds ``retry_after_s`` to ``busy``), each a thin
wrapper over the class's ``build``. New code may use the classes directly:
``Progress.build(...).serialize()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import MessageError
from ..ids import ID_PATTERN, MAX_ID_LENGTH
from .client_messages import (
    Attach,
    Cancel,
    ClientMessage,
    Generate,
    Pause,
    Resume,
    check_id,
    parse_client_message,
    parse_client_object,
)
from .codec import clip, decode_json, dumps
from .codes import (
    CANCEL_REASONS,
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    MAX_ECHO,
    MAX_ERROR_MESSAGE,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PAUSE_REASONS,
    REJECTION_CODES,
    REQUEST_ENDING_CODES,
    RESTART_REASONS,
    RESUME_REASONS,
)
from .frames import PreviewHeader, pack_preview, unpack_preview
from .server_messages import (
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Paused,
    Progress,
    Restarted,
    Resumed,
)

# MessageError is defined in errors.py with every other error; re-exported here,
# where the wire's rules raise it.
__all__ = [
    "CANCEL_REASONS",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_TRY_AGAIN_LATER",
    "ID_PATTERN",
    "MAX_ECHO",
    "MAX_ERROR_MESSAGE",
    "MAX_ID_LENGTH",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "PAUSE_REASONS",
    "REJECTION_CODES",
    "REQUEST_ENDING_CODES",
    "RESTART_REASONS",
    "RESUME_REASONS",
    "Attach",
    "Cancel",
    "ClientMessage",
    "Generate",
    "MessageError",
    "Pause",
    "Resume",
    "PreviewHeader",
    "accepted",
    "cancelled",
    "check_id",
    "clip",
    "decode_json",
    "done",
    "dumps",
    "error",
    "loading",
    "pack_preview",
    "paused",
    "restarted",
    "resumed",
    "parse_client_message",
    "parse_client_object",
    "progress",
    "unpack_preview",
]


def accepted(
    request_id: str,
    *,
    total: int,
    detach: bool,
    attached: bool,
    preview: Mapping[str, Any],
    output: Mapping[str, Any] | None = None,
    seed: int | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """``accepted`` (:meth:`Accepted.build`): a generate started, or an attach succeeded."""
    return Accepted.build(
        request_id, total=total, detach=detach, attached=attached, preview=preview, output=output, seed=seed,
        model=model,
    ).to_dict()


def paused(request_id: str, *, step: int, reason: str | None = None) -> dict[str, Any]:
    """``paused`` (:meth:`Paused.build`): the request stopped after ``step``, for ``reason``
    (PAUSE_REASONS); raises ValueError for another reason."""
    return Paused.build(request_id, step=step, reason=reason).to_dict()


def resumed(request_id: str, *, step: int, reason: str | None = None) -> dict[str, Any]:
    """``resumed`` (:meth:`Resumed.build`): the paused request runs again, for ``reason``
    (RESUME_REASONS); raises ValueError for another reason."""
    return Resumed.build(request_id, step=step, reason=reason).to_dict()


def restarted(request_id: str, *, from_step: int, reason: str) -> dict[str, Any]:
    """``restarted`` (:meth:`Restarted.build`): brought back after a restart, it runs again from
    ``from_step``; raises ValueError for a reason outside RESTART_REASONS."""
    return Restarted.build(request_id, from_step=from_step, reason=reason).to_dict()


def loading(request_id: str, *, model: str) -> dict[str, Any]:
    """``loading`` (:meth:`Loading.build`): the request waits for its model to load."""
    return Loading.build(request_id, model=model).to_dict()


def progress(request_id: str, *, step: int, total: int, eta_s: float) -> dict[str, Any]:
    """``progress`` (:meth:`Progress.build`); ``eta_s`` is clamped to >= 0 and rounded to ms."""
    return Progress.build(request_id, step=step, total=total, eta_s=eta_s).to_dict()


def done(request_id: str, *, total: int, elapsed_s: float) -> dict[str, Any]:
    """``done`` (:meth:`Done.build`): the final preview was sent before it."""
    return Done.build(request_id, total=total, elapsed_s=elapsed_s).to_dict()


def cancelled(request_id: str, *, reason: str) -> dict[str, Any]:
    """``cancelled`` (:meth:`Cancelled.build`); raises ValueError for a reason outside CANCEL_REASONS."""
    return Cancelled.build(request_id, reason=reason).to_dict()


def error(
    code: str, message: str, *, request_id: str | None = None, field: str | None = None
) -> dict[str, Any]:
    """``error`` (:meth:`ErrorMessage.build`); raises ValueError for a code docs/protocol.md does not list.

    ``field`` is clipped to MAX_ECHO characters and ``message`` to
    MAX_ERROR_MESSAGE: both may echo what a client sent.
    """
    return ErrorMessage.build(code, message, request_id=request_id, field=field).to_dict()
