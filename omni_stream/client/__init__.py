"""The async websocket client for an omni_stream server (docs/protocol.md).

>>> import omni_stream as om
>>> async with om.client.connect("ws://127.0.0.1:8765/ws") as client:   # doctest: +SKIP
...     async for frame in client.generate({"prompt": "red circle", "steps": 20}):
...         print(frame.step, frame.total, frame.final, frame.width, frame.height)
...     frame.image().save("result.png")

Shape: one connection, one reader task in the client's anyio task group; the
reader parses every server message strictly and hands it to the request it
names, so several ``generate()`` iterations run at once on one connection.
The reader never waits on a consumer: a consumer that falls behind loses
its oldest intermediate previews, never the final one or the outcome.

.. code-block:: text

    ../protocol/           the protocol without I/O, shared with the server: each
                           message one class (client_messages.py, server_messages.py,
                           frames.py), the format table, what an error code means
                           (client.py), one request's inbox (inbox.py)
    stream.py              RequestStream, what the caller iterates
    connection.py          Client and connect(): the websocket, the reader, cancels

Errors (drawn in omni_stream/errors.py, re-exported here) are the engine's
own where the meaning is the same, so code written against
``engine.stream()`` reads the same remotely: ParamsRejectedError is also
om.ParamsError, RequestFailedError om.RequestError, RemoteCancelledError
om.RequestCancelledError. BusyError is the RequestRejectedError of a
server too busy to take a request; its ``retry_after_s`` says when to try
again. Every error raised while serving a request carries its
``request_id``. Bad arguments (a malformed id, params that are not a JSON
object) raise om.ParamsError naming the field, before anything is sent.
"""

from __future__ import annotations

from ..errors import (
    BusyError,
    ClientError,
    ConnectError,
    ConnectionClosedError,
    ParamsRejectedError,
    ProtocolError,
    RemoteCancelledError,
    RequestFailedError,
    RequestRejectedError,
)
from ..protocol.formats import FORMATS
from ..protocol.frames import PreviewFrame, parse_preview_frame
from ..protocol.server_messages import Progress
from .connection import DEFAULT_MAX_SIZE, Client, connect
from .stream import RequestStream

__all__ = [
    "DEFAULT_MAX_SIZE",
    "FORMATS",
    "BusyError",
    "Client",
    "ClientError",
    "ConnectError",
    "ConnectionClosedError",
    "ParamsRejectedError",
    "PreviewFrame",
    "Progress",
    "ProtocolError",
    "RemoteCancelledError",
    "RequestFailedError",
    "RequestRejectedError",
    "RequestStream",
    "connect",
    "parse_preview_frame",
]
