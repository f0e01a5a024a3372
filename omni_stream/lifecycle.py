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

:class:`Lifetime` makes those moves, and only it: an object holds one and
asks it to ``start()``, ``close()`` and mark itself ``closed()``, rather
than setting its state by hand at each step (engine/facade.py).
"""

from __future__ import annotations

import enum

from .errors import LifecycleError

__all__ = ["Lifecycle", "Lifetime"]


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


class Lifetime:
    """One object's place in the lifecycle, moved only forward, only by these methods.

    ``owner`` names the object in the error a second start raises ("an
    Engine"); ``error`` is that error's class (a LifecycleError: the
    engine's is EngineClosedError).
    """

    __slots__ = ("_error", "_owner", "_state")

    def __init__(self, owner: str, *, error: type[LifecycleError] = LifecycleError) -> None:
        self._owner = owner
        self._error = error
        self._state = Lifecycle.NEW

    @property
    def state(self) -> Lifecycle:
        return self._state

    def start(self) -> None:
        """NEW to RUNNING; raises ``error`` in any other state (each starts once)."""
        if self._state is not Lifecycle.NEW:
            raise self._error(f"{self._owner} can be started once; create a new one")
        self._state = Lifecycle.RUNNING

    def close(self) -> bool:
        """Begin closing. True from RUNNING (now CLOSING): the caller shuts down, then calls
        :meth:`closed`. False otherwise, with nothing to shut down: NEW goes straight to CLOSED,
        and CLOSING or CLOSED stays as it is (closing is idempotent)."""
        if self._state is Lifecycle.RUNNING:
            self._state = Lifecycle.CLOSING
            return True
        if self._state is Lifecycle.NEW:
            self._state = Lifecycle.CLOSED
        return False

    def closed(self) -> None:
        """CLOSED, the shutdown over (whether it succeeded or raised)."""
        self._state = Lifecycle.CLOSED
