"""The state directory's writes: each request's in order, in worker threads, never waited on.

:class:`StateLanes` is the part of the server's
:class:`~omni_stream.server.state.StateKeeper` that runs the store's calls
(``omni_stream/store/``): every write is queued on its request's
:class:`Lane` (recorded, then checkpoints, then its end, then its
deletion), and a lane runs in one task, its calls in worker threads, at
most ``StateKeeper``'s limiter's worth at once across lanes. A lane holds
at most one checkpoint waiting: a newer one replaces it (latest wins), so
a slow disk costs more redone steps after a crash, never memory or the
engine's time. A failed write (a full disk, a closed store) is one WARNING
and costs what it wrote, never the request or the server.

It decides nothing about what is written or when (the keeper's hooks do,
``state.py``), and reads nothing back (``state_restore.py``): it is the
one place that touches the store from the event loop's side, so the
order of a request's writes is kept in one place.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import CheckpointError, LifecycleError, StoreError
from ..store import Store

if TYPE_CHECKING:
    from ..checkpoint import CheckpointLike
    from ..store import Saved

__all__ = ["Lane", "StateLanes"]

logger = logging.getLogger("omni_stream.server")


@dataclasses.dataclass(eq=False)
class Lane:
    """One request's writes, run in order; at most one checkpoint waiting (latest wins)."""

    ops: collections.deque[Callable[[], None]] = dataclasses.field(default_factory=collections.deque)
    checkpoint: CheckpointLike | None = None
    running: bool = False
    #: Its end is queued: a checkpoint arriving now would be refused by the store anyway.
    ending: bool = False
    #: Deleted from the store: the lane goes once idle.
    forgotten: bool = False

    def next(self) -> Callable[[], None] | CheckpointLike | None:
        if self.ops:
            return self.ops.popleft()
        checkpoint, self.checkpoint = self.checkpoint, None
        return checkpoint


class StateLanes:
    """Each request's writes to the store, in order (see the module docstring).

    A base of :class:`~omni_stream.server.state.StateKeeper`, which sets
    these attributes as it is built and starts :meth:`_dispatch` in its
    task group once the store is open.
    """

    #: The folder (for the log lines) and its store (None until opened, and once closed).
    path: Path
    store: Store | None
    #: The step of each request's latest checkpoint written in this process.
    checkpoint_steps: dict[str, int]
    _limiter: anyio.CapacityLimiter
    _lanes: dict[str, Lane]
    _busy: int
    _idle: anyio.Event | None
    _send: MemoryObjectSendStream[str]
    _ready: MemoryObjectReceiveStream[str]
    _tg: anyio.abc.TaskGroup | None
    # The producer thread's hand-over (state.py): a forgotten lane's entry goes with it.
    _lock: threading.Lock
    _last_taken: dict[str, float]

    async def flush(self) -> None:
        """Return once every write queued so far is done (a graceful shutdown's last step)."""
        while self._busy:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def _write_checkpoint(self, request_id: str, checkpoint: CheckpointLike) -> None:
        # (Worker thread.) The bytes are made here, not on the producer or the loop.
        data = checkpoint.to_bytes()
        saved = self._open_store().save_checkpoint(request_id, checkpoint.step, data)
        if saved.stored:
            self.checkpoint_steps[request_id] = checkpoint.step
            logger.debug("request %s: checkpoint at step %d written", request_id, checkpoint.step)
        self._saved(request_id, saved)

    # -- the lanes -----------------------------------------------------------------

    def _queue(self, request_id: str, op: Callable[[], object], doing: str, *, new: bool = False) -> None:
        lane = self._lanes.get(request_id)
        if lane is None:
            lane = self._lanes[request_id] = Lane()
        elif new:
            lane.ending = lane.forgotten = False  # an id used again, after its deletion
        lane.ops.append(lambda: self._logged(doing, request_id, op))
        self._kick(request_id, lane)

    def _kick(self, request_id: str, lane: Lane) -> None:
        if not lane.running and self.store is not None:
            lane.running = True
            self._busy += 1
            self._send.send_nowait(request_id)

    async def _dispatch(self) -> None:
        assert self._tg is not None
        async with self._ready:
            async for request_id in self._ready:
                self._tg.start_soon(self._drain, request_id, name=f"omni_stream state {request_id}")

    async def _drain(self, request_id: str) -> None:
        lane = self._lanes[request_id]
        try:
            while (item := lane.next()) is not None:
                if callable(item):
                    await self._run(item)
                else:
                    write = functools.partial(self._write_checkpoint, request_id, item)
                    await self._run(
                        functools.partial(self._logged, "writing a checkpoint", request_id, write)
                    )
        finally:
            lane.running = False
            if lane.forgotten and not lane.ops and self._lanes.get(request_id) is lane:
                del self._lanes[request_id]
                with self._lock:
                    self._last_taken.pop(request_id, None)
            self._busy -= 1
            if self._busy == 0 and self._idle is not None:
                self._idle.set()
                self._idle = None

    # -- plumbing ------------------------------------------------------------------

    def _open_store(self) -> Store:
        if self.store is None:
            raise LifecycleError("the state directory is closed")
        return self.store

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    async def _guarded(self, doing: str, fn: Callable[[], Any]) -> Any:
        return await self._run(lambda: self._logged(doing, None, fn))

    def _logged(self, doing: str, request_id: str | None, fn: Callable[[], Any]) -> Any:
        # (Worker thread.) A full disk or a closed store costs what it wrote,
        # never the request or the server: one WARNING, and on.
        try:
            return fn()
        except LifecycleError:
            return None  # closed under it: shutting down
        except (StoreError, CheckpointError, OSError) as exc:
            where = f"request {request_id}: " if request_id else ""
            logger.warning("%sstate directory %s: %s failed: %s", where, self.path, doing, exc)
            return None

    def _saved(self, request_id: str, saved: Saved) -> None:
        if saved.evicted:
            logger.info(
                "state directory %s: %d finished requests deleted to make room for %s",
                self.path,
                len(saved.evicted),
                request_id,
            )
