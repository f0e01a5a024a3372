"""The wire's names in one place: codes, limits, the client's messages and the frame (pure).

The messages themselves are defined once, for both sides, in
``client_messages.py``, ``server_messages.py`` and ``frames.py``; the
server builds each with its class's ``build`` (``Progress.build(...)``) and
hands the object around, encoding it once (``.wire``) where a websocket
sends it.
"""

from __future__ import annotations

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
    parse_duration,
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
from .frames import Cell, Preview, PreviewHeader, pack_preview, unpack_preview

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
    "Cell",
    "Preview",
    "PreviewHeader",
    "check_id",
    "clip",
    "decode_json",
    "dumps",
    "pack_preview",
    "parse_client_message",
    "parse_client_object",
    "parse_duration",
    "unpack_preview",
]
