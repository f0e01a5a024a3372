"""The HTTP server under trio: hypercorn runs the same ASGI app that uvicorn runs under asyncio.

uvicorn runs on asyncio only; hypercorn (h11, wsproto, h2) runs ASGI apps
on trio as well, so ``Server`` picks it when it is started under trio (and
``omni-stream serve --loop trio``). Everything above the HTTP server is
the same code on both: the front door, the one core, the engine (which
runs on every anyio backend).

What differs is what we add to uvicorn's wire handling (``http11.py``,
``ws_protocol.py``), which reaches into uvicorn's protocol classes and has
no hypercorn equivalent. Under hypercorn its own settings take their place:

* a header block is bounded in bytes (``h11_max_incomplete_size``, 16 KiB),
  but not in time: uvicorn gets our header and body deadlines, hypercorn
  only its idle keep-alive bound. Its ``read_timeout`` is no substitute:
  it bounds every read on a connection, so a websocket or event-stream
  client that only listens to a long render would be cut off; it stays
  unset. Behind a reverse proxy (which bounds slow headers itself) this
  does not matter; exposed directly, prefer asyncio (uvicorn);
* a websocket message is bounded by ``max_message_bytes``
  (``websocket_max_message_size``), as uvicorn's ``ws_max_size``;
* a graceful stop gives connections ``close_timeout_s`` (``graceful_timeout``);
* the peer address is the socket's: hypercorn reads ``X-Forwarded-For``
  only through its ``ProxyFixMiddleware``, which is never applied, as
  uvicorn's ``proxy_headers`` is turned off (``app.py``): a forwarded
  address counts only from a ``--trusted-proxy`` (core/principal.py).

The app's request bodies stay bounded by the app itself (``bodies.py``),
and a send to a client that stopped reading by :class:`~.http11.BoundedSend`
on both servers; only the transport-level abort of such a client needs
uvicorn's transport (``transport_of`` finds none here, and the send's
bound then ends the exchange instead).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import anyio

from ..core.limits import ServerLimits
from ..errors import UnsupportedBackendError

__all__ = ["HypercornServer"]

logger = logging.getLogger("omni_stream.server")


class HypercornServer:
    """One run of hypercorn on trio over sockets already bound (``Server`` binds them, port 0 included).

    The same face as ``app._Uvicorn``: :meth:`serve`, ``on_started``,
    ``exited``, and :meth:`stop` for a graceful end (leaving the task group
    that runs :meth:`serve` is the forced one).
    """

    def __init__(self, app: Callable[..., Any], limits: ServerLimits) -> None:
        try:
            import hypercorn.config
            import hypercorn.trio  # noqa: F401 - checked here, used in serve()
        except ImportError as exc:
            raise UnsupportedBackendError(
                "serving under trio needs hypercorn, which is not installed: "
                "pip install 'omni-stream[trio]' (or run the server under asyncio, with uvicorn)"
            ) from exc
        self._app = _without_lifespan(app)
        self._limits = limits
        self._stop = anyio.Event()
        self.exited = anyio.Event()
        self.on_started: Callable[[], object] | None = None

    def config(self, sockets: list[socket.socket]) -> Any:
        """hypercorn's Config for ``sockets`` and our limits (see the module docstring)."""
        import hypercorn.config

        limits = self._limits
        config = hypercorn.config.Config()
        # hypercorn takes listening sockets as file descriptors and owns what
        # it is given: a duplicate each, so that closing ours (Server does,
        # on the way out) and closing its never close the same descriptor twice.
        config.bind = [f"fd://{os.dup(sock.fileno())}" for sock in sockets]
        config.accesslog = None
        config.errorlog = logger
        config.include_server_header = False
        config.websocket_max_message_size = limits.max_message_bytes
        # Not read_timeout (the module docstring): it would cut off listeners.
        config.graceful_timeout = max(1.0, float(limits.close_timeout_s))
        return config

    async def serve(self, sockets: list[socket.socket]) -> None:
        """Serve until :meth:`stop` (then gracefully) or until cancelled."""
        import hypercorn.trio

        try:
            await hypercorn.trio.serve(
                self._app,
                self.config(sockets),
                shutdown_trigger=self._stop.wait,
                task_status=_Started(self.on_started),
            )
        finally:
            self.exited.set()

    def stop(self) -> None:
        """Stop accepting, let open exchanges finish (``graceful_timeout``), return from :meth:`serve`."""
        self._stop.set()


class _Started:
    """hypercorn's ``task_status``: it reports its binds once it listens; we call ``on_started``."""

    def __init__(self, callback: Callable[[], object] | None) -> None:
        self._callback = callback

    def started(self, value: object = None) -> None:
        if self._callback is not None:
            self._callback()


def _without_lifespan(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` with ASGI lifespan answered and nothing else done (uvicorn's ``lifespan="off"``).

    ``Server`` runs the service itself, in the task that started it; the
    app's own lifespan (for hosts that mount it) would try to run it again.
    """

    async def wrapped(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    return wrapped
