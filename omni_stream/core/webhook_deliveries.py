"""Webhook deliveries (pure): what is held, and which delivery gets the next send slot.

- :class:`WebhookBook`: how many requests with a webhook the server holds
  (running, or their terminal delivery not yet settled), so that terminal
  deliveries, which are never dropped, are bounded by admission instead;
  each principal holds at most its share, so one tenant's receivers that
  never answer cannot fill it for the others (issue #39, attack 3).
- :class:`Delivery`: one payload to one URL, and its tries.
- :class:`DeliveryQueue`: round robin across principals for the send slots,
  the last free slot kept for a principal with none in flight.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["LIMITS_ENV", "Delivery", "DeliveryQueue", "WebhookBook"]

#: The limits read from the environment (docs/configuration.md): WebhookConfig's field -> variable.
LIMITS_ENV: Final[Mapping[str, tuple[str, type]]] = {
    "max_held": ("OMNI_STREAM_WEBHOOK_MAX_HELD", int),
    "concurrency": ("OMNI_STREAM_WEBHOOK_CONCURRENCY", int),
    "attempt_timeout_s": ("OMNI_STREAM_WEBHOOK_TRY_TIMEOUT", float),
    "max_delivery_s": ("OMNI_STREAM_WEBHOOK_DELIVERY_TIMEOUT", float),
}


class WebhookBook:
    """Requests with a webhook the server holds: running, or their terminal delivery unsettled.

    Terminal deliveries are never dropped, so this is what bounds them: a
    request is counted from admission (:meth:`hold`) until its terminal
    delivery is delivered, given up or dropped at shutdown (:meth:`release`).

    Each principal holds at most its share: ``capacity // (n + 1)`` with
    ``n`` the principals holding one (itself counted), so a share is always
    left for one more (alone, half the book). One global book let one
    tenant whose receivers never answer fill it, and every other tenant's
    webhooks got ``busy`` for 1.8 h (issue #39, attack 3). What a principal
    holds over its share when others arrive is not taken back (a terminal
    delivery is never dropped): it drains as its deliveries settle, each
    within ``max_delivery_s`` of tries.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._by: Counter[str] = Counter()

    def held_by(self, principal: str) -> int:
        return self._by[principal]

    def share(self, principal: str) -> int:
        """What ``principal`` may hold now."""
        holders = len(self._by) + (principal not in self._by)
        return max(1, self.capacity // (holders + 1))

    def refusal(self, principal: str) -> str | None:
        """Why ``principal`` may not hold one more (None: it may)."""
        if self.held >= self.capacity:
            return (
                f"the server holds {self.held} requests with a webhook whose deliveries are not done "
                f"(max_held, {LIMITS_ENV['max_held'][0]})"
            )
        own, share = self._by[principal], self.share(principal)
        if own >= share:
            holders = len(self._by) + (principal not in self._by)
            return (
                f"this client holds {own} requests with a webhook whose deliveries are not done, its "
                f"share of the server's {self.capacity} (max_held, {LIMITS_ENV['max_held'][0]}) while "
                f"{holders} client{'s' if holders > 1 else ''} hold some: a share is kept for one more"
            )
        return None

    def has_room(self, principal: str) -> bool:
        return self.refusal(principal) is None

    def hold(self, principal: str) -> None:
        self.held += 1
        self._by[principal] += 1

    def release(self, principal: str) -> None:
        if self._by[principal] > 0:
            self.held = max(0, self.held - 1)
            self._by[principal] -= 1
        if self._by[principal] <= 0:
            del self._by[principal]


@dataclasses.dataclass(eq=False)
class Delivery:
    """One webhook message: its payload, signed and sent by the server's sender, and how that went.

    ``status``: ``pending`` (waiting, or between tries), ``sending``,
    ``delivered`` (a 2xx), ``failed`` (every try failed), ``dropped`` (a
    full queue dropped a progress delivery, or the server shut down first).
    """

    request_id: str
    event: str
    #: Where it goes, in the form it is sent in (sent_form): the string the allow-list matched.
    url: str
    #: The JSON body, exactly as signed and sent on every try.
    body: bytes
    #: The Standard Webhooks ``webhook-id``: the same on every try, so a receiver can de-duplicate.
    webhook_id: str
    max_attempts: int
    #: Whose request it is (Principal.key): send slots are shared across principals.
    principal: str = ""
    attempts: int = 0
    #: Seconds its tries took so far, together (at most max_delivery_s).
    spent_s: float = 0.0
    status: str = "pending"
    last_error: str | None = None
    #: The HTTP status of the last answer (None before one, or when none came).
    response_status: int | None = None
    #: Called once when it settles (delivered, failed, dropped).
    on_settled: Callable[[Delivery], None] | None = None

    @property
    def terminal(self) -> bool:
        return self.event != "progress"

    @property
    def settled(self) -> bool:
        return self.status in ("delivered", "failed", "dropped")

    def settle(self, status: str, error: str | None = None) -> None:
        """End it as ``status`` (delivered, failed, dropped); the first settlement stands."""
        if self.settled:
            return
        self.status = status
        if error is not None:
            self.last_error = error
        callback, self.on_settled = self.on_settled, None
        if callback is not None:
            callback(self)

    def view(self) -> dict[str, Any]:
        """What the request's status shows of it."""
        return {
            "event": self.event,
            "webhook_id": self.webhook_id,
            "attempts": self.attempts,
            "status": self.status,
            "response_status": self.response_status,
            "last_error": self.last_error,
        }


@dataclasses.dataclass(eq=False)
class _Lane:
    """One principal's deliveries waiting for a send slot, and its tries in flight."""

    #: Terminal deliveries and due retries, in order.
    ready: deque[Delivery] = dataclasses.field(default_factory=deque)
    #: Progress deliveries (at most one per request is unsettled: a newer one drops the older).
    progress: deque[Delivery] = dataclasses.field(default_factory=deque)
    in_flight: int = 0

    def __len__(self) -> int:
        return len(self.ready) + len(self.progress)


class DeliveryQueue:
    """Deliveries waiting for one of ``concurrency`` send slots, and which goes next (pure).

    Each principal has its own lane: its terminal deliveries and due
    retries first, then its progress ones. A free slot goes to the waiting
    principal with the fewest tries in flight, in turn among equals (round
    robin); the last free slot only to one with none in flight. So a
    tenant whose receivers never answer holds at most ``concurrency - 1``
    slots, and another tenant's delivery goes at once: with one queue and
    8 slots for all, B's ``completed`` waited 218.8 s behind A's (issue #39,
    attack 3). Progress deliveries are bounded by ``max_progress_pending``
    in all: past it the oldest of the principal with the most waiting is
    dropped (:meth:`put` returns it; the caller settles it).

    The sender calls :meth:`put` and :meth:`retry_at` when a delivery is
    due, :meth:`take` for the next to send (counted in flight until
    :meth:`finished`), and waits :meth:`wait_s` when it gets None.
    """

    def __init__(self, *, concurrency: int, max_progress_pending: int) -> None:
        self.concurrency = max(1, concurrency)
        self.max_progress_pending = max_progress_pending
        #: Lanes by principal, in turn order: one served moves to the end.
        self._lanes: dict[str, _Lane] = {}
        #: Deliveries waiting for their next try: (due, order, delivery).
        self._retries: list[tuple[float, int, Delivery]] = []
        self._order = itertools.count()
        self._progress = 0
        self.in_flight = 0

    @property
    def pending(self) -> int:
        """Deliveries not yet settled here: waiting, waiting for a retry, or being tried."""
        return sum(len(lane) for lane in self._lanes.values()) + len(self._retries) + self.in_flight

    def in_flight_of(self, principal: str) -> int:
        lane = self._lanes.get(principal)
        return lane.in_flight if lane is not None else 0

    def put(self, delivery: Delivery) -> Delivery | None:
        """Queue ``delivery`` in its principal's lane; the progress delivery this pushed out, if any."""
        lane = self._lane(delivery.principal)
        if delivery.terminal:
            lane.ready.append(delivery)
            return None
        dropped = None
        if self._progress >= self.max_progress_pending:
            # A flood of one principal's progress drops its own first.
            fullest = max(self._lanes.values(), key=lambda other: len(other.progress))
            if fullest.progress:
                dropped = fullest.progress.popleft()
                self._progress -= 1
        lane.progress.append(delivery)
        self._progress += 1
        return dropped

    def retry_at(self, delivery: Delivery, due: float) -> None:
        """Queue ``delivery`` again once the clock reaches ``due``."""
        heapq.heappush(self._retries, (due, next(self._order), delivery))

    def take(self, now: float) -> Delivery | None:
        """The next delivery to try (counted in flight), or None: none is due, or no slot is free
        for the principals waiting."""
        while self._retries and self._retries[0][0] <= now:
            due = heapq.heappop(self._retries)[2]
            if not due.settled:
                self._lane(due.principal).ready.append(due)
        free = self.concurrency - self.in_flight
        while free > 0:  # (until one is taken, or none may be)
            waiting = [(key, lane) for key, lane in self._lanes.items() if lane]
            if not waiting:
                break
            key, lane = min(waiting, key=lambda item: item[1].in_flight)  # the first of the fewest
            if free == 1 and lane.in_flight > 0 and self.concurrency > 1:
                break  # the last slot: for a principal with none in flight
            delivery = self._pop(lane)
            if delivery is None or delivery.settled:
                continue  # a superseded progress delivery: look again
            lane.in_flight += 1
            self.in_flight += 1
            del self._lanes[key]
            self._lanes[key] = lane  # its turn is over: to the end
            return delivery
        self._forget_idle()
        return None

    def finished(self, delivery: Delivery) -> None:
        """``delivery``'s try ended (whatever came of it): its slot is free."""
        lane = self._lanes.get(delivery.principal)
        if lane is not None and lane.in_flight > 0:
            lane.in_flight -= 1
            self.in_flight -= 1

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next retry is due; None when none waits."""
        return max(0.0, self._retries[0][0] - now) if self._retries else None

    def clear(self) -> list[Delivery]:
        """Every delivery waiting or waiting for a retry (not those in flight), removed."""
        left = [d for lane in self._lanes.values() for d in (*lane.ready, *lane.progress)]
        left += [d for _, _, d in self._retries]
        for lane in self._lanes.values():
            lane.ready.clear()
            lane.progress.clear()
        self._retries.clear()
        self._progress = 0
        self._forget_idle()
        return left

    def _lane(self, principal: str) -> _Lane:
        lane = self._lanes.get(principal)
        if lane is None:
            lane = self._lanes[principal] = _Lane()
        return lane

    def _pop(self, lane: _Lane) -> Delivery | None:
        if lane.ready:
            return lane.ready.popleft()
        if lane.progress:
            self._progress -= 1
            return lane.progress.popleft()
        return None

    def _forget_idle(self) -> None:
        # Lanes with nothing waiting and nothing in flight: so that the map is
        # bounded by the principals with deliveries, not all there ever were.
        for key in [k for k, lane in self._lanes.items() if not lane and not lane.in_flight]:
            del self._lanes[key]
