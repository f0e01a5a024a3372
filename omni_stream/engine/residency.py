"""Residency: which loaded model gives up the device for another, and when (pure).

A :class:`~omni_stream.engine.router.ModelRouter` with ``max_loaded`` set
asks these rules each time a model it must load finds no room; it tells
them what it sees (each loaded model as a :class:`Resident`, the requests
waiting for the model it wants) and the time, and does what they say. No
clock, task or engine here.

Issue #39, attack 6: a 20-step request waited a long request's whole run
on the other model, and two tenants alternating models livelocked the
router at 21,000 swaps in 30 s. Which loaded model makes room, and when;
its quantum is ``min_residency_s``:

- one nobody uses (no request runs in it but paused ones, none waits for
  it) once a quantum has passed since it loaded or last served a request:
  a client's next request, a moment later, finds it still there, and
  requests alternating between models swap at most once a quantum;
- one in use, once it has been loaded a quantum, by the scheduling
  policy: ``preemptive`` (the default) when every request running in it
  has more steps left than the shortest waiting for the other model, or
  that one has waited ten quanta (the shortest remaining work first,
  aged, as the engine ranks); ``round-robin`` always (time slices);
  ``fcfs`` never while its requests run (it takes no new ones, and goes
  when they end). Its running requests are paused to the host and handed
  over (``Engine.offload``, ``Engine.hand_over``: their state as a
  checkpoint) and go on where they stopped when it loads again, their
  frames and results the uninterrupted run's; a request its model cannot
  snapshot runs to its end first;
- and every such switch is one of at most ``max_swaps_per_min`` in any
  minute (the swap budget): past it, the next switch waits, so requests
  alternating between models cannot keep the device moving weights (an
  H200 took 0.45 s to load SD 1.5 and 1.53 s to unload it).

The defaults: ``OMNI_STREAM_MIN_RESIDENCY`` (2.0 s) and
``OMNI_STREAM_MAX_SWAPS_PER_MIN`` (6), read when the rules are made.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from ..config import env_float, env_int
from ..errors import ParamsError
from ..params import positive_int

__all__ = [
    "DEFAULT_MAX_SWAPS_PER_MIN",
    "DEFAULT_MIN_RESIDENCY_S",
    "MAX_SWAPS_PER_MIN_ENV",
    "MIN_RESIDENCY_ENV",
    "Resident",
    "Residency",
]

MIN_RESIDENCY_ENV: Final = "OMNI_STREAM_MIN_RESIDENCY"
MAX_SWAPS_PER_MIN_ENV: Final = "OMNI_STREAM_MAX_SWAPS_PER_MIN"
#: The defaults (see the module docstring): on an H200 a swap of SD 1.5 took about 2 s, so at
#: most 6 a minute spend at most a fifth of the device's time moving weights.
DEFAULT_MIN_RESIDENCY_S: Final = 2.0
DEFAULT_MAX_SWAPS_PER_MIN: Final = 6
#: Under the ``preemptive`` policy a request waits for its model at most this many quanta
#: (``min_residency_s``) while shorter requests keep the device on another: aged, never starved.
_STARVED_QUANTA: Final = 10
#: The swap budget's window, in seconds.
_MINUTE: Final = 60.0

_Key = TypeVar("_Key")


@dataclass(frozen=True, slots=True)
class Resident:
    """What the rules read of one loaded model (times on the router's clock, ``time.monotonic``)."""

    #: When its engine was last ready: its residency counts from here.
    loaded_at: float
    #: When it last took or released a request.
    last_used: float
    #: A request runs in it (not one its client paused) or waits for it.
    in_use: bool
    #: The steps left of each request running in it that its client did not pause.
    running: tuple[int, ...] = ()


class Residency:
    """The residency rules and the swap budget of one router (see the module docstring).

    ``min_residency_s`` and ``max_swaps_per_min``: None reads their
    environment variables, else the defaults. ``scheduling``: the engines'
    policy (engine/scheduler.py). Raises ParamsError for a
    ``min_residency_s`` that is not a finite number >= 0 or a
    ``max_swaps_per_min`` that is not a positive int.
    """

    def __init__(
        self,
        *,
        min_residency_s: float | None = None,
        max_swaps_per_min: int | None = None,
        scheduling: str = "preemptive",
    ) -> None:
        if min_residency_s is None:
            min_residency_s = env_float(MIN_RESIDENCY_ENV, DEFAULT_MIN_RESIDENCY_S, positive=False)
        if (
            isinstance(min_residency_s, bool)
            or not isinstance(min_residency_s, (int, float))
            or not math.isfinite(min_residency_s)
            or min_residency_s < 0
        ):
            raise ParamsError(
                f"min_residency_s ({MIN_RESIDENCY_ENV}) must be a finite number >= 0, "
                f"got {min_residency_s!r}",
                field="min_residency_s",
            )
        if max_swaps_per_min is None:
            max_swaps_per_min = env_int(MAX_SWAPS_PER_MIN_ENV, DEFAULT_MAX_SWAPS_PER_MIN)
        positive_int(max_swaps_per_min, "max_swaps_per_min", env=MAX_SWAPS_PER_MIN_ENV)
        self.min_residency_s = float(min_residency_s)
        self.max_swaps_per_min = max_swaps_per_min
        self._scheduling = scheduling
        self._recent: deque[float] = deque()  # when each switch of the last minute began
        #: Switches (an unload to load another) so far.
        self.swaps = 0

    @property
    def preempts(self) -> bool:
        """Whether a model giving way hands its running requests over (``fcfs`` runs them out)."""
        return self._scheduling != "fcfs"

    def victim(
        self, residents: Mapping[_Key, Resident], waiting: Sequence[tuple[int, float]], now: float
    ) -> tuple[_Key | None, float]:
        """Which of ``residents`` (the loaded models but the one wanted) gives way now, or None
        and the seconds until one may; the least recently used first among those that may.

        ``waiting``: each request waiting for the wanted model, not paused, as (its steps left,
        when it began to wait).
        """
        quantum = self.min_residency_s
        wait = math.inf
        free: list[_Key] = []
        due: list[_Key] = []
        shortest = min((remaining for remaining, _ in waiting), default=0)
        waited = max((now - since for _, since in waiting), default=0.0)
        for key, resident in residents.items():
            if not resident.in_use:
                # Unused: it goes once its quantum since it loaded or last served a request is
                # over, so a client's next request, a moment later, finds it still there and
                # alternating requests swap at most once a quantum.
                idle = now - max(resident.loaded_at, resident.last_used)
                if idle >= quantum:
                    free.append(key)
                else:
                    wait = min(wait, quantum - idle)
                continue
            # In use: it keeps the device for its quantum since it loaded. Without that, two
            # loads in turn took each other's model before its requests ran (the livelock).
            resident_s = now - resident.loaded_at
            if resident_s < quantum:
                wait = min(wait, quantum - resident_s)
            elif self._scheduling != "preemptive" or waited >= _STARVED_QUANTA * quantum:
                due.append(key)
            elif min(resident.running, default=0) > shortest:
                # Shortest remaining work first, as the engine's own policy: a long run gives
                # way to a shorter request, never the other way round.
                due.append(key)
            else:
                # A longer request waits for the shorter ones, aged: never past its bound.
                wait = min(wait, _STARVED_QUANTA * quantum - waited)
        candidates = free or due
        if candidates:
            return min(candidates, key=lambda key: residents[key].last_used), 0.0
        return None, wait

    def swap_wait(self, now: float) -> float:
        """Seconds until the swap budget allows one more switch (<= 0: now)."""
        while self._recent and now - self._recent[0] >= _MINUTE:
            self._recent.popleft()
        if len(self._recent) < self.max_swaps_per_min:
            return 0.0
        return self._recent[0] + _MINUTE - now

    def swapped(self, now: float) -> None:
        """A switch began at ``now``: it counts against the budget for a minute."""
        self._recent.append(now)
        self.swaps += 1
