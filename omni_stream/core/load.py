"""The server's load against its bound: ``busy`` and the fair share (pure).

docs/protocol.md, "Busy": the engine steps every request it holds in turn,
a batch a model call, so every request admitted slows every other's steps.
:class:`Load` measures the engine against ``max_active`` + ``max_queued``;
:func:`check_load` refuses a ``generate`` past them, or past its
principal's fair share once the queue is over half full, with
:class:`~omni_stream.errors.ServerBusyError` and a ``retry_after_s`` from
:func:`retry_after`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from ..errors import ServerBusyError
from .limits import ServerLimits

__all__ = ["RETRY_AFTER_MAX_S", "RETRY_AFTER_MIN_S", "Load", "check_load", "retry_after"]


#: The range of ``busy``'s ``retry_after_s``: sooner is a retry storm, later
#: an estimate too uncertain to be worth waiting for (ask again).
RETRY_AFTER_MIN_S: Final = 1.0
RETRY_AFTER_MAX_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's requests against the server's bound.

    ``held``: requests the engine holds (started, or waiting for their first
    step). The first ``max_active`` count as ``active``, the rest as
    ``queued``: each of those costs every request a share of a model call
    per step, so there may be at most ``max_queued``.
    """

    held: int
    max_active: int
    max_queued: int

    @classmethod
    def of(
        cls, active: int, queued: int, limits: ServerLimits, *, engine_batch_size: int, host_engines: int = 0
    ) -> Load:
        """From the engine's statistics (``active``, ``queued``) and the server's limits
        (``ServerLimits.active_bound`` says what the two keywords are)."""
        bound = limits.active_bound(engine_batch_size, host_engines=host_engines)
        return cls(active + queued, bound, limits.max_queued)

    @property
    def active(self) -> int:
        return min(self.held, self.max_active)

    @property
    def queued(self) -> int:
        return max(0, self.held - self.max_active)

    @property
    def capacity(self) -> int:
        return self.max_active + self.max_queued

    @property
    def busy(self) -> bool:
        """True when a ``generate`` now gets ``busy`` whoever sends it."""
        return self.held >= self.capacity

    @property
    def crowded(self) -> bool:
        """True when the queue is over half full: each connection gets a fair share only."""
        return 2 * self.queued > self.max_queued

    def fair_share(self, principals: int) -> int:
        """Requests one of ``principals`` clients may hold while crowded."""
        return max(1, self.capacity // max(1, principals))

    def to_dict(self) -> dict[str, int]:
        return {
            "active": self.active,
            "queued": self.queued,
            "max_active": self.max_active,
            "max_queued": self.max_queued,
        }


def retry_after(
    remaining: Iterable[int],
    *,
    held: int,
    step_s: float | None,
    batch_size: float | None,
    whole_requests: bool = False,
) -> float:
    """Seconds until one of the requests the engine holds likely ends, in [1, 60].

    ``remaining``: their steps left. The engine steps each in turn,
    ``batch_size`` requests a model call of ``step_s`` seconds (the recent
    means), so one with ``r`` steps left ends in about ``r * held /
    batch_size`` calls; a whole-request model runs one request at a time,
    ``r`` calls. Unknown timings give the minimum.
    """
    left = [r for r in remaining if r > 0]
    if step_s is None or not left:
        return RETRY_AFTER_MIN_S
    calls_per_step = 1.0 if whole_requests else max(1.0, held / max(1.0, batch_size or 1.0))
    estimate = min(left) * calls_per_step * step_s
    if not math.isfinite(estimate):
        return RETRY_AFTER_MAX_S
    # Rounded up to a tenth: a client waiting exactly that long is not early.
    return min(max(math.ceil(estimate * 10) / 10, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def check_load(
    load: Load,
    *,
    own: int,
    principals: int,
    retry_after_s: Callable[[], float],
    request_id: str,
) -> None:
    """Refuse one more request when the engine is full, or its principal has its share.

    ``own``: requests the asking principal runs; ``principals``: principals
    with a client open or a request held, counted whether or not they hold
    work (one just refused holds none, and must still count, or whoever
    holds the queue refills each slot first). Raises ServerBusyError with
    ``retry_after_s()``.
    """
    names = "max_active + max_queued, OMNI_STREAM_MAX_ACTIVE / OMNI_STREAM_MAX_QUEUED"
    share = load.fair_share(principals)
    if load.busy:
        why = f"the server is busy: it holds {load.held} requests ({names} = {load.capacity})"
    elif load.crowded and own >= share:
        why = (
            f"the server is crowded ({load.queued} of max_queued={load.max_queued} queued) and this "
            f"client holds {own} requests, its fair share of {share} among {principals} "
            "clients"
        )
    else:
        return
    retry = retry_after_s()
    raise ServerBusyError(
        f"{why}; try again in about {retry:g} s", retry_after_s=retry, request_id=request_id
    )
