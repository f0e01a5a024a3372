"""The rules' reading of a client's messages: parse one, act on it, answer its errors.

:class:`Dispatch`, a part of :class:`~omni_stream.core.rules.Rules`, takes
a client's message in the websocket's form (every door's: the HTTP API
builds the same messages), parses it (:meth:`Dispatch.receive`: a
malformed one is answered ``error`` in the client's outbox), hands it to
the rule it names (:meth:`Dispatch.dispatch`: generate, cancel, pause,
resume, attach) and turns what that rule refused into the ``error`` the
client gets (:meth:`Dispatch.error_reply`), each ``generate`` refused
counted once by its code (:meth:`Dispatch.refused`). It decides nothing
itself: what a message does is the rules' (rules.py, preemption.py); a
bug while acting is an ``internal`` to that client only, and the server
goes on. Synchronous: handling a message never waits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import protocol

if TYPE_CHECKING:
    from .clients import Client
    from .metrics import ServerMetrics
    from .records import RequestRecord

__all__ = ["Dispatch"]

logger = logging.getLogger("omni_stream.server")


class Dispatch:
    """A client's messages read and acted on: a part of :class:`~omni_stream.core.rules.Rules` (see
    the module docstring), whose ``__init__`` sets ``metrics``."""

    metrics: ServerMetrics

    if TYPE_CHECKING:

        def generate(self, client: Client, msg: protocol.Generate) -> RequestRecord: ...

        def cancel(self, client: Client, request_id: str) -> RequestRecord: ...

        def pause(self, client: Client, request_id: str, *, to_host: bool = False) -> RequestRecord: ...

        def resume(self, client: Client, request_id: str) -> RequestRecord: ...

        def attach(self, client: Client, request_id: str) -> RequestRecord: ...

    def receive(self, client: Client, data: str | bytes) -> protocol.ClientMessage | None:
        """Parse one message; a malformed one is answered in ``client.outbox`` (None returned)."""
        try:
            return protocol.parse_client_message(data)
        except protocol.MessageError as exc:
            self.reply_error(client, exc, request_id=exc.request_id)
            return None

    def dispatch(self, client: Client, msg: protocol.ClientMessage) -> None:
        """Act on one parsed message; every reply (and error) goes to ``client.outbox``.

        Synchronous on purpose: handling a message never waits, so one
        client is never blocked behind anything.
        """
        try:
            if isinstance(msg, protocol.Generate):
                self.generate(client, msg)
            elif isinstance(msg, protocol.Cancel):
                self.cancel(client, msg.id)
            elif isinstance(msg, protocol.Pause):
                self.pause(client, msg.id, to_host=msg.to_host)
            elif isinstance(msg, protocol.Resume):
                self.resume(client, msg.id)
            else:
                self.attach(client, msg.id)
        except protocol.MessageError as exc:
            request_id = exc.request_id
            if isinstance(msg, protocol.Generate) and msg.id is None:
                request_id = None  # an id the server made up means nothing to the client
            self.reply_error(client, exc, request_id=request_id)
        except Exception as exc:
            # A bug: this message gets ``internal``; the client and the server go on.
            logger.exception("handling a message from client %s failed", client.id)
            if client.outbox is not None:
                reply = protocol.ErrorMessage.build(
                    "internal", f"internal server error: {exc!r}", request_id=msg.id
                )
                client.outbox.put(reply)

    def handle(self, client: Client, data: str | bytes) -> None:
        """:meth:`receive` then :meth:`dispatch`: one message, start to end."""
        msg = self.receive(client, data)
        if msg is not None:
            self.dispatch(client, msg)

    def refused(self, exc: protocol.MessageError, model: str | None = None) -> None:
        """Count a ``generate`` refused with ``exc``, once, whichever step of whichever door refused
        it; ``model``: the name it asked for (None: the default)."""
        self.metrics.refused(exc.code, model)

    def reply_error(self, client: Client, exc: protocol.MessageError, *, request_id: str | None) -> None:
        if client.outbox is not None:
            client.outbox.put(self.error_reply(exc, request_id=request_id))

    def error_reply(self, exc: protocol.MessageError, *, request_id: str | None) -> protocol.ErrorMessage:
        """The ``error`` message for a refused client message (``busy`` carries ``retry_after_s``)."""
        retry = getattr(exc, "retry_after_s", None)
        return protocol.ErrorMessage.build(
            exc.code,
            exc.message,
            request_id=request_id,
            field=exc.field,
            retry_after_s=None if retry is None else float(retry),
        )
