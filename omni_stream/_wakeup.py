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

On asyncio (uvloop included) a wait is one bare future of the loop's,
returned by :meth:`wait` for the caller to await: no ``asyncio.Event``
(its construction, its loop check and its coroutine are three Python
frames a wait) and no coroutine of ours, and on asyncio's own loops
neither ``loop.create_future`` nor ``loop.time`` (each a Python frame
around a C call: the C calls are made directly, chosen once per loop),
because this is on the per-frame path: a reader waits once a frame, and
every frame of the loop's Python holds the GIL the producer's next torch
call may be waiting for. Each
waiter has its own future, so a cancelled waiter (asyncio cancels the
future a task awaits) never takes another's wake with it; a cancelled
future is skipped by the wake and dropped by the next wait. On trio a wait
parks the task (``trio.lowlevel.wait_task_rescheduled``, which a wake
reschedules): no ``trio.Event`` and its parking lot, and no backend
look-up a wait (``anyio.Event`` has one). Which one is decided at a
Wakeup's first wait, on the loop, and kept: a Wakeup may be made before
any loop runs (the engine's, in ``Engine.__init__``).

``wait(timeout)`` bounds a wait (a reader's step timeout) without a
cancel scope: one timer per Wakeup that wakes it when it fires (anyio's
``move_on_after`` costs about 6 µs a wait, and a reader waits once a
frame): the loop's ``call_at`` on asyncio, on trio the run's timers
(``_trio_timers.py``: trio has only cancel scopes, whose cost a wait
would pay every frame). It returns as a wake does, and the waiter's check
decides whether anything changed, its time included. The timer outlives
the wait: a reader waits once a frame with a bound minutes long, and the
next wait's deadline is later than the last's, so the timer armed for the
first serves every later one (armed again only for an earlier deadline,
or once it fired). A wait whose bound is no shorter than the one the
timer was armed with does not even read the clock: the timer was armed
no later than now, so it fires no later than this wait's deadline (on
trio the clock is three Python calls, paid once a frame otherwise).
Firing early for a later wait is a spurious wake, which the rule allows:
the waiter sees its deadline has not come and waits again, arming the
timer for it. :meth:`disarm` drops the timer when no bounded wait is to
come (a Delivery that ended), so an ended request leaves nothing in the
loop's timer heap. A timer of another loop (or of a trio run that ended)
is never taken for an armed one: it would never fire.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ._backend import current_backend

__all__ = ["Wakeup"]

_get_running_loop = asyncio.get_running_loop
_Future = asyncio.Future
_BASE_CREATE_FUTURE = asyncio.BaseEventLoop.create_future
_BASE_TIME = asyncio.BaseEventLoop.time


_NewFuture = Callable[[], "asyncio.Future[None]"]


def _loop_calls(loop: asyncio.AbstractEventLoop) -> tuple[_NewFuture, Callable[[], float]]:
    """``loop.create_future`` and ``loop.time``, as C calls where they are asyncio's own Python methods.

    asyncio's ``create_future`` is ``Future(loop=self)`` and its ``time`` is
    ``time.monotonic()``; a loop that overrides either, in its class or on
    the instance (uvloop's are C already, a test's clock), keeps its own.
    """
    # The bound methods are looked at, not the class's: a loop may have its clock
    # replaced on the instance (a fake-clock fixture's ``loop.time = ...``).
    new_future: _NewFuture = loop.create_future
    if getattr(new_future, "__func__", None) is _BASE_CREATE_FUTURE:
        new_future = functools.partial(_Future, loop=loop)
    now: Callable[[], float] = loop.time
    if getattr(now, "__func__", None) is _BASE_TIME:
        now = time.monotonic
    return new_future, now


class _Timer(Protocol):
    """What asyncio's TimerHandle and ours on trio share: all a Wakeup uses of them."""

    def cancel(self) -> None: ...

    def cancelled(self) -> bool: ...


class Wakeup:
    """Wakes the tasks waiting on it (see the module docstring); loop-only."""

    __slots__ = (
        "_waiters",
        "_tasks",
        "_trio",
        "_timer",
        "_timer_at",
        "_timer_bound",
        "_timer_loop",
        "_loop",
        "_new_future",
        "_now",
    )

    def __init__(self) -> None:
        # asyncio: the futures of the tasks waiting now (a cancelled one until the next wait).
        self._waiters: list[asyncio.Future[None]] = []
        # trio: the tasks parked here now.
        self._tasks: list[Any] = []
        # Decided at the first wait: None until then.
        self._trio: bool | None = None
        # The timer for bounded waits, and the loop time it fires at.
        self._timer: _Timer | None = None
        self._timer_at = 0.0
        # The bound of the wait that armed the timer. It was armed at ``_timer_at - _timer_bound``,
        # no later than now, so it fires no later than now plus that bound: a wait for at least
        # as long (a reader's next frame, the same bound) keeps it without reading the clock.
        self._timer_bound = 0.0
        # The asyncio loop the timer is on: a Wakeup waited on again under another loop arms
        # a timer there (the old one would never fire, and its time is another loop's clock).
        self._timer_loop: object = None
        # The asyncio loop of the last wait, and its create_future and time (``_loop_calls``).
        self._loop: object = None
        self._new_future: _NewFuture | None = None
        self._now: Callable[[], float] = time.monotonic

    def wait(self, timeout: float | None = None) -> Awaitable[object]:
        """Wait for the next :meth:`wake`, or ``timeout`` seconds at most; check the condition again after.

        Returns what to await (a future on asyncio): ``await wakeup.wait()``.
        """
        trio = self._trio
        if trio is None:
            trio = self._trio = current_backend() == "trio"
        if trio:
            if timeout is not None:
                self._arm_trio(timeout)
            return self._park()
        loop = _get_running_loop()
        new_future = self._new_future
        if loop is not self._loop or new_future is None:
            new_future, self._now = _loop_calls(loop)
            self._new_future, self._loop = new_future, loop
        waiter = new_future()
        waiters = self._waiters
        if waiters:
            # Another task waits too, or a cancelled waiter's future is left over.
            waiters[:] = [w for w in waiters if not w.done()]
        waiters.append(waiter)
        if timeout is not None and (
            self._timer is None or timeout < self._timer_bound or self._timer_loop is not loop
        ):
            # (A timer armed on this loop for a bound no longer than this one fires in time
            # without reading the clock: see _timer_bound.)
            at = self._now() + timeout
            if self._timer is None or self._timer_at > at or self._timer_loop is not loop:
                # None armed, the one armed fires after this wait's deadline, or it is another loop's.
                self._arm(at, timeout, loop.call_at)
                self._timer_loop = loop
        return waiter

    def _arm(self, at: float, bound: float, call_at: Callable[[float, Callable[[], None]], _Timer]) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
        self._timer = call_at(at, self._expire)
        self._timer_at = at
        self._timer_bound = bound

    def _arm_trio(self, timeout: float) -> None:
        timer = self._timer
        # (cancelled(): fired, or a timer of a trio run that has ended, whose clock was another.)
        if timer is not None and timeout >= self._timer_bound and not timer.cancelled():
            return  # it fires in time (see _timer_bound): no clock read (three Python calls on trio)
        trio = sys.modules["trio"]
        at = trio.current_time() + timeout
        if timer is None or self._timer_at > at or timer.cancelled():
            from ._trio_timers import timers  # only under trio: trio is imported

            self._arm(at, timeout, timers().call_at)

    async def _park(self) -> None:
        lowlevel = sys.modules["trio"].lowlevel
        task = lowlevel.current_task()
        tasks = self._tasks
        tasks.append(task)

        def abort(_: object) -> Any:
            # Cancelled while parked: no wake may reschedule it any more.
            if task in tasks:
                tasks.remove(task)
            return lowlevel.Abort.SUCCEEDED

        await lowlevel.wait_task_rescheduled(abort)

    def wake(self) -> None:
        """Wake every task waiting now; nothing if none is."""
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        tasks = self._tasks
        if tasks:
            # (A list of the waiting tasks: each is taken off the list as it is woken, once.)
            self._tasks = []
            reschedule = sys.modules["trio"].lowlevel.reschedule
            for task in tasks:
                reschedule(task)

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
