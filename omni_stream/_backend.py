"""The async library under the caller, asked once where something binds to it.

The engine is anyio code, and runs wherever anyio does: asyncio (with or
without uvloop) and trio. Two things anyio does not give cheaply:

* **A call from a thread onto the loop.** The producer thread hands every
  step's frames to the loop, and a stream dropped by the garbage collector
  may cancel its request from any thread. anyio's ``from_thread.run_sync``
  waits for the result (a round trip per frame, the producer idle) and
  looks the backend up on every call; a ``BlockingPortal`` is a task of its
  own. :func:`running_loop` returns, once, when the engine starts, an
  object whose ``call_soon_threadsafe`` is the loop's own non-blocking call:
  on asyncio the loop itself, on trio a :class:`TrioLoop` whose method *is*
  ``TrioToken.run_sync_soon`` (no wrapper call per frame). Both run
  callbacks in the order they were scheduled (the copier relies on it), and
  both raise a RuntimeError (trio's RunFinishedError is one) once the loop
  has finished.
* **A check for the parts that stay asyncio-only** (the server on
  uvicorn; under trio it runs on hypercorn, and the client on an
  AnyioSocket): :func:`require_asyncio` raises UnsupportedBackendError at
  their entry, rather than a RuntimeError from deep inside a library.

trio and sniffio are read from ``sys.modules``, never imported: a trio loop
can only be running if trio (which imports sniffio and marks its tasks with
it) was imported, and nobody without trio pays for the look-up.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, Protocol

from .errors import UnsupportedBackendError

__all__ = ["ThreadsafeLoop", "TrioLoop", "current_backend", "require_asyncio", "running_loop"]


class ThreadsafeLoop(Protocol):
    """The one call the engine's threads make onto the loop: an asyncio loop has it as it is."""

    def call_soon_threadsafe(self, callback: Callable[..., object], /, *args: Any) -> object:
        """Schedule ``callback(*args)`` on the loop, from any thread; never blocks or waits for it.

        Raises RuntimeError when the loop has finished. A callback that
        raises is a bug: asyncio only logs it, trio crashes the whole run
        (TrioInternalError), so callbacks contain their own failures.
        """
        ...


class TrioLoop:
    """A trio run as a ThreadsafeLoop: ``call_soon_threadsafe`` is its token's ``run_sync_soon``."""

    __slots__ = ("call_soon_threadsafe",)

    def __init__(self, token: Any) -> None:
        # The bound method itself, not a method of ours calling it: this is
        # called once per batch of frames, from the producer thread.
        self.call_soon_threadsafe: Callable[..., object] = token.run_sync_soon


def current_backend() -> str | None:
    """``"asyncio"`` (uvloop included), ``"trio"``, another library's name, or None outside any."""
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None:
        try:
            return str(sniffio.current_async_library())
        except sniffio.AsyncLibraryNotFoundError:
            return None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "asyncio"


def running_loop() -> ThreadsafeLoop:
    """The running loop, to be called onto from threads (see the module docstring).

    Call it on the loop, once; the result is then used from any thread.
    Raises UnsupportedBackendError outside an asyncio or trio loop.
    """
    backend = current_backend()
    if backend == "asyncio":
        return asyncio.get_running_loop()
    if backend == "trio":
        return TrioLoop(sys.modules["trio"].lowlevel.current_trio_token())
    raise UnsupportedBackendError(
        f"the engine runs on anyio's asyncio (uvloop included) and trio backends; it was started "
        f"{_where(backend)}"
    )


def require_asyncio(what: str) -> None:
    """Return on an asyncio loop (uvloop included); raise UnsupportedBackendError elsewhere.

    ``what`` names the part that needs it, for the message ("the client").
    """
    backend = current_backend()
    if backend != "asyncio":
        raise UnsupportedBackendError(
            f"{what} needs anyio's asyncio backend (uvloop included); it was used {_where(backend)}. "
            "The engine, its streams and EngineGroup also run on trio"
        )


def _where(backend: str | None) -> str:
    return "outside any event loop" if backend is None else f"under {backend}"
