"""One request's side of the client: :class:`RequestStream`, what the caller iterates.

It reads its request's :class:`~omni_stream.protocol.inbox.Inbox` (the
pure state machine the connection's reader feeds: latest-wins buffering,
outcomes never dropped) and owns the request's lifetime on this side:
the message is sent on first use, leaving early cancels or detaches.
"""

from __future__ import annotations

import logging
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from ..errors import ClientError, ProtocolError
from ..protocol.frames import PreviewFrame
from ..protocol.inbox import Inbox
from ..protocol.server_messages import Progress, Queued, Restarted

if TYPE_CHECKING:
    from .connection import Client

__all__ = ["RequestStream"]

logger = logging.getLogger("omni_stream.client")


# ---- what the caller iterates -----------------------------------------------------

T = TypeVar("T")


class RequestStream(Generic[T]):
    """One request's previews (and ``Progress`` items, if asked for), ending on ``done``.

    Made by :meth:`Client.generate` and :meth:`Client.attach`; the message is
    sent on the first ``__anext__`` (or ``async with``). Iteration raises
    RemoteCancelledError on ``cancelled``, RequestFailedError /
    RequestRejectedError / ParamsRejectedError on ``error``,
    ConnectionClosedError when the connection ends first, and ParamsError
    when this connection already watches a request with this id.

    Leaving early cancels a generate that was not detached; an attach only
    stops watching (the request runs on). Leaving ``async with`` or calling
    ``aclose()`` cancels at once. A plain ``break`` (or an exception out of
    the loop) cancels when the stream is garbage collected: in CPython right
    after the loop, once nothing refers to it, but an exception's traceback
    keeps it alive as long as the exception is kept; use ``async with``
    where that matters.
    """

    def __init__(
        self,
        client: Client,
        request_id: str,
        message: str,
        *,
        kind: Literal["generate", "attach"],
        cancel_on_exit: bool,
        want_progress: bool,
        max_buffered: int,
    ) -> None:
        self.id = request_id
        self.kind = kind
        self._client = client
        self._message = message
        self._cancel_on_exit = cancel_on_exit
        self._inbox = Inbox(request_id, want_progress=want_progress, max_buffered=max_buffered)
        self._state: Literal["new", "started", "closed"] = "new"
        self._finalizer: weakref.finalize[[Inbox, bool], RequestStream[T]] | None = None

    # -- what the server said about it --

    @property
    def accepted(self) -> bool:
        """True once the server accepted the request."""
        return self._inbox.accepted is not None

    @property
    def total(self) -> int | None:
        """Steps in the request (from ``accepted``), or None before it."""
        a = self._inbox.accepted
        return None if a is None else a.total

    @property
    def seed(self) -> int | None:
        """The seed the request runs with (from ``accepted``; drawn by the server when none
        was given), or None before it or for a model without one."""
        a = self._inbox.accepted
        return None if a is None else a.seed

    @property
    def preview_settings(self) -> dict[str, Any] | None:
        """The effective preview settings from ``accepted``, or None before it."""
        a = self._inbox.accepted
        return None if a is None else dict(a.preview)

    @property
    def last_progress(self) -> Progress | None:
        """The latest ``progress`` seen (kept even when progress items are not yielded)."""
        return self._inbox.last_progress

    @property
    def elapsed_s(self) -> float | None:
        """Server-side seconds from ``accepted`` to the final step, once ``done`` arrived."""
        d = self._inbox.done
        return None if d is None else d.elapsed_s

    @property
    def queued(self) -> Queued | None:
        """The server's ``queued`` while the request waits unstarted (``position``: requests
        before it, 0 next), as it stood when this stream opened or the request came to wait;
        None once it runs (its first ``progress``) or when it never waited."""
        return self._inbox.queued

    @property
    def paused(self) -> bool:
        """True while the server says the request is paused (``paused`` came, no ``resumed`` since)."""
        return self._inbox.paused

    @property
    def restarted(self) -> Restarted | None:
        """The server's ``restarted`` once it came (it restarted, a crash or a deploy, and runs the
        request again: ``from_step``, the steps not redone, and ``reason``); None before."""
        return self._inbox.restarted

    @property
    def dropped(self) -> int:
        """Intermediate items dropped because this consumer fell ``max_buffered`` behind."""
        return self._inbox.dropped

    @property
    def finished(self) -> bool:
        """True once the request's outcome arrived (or the connection ended)."""
        return self._inbox.finished

    # -- iteration --

    def __aiter__(self) -> RequestStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._state == "new":
            await self._start()
        if self._state == "closed":
            raise StopAsyncIteration
        try:
            item = await self._inbox.get()
        except (StopAsyncIteration, ClientError):
            self._settle()
            raise
        return item  # type: ignore[return-value]

    async def result(self) -> PreviewFrame:
        """Iterate to the end and return the final preview (the result; the first image's for
        a request of several, see :meth:`results`); raises as iteration does."""
        return (await self.results())[0]

    async def results(self) -> list[PreviewFrame]:
        """Iterate to the end and return the results: one final preview per image
        (``num_images``), in index order; raises as iteration does."""
        finals: list[PreviewFrame] = []
        async with self:
            async for item in self:
                if isinstance(item, PreviewFrame) and item.final:
                    finals.append(item)
        if not finals:  # pragma: no cover - Inbox refuses 'done' without a final
            raise ProtocolError("request ended without a final preview", request_id=self.id)
        return sorted(finals, key=lambda f: f.index)

    async def __aenter__(self) -> RequestStream[T]:
        if self._state == "new":
            await self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop iterating; cancels an unfinished, non-detached generate. Never raises."""
        if self._state != "started":
            self._state = "closed"
            return
        unfinished = not self._inbox.finished
        self._settle()
        if unfinished and self._cancel_on_exit:
            # Queued, not awaited: leaving `async with` inside a cancelled
            # scope must still cancel, and closing must never block on a send.
            self._client._queue_cancel(self.id)

    async def _start(self) -> None:
        self._state = "started"
        try:
            await self._client._open_request(self._inbox, self._message)
        except BaseException:
            self._state = "closed"
            raise
        # On garbage collection after an early ``break``: unregister, and
        # cancel unless detached. Refers to the client and inbox, not to self.
        self._finalizer = weakref.finalize(self, self._client._abandon, self._inbox, self._cancel_on_exit)
        self._finalizer.atexit = False

    def _settle(self) -> None:
        """Done with this stream: unregister its inbox, without cancelling."""
        self._state = "closed"
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._client._forget(self._inbox)
