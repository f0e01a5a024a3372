"""ReplicaBoard: the one small actor a deployment's replicas and its front doors share.

Two jobs, both soft state (lost on a restart, rebuilt within a second):

- **Acknowledgements.** A reader acknowledges each frame it takes
  (``ack(key, seq)``, fire and forget); a replica with ``window`` frames
  unacknowledged waits in ``wait_acked`` before it takes the next frame
  from its engine. That is what bounds the frames in transit: Serve drains
  a replica's generator into an unbounded queue and offers no flow control
  of its own, and a DeploymentHandle cannot address the replica that runs
  a given request, so the acknowledgements go through this actor, which
  every replica of the deployment and every front door can reach.
- **Reports.** Each replica publishes its health and statistics every
  fraction of a second (``report``); front doors read them all at once
  (``snapshot``), which is how ``RemoteEngine.health()`` and
  ``statistics()`` stay synchronous and cheap.

It runs as a Serve *deployment actor* (created, health-checked and deleted
with the deployment). Serve pickles this class by value, so this module
imports nothing of omni_stream: the actor's process never loads torch.
Reports are opaque bytes here for the same reason.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["ReplicaBoard"]

#: Acknowledgement entries nobody touched for this long are dropped (a
#: replica that died mid-request never calls forget).
_ACK_IDLE_S = 300.0
#: Reports older than this are dropped (a replica that died never leaves).
_REPORT_MAX_AGE_S = 120.0
_SWEEP_EVERY_S = 30.0


class _Acks:
    __slots__ = ("acked", "changed", "touched")

    def __init__(self) -> None:
        self.acked = 0
        self.changed = asyncio.Event()
        self.touched = time.monotonic()


class ReplicaBoard:
    """Acknowledgements and replica reports (see the module docstring). An async actor."""

    def __init__(self) -> None:
        self._acks: dict[str, _Acks] = {}
        self._reports: dict[str, tuple[float, bytes]] = {}
        self._swept = time.monotonic()

    # -- acknowledgements ----------------------------------------------------------

    def _entry(self, key: str) -> _Acks:
        entry = self._acks.get(key)
        if entry is None:
            entry = self._acks[key] = _Acks()
        entry.touched = time.monotonic()
        return entry

    async def ack(self, key: str, seq: int) -> None:
        """The reader of stream ``key`` has taken frames up to ``seq``."""
        entry = self._entry(key)
        if seq > entry.acked:
            entry.acked = seq
            entry.changed.set()
            entry.changed = asyncio.Event()
        self._sweep()

    async def wait_acked(self, key: str, at_least: int, timeout_s: float) -> int:
        """The frames acknowledged on ``key``, once at least ``at_least`` (or after ``timeout_s``)."""
        entry = self._entry(key)
        deadline = time.monotonic() + timeout_s
        while entry.acked < at_least:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(entry.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return entry.acked

    async def forget(self, key: str) -> None:
        """Stream ``key`` has ended; drop its entry."""
        entry = self._acks.pop(key, None)
        if entry is not None:
            entry.changed.set()  # a waiter (there should be none) returns

    # -- reports -------------------------------------------------------------------

    async def report(self, replica: str, blob: bytes) -> None:
        """Replica ``replica``'s latest report (pickled by the replica; opaque here)."""
        self._reports[replica] = (time.monotonic(), blob)

    async def leave(self, replica: str) -> None:
        """Replica ``replica`` shut down cleanly."""
        self._reports.pop(replica, None)

    async def snapshot(self) -> dict[str, tuple[float, bytes]]:
        """Every replica's latest report and its age in seconds."""
        self._sweep()
        now = time.monotonic()
        return {replica: (now - at, blob) for replica, (at, blob) in self._reports.items()}

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = now
        for key in [k for k, e in self._acks.items() if now - e.touched > _ACK_IDLE_S]:
            del self._acks[key]
        for replica in [r for r, (at, _) in self._reports.items() if now - at > _REPORT_MAX_AGE_S]:
            del self._reports[replica]
