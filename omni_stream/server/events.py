"""Server-Sent Events for one request: the websocket's messages as ``text/event-stream``.

:func:`sse_event` turns one outbox item (a JSON message, or a binary
preview frame) into one event, pure. :class:`EventStream` is the ASGI
response that drains a watcher's :class:`Outbox` onto the HTTP connection:
it is the only task that waits on that client, each send bounded by
``send_timeout_s``; a client that stops reading loses intermediate previews
and progress (latest-wins in its outbox) and, once a must-deliver message
overflows, its stream ends. It never slows the request or anyone else.

Each event's ``id:`` is the step it reports (``progress``, ``preview``;
``done`` carries the total), so a reconnecting ``EventSource`` sends
``Last-Event-ID`` and the new stream skips what that client already saw.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable

import anyio
from starlette.datastructures import MutableHeaders
from starlette.types import Receive, Scope, Send

from .. import protocol
from ..core.outbox import Outbox, OutboxItem, OutboxOverflowError

__all__ = ["EventStream", "parse_last_event_id", "sse_event"]

logger = logging.getLogger("omni_stream.server")

#: A comment line every so often keeps proxies from closing an idle stream
#: (a request queued behind others sends nothing for a while).
KEEPALIVE_S = 15.0
#: The messages that end a request (and so its event stream).
TERMINAL_KINDS = frozenset({"done", "cancelled", "error"})


def sse_event(item: OutboxItem, *, after_step: int | None = None) -> bytes | None:
    """One outbox item as one SSE event; None to skip it.

    ``after_step``: the client's ``Last-Event-ID``; progress and non-final
    previews at or before it were seen already, and so was ``accepted``.
    """
    message = item.message
    if isinstance(message, protocol.Preview):
        header = message.header
        if after_step is not None and header.step <= after_step and not header.final:
            return None
        payload = header.to_dict()
        payload["image"] = f"data:{header.mime};base64," + base64.b64encode(message.image).decode("ascii")
        return _format("preview", json.dumps(payload, separators=(",", ":")), event_id=header.step)
    event_id: int | None = None
    if isinstance(message, protocol.Progress):
        event_id = message.step
        if after_step is not None and event_id <= after_step:
            return None
    elif isinstance(message, protocol.Done):
        event_id = message.total
    elif isinstance(message, protocol.Accepted) and after_step is not None:
        return None
    # The event's data is the message's JSON, the websocket's text frame.
    return _format(message.kind, message.wire, event_id=event_id)


def _format(event: str, data: str, *, event_id: int | None) -> bytes:
    # JSON never holds a raw newline, so one data: line is enough.
    head = f"event: {event}\n"
    if event_id is not None:
        head += f"id: {event_id}\n"
    return (head + f"data: {data}\n\n").encode()


class EventStream:
    """An ASGI response streaming ``outbox`` as Server-Sent Events (module docstring).

    ``on_close`` runs once when the stream ends, however it ends (the
    caller stops watching the request there).
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        send_timeout_s: float,
        on_close: Callable[[], None] = lambda: None,
        after_step: int | None = None,
        headers: dict[str, str] | None = None,
        encode: Callable[[OutboxItem], Awaitable[bytes | None]] | None = None,
    ) -> None:
        self._outbox = outbox
        # How an item becomes an event: ours (sse_event), or another API's
        # (the OpenAI doors' partial images: server/openai_api.py).
        self._encode = encode
        self._send_timeout_s = send_timeout_s
        self._on_close = on_close
        self._after_step = after_step
        self.status_code = 200
        fixed = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-store",
            "x-accel-buffering": "no",  # nginx: do not buffer the stream
            "x-content-type-options": "nosniff",
            **{k.lower(): v for k, v in (headers or {}).items()},
        }
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fixed.items()]
        #: The response's headers (the door adds CORS ones here).
        self.headers = MutableHeaders(raw=self.raw_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # Stays False when the client hangs up first (the watcher
            # cancels the pump): then there is no one to end the body for.
            ended = False
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                ended = await self._pump(send)
                tg.cancel_scope.cancel()
            if ended:
                with anyio.move_on_after(self._send_timeout_s):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-send
        finally:
            self._outbox.abort()
            self._on_close()

    async def _pump(self, send: Send) -> bool:
        """Send events until the outbox ends; False when the client is too slow (drop it)."""
        while True:
            try:
                with anyio.move_on_after(KEEPALIVE_S) as idle:
                    item = await self._outbox.get()
                if idle.cancelled_caught:
                    chunk: bytes | None = b": keepalive\n\n"
                elif self._encode is not None:
                    chunk = await self._encode(item)
                else:
                    chunk = sse_event(item, after_step=self._after_step)
            except anyio.EndOfStream:
                return True
            except OutboxOverflowError as exc:
                logger.warning("ending an event stream: client not reading (%s)", exc)
                return False
            terminal = not idle.cancelled_caught and item.kind in TERMINAL_KINDS
            if chunk is None:
                if terminal:
                    return True
                continue
            with anyio.move_on_after(self._send_timeout_s) as scope:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if scope.cancelled_caught:
                logger.warning("ending an event stream: a send was blocked for %g s", self._send_timeout_s)
                return False
            if terminal:
                return True  # one request per stream: its outcome ends it

    def __repr__(self) -> str:
        return f"EventStream({self._outbox!r})"


def parse_last_event_id(value: str | None) -> int | None:
    """``Last-Event-ID`` as a step, None when absent or not a step number."""
    if value is None:
        return None
    try:
        step = int(value.strip())
    except ValueError:
        return None
    return step if step >= 0 else None
