"""The one lifecycle of everything that is started and closed: Engine, EngineGroup, Server, Client.

.. code-block:: text

    NEW ──start / async with──▶ RUNNING ──aclose / shutdown──▶ CLOSING ──▶ CLOSED
     └───────────────────────────aclose before start───────────────────────▲

Each starts once: starting it again, in any state but NEW, raises
:class:`~omni_stream.errors.LifecycleError` (the engine's is
EngineClosedError, a LifecycleError), and so does using it while it is
not RUNNING. Closing is idempotent. CLOSING lasts while the shutdown runs
(requests being ended, threads joined); a client goes from RUNNING
straight to CLOSED.
"""

from __future__ import annotations

import enum

__all__ = ["Lifecycle"]


class Lifecycle(enum.Enum):
    """Where an Engine, EngineGroup, Server or Client is in its life (see the module docstring)."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"

    @property
    def ending(self) -> bool:
        """CLOSING or CLOSED: it takes no new work."""
        return self is Lifecycle.CLOSING or self is Lifecycle.CLOSED
