"""The client's side of docs/protocol.md, with no I/O: what an ``error`` means to a caller.

The messages are defined once for both sides (``client_messages.py``,
``server_messages.py``, ``frames.py``); this module holds what only the
client decides: :func:`server_error` maps an ``error`` code to the
exception a caller sees, and :data:`Event` names what a client reads.
"""

from __future__ import annotations

from typing import Final

from ..errors import (
    BusyError,
    ClientError,
    ParamsRejectedError,
    RequestFailedError,
    RequestRejectedError,
)
from ..ids import ID_PATTERN, MAX_ID_LENGTH
from .client_messages import check_request_id
from .codes import CLOSE_PROTOCOL_ERROR, REJECTION_CODES, REQUEST_ENDING_CODES
from .formats import FORMATS
from .frames import MAX_HEADER_BYTES, PreviewFrame, parse_preview_frame
from .server_messages import (
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Progress,
    Queued,
    ServerMessage,
)

__all__ = [
    "BusyError",
    "CLOSE_PROTOCOL_ERROR",
    "FORMATS",
    "ID_PATTERN",
    "MAX_HEADER_BYTES",
    "MAX_ID_LENGTH",
    "PARAMS_CODES",
    "REJECTION_CODES",
    "REQUEST_ENDING_CODES",
    "Accepted",
    "Cancelled",
    "Done",
    "ErrorMessage",
    "Event",
    "Loading",
    "PreviewFrame",
    "Progress",
    "Queued",
    "check_request_id",
    "parse_preview_frame",
    "server_error",
]

#: Rejections that mean "your input is wrong": raised as ParamsRejectedError.
PARAMS_CODES: Final = frozenset({"bad_params", "invalid_field", "limit_exceeded"})

#: Everything the client reads from a server: a text message or a preview frame.
Event = ServerMessage | PreviewFrame


def server_error(
    code: str,
    message: str,
    *,
    field: str | None,
    request_id: str | None,
    accepted: bool,
    retry_after_s: float | None = None,
) -> ClientError:
    """The exception for an ``error`` about one request.

    Once the server ``accepted`` the request, an error ends it:
    RequestFailedError, whatever the code. Before that, the request was
    rejected: ParamsRejectedError for the codes that blame the input,
    BusyError (with ``retry_after_s``) for ``busy``, RequestRejectedError
    for the rest.
    """
    if accepted:
        return RequestFailedError(message, code=code, field=field, request_id=request_id)
    if code == "busy":
        return BusyError(message, retry_after_s=retry_after_s, request_id=request_id)
    if code in PARAMS_CODES:
        return ParamsRejectedError(message, code=code, field=field, request_id=request_id)
    return RequestRejectedError(message, code=code, field=field, request_id=request_id)
