"""The wire protocol, with no I/O: what the server and the client both speak (docs/protocol.md).

Every message is defined once, for both sides, as one frozen class with its
fields, its wire form and its parser:

.. code-block:: text

    codes.py            error codes, cancel reasons, close codes, priority range, echo bounds
    formats.py          format -> MIME type (the one table), the formats' signatures
    codec.py            JSON text: one serializer (dumps), the server's reading of a
                        client (MessageError), the client's reading of the server (ProtocolError)
    client_messages.py  Generate, Cancel, Pause, Resume, Attach: built by the client
                        (ParamsError), parsed by the server (MessageError with the
                        ``error`` code)
    server_messages.py  Accepted, Queued, Loading, Progress, Paused, Resumed, Restarted, Done,
                        Cancelled, ErrorMessage: built by the server, parsed by the
                        client (ProtocolError)
    frames.py           the binary preview frame: PreviewHeader, PreviewFrame, one pack,
                        one strict parse, and the server's cheap unpack of its own frames
    messages.py         the server's functions over those: accepted() ... error() -> dict
    client.py           the client's policy: an ``error`` code -> the exception a caller sees
    inbox.py            one request's inbox on the client, a pure state machine

The server's rules (admission, ownership, attach, retention, every
per-client bound) are ``omni_stream.core`` (``rules.py``, sans-I/O like
this package); the I/O layers (the server's doors, the client's
connection) are thin pumps around these.
Importing this package loads neither the server nor the engine.
"""

from __future__ import annotations

from .client_messages import (
    CLIENT_MESSAGES,
    check_request_id,
)
from .codes import CLOSE_PROTOCOL_ERROR
from .formats import FORMATS, PREVIEW_FORMATS
from .frames import MAX_HEADER_BYTES, PreviewFrame, parse_preview_frame
from .messages import *  # noqa: F403 - the server's names, kept as they were
from .messages import __all__ as _messages_all
from .server_messages import (
    SERVER_MESSAGES,
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Paused,
    Progress,
    Queued,
    Restarted,
    Resumed,
    ServerMessage,
    parse_server_message,
)

__all__ = [
    *_messages_all,
    "CLIENT_MESSAGES",
    "CLOSE_PROTOCOL_ERROR",
    "FORMATS",
    "MAX_HEADER_BYTES",
    "PREVIEW_FORMATS",
    "SERVER_MESSAGES",
    "Accepted",
    "Cancelled",
    "Done",
    "ErrorMessage",
    "Loading",
    "Paused",
    "Queued",
    "PreviewFrame",
    "Progress",
    "Restarted",
    "Resumed",
    "ServerMessage",
    "check_request_id",
    "parse_preview_frame",
    "parse_server_message",
]
