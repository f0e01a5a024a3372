"""Replica reports and what a front door makes of them: health and statistics (pure, no Ray).

Each replica publishes a :class:`ReplicaReport` a few times a second; the
front door reads them all at once and judges each by its age: a replica
silent for ``stale_after_s`` is *lost* (its process or node is gone, or
its event loop is stuck), whatever its last report said.

Health of the whole (``summarize``): ``ok`` while any replica is ok (the
reason then names those that are not). With none ok it is ``stalled``, not
``dead``: Serve replaces failed replicas, so a front door that gave up
(the server exits on ``dead``) would throw away a deployment that is
recovering. ``dead`` is for a front door that has not reached the
deployment's board for ``dead_after_s``: the cluster or the application
is gone, and a supervisor restarting the front door is the remedy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.group import GroupStatistics, _sum_statistics
from ...engine.stats import EngineStatistics, Health

__all__ = ["ReplicaReport", "ReplicaView", "sum_statistics", "summarize", "view"]


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What one replica says about itself (pickled by the replica, read by front doors).

    ``streams``: requests it is streaming; ``in_transit``: frames it sent
    that their readers had not acknowledged when it last looked (an upper
    bound; at most ``window`` per stream). ``loaded``: the models on its
    device now, for a replica that loads them on demand (None: it has one
    model, or holds every model from its start).
    """

    replica: str
    health: Health
    max_batch_size: int
    streams: int
    in_transit: int
    pid: int
    node: str
    loaded: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A replica as a front door sees it: its last report, how old, and the verdict."""

    report: ReplicaReport
    age_s: float
    lost: bool

    @property
    def replica(self) -> str:
        return self.report.replica

    @property
    def status(self) -> str:
        return "lost" if self.lost else self.report.health.status

    @property
    def ok(self) -> bool:
        return not self.lost and self.report.health.ok

    def describe(self) -> str:
        if self.lost:
            return f"replica {self.replica} is lost (no report for {self.age_s:.1f} s)"
        h = self.report.health
        return f"replica {self.replica} is {h.status}" + (f": {h.reason}" if h.reason else "")


def view(
    reports: Mapping[str, tuple[float, ReplicaReport]],
    *,
    stale_after_s: float,
    forget_after_s: float = 30.0,
    known_lost: Collection[str] = (),
) -> list[ReplicaView]:
    """Each report with its verdict, in replica-name order.

    Lost: silent for ``stale_after_s``, or in ``known_lost`` (a stream from
    it failed with Ray's "actor died"). Reports older than ``forget_after_s``
    are left out: the replica is long gone and Serve has replaced it.
    """
    return [
        ReplicaView(report, age, age > stale_after_s or replica in known_lost)
        for replica, (age, report) in sorted(reports.items())
        if age <= forget_after_s
    ]


def sum_statistics(members: Sequence[EngineStatistics]) -> GroupStatistics:
    """The members' counters summed (EngineGroup's rule), each member's kept in ``members``."""
    if not members:
        zero: dict[str, Any] = {
            f.name: 0 for f in dataclasses.fields(EngineStatistics) if f.name != "batch_sizes"
        }
        return GroupStatistics(**zero, members=())
    return _sum_statistics(members)


def summarize(
    views: Sequence[ReplicaView],
    *,
    name: str,
    state: str,
    unreachable_s: float | None,
    dead_after_s: float,
) -> Health:
    """The deployment's Health for ``/health`` (see the module docstring).

    ``state``: the front door's own, a Lifecycle value (``new``, ``running``,
    ``closing``, ``closed``);
    ``unreachable_s``: how long its board has not answered (None: it did).
    Statistics sum the replicas that are not lost.
    """
    live = [v for v in views if not v.lost]
    stats = sum_statistics([v.report.health.statistics for v in live])
    device = f"ray:{name}"
    if state == "new":
        return Health("closed", "the RemoteEngine was not entered (use `async with`)", stats, device)
    if state != "running":
        return Health("closed", "the RemoteEngine was closed", stats, device)
    if unreachable_s is not None and unreachable_s > dead_after_s:
        return Health(
            "dead",
            f"the deployment {name!r} has not answered for {unreachable_s:.0f} s "
            "(the Ray cluster or the Serve application is gone)",
            stats,
            device,
        )
    if any(v.ok for v in views):
        bad = "; ".join(v.describe() for v in views if not v.ok)
        return Health("ok", bad or None, stats, device)
    if not views:
        reason = f"no replica of {name!r} has reported yet (starting, or being replaced)"
    else:
        reason = "no replica is ok: " + "; ".join(v.describe() for v in views)
    return Health("stalled", reason, stats, device)
