"""What the core asks of the server around it: its effects, as two typed interfaces (pure).

The core (rules.py) decides; the shell acts. Everything the core needs done
that waits, threads or touches the disk goes out through one of these, set
once when the server is built (``Rules.bind``, ``Rules.keep_journal``):

- :class:`Shell` (the service, server/service.py): run a request's
  consumer, send a webhook delivery, keep the time of the core's timers
  (pauses, deadlines), and hear that the last request or client is gone
  (shutdown waits on those);
- :class:`Journal` (the state directory, server/state.py; none without
  one): write down what a restart needs: a request admitted, refused a
  checkpoint, handed over to another replica, ended, and what its stream
  is opened with.

A test of the core implements them with lists; nothing here is I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .. import protocol
    from ..engine.like import FrameStreamLike
    from ..errors import CheckpointError
    from .records import RequestRecord, Terminal
    from .rules import Admitted
    from .webhook_deliveries import Delivery

__all__ = ["Journal", "Shell"]


class Shell(Protocol):
    """The server's side of the core: what runs, waits or sends for it."""

    def start_consumer(self, admitted: Admitted, stream: FrameStreamLike) -> None:
        """Run the consumer of a request the core let into the engine (it streams ``stream``)."""

    def send_webhook(self, delivery: Delivery) -> None:
        """Queue a webhook delivery for sending (never waits)."""

    def timers_changed(self) -> None:
        """A client's pause began, or a request with a deadline was admitted: call
        ``Rules.expire_pauses`` and ``Rules.expire_deadlines`` again when the next is due."""

    def requests_idle(self) -> None:
        """The last running request ended."""

    def clients_idle(self) -> None:
        """The last client left."""


class Journal(Protocol):
    """The state directory's side of the core: what a restart needs written down."""

    def admitted(self, admitted: Admitted, msg: protocol.Generate) -> None:
        """A request was admitted (write it down before it runs)."""

    def stream_options(self, admitted: Admitted) -> Mapping[str, Any]:
        """The keywords its stream gets besides the core's own (checkpoints, one to resume from)."""

    def resume_refused(self, record: RequestRecord, error: CheckpointError) -> None:
        """The model refused the checkpoint it was to resume from: it starts from step 0."""

    def handed_over(self, record: RequestRecord, from_step: int) -> None:
        """It was handed over to another replica and its watchers were told (``restarted``)."""

    def finished(self, record: RequestRecord, message: Terminal) -> None:
        """It ended with ``message`` (its results are still on the record)."""
