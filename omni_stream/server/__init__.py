"""The server: live per-step previews over a websocket, an HTTP API and event streams.

docs/protocol.md (the websocket), docs/http.md (HTTP, SSE, mounting).

>>> import omni_stream as om
>>> from omni_stream.server import serve, Server
>>> serve(om.models.Synthetic(), port=8765)                       # doctest: +SKIP
>>> async with Server(om.models.Synthetic(), port=0) as server:   # doctest: +SKIP
...     print(server.url)                                         # ws://127.0.0.1:PORT/ws
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Server, serve
    from .asgi import create_app
    from .limits import ServerLimits

__all__ = ["Server", "ServerLimits", "create_app", "serve"]

_LAZY = {"Server": ".app", "serve": ".app", "ServerLimits": ".limits", "create_app": ".asgi"}


def __getattr__(name: str) -> Any:
    # Lazy: the client imports the pure wire constants of .protocol and must
    # not load the ASGI server, prometheus-client and the engine.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
