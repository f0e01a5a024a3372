"""RemoteStream: one request's frames from a replica, a FrameStreamLike.

It reads the items of the replica's Ray streaming generator (wire.py),
unpacks a batch into a local queue (which ``poll()`` reads without
waiting), acknowledges the frames its reader takes (the replica's window),
and ends early only one way: ``DeploymentResponseGenerator.cancel()``, the one
thing that stops the request on its replica. Ray's errors are translated
here (translate.py); the reader's own cancellation never is.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ...errors import EngineError, OmniStreamError
from ...frame import Frame
from .translate import LOST, translate
from .wire import Header, Item, WireBatch, WireError, WireFrame

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
    """One request's frames from a replica; a FrameStreamLike (see the module docstring)."""

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
    ) -> None:
        self._engine = engine
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

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        if self._done:
            raise StopAsyncIteration
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
            self._end(cancel=True)
            if not isinstance(exc, Exception):
                raise  # the reader's own cancellation (or an exit): never translated
            if self._ending is not None:
                raise self._ending from exc
            if isinstance(exc, LOST) and self._replica is not None:
                self._engine._mark_lost(self._replica)
            # No `from exc`: translate() sets __cause__ itself, and may return
            # exc or the error Ray wrapped, whose own cause chain must stay.
            raise translate(  # noqa: B904
                exc, request_id=self._request_id, replica=self._replica, step=self._step
            )
        if isinstance(item, WireError):
            self._end(cancel=False)
            raise item.error()
        return self._took(item)

    async def _next_item(self) -> WireFrame | WireError:
        if self._pending:
            return self._pending.popleft()
        while True:
            item = await self._response.__anext__()
            if isinstance(item, Header):
                self._replica = item.replica
                self._total = item.total
                self._loading = item.loading
                # At most half the window taken unacked: the replica is never
                # out of credit while the reader keeps up.
                self._ack_every = max(1, item.window // 2)
                continue
            if isinstance(item, WireBatch):
                self._pending.extend(item.frames[1:])
                return item.frames[0]
            assert isinstance(item, (WireFrame, WireError)), type(item)
            return item

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
        # Not _end(): the reader, if waiting, must wake to the cancellation
        # and raise it; the stream ends there.
        cancel_response(self._response)
        return True

    def _end(self, *, cancel: bool) -> None:
        if self._done:
            return
        self._done = True
        if cancel:
            cancel_response(self._response)
        self._engine._forget(self)

    def __del__(self) -> None:
        # A `break` out of `async for` drops the stream: stop the replica's
        # request (the only way is .cancel(); see the module docstring).
        if not getattr(self, "_done", True):
            self._done = True
            self._engine._cancel_threadsafe(self._response)
            self._engine._forget(self)
