"""One request's record, shared by the producer thread and the event loop.

Fields marked (lock) are read and written under the engine's lock by both
sides; (producer) only on the producer thread; (loop) only on the loop.
The state machine::

    QUEUED --first step--> RUNNING --final frame delivered--> FINISHED
       \\________________________\\--> CANCELLED | FAILED | TIMED_OUT
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

from .delivery import Delivery

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

__all__ = ["Status", "Request"]


class Status(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    TIMED_OUT = "timed_out"

    @property
    def ended(self) -> bool:
        return self not in (Status.QUEUED, Status.RUNNING)


# The live statuses, compared by identity on the producer's per-step scan (``not status.ended``
# without its property call).
_QUEUED, _RUNNING = Status.QUEUED, Status.RUNNING


class Request:
    """See the module docstring for which side owns which field."""

    __slots__ = (
        "id",
        "params",
        "total",
        "images",
        "batch_key",
        "policy",
        "timeout",
        "preview_every",
        "arrival",
        "priority",
        "group",
        "rank",
        "arrival_round",
        "submitted_at",
        "delivery",
        # (lock)
        "status",
        "issued",
        "delivered",
        "consumed",
        "last_scheduled",
        "run_streak",
        "ready_at",
        "handed_at",
        "preparing",
        "started",
        "closed",
        "finalized",
        "paused",
        "resumed_at",
        "to_host",
        "step_cached",
        # (producer)
        "state",
        "resume_from",
        "checkpoint_every",
        "on_checkpoint",
    )

    def __init__(
        self,
        *,
        request_id: str,
        params: Mapping[str, Any],
        total: int,
        batch_key: Hashable | None,
        policy: str,
        timeout: float | None,
        arrival: int,
        preview_every: int | None = None,
        priority: int = 0,
        group: Hashable | None = None,
        rank: int = 0,
        arrival_round: int = 0,
        delivery: Delivery,
        resume_from: Checkpoint | None = None,
        checkpoint_every: int | None = None,
        on_checkpoint: Callable[[str, Checkpoint], None] | None = None,
    ) -> None:
        self.id = request_id
        self.params = params
        self.total = total
        # How many images each frame holds: a model that makes several per
        # request declares them as its num_images param (Frame.image_count).
        self.images = _images(params)
        self.batch_key = batch_key
        self.policy = policy
        self.timeout = timeout
        self.preview_every = preview_every
        self.arrival = arrival
        self.priority = priority  # scheduler.py: higher runs first, aged so nobody starves
        # scheduler.py: the requests of one group (a server's principal) take the places the
        # policy gives the group in the order of their rank (their own priority), higher first.
        self.group = group
        self.rank = rank
        self.arrival_round = arrival_round  # the producer's batch count when it arrived
        self.submitted_at = time.monotonic()
        self.delivery = delivery
        self.status = Status.QUEUED
        self.issued = 0  # steps computed and handed to the copier
        self.delivered = 0  # frames that reached the delivery (or were dropped there)
        self.consumed = 0  # frames the reader took, or that "latest" replaced
        self.last_scheduled = -1
        self.run_streak = 0  # consecutive rounds it ran, up to last_scheduled (scheduler.py)
        self.ready_at = self.submitted_at  # when its next step could first run
        # When the producer last handed it the device (picked it for a batch),
        # on the table's clock; None until it first does. A whole-request
        # model's reader bounds its wait from here (OutputProcessor.step_deadline).
        self.handed_at: float | None = None
        #: model.prepare() has not finished yet (a worker thread): not runnable.
        self.preparing = False
        self.started = False  # model.start() ran (producer)
        self.closed = False  # model.close() ran (producer)
        self.finalized = False  # its outcome was counted and its reader told (loop)
        #: Paused (Engine.pause): not runnable, holds no batch place; its state
        #: stays where it is, or goes to host memory with ``to_host``.
        self.paused = False
        #: When it was last resumed: a reader's wait for a step is bounded from
        #: no earlier than this (paused time does not count against the timeout).
        self.resumed_at: float | None = None
        self.to_host = False  # the producer moves its state to the host (a checkpoint)
        # Its latest step reused its step cache (the model's step_reused; StepTimings.cached).
        self.step_cached = False
        self.state: Any = None
        #: Start from this checkpoint (model.restore) rather than model.start: a
        #: request resumed after a restart, or one whose state went to the host.
        self.resume_from = resume_from
        if resume_from is not None:
            # Its first resume_from.step frames were made (and sent) before.
            self.issued = self.delivered = self.consumed = resume_from.step
        self.checkpoint_every = checkpoint_every
        #: Called on the producer thread with each periodic checkpoint: hand it off, never block.
        self.on_checkpoint = on_checkpoint

    @property
    def in_flight(self) -> int:
        """Steps computed whose frames have not reached the delivery yet."""
        return self.issued - self.delivered

    @property
    def remaining(self) -> int:
        """Steps it has left to compute (the ``preemptive`` policy ranks by it)."""
        return self.total - self.issued

    @property
    def unconsumed(self) -> int:
        """Frames computed that the reader has not taken (nor were replaced)."""
        return self.issued - self.consumed

    def previewed(self, step: int) -> bool:
        """Whether a reader will preview this (non-final) step: decode it for them."""
        every = self.preview_every
        return every is not None and step < self.total and step % every == 0

    def runnable(self, max_run_ahead: int, queue_size: int) -> bool:
        # The producer asks this of every live request once a step: the status by identity and
        # the counters inline (``ended``, ``in_flight``, ``unconsumed`` are Python calls each).
        status, issued = self.status, self.issued
        if (
            (status is not _QUEUED and status is not _RUNNING)
            or issued >= self.total
            or self.preparing
            or self.paused
        ):
            return False
        if issued - self.delivered >= max_run_ahead:
            return False
        # "latest" never waits for its reader: newer frames replace older ones.
        return self.policy == "latest" or issued - self.consumed < queue_size


def _images(params: Mapping[str, Any]) -> int:
    n = params.get("num_images", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
