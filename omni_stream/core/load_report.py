"""What the rules report of the server's load: the load now, ``busy``'s wait, the queue's order.

:class:`LoadReport`, a part of :class:`~omni_stream.core.rules.Rules`,
reads the engine's health and the gate and says how loaded the server is
(:meth:`LoadReport.load`: what the engine holds and what waits in the
gate, against ``max_active`` + ``max_queued``, load.py's arithmetic), how
long a refused client should wait (:meth:`LoadReport.retry_after`, from
the steps the running requests have left and the recent step time), and
where each request that has not started waits
(:meth:`LoadReport.queue_positions`). It only reads: admission refuses on
its load (rules.py, admission.py), ``/health`` and the status routes show
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import admission

if TYPE_CHECKING:
    from ..engine.like import EngineLike
    from ..model import StepModel
    from .gate import Gate
    from .limits import ServerLimits
    from .metrics import ServerMetrics
    from .records import RequestRecord
    from .registry import RequestRegistry

__all__ = ["LoadReport"]


class LoadReport:
    """The server's load, read: a part of :class:`~omni_stream.core.rules.Rules` (see the module
    docstring), whose ``__init__`` sets these attributes."""

    engine: EngineLike
    limits: ServerLimits
    models: dict[str, StepModel]
    gate: Gate
    registry: RequestRegistry
    metrics: ServerMetrics
    paused: dict[str, RequestRecord]
    #: Engines computing on this host's CPU (max_active's default depends on it).
    host_engines: int

    def load(self, health: Any | None = None) -> admission.Load:
        stats = (health or self.engine.health()).statistics
        # What the engine holds (its own count, in case others share it) and what waits in the
        # gate; the requests their clients paused hold no place.
        in_engine = max(self.gate.in_engine, stats.active + stats.queued - len(self.paused))
        return admission.Load.of(
            in_engine,
            self.gate.waiting,
            self.limits,
            engine_batch_size=self.engine.max_batch_size,
            host_engines=self.host_engines,
        )

    def retry_after(self, load: admission.Load) -> float:
        return admission.retry_after(
            (r.total - r.latest_step for r in self.registry.running()),
            held=load.held,
            step_s=self.metrics.recent_step_s,
            batch_size=self.metrics.recent_batch_size,
            whole_requests=any(getattr(m, "runs_whole_requests", False) for m in self.models.values()),
        )

    def position_of(self, record: RequestRecord) -> int | None:
        """``record``'s position in :meth:`queue_positions`; None once it started or ended."""
        if record.ended or record.latest_step > 0:
            return None
        return self.queue_positions().get(record.id)

    def queue_positions(self) -> dict[str, int]:
        """Position (0 = next) of every request that has not started a step yet.

        Those in the engine first, in the order its scheduler takes them
        (higher priority across principals first, then arrival), then
        those waiting in the gate, in the order it lets them in.
        """
        starting = [
            r
            for r in self.registry.running()
            if r.latest_step == 0 and r.id not in self.gate and r.id not in self.paused
        ]
        starting.sort(key=lambda r: (-r.cross_priority, r.created_at))
        order = [r.id for r in starting] + self.gate.order()
        return {rid: i for i, rid in enumerate(order)}
