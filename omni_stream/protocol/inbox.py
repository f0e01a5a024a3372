"""One request's inbox on the client: a pure state machine (the reader feeds, the consumer takes).

Who waits on whom: the connection's reader feeds an :class:`Inbox` and never
waits on its consumer. Each inbox buffers what arrived for its request; when
the consumer falls ``max_buffered`` items behind, the oldest intermediate
progress and previews are dropped (latest wins, as on the server). The final
preview and the outcome (``done``, ``cancelled``, ``error``) are never dropped.
"""

from __future__ import annotations

import logging
from collections import deque

from .._wakeup import Wakeup
from ..errors import ClientError, ProtocolError, RemoteCancelledError
from .client import Event, server_error
from .codes import REJECTION_CODES
from .frames import PreviewFrame
from .server_messages import (
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Paused,
    Progress,
    Queued,
    Restarted,
    Resumed,
)

__all__ = ["Inbox"]

logger = logging.getLogger("omni_stream.client")


class Inbox:
    """What arrived for one request, waiting for its consumer; never blocks the feeder."""

    def __init__(self, request_id: str, *, want_progress: bool, max_buffered: int) -> None:
        self.id = request_id
        self.want_progress = want_progress
        self.max_buffered = max_buffered
        self.items: deque[Progress | PreviewFrame] = deque()
        self.accepted: Accepted | None = None
        self.done: Done | None = None
        self.last_progress: Progress | None = None
        #: Where it waited unstarted, while it did (None once frames come).
        self.queued: Queued | None = None
        #: The model it waited to load, while it did (None once frames come).
        self.loading: Loading | None = None
        #: Paused (a ``paused`` arrived, no ``resumed`` since).
        self.paused = False
        #: The server restarted and runs the request again (from which step, and why); None
        #: while it has not.
        self.restarted: Restarted | None = None
        self.final_seen = False
        self.finals = 0  # results arrived: one per image
        self.final_images = 1  # how many results the request has (their headers say)
        self.dropped = 0
        self.finished = False  # an outcome arrived (or the connection ended)
        self.outcome: ClientError | None = None  # None with finished: done
        self._raised = False
        self._wakeup = Wakeup()

    def feed(self, event: Event) -> None:
        """Take one event routed to this request. Never raises, never waits."""
        if self.finished:
            logger.debug("request %s: ignoring %s after its outcome", self.id, type(event).__name__)
            return
        if isinstance(event, ErrorMessage):
            self._feed_error(event)
        elif isinstance(event, Accepted):
            if self.accepted is not None:
                self.fail(ProtocolError("second 'accepted' for one request", request_id=self.id))
            else:
                self.accepted = event
        elif self.accepted is None:
            # docs/protocol.md: accepted comes first. Anything else first means
            # the server and this client disagree about the request's state.
            self.fail(
                ProtocolError(f"server sent {type(event).__name__} before 'accepted'", request_id=self.id)
            )
        elif isinstance(event, Queued):
            self.queued = event
        elif isinstance(event, Loading):
            self.queued = None
            self.loading = event
        elif isinstance(event, (Paused, Resumed)):
            self.paused = isinstance(event, Paused)
        elif isinstance(event, Restarted):
            # Runs again in a new server process: whatever paused it there is gone.
            self.restarted = event
            self.paused = False
        elif isinstance(event, Progress):
            self.queued = self.loading = None
            self.last_progress = event
            if self.want_progress:
                self._push(event)
        elif isinstance(event, PreviewFrame):
            if event.final:
                self.final_seen = True
                self.finals += 1
                self.final_images = event.images
            self._push(event)
        elif isinstance(event, Done):
            if not self.final_seen:
                self.fail(ProtocolError("server sent 'done' without a final preview", request_id=self.id))
                return
            if self.finals != self.final_images:
                self.fail(
                    ProtocolError(
                        f"server sent 'done' after {self.finals} of the request's "
                        f"{self.final_images} results",
                        request_id=self.id,
                    )
                )
                return
            self.done = event
            self._finish(None)
        elif isinstance(event, Cancelled):
            self._finish(
                RemoteCancelledError(
                    f"request cancelled ({event.reason})", reason=event.reason, request_id=self.id
                )
            )

    def _feed_error(self, event: ErrorMessage) -> None:
        accepted = self.accepted is not None
        if accepted and event.code in REJECTION_CODES:
            # A rejection naming a running request rejects some later message
            # about it (a cancel racing its end gets not_found): the request
            # itself goes on, and its own outcome is still to come. Unknown
            # codes end it: a newer server's new failure must not hang us.
            logger.debug("request %s: server rejected a message about it: %s", self.id, event.message)
            return
        self._finish(
            server_error(event.code, event.message, field=event.field, request_id=self.id, accepted=accepted)
        )

    def _push(self, item: Progress | PreviewFrame) -> None:
        self.items.append(item)
        if len(self.items) > self.max_buffered:
            # Latest wins: drop the oldest intermediate item; finals stay.
            for i, old in enumerate(self.items):
                if not (isinstance(old, PreviewFrame) and old.final):
                    del self.items[i]
                    self.dropped += 1
                    break
        self._wakeup.wake()

    def fail(self, error: ClientError) -> None:
        """End the request with ``error`` unless it already ended."""
        if not self.finished:
            self._finish(error)

    def _finish(self, outcome: ClientError | None) -> None:
        self.finished = True
        self.outcome = outcome
        self._wakeup.wake()

    async def get(self) -> Progress | PreviewFrame:
        """The next item; raises StopAsyncIteration after ``done``, the error once after others."""
        while True:
            if self.items:
                return self.items.popleft()
            if self.finished:
                if self.outcome is not None and not self._raised:
                    self._raised = True
                    raise self.outcome
                raise StopAsyncIteration
            await self._wakeup.wait()
