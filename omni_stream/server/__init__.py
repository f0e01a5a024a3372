"""The server: live per-step previews over a websocket, an HTTP API and event streams.

docs/protocol.md (the websocket), docs/http.md (HTTP, SSE, mounting).

>>> import omni_stream as om
>>> from omni_stream.server import serve, Server
>>> serve(om.models.Synthetic(), port=8765)                       # doctest: +SKIP
>>> async with Server(om.models.Synthetic(), port=0) as server:   # doctest: +SKIP
...     print(server.url)                                         # ws://127.0.0.1:PORT/ws
"""

from __future__ import annotations

from ..core.limits import ServerLimits
from .app import Server, serve
from .asgi import OmniStreamApp, create_app
from .ws_protocol import LingeringWSProtocol

__all__ = ["LingeringWSProtocol", "OmniStreamApp", "Server", "ServerLimits", "create_app", "serve"]
