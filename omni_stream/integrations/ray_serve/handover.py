"""Hand-over: a request whose replica died goes on on another from its last checkpoint (pure, no I/O).

::

    replica A: step ... N (frame) ──▶ WireCheckpoint(N) ──▶ front door: CheckpointKeeper[request] = N
    replica A dies (Ray: ActorDiedError, ...)  ──▶ should_hand_over? ──▶ stream(resume=N) on replica B
    replica B: Header, frames N+1 ... ──▶ redone(): frames the reader already has are dropped (acked)

A replica sends a request's periodic checkpoint (every ``checkpoint_every``
steps, ``Engine.stream(on_checkpoint=)``) as its bytes
(``Checkpoint.to_bytes``: versioned, checksummed), and only once the frame of
that step has been sent before it: a checkpoint at the front door is never
ahead of the frames its reader has, so resuming from it leaves no gap. The
front door keeps the newest per request (:class:`CheckpointKeeper`, bounded
in bytes; it never reads them: the replica that resumes does), and drops
it when the request ends.

When Ray says the replica is gone (:data:`~.translate.LOST`), the request is
submitted again under the same id with ``resume`` the kept checkpoint (or
from step 0, with a warning, when its model cannot snapshot it or none came
yet); the frames the new replica makes again, up to the last step the
reader received, are dropped (:func:`redone`), so the reader's stream goes
on without a gap or a repeated frame. What is never handed over: a request
that failed on its own (its model raised: a WireError), one its reader
cancelled, and one handed over ``max_handovers`` times already (a request
that kills every replica it lands on must not take the deployment down with
it, one replica at a time).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ...errors import ParamsError
from .translate import LOST
from .wire import WireFrame

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_CHECKPOINT_MAX_BYTES",
    "DEFAULT_MAX_HANDOVERS",
    "CheckpointKeeper",
    "Handover",
    "HandoverSettings",
    "KeptCheckpoint",
    "redone",
    "should_hand_over",
]

#: Steps between two checkpoints a replica sends: a replica's death redoes at
#: most this many steps of each of its requests (the state directory's default too).
DEFAULT_CHECKPOINT_EVERY: Final = 10
#: Hand-overs per request: a second replica lost under one request is bad luck,
#: a third looks like the request itself killing them.
DEFAULT_MAX_HANDOVERS: Final = 2
#: Bytes of checkpoints the front door keeps: about 500 requests of a
#: 512 px SD model (latents and prompt embeddings, about 0.5 MiB each), 60 of Flux.
DEFAULT_CHECKPOINT_MAX_BYTES: Final = 256 << 20


@dataclass(frozen=True, slots=True)
class HandoverSettings:
    """How a RemoteEngine hands requests over; raises ParamsError (naming the field) for bad values.

    ``checkpoint_every``: steps between two checkpoints a replica sends
    (None: none are sent; a lost replica's requests then restart from step
    0); ``max_handovers``: hand-overs per request (0: none, a lost replica's
    requests fail with EngineDeadError); ``checkpoint_max_bytes``: the bytes
    of checkpoints the front door keeps, all requests together.
    """

    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY
    max_handovers: int = DEFAULT_MAX_HANDOVERS
    checkpoint_max_bytes: int = DEFAULT_CHECKPOINT_MAX_BYTES

    def __post_init__(self) -> None:
        every = self.checkpoint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ParamsError(
                f"checkpoint_every must be a positive int or None, got {every!r}", field="checkpoint_every"
            )
        for name in ("max_handovers", "checkpoint_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ParamsError(f"{name} must be an int >= 0, got {value!r}", field=name)

    @property
    def sends_checkpoints(self) -> bool:
        """Whether replicas are asked for checkpoints: only where one could be used."""
        return self.checkpoint_every is not None and self.max_handovers > 0 and self.checkpoint_max_bytes > 0


@dataclass(frozen=True, slots=True)
class KeptCheckpoint:
    """A request's newest checkpoint as the replica sent it: its step and ``Checkpoint.to_bytes()``.

    A :class:`~omni_stream.checkpoint.CheckpointLike`: what a RemoteEngine's
    ``on_checkpoint`` gets (a state directory writes the bytes as they came).
    """

    step: int
    data: bytes

    def to_bytes(self) -> bytes:
        return self.data


@dataclass(frozen=True, slots=True)
class Handover:
    """One hand-over of a request: the replica lost (None: before its Header came), the step the
    request resumed after (0: from the start, as when the new replica refused the checkpoint) and
    the last step its reader had received then (``received - step`` steps were made again)."""

    lost: str | None
    step: int
    received: int

    @property
    def redone(self) -> int:
        """Steps the new replica computes again (their frames are not sent again)."""
        return max(0, self.received - self.step)


class CheckpointKeeper:
    """The newest checkpoint of each request, at most ``max_bytes`` of them in all. Thread-safe.

    A newer checkpoint replaces its request's older one; to make room, the
    requests whose checkpoint is the oldest to arrive lose theirs first (a
    hand-over of those restarts from step 0). A checkpoint larger than
    ``max_bytes`` on its own is not kept.
    """

    def __init__(self, max_bytes: int = DEFAULT_CHECKPOINT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, KeptCheckpoint] = OrderedDict()
        self._bytes = 0
        # A stream's __del__ (any thread) discards too.
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, request_id: str, step: int, data: bytes) -> bool:
        """Keep ``data`` as ``request_id``'s checkpoint at ``step``; False when not kept (too large
        alone, or not newer than the one kept)."""
        with self._lock:
            old = self._kept.get(request_id)
            if old is not None and old.step >= step:
                return False
            if old is not None:
                del self._kept[request_id]
                self._bytes -= len(old.data)
            if len(data) > self.max_bytes:
                return False
            while self._kept and self._bytes + len(data) > self.max_bytes:
                _, evicted = self._kept.popitem(last=False)
                self._bytes -= len(evicted.data)
            self._kept[request_id] = KeptCheckpoint(step, data)
            self._bytes += len(data)
            return True

    def get(self, request_id: str) -> KeptCheckpoint | None:
        """``request_id``'s newest checkpoint kept, or None."""
        with self._lock:
            return self._kept.get(request_id)

    def discard(self, request_id: str) -> None:
        """Forget ``request_id``'s checkpoint (its request ended); no error when there is none."""
        with self._lock:
            old = self._kept.pop(request_id, None)
            if old is not None:
                self._bytes -= len(old.data)


def should_hand_over(exc: BaseException, *, cancelled: bool, handovers: int, limit: int) -> bool:
    """Whether a request whose read raised ``exc`` goes on on another replica.

    Only when Ray says its replica is gone (``LOST``), its reader has not
    cancelled it, and it has been handed over fewer than ``limit`` times.
    """
    return isinstance(exc, LOST) and not cancelled and handovers < limit


def redone(frames: Sequence[WireFrame], received: int) -> tuple[list[WireFrame], int]:
    """``frames`` less those of steps the reader has received already (``received``: the highest),
    with the highest ``seq`` among those dropped (0: none): they still count in the window, and
    the reader acknowledges them as taken."""
    fresh = [f for f in frames if f.step > received]
    dropped = max((f.seq for f in frames if f.step <= received), default=0)
    return fresh, dropped
