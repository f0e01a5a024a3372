"""The wire protocol, with no I/O: what the server and the client both speak (docs/protocol.md).

- :mod:`.messages`: the message types and the codec, one for both sides:
  client messages parsed and checked into :class:`Generate`,
  :class:`Cancel`, :class:`Attach` (or :class:`MessageError` with the
  ``error`` code to answer), the server's messages built, binary preview
  frames packed and unpacked, the shared constants and codes.
- :mod:`.client`: the client's reading of the server's messages (strict:
  ``ProtocolError`` naming what is wrong) into events, and its own messages.
- :mod:`.inbox`: one request's inbox on the client, a pure state machine.

The server's rules (admission, ownership, attach, retention) are
``omni_stream.server.service`` and ``.records``; the I/O layers (the
server's front doors, the client's connection) are thin pumps around these.
Importing this package loads neither the server nor the engine.
"""

from __future__ import annotations

from .messages import *  # noqa: F403 - this package's face is the messages module
from .messages import __all__ as _messages_all

__all__ = list(_messages_all)
