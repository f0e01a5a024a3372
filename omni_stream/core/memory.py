"""The server's memory bound: what every outbox, retained result and running request holds.

:class:`MemoryBudget` counts the bytes the server holds for clients against
``max_memory_bytes`` and decides what gives way when an addition takes it
over (its docstring); :class:`MemoryReservation` is one running request's
share, made at admission (``admission.reserve_memory``). Pure bookkeeping:
no I/O; outboxes (outbox.py) and request records (records.py, registry.py) report to it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol

from ..model import ModelMemory, model_memory
from ..params import positive_int

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["MemoryBudget", "MemoryReservation"]


class _Retained(Protocol):
    def evict_oldest_retained(self) -> bool: ...


class MemoryBudget:
    """Bytes the server holds, against ``limit`` (``max_memory_bytes``).

    Counted in ``used``: what waits in every :class:`Outbox` given this
    budget, plus what request records keep for ``attach`` replays (their
    latest progress, preview and terminal message). Counted in
    ``reserved``: what running requests are expected to hold outside the
    outboxes (their state in the engine, frames on their way to the
    consumer, preview and result rendering), as :class:`MemoryReservation`
    objects made at admission (``admission.reserve_memory``, which refuses a
    request that does not fit with ``busy``).

    A reservation has two parts: ``own`` bytes, and ``shared`` bytes that
    count only towards its batch ``group``: the engine steps one batch at a
    time, so of the groups only the largest counts, and within a group only
    its ``batch_size`` largest ``shared`` values (what one model call
    handles at most), summed and passed through the group's ``batch_cost``
    (bytes held for a batch of that many shared bytes; default: as many).

    While ``used + reserved`` is over the limit, new latest-wins previews are
    refused; when an addition takes it over, it sheds until under,
    deterministically: first every queued latest-wins preview; then, one at
    a time, the larger side gives way: held for requests (retained results
    plus reservations: the result that ended first is forgotten,
    :meth:`set_retained`) or queued (the connection holding the most queued
    bytes is closed, 1008: its outbox overflows). When that side is larger
    but only running requests hold it, shedding stops there. Must-deliver
    messages of a connection that stays open are never dropped. A message
    fanned out to several clients counts once per outbox.
    """

    def __init__(self, limit: int) -> None:
        """Raises ParamsError when ``limit`` < 1."""
        positive_int(limit, "limit")
        self.limit = limit
        self.used = 0
        # Weak: a budget outlives connections, and must not keep one alive.
        self._outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()
        self._retained: weakref.ref[_Retained] | None = None
        self._shedding = False
        # Reservations, by token (the budget holds no reference to them, so
        # one dropped without release() is released by its __del__).
        self._own: dict[int, int] = {}
        self._groups: dict[Hashable, dict[int, int]] = {}
        self._batch_size: dict[Hashable, int] = {}
        self._batch_cost: dict[Hashable, Callable[[int], int]] = {}
        self._own_total = 0
        self._reserved = 0
        self._tokens = itertools.count()
        # The model whose caches count here (see watch_model), and what they held when last looked at.
        self._model: ModelMemory | None = None
        self.model_bytes = 0

    def set_retained(self, source: _Retained) -> None:
        """Where ended retained results are evicted from (the request registry; held weakly)."""
        self._retained = weakref.ref(source)

    def watch_model(self, model: object) -> None:
        """Count ``model``'s caches (``cache_bytes()``) in ``used``, if it has any.

        A model that builds buffers for requests and keeps them afterwards
        (the Mixture's image banks per size) holds memory no request
        reserves once they end: counted here (refreshed by
        :meth:`recount_model`, which the rules call as requests end), and
        given back through its ``trim_cache`` before retained results are
        forgotten when the budget is over.
        """
        found = model_memory(model)
        if found is not None:
            self._model = found
            self.recount_model()

    def recount_model(self) -> None:
        """Look at the model's caches again; shed if they took the budget over."""
        if self._model is None:
            return
        held = max(0, int(self._model.cache_bytes()))
        delta, self.model_bytes = held - self.model_bytes, held
        if delta >= 0:
            self.add(delta)
        else:
            self.release(-delta)

    @property
    def reserved(self) -> int:
        """Bytes reserved by running requests (see the class docstring)."""
        return self._reserved

    @property
    def total(self) -> int:
        """``used + reserved``: what the limit bounds."""
        return self.used + self._reserved

    @property
    def reservations(self) -> int:
        """How many reservations are held."""
        return len(self._own)

    def over(self, extra: int = 0) -> bool:
        """Whether holding ``extra`` more bytes would be over the limit."""
        return self.used + self._reserved + extra > self.limit

    def add(self, n: int) -> None:
        """Count ``n`` bytes more; shed (see the class docstring) if that goes over."""
        self.used += n
        if self.used + self._reserved > self.limit:
            self._shed()

    def release(self, n: int) -> None:
        """Count ``n`` bytes fewer."""
        self.used -= n

    # -- reservations --------------------------------------------------------------

    def reserved_with(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
    ) -> int:
        """What ``reserved`` would be with one more reservation like this (``group`` None: alone)."""
        token = next(self._tokens)
        self._put(token, own, shared, group, batch_size, batch_cost)
        try:
            return self._reserved
        finally:
            self._drop_token(token, group)

    def fits(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
    ) -> bool:
        """Whether such a reservation keeps ``used + reserved`` within the limit."""
        reserved = self.reserved_with(own, shared, group=group, batch_size=batch_size, batch_cost=batch_cost)
        return self.used + reserved <= self.limit

    def reserve(
        self,
        own: int,
        shared: int = 0,
        *,
        group: Hashable | None = None,
        batch_size: int = 1,
        batch_cost: Callable[[int], int] | None = None,
        own_per_byte: float = 0.0,
        shared_per_byte: float = 0.0,
        frame_bytes: int = 0,
    ) -> MemoryReservation:
        """Count a running request's expected bytes until the reservation is released.

        Never refuses (``admission.reserve_memory`` checks :meth:`fits`
        first). ``group`` None: a group of its own. ``own_per_byte``,
        ``shared_per_byte`` and ``frame_bytes``: how
        :meth:`MemoryReservation.observe_frame` grows it when frames turn out
        larger than ``frame_bytes``.
        """
        token = next(self._tokens)
        if group is None:
            group = ("alone", token)
        self._put(token, own, shared, group, batch_size, batch_cost)
        return MemoryReservation(
            self,
            token,
            group,
            own,
            shared,
            own_per_byte=own_per_byte,
            shared_per_byte=shared_per_byte,
            frame_bytes=frame_bytes,
        )

    def _put(
        self,
        token: int,
        own: int,
        shared: int,
        group: Hashable | None,
        batch_size: int,
        batch_cost: Callable[[int], int] | None = None,
    ) -> None:
        if group is None:
            group = ("alone", token)
        self._own[token] = own
        self._own_total += own
        self._groups.setdefault(group, {})[token] = shared
        self._batch_size[group] = max(1, batch_size)
        if batch_cost is not None:
            self._batch_cost[group] = batch_cost
        self._recount()

    def _drop_token(self, token: int, group: Hashable | None) -> None:
        if group is None:
            group = ("alone", token)
        own = self._own.pop(token, None)
        if own is None:
            return
        self._own_total -= own
        members = self._groups.get(group)
        if members is not None:
            members.pop(token, None)
            if not members:
                del self._groups[group]
                self._batch_size.pop(group, None)
                self._batch_cost.pop(group, None)
        self._recount()

    def _recount(self) -> None:
        # The largest batch the engine could step: of each group its
        # batch_size largest shared parts; of the groups the largest.
        batch = 0
        for group, members in self._groups.items():
            size = self._batch_size.get(group, 1)
            values = members.values()
            part = sum(values) if len(members) <= size else sum(heapq.nlargest(size, values))
            cost = self._batch_cost.get(group)
            batch = max(batch, cost(part) if cost is not None else part)
        self._reserved = self._own_total + batch

    # -- shedding --------------------------------------------------------------

    def _register(self, outbox: Outbox) -> None:
        self._outboxes.add(outbox)

    def _unregister(self, outbox: Outbox) -> None:
        self._outboxes.discard(outbox)

    def _shed(self) -> None:
        if self._shedding:  # overflowing an outbox releases bytes, re-entering here
            return
        self._shedding = True
        try:
            for box in list(self._outboxes):
                box.shed_previews()
            while self.used + self._reserved > self.limit:
                queued = {box: box.pending_bytes for box in list(self._outboxes) if box.pending_bytes}
                queued_total = sum(queued.values())
                if self.used - queued_total + self._reserved >= queued_total:
                    if not self._trim_model() and not self._evict_retained():
                        # Held by running requests: not the connections'
                        # doing. Previews stay refused until they end.
                        return
                else:
                    max(queued, key=queued.__getitem__).overflow(
                        "max_memory_bytes",
                        f"the server holds more than max_memory_bytes={self.limit} bytes",
                    )
        finally:
            self._shedding = False

    def _trim_model(self) -> bool:
        # What the model's caches hold beyond what running requests use is
        # the cheapest to give back: a request that needs it again rebuilds it.
        if self._model is None or self.model_bytes <= 0:
            return False
        excess = self.used + self._reserved - self.limit
        before = self.model_bytes
        self._model.trim_cache(max(0, before - excess))
        self.recount_model()
        return self.model_bytes < before

    def _evict_retained(self) -> bool:
        source = self._retained() if self._retained is not None else None
        return source is not None and source.evict_oldest_retained()

    def __repr__(self) -> str:
        return (
            f"MemoryBudget(used={self.used}, reserved={self._reserved}, limit={self.limit}, "
            f"outboxes={len(self._outboxes)}, reservations={len(self._own)})"
        )


class MemoryReservation:
    """What one running request is expected to hold, counted in a :class:`MemoryBudget`.

    Made by :meth:`MemoryBudget.reserve`; ``release()`` (idempotent) gives
    the bytes back, and so does dropping the last reference to it
    unreleased. :meth:`observe_frame` grows it when the request's frames
    turn out larger than estimated at admission (never shrinks it).
    """

    __slots__ = (
        "_budget",
        "_group",
        "_own_base",
        "_own_per_byte",
        "_released",
        "_shared_per_byte",
        "_token",
        "frame_bytes",
        "own",
        "shared",
    )

    def __init__(
        self,
        budget: MemoryBudget,
        token: int,
        group: Hashable,
        own: int,
        shared: int,
        *,
        own_per_byte: float,
        shared_per_byte: float,
        frame_bytes: int,
    ) -> None:
        self._budget = budget
        self._token = token
        self._group = group
        self.own = own
        self.shared = shared
        self.frame_bytes = frame_bytes
        # What own is beyond its per-frame part (a fixed base per request).
        self._own_base = max(0, own - int(own_per_byte * frame_bytes))
        self._own_per_byte = own_per_byte
        self._shared_per_byte = shared_per_byte
        self._released = False

    @property
    def nbytes(self) -> int:
        """What the request reserves when it is alone in its batch."""
        cost = self._budget._batch_cost.get(self._group)
        return self.own + (cost(self.shared) if cost is not None else self.shared)

    @property
    def released(self) -> bool:
        return self._released

    def observe_frame(self, nbytes: int) -> None:
        """A frame of ``nbytes`` reached the server: grow the reservation if it is over the estimate.

        Growing may take the budget over its limit (the frame is already
        there): then queued previews give way, then retained results, as
        for an addition.
        """
        if self._released or nbytes <= self.frame_bytes:
            return
        self.frame_bytes = nbytes
        own = max(self.own, self._own_base + int(self._own_per_byte * nbytes))
        shared = max(self.shared, int(self._shared_per_byte * nbytes))
        if (own, shared) == (self.own, self.shared):
            return
        budget = self._budget
        size = budget._batch_size.get(self._group, 1)
        cost = budget._batch_cost.get(self._group)
        budget._drop_token(self._token, self._group)
        self.own, self.shared = own, shared
        budget._put(self._token, own, shared, self._group, size, cost)
        if budget.used + budget._reserved > budget.limit:
            budget._shed()

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        if self._released:
            return
        self._released = True
        self._budget._drop_token(self._token, self._group)

    def __del__(self) -> None:
        # Dropped unreleased (a caller that raised between reserving and
        # starting the request): give the bytes back. Nothing to do when the
        # interpreter is shutting down.
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"MemoryReservation(own={self.own}, shared={self.shared}, {state})"
