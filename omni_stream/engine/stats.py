"""Frozen records the engine reports: statistics() and health()."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EngineStatistics", "Health"]


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine's counters.

    ``active``: requests that have started and not ended; ``queued``: not
    started yet. ``completed``/``cancelled``/``failed``/``timed_out`` count
    ended requests by outcome since start. ``buffers_*`` describe the host
    buffer pool: allocated, leased, and leased with a copy still in flight.
    ``steps`` counts request-steps computed, ``batches`` model calls, and
    ``batch_sizes`` maps a batch size to how many calls ran with it.
    ``frames_dropped`` counts intermediate frames replaced under "latest".
    """

    active: int
    queued: int
    completed: int
    cancelled: int
    failed: int
    timed_out: int
    buffers_total: int
    buffers_in_use: int
    buffers_in_flight: int
    steps: int
    batches: int
    frames_delivered: int
    frames_dropped: int
    batch_sizes: dict[int, int] = field(default_factory=dict)
    #: Host buffers lent to readers as their frames (given back when they drop them).
    buffers_lent: int = 0
    #: Frames handed over as lent buffers, and frames cloned on the host after their copy.
    frames_lent: int = 0
    frames_cloned: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        return out


@dataclass(frozen=True, slots=True)
class Health:
    """``status`` is "ok", "stalled", "dead" or "closed"; ``reason`` says why when not ok."""

    status: str
    reason: str | None
    statistics: EngineStatistics
    device: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "ok": self.ok,
            "reason": self.reason,
            "device": self.device,
            **self.statistics.to_dict(),
        }
