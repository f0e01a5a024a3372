"""RemoteStream: one request's frames from a replica, a FrameStreamLike.

It reads the items of the replica's Ray streaming generator (wire.py),
unpacks a batch into a local queue (which ``poll()`` reads without
waiting), acknowledges the frames its reader takes (the replica's window),
and ends early only one way: ``DeploymentResponseGenerator.cancel()``, the one
thing that stops the request on its replica (with an acknowledgement of
``CANCELLED_SEQ`` behind it, for a request Serve was still assigning to a
replica, where its cancel is best effort). Ray's errors are translated
here (translate.py); the reader's own cancellation never is.

It keeps the checkpoints its replica sends (in the RemoteEngine's
CheckpointKeeper) and, when Ray says the replica is gone, submits the
request again from the newest one and reads on from the new replica,
dropping the frames it makes again that the reader had already
(handover.py): ``handovers`` lists each, and ``on_handover`` (the server's
consumer sets it) hears of each as it happens, before the new replica's
first frame (which may be long in coming: Serve may wait for a replacement
replica, and that replica for its model).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError, EngineDeadError, EngineError, OmniStreamError, RequestCancelledError
from ...frame import Frame
from .handover import Handover, KeptCheckpoint, redone, should_hand_over
from .translate import LOST, translate
from .wire import CANCELLED_SEQ, Header, Item, Submit, WireBatch, WireCheckpoint, WireError, WireFrame

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentResponseGenerator

    from .remote import RemoteEngine

__all__ = ["RemoteStream", "cancel_response"]

logger = logging.getLogger("omni_stream.ray_serve")

#: A reader that has waited this long since its last acknowledgement sends
#: it again (the board may have been replaced, losing it).
_REACK_AFTER_S = 1.0


def cancel_response(response: DeploymentResponseGenerator[Item]) -> None:
    """``DeploymentResponseGenerator.cancel()``, which must not mask the error being handled."""
    try:
        response.cancel()  # type: ignore[no-untyped-call]  # Ray leaves cancel() unannotated
    except Exception:  # noqa: BLE001 - a dead replica's request needs no cancelling
        logger.debug("cancelling a Serve request raised", exc_info=True)


class RemoteStream:
    """One request's frames from a replica; a FrameStreamLike (see the module docstring).

    ``on_handover(step)``, when set, is called in the reader's task each time the request goes
    on on another replica, ``step`` the step it resumes after (0: from the start), and again
    with 0 when the new replica refused the checkpoint; it must not raise.
    """

    def __init__(
        self,
        engine: RemoteEngine,
        response: DeploymentResponseGenerator[Item],
        *,
        key: str,
        request_id: str,
        total: int,
        params: Mapping[str, Any],
        model: str | None = None,
        loading: bool = False,
        resubmit: tuple[Mapping[str, Any] | None, Submit] | None = None,
        on_handover: Callable[[int], None] | None = None,
        resumed_from: int = 0,
        on_checkpoint: Callable[[str, KeptCheckpoint], None] | None = None,
    ) -> None:
        self._engine = engine
        self.on_handover = on_handover
        #: Called (in the reader's task) when the replica refused the checkpoint the request was
        #: submitted to resume from; it then starts again from step 0. None: the reader gets the
        #: CheckpointError instead. It must not raise.
        self.on_resume_refused: Callable[[CheckpointError], None] | None = None
        self._on_checkpoint = on_checkpoint
        self._response = response
        self._key = key
        self._request_id = request_id
        self._total = total
        self._params = params
        self._replica: str | None = None
        self._model = model
        self._loading = loading
        self._started = False  # its first frame arrived
        self._step = 0
        self._seq = 0
        #: Frames that arrived in a batch and are not taken yet (still in transit for the window).
        self._pending: deque[WireFrame] = deque()
        #: The last seq acknowledged, and how many taken frames may go unacknowledged
        #: (the replica's Header sets it from the window it grants).
        self._acked = 0
        self._ack_every = 1
        self._acked_at = time.monotonic()
        self._done = False
        self._ending: OmniStreamError | None = None  # set by the engine closing under it
        #: What was sent (params, Submit), sent again on a hand-over; None: never handed over.
        self._resubmit = resubmit
        #: The highest step received from any replica (taken or in ``_pending``): a new
        #: replica's frames up to it are dropped (handover.py). A resumed request's reader
        #: starts past the checkpoint's step.
        self._received = resumed_from
        self._cancelled = False  # its reader (or the engine) cancelled it: never handed over
        self._checkpointed = False  # the replica's Header said it sends checkpoints
        # The checkpoint step the current replica resumed after (None: it started afresh).
        self._resumed_from: int | None = resumed_from or None
        self._handovers: list[Handover] = []

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def total(self) -> int:
        """The step count: the card's estimate, then the replica's own once its Header arrived."""
        return self._total

    @property
    def params(self) -> Mapping[str, Any]:
        """The params as the front door checked them against the card, defaults filled in."""
        return self._params

    @property
    def model(self) -> str | None:
        """The name of the served model that runs the request."""
        return self._model

    @property
    def loading(self) -> bool:
        """True while the request waits for its model to load: the front door's guess until the
        replica's Header says, False from the first frame (remote.py)."""
        return self._loading and not self._started and not self._done

    @property
    def replica(self) -> str | None:
        """The replica running the request, once known (its first item arrived)."""
        return self._replica

    @property
    def handovers(self) -> tuple[Handover, ...]:
        """Each time the request went on on another replica, its replica lost (handover.py)."""
        return tuple(self._handovers)

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                item = await self._next_item()
            except StopAsyncIteration:
                if self._done:
                    raise
                self._end(cancel=False)
                raise EngineError(
                    f"replica {self._replica} ended the stream before its final frame",
                    request_id=self._request_id,
                ) from None
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    self._end(cancel=True)
                    raise  # the reader's own cancellation (or an exit): never translated
                if self._ending is None and self._hand_over(exc):
                    continue
                self._end(cancel=True)
                # No `from exc`: _failed() sets __cause__ itself (translate() may return
                # the error Ray wrapped, whose own cause chain must stay).
                raise self._failed(exc)  # noqa: B904
            if isinstance(item, WireError):
                error = item.error()
                if isinstance(error, CheckpointError) and self._resumed_from and self._restart(error):
                    continue
                self._end(cancel=False)
                raise error
            return self._took(item)

    def _failed(self, exc: Exception) -> OmniStreamError:
        """What the reader gets for ``exc`` raised while reading (the stream has ended)."""
        if self._ending is not None:
            self._ending.__cause__ = exc
            return self._ending
        if isinstance(exc, LOST) and self._replica is not None:
            self._engine._mark_lost(self._replica)
        if isinstance(exc, LOST) and self._cancelled:
            # Cancelled, then its replica died before the cancel landed: a cancel all the same.
            error: OmniStreamError = RequestCancelledError("cancelled", request_id=self._request_id)
            error.__cause__ = exc
            return error
        error = translate(exc, request_id=self._request_id, replica=self._replica, step=self._step)
        if isinstance(error, EngineDeadError) and self._handovers:
            limit = self._engine.handover.max_handovers
            error.message += (
                f"; not handed over again: handed over {len(self._handovers)} times already (max_handovers "
                f"{limit}): the request may be what kills its replicas"
            )
        return error

    def _hand_over(self, exc: Exception) -> bool:
        """Submit the request again from its newest checkpoint when ``exc`` says its replica is gone
        (handover.py); False when it is not handed over (then ``exc`` ends it)."""
        settings = self._engine.handover
        if (
            self._resubmit is None
            or self._done
            or not should_hand_over(
                exc, cancelled=self._cancelled, handovers=len(self._handovers), limit=settings.max_handovers
            )
        ):
            return False
        lost = self._replica
        if lost is not None:
            self._engine._mark_lost(lost)
        kept = self._engine.checkpoints.get(self._request_id)
        # A checkpoint is sent behind its frame, so never ahead of the reader; checked all the same.
        if kept is not None and kept.step > self._received:
            kept = None
        step = 0 if kept is None else kept.step
        self._handovers.append(Handover(lost, step, self._received))
        if kept is not None:
            logger.warning(
                "request %s: replica %s was lost (%s); it goes on on another replica after step %d "
                "(hand-over %d of at most %d; %d steps made again, not sent again)",
                self._request_id,
                lost,
                type(exc).__name__,
                step,
                len(self._handovers),
                settings.max_handovers,
                self._received - step,
            )
        else:
            why = (
                "its replica sent no checkpoints of it (its model cannot snapshot it, or none were asked)"
                if lost is not None and not self._checkpointed
                else "no checkpoint of it had arrived yet"
            )
            logger.warning(
                "request %s: replica %s was lost (%s) and %s: it starts again from step 0 on another "
                "replica (hand-over %d of at most %d; the %d frames its reader has are not sent again)",
                self._request_id,
                lost,
                type(exc).__name__,
                why,
                len(self._handovers),
                settings.max_handovers,
                self._received,
            )
        self._send_again(None if kept is None else kept.data, step)
        if self.on_handover is not None:
            self.on_handover(step)
        return True

    def _restart(self, error: CheckpointError) -> bool:
        """The replica refused the checkpoint (another version of the model, say): start the
        request again from step 0, once; False when it cannot be (then ``error`` ends it)."""
        if self._resubmit is None or self._cancelled or self._done:
            return False
        initial = not self._handovers  # the checkpoint it was submitted with, not a hand-over's
        if initial and self.on_resume_refused is None:
            return False  # the caller asked to resume from it: refused is its answer
        logger.warning(
            "request %s: %s refused its checkpoint (%s): it starts again from step 0",
            self._request_id,
            f"replica {self._replica}" if self._replica else "the replica",
            error.message,
        )
        self._engine.checkpoints.discard(self._request_id)
        self._send_again(None, 0)
        if initial:
            # Its reader has none of the steps now made (they were made before a restart).
            self._received = 0
            assert self.on_resume_refused is not None
            self.on_resume_refused(error)
            return True
        # The same hand-over, from step 0 now.
        self._handovers[-1] = dataclasses.replace(self._handovers[-1], step=0)
        if self.on_handover is not None:
            self.on_handover(0)
        return True

    def _send_again(self, resume: bytes | None, step: int) -> None:
        assert self._resubmit is not None
        params, submit = self._resubmit
        # Whatever Ray said, the old request must not run on: a replica only
        # unreachable for a while would otherwise stream it twice.
        cancel_response(self._response)
        submit = dataclasses.replace(submit, key=uuid.uuid4().hex, resume=resume)
        self._response = self._engine._submit(params, submit)
        self._key = submit.key
        self._replica = None
        self._checkpointed = False
        self._resumed_from = step
        # The new replica's window starts afresh. (Nothing is pending: the
        # response is read, and so found dead, only once every frame it sent was taken.)
        assert not self._pending, "a hand-over with frames still pending"
        self._seq = self._acked = 0
        self._acked_at = time.monotonic()

    async def _next_item(self) -> WireFrame | WireError:
        while True:
            if self._pending:
                return self._pending.popleft()
            item = await self._response.__anext__()
            if isinstance(item, Header):
                self._replica = item.replica
                self._total = item.total
                self._loading = item.loading
                self._checkpointed = item.checkpoints
                # At most half the window taken unacked: the replica is never
                # out of credit while the reader keeps up.
                self._ack_every = max(1, item.window // 2)
                continue
            if isinstance(item, WireCheckpoint):
                if self._engine.handover.sends_checkpoints:
                    self._engine.checkpoints.put(self._request_id, item.step, item.data)
                if self._on_checkpoint is not None:
                    self._on_checkpoint(self._request_id, KeptCheckpoint(item.step, item.data))
                continue
            if isinstance(item, WireError):
                return item
            frames = item.frames if isinstance(item, WireBatch) else (item,)
            assert all(isinstance(f, WireFrame) for f in frames), type(item)
            if self._handovers:
                # Made again by the replica it was handed over to: the reader has them.
                fresh, dropped = redone(frames, self._received)
                if dropped:
                    self._seq = max(self._seq, dropped)
                    self._ack()
                frames = tuple(fresh)
            if frames:
                self._received = max(self._received, frames[-1].step)
                self._pending.extend(frames)

    def _took(self, item: WireFrame) -> Frame:
        frame = item.frame(self._request_id)
        self._started = True
        self._step = frame.step
        self._seq = item.seq
        if frame.final:
            self._end(cancel=False)
        elif not self._pending or self._seq - self._acked >= self._ack_every:
            # Once a batch is taken (or half the window of it): one ack round trip
            # a batch, not a frame. A frame that came alone is acked at once:
            # the replica learns of acks only when it runs out of credit, and
            # an ack held back then costs it a whole round trip (measured: a
            # latest reader at window 8 got a third fewer previews).
            self._ack()
        return frame

    def _ack(self) -> None:
        self._acked_at = time.monotonic()
        self._acked = self._seq
        self._engine._ack(self._key, self._seq)

    def _reack_if_waiting(self, now: float) -> None:
        if not self._done and self._seq and now - self._acked_at > _REACK_AFTER_S:
            self._ack()

    def poll(self) -> Frame | None:
        """The next frame of a batch already here, else None; never waits, never raises.

        (A Ray stream cannot be asked whether an item is ready without
        waiting, so only frames that came in a batch are ready here; the
        replica coalesces for a ``latest`` reader, so what arrives is at
        most ``window`` frames old.)
        """
        if self._done or not self._pending:
            return None
        return self._took(self._pending.popleft())

    async def aclose(self) -> None:
        """Stop the request on its replica if it has not finished; idempotent."""
        self._end(cancel=True)

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _cancel(self, ending: OmniStreamError | None = None) -> bool:
        """Stop the request on the replica; the reader gets ``ending`` or RequestCancelledError."""
        if self._done:
            return False
        if ending is not None:
            self._ending = ending
        self._cancelled = True
        # Not _end(): the reader, if waiting, must wake to the cancellation
        # and raise it; the stream ends there.
        self._stop_on_replica()
        return True

    def _stop_on_replica(self) -> None:
        """Cancel the request on its replica: Serve's cancel, and the board's word (CANCELLED_SEQ)
        for a request Serve was still assigning, where its cancel is best effort."""
        cancel_response(self._response)
        try:
            self._engine._ack(self._key, CANCELLED_SEQ)
        except Exception:  # noqa: BLE001 - Ray gone (shutting down): nothing runs to stop
            logger.debug("telling the replica of a cancel failed", exc_info=True)

    def _end(self, *, cancel: bool) -> None:
        if self._done:
            return
        self._done = True
        if cancel:
            self._stop_on_replica()
        self._engine._forget(self)

    def __del__(self) -> None:
        # A `break` out of `async for` drops the stream: stop the replica's
        # request (the only way is .cancel(); see the module docstring).
        if not getattr(self, "_done", True):
            self._done = True
            self._engine._cancel_threadsafe(self._response)
            self._engine._forget(self)
