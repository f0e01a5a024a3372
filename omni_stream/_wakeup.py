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

``asyncio.Event`` rather than ``anyio.Event``: this is on the per-frame
path, and anyio's costs a backend look-up each; everything that uses it
runs on asyncio (uvicorn, websockets' asyncio client, the engine). The
event is made on the first wait after a wake, and dropped by the wake,
so an idle Wakeup holds none.
"""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    """Wakes the tasks waiting on it (see the module docstring); loop-only."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    async def wait(self) -> None:
        """Wait for the next :meth:`wake`; check the condition again after."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def wake(self) -> None:
        """Wake every task waiting now; nothing if none is."""
        event = self._event
        if event is not None:
            self._event = None
            event.set()
