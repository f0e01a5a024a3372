"""Wakeup: how a task waits for a single-reader hand-off (loop-only).

Used by the engine's Delivery and its copier-to-consumer mailbox, the
client's Inbox and the server's Outbox. The rule, written once:

* the waiter checks its condition first, and waits only while it does not
  hold: ``while not ready(): await wakeup.wait()``;
* whoever changes what the condition reads calls :meth:`Wakeup.wake`.

A wake with nobody waiting is not remembered (the waiter's check sees the
change instead), so nothing has to be cleared, and a wake-up can never be
lost between a check and a wait: both run on the event loop, with no
``await`` between them. Every task waiting at a wake is woken, so a second
concurrent reader cannot strand the first.

The loop's own event rather than ``anyio.Event``: this is on the per-frame
path, and anyio's costs a backend look-up each. ``asyncio.Event`` on
asyncio (uvloop included), ``trio.Event`` on trio (the engine runs on
both; the client and the server only on asyncio). Which one is decided at
a Wakeup's first wait, on the loop, and kept: a Wakeup may be made before
any loop runs (the engine's, in ``Engine.__init__``). The event is made on
the first wait after a wake, and dropped by the wake, so an idle Wakeup
holds none.

``wait(timeout)`` bounds a wait (a reader's step timeout) without a
cancel scope: on asyncio a timer handle that wakes the Wakeup when it
fires (anyio's ``move_on_after`` costs about 6 µs a wait, a timer handle
about 1.5, and a reader waits once a frame); on trio, trio's own
``move_on_after``. Either way it returns as a wake does, and the waiter's
check decides whether anything changed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Protocol

from ._backend import current_backend

__all__ = ["Wakeup"]


class _Event(Protocol):
    """What asyncio.Event and trio.Event share, and all a Wakeup uses of them."""

    async def wait(self) -> object: ...

    def set(self) -> None: ...


class Wakeup:
    """Wakes the tasks waiting on it (see the module docstring); loop-only."""

    __slots__ = ("_event", "_new_event")

    def __init__(self) -> None:
        self._event: _Event | None = None
        self._new_event: Callable[[], _Event] | None = None

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the next :meth:`wake`, or ``timeout`` seconds at most; check the condition again after."""
        event = self._event
        if event is None:
            new_event = self._new_event
            if new_event is None:
                new_event = self._new_event = _event_class()
            event = self._event = new_event()
        if timeout is None:
            await event.wait()
        elif self._new_event is asyncio.Event:
            handle = asyncio.get_running_loop().call_later(timeout, self._expire, event)
            try:
                await event.wait()
            finally:
                # Cancelled, the handle is dropped from the loop's timer heap
                # lazily (asyncio) or at once (uvloop): nothing accumulates.
                handle.cancel()
        else:
            with sys.modules["trio"].move_on_after(timeout):
                await event.wait()

    def wake(self) -> None:
        """Wake every task waiting now; nothing if none is."""
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    def _expire(self, event: _Event) -> None:
        # A timed wait's timer fired: a wake of that wait's event, unless a
        # wake got there first (then the Wakeup may hold a newer event, for
        # other waits, which this timer must not touch). Other tasks waiting
        # on the same event are woken too, as the rule allows: they check.
        if self._event is event:
            self._event = None
        event.set()


def _event_class() -> Callable[[], _Event]:
    """The running loop's event class (asked on the loop)."""
    if current_backend() == "trio":
        # Read, not imported: a trio loop runs only where trio was imported.
        trio_event: Callable[[], _Event] = sys.modules["trio"].Event
        return trio_event
    return asyncio.Event
