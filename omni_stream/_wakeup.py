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
cancel scope: on asyncio one timer per Wakeup that wakes it when it fires
(anyio's ``move_on_after`` costs about 6 µs a wait, and a reader waits
once a frame); on trio, trio's own ``move_on_after``. Either way it
returns as a wake does, and the waiter's check decides whether anything
changed, its time included. The asyncio timer outlives the wait: a reader
waits once a frame with a bound minutes long, and the next wait's deadline
is later than the last's, so the timer armed for the first serves every
later one (armed again only for an earlier deadline, or once it fired).
Firing early for a later wait is a spurious wake, which the rule allows:
the waiter sees its deadline has not come and waits again, arming the
timer for it. :meth:`disarm` drops the timer when no bounded wait is to
come (a Delivery that ended), so an ended request leaves nothing in the
loop's timer heap.
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

    __slots__ = ("_event", "_new_event", "_timer", "_timer_at")

    def __init__(self) -> None:
        self._event: _Event | None = None
        self._new_event: Callable[[], _Event] | None = None
        # asyncio's timer for bounded waits, and the loop time it fires at.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

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
            loop = asyncio.get_running_loop()
            at = loop.time() + timeout
            timer = self._timer
            if timer is None or self._timer_at > at:
                # None armed, or the one armed fires after this wait's deadline.
                if timer is not None:
                    timer.cancel()
                self._timer = loop.call_at(at, self._expire)
                self._timer_at = at
            await event.wait()
        else:
            with sys.modules["trio"].move_on_after(timeout):
                await event.wait()

    def wake(self) -> None:
        """Wake every task waiting now; nothing if none is."""
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    def disarm(self) -> None:
        """Drop the bounded waits' timer (no bounded wait is to come); a later one arms it again."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _expire(self) -> None:
        # The timer fired: wake whoever waits now. Its wait may have a later
        # deadline than the one the timer was armed for (see the module
        # docstring): it checks, and waits again.
        self._timer = None
        self.wake()


def _event_class() -> Callable[[], _Event]:
    """The running loop's event class (asked on the loop)."""
    if current_backend() == "trio":
        # Read, not imported: a trio loop runs only where trio was imported.
        trio_event: Callable[[], _Event] = sys.modules["trio"].Event
        return trio_event
    return asyncio.Event
