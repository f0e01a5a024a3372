"""uvicorn's websocket protocol (websockets' sans-I/O core) with a lingering close.

When a client's message breaks a rule the parser enforces (over
``max_message_bytes``: 1009; bad UTF-8: 1007; a protocol error: 1002),
uvicorn writes the close frame and closes the socket at once. The client is
usually still sending that message then, so the server's kernel holds unread
bytes (or gets more for a closed socket) and answers with a TCP reset; the
reset makes the client's send fail (a broken pipe) and can discard, in the
client's kernel, the close frame it had not read yet: the client never
learns why. Here the server half-closes instead (the close frame, then
FIN), keeps reading and discarding what the client still sends, and closes
when the client does, or after :data:`LINGER_S` (Apache's "lingering close").
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["LINGER_S", "LingeringWSProtocol"]

#: Seconds the server reads and discards after a failing close before it
#: drops the connection (the client may never stop sending).
LINGER_S = 10.0


class LingeringWSProtocol(WebSocketsSansIOProtocol):
    """:class:`WebSocketsSansIOProtocol` whose failing close lets the client read the close frame."""

    _lingering = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            # The parser discards it (websockets' discard()); nothing else to do.
            self.conn.receive_data(data)
            return
        super().data_received(data)

    def handle_parser_exception(self) -> None:
        close = self.conn.close_sent
        assert close is not None  # the parser failed: it queued the close frame
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self._lingering = True
        if self.transport.can_write_eof():
            # FIN after the close frame: the client sees the end and closes
            # its side, which ends the connection here (eof_received).
            self.transport.write_eof()
        self.close_timer = self.loop.call_later(LINGER_S, self.transport.close)
