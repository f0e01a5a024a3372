"""uvicorn's HTTP/1.1 protocol with a deadline for each request's headers.

uvicorn times out only idle keep-alive connections: a client that opens a
connection and sends nothing, or sends its headers a byte at a time
(slowloris), holds a descriptor and a slot of ``max_connections``' budget
of the process forever. Here the headers of every request (the first on a
connection, and each next one on a kept-alive connection) must be complete
within :data:`HEADER_TIMEOUT_S`; otherwise the connection is dropped.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEADER_TIMEOUT_S", "DeadlineH11Protocol"]

#: Seconds a client has to send a request's headers (the websocket
#: handshake included); as python-websockets' open_timeout.
HEADER_TIMEOUT_S = 10.0


class DeadlineH11Protocol(H11Protocol):
    """:class:`H11Protocol` that drops a connection whose request headers take too long."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # A request whose headers arrived (an HTTP cycle, or an upgrade to a
        # websocket: this object is no longer the transport's protocol).
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.transport.get_protocol() is not self:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this connection

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being answered (its headers did arrive)
        if not self.transport.is_closing():
            self.transport.close()
