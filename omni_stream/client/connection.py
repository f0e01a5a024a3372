"""Client and connect(): one websocket connection, its reader task, its requests.

The reader parses every server message (omni_stream/protocol/server_messages.py,
frames.py) and hands it to the inbox of the request it names (stream.py), so
several iterations run at once on one connection. A message or frame that
breaks the protocol closes the connection with 1002 and fails every request
on it with ProtocolError.
Websockets' exceptions are translated here and nowhere else.

On asyncio (uvloop included) the connection is websockets' asyncio client;
under trio it is an :class:`~.anyio_socket.AnyioSocket`, websockets'
Sans-I/O protocol over anyio's streams, with the same surface and the same
exceptions, so everything below runs unchanged on both.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import ssl
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final, Literal, Protocol, overload

import anyio
import anyio.abc
from websockets.asyncio.client import ClientConnection, connect as _ws_connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)

from .._backend import ThreadsafeLoop, current_backend, running_loop
from ..errors import (
    ClientError,
    ConnectError,
    ConnectionClosedError,
    LifecycleError,
    ParamsError,
    ProtocolError,
)
from ..lifecycle import Lifecycle
from ..params import positive_int
from ..protocol.client import Event, server_error
from ..protocol.client_messages import Attach, Cancel, Generate, Pause, Resume
from ..protocol.codes import CLOSE_PROTOCOL_ERROR
from ..protocol.frames import PreviewFrame, parse_preview_frame
from ..protocol.inbox import Inbox
from ..protocol.server_messages import ErrorMessage, Progress, parse_server_message
from .anyio_socket import AnyioSocket
from .stream import RequestStream

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_PING_INTERVAL",
    "DEFAULT_PING_TIMEOUT",
    "Client",
    "connect",
]

logger = logging.getLogger("omni_stream.client")

#: Default websocket message limit: a raw 2048 x 2048 RGB preview (12 MiB) fits.
DEFAULT_MAX_SIZE: Final = 32 * 1024 * 1024

#: Keepalive: a ping every DEFAULT_PING_INTERVAL seconds and a pong due
#: within DEFAULT_PING_TIMEOUT; then websockets still waits ``close_timeout``
#: (DEFAULT_CLOSE_TIMEOUT) for the closing handshake before it drops the TCP
#: connection. So a server that froze (SIGSTOP, a wedged host, a dead
#: network path) is noticed after ~25 s, at most 30 s; websockets' own
#: defaults (20 + 20 + 10) took up to ~50 s. The pong timeout is the larger
#: part on purpose: the server's pong waits behind whatever it is sending,
#: and a 32 MiB result takes ~10 s at 25 Mbit/s.
DEFAULT_PING_INTERVAL: Final = 10.0
DEFAULT_PING_TIMEOUT: Final = 15.0
DEFAULT_CLOSE_TIMEOUT: Final = 5.0

#: What an AnyioSocket (under trio) takes of websockets' ``connect`` keywords.
_ANYIO_OPTIONS: Final = frozenset(
    {"max_size", "open_timeout", "close_timeout", "ping_interval", "ping_timeout", "ssl", "compression"}
)


class _Socket(Protocol):
    """What the client uses of its connection: websockets' ClientConnection, or an AnyioSocket."""

    @property
    def close_code(self) -> int | None: ...

    @property
    def close_reason(self) -> str | None: ...

    async def send(self, message: str) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...

    def __aiter__(self) -> Any: ...


class Client:
    """One websocket connection to an omni_stream server; use ``async with``.

    ``token`` is sent as ``Authorization: Bearer TOKEN``. ``max_buffered``
    bounds the items one request buffers for a slow consumer (see
    omni_stream/protocol/inbox.py). Keepalive: a ping every ``ping_interval``
    seconds; when no pong comes within ``ping_timeout``, the connection is
    dropped after ``close_timeout`` more (default DEFAULT_CLOSE_TIMEOUT) and
    running requests end with ConnectionClosedError (1006); ``None`` turns
    either off. Other keyword arguments go to
    ``websockets.asyncio.client.connect`` (``open_timeout``, ``max_size``
    (default DEFAULT_MAX_SIZE), ``close_timeout``, ...). Entering raises
    ConnectError, and LifecycleError the second time; ParamsError for a bad
    url, token or option. Runs on anyio's asyncio (uvloop included) and trio
    backends; under trio the keywords websockets' own client would take are
    ``max_size``, ``open_timeout``, ``close_timeout``, ``ssl`` (an
    SSLContext) and ``additional_headers`` (others: ParamsError).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        max_buffered: int = 64,
        ping_interval: float | None = DEFAULT_PING_INTERVAL,
        ping_timeout: float | None = DEFAULT_PING_TIMEOUT,
        **connect_kwargs: Any,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("ws://", "wss://")):
            raise ParamsError(f"url must be a ws:// or wss:// URL, got {url!r:.120}", field="url")
        if token is not None and (not isinstance(token, str) or not token):
            raise ParamsError("token must be a non-empty string or None", field="token")
        positive_int(max_buffered, "max_buffered")
        for name, value in (("ping_interval", ping_interval), ("ping_timeout", ping_timeout)):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ParamsError(
                    f"{name} must be a positive number of seconds or None, got {value!r}", field=name
                )
        self.url = url
        self._token = token
        self._max_buffered = max_buffered
        self._connect_kwargs = {
            "ping_interval": ping_interval,
            "ping_timeout": ping_timeout,
            **connect_kwargs,
        }
        self._ws: _Socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: ThreadsafeLoop | None = None
        # Cancels of streams closed or dropped early, sent by one task of ours.
        self._cancels_send, self._cancels_receive = anyio.create_memory_object_stream[str](math.inf)
        self._inboxes: dict[str, Inbox] = {}
        self._closed: ConnectionClosedError | None = None
        self._state = Lifecycle.NEW

    # -- lifecycle --

    async def __aenter__(self) -> Client:  # noqa: PYI034 - subclasses are not expected
        if self._state is not Lifecycle.NEW:
            raise LifecycleError("a Client can be entered once; create a new one")
        self._state = Lifecycle.RUNNING
        try:
            self._ws = await self._connect()
        except BaseException:
            self._state = Lifecycle.CLOSED
            raise
        self._loop = running_loop()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_loop)
        self._tg.start_soon(self._send_queued_cancels)
        interval = self._connect_kwargs.get("ping_interval")
        if isinstance(self._ws, AnyioSocket) and interval is not None:
            # websockets' own client pings by itself.
            self._tg.start_soon(self._ws.keepalive, interval, self._connect_kwargs.get("ping_timeout"))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        try:
            # Shielded: a cancelled body still closes the socket (bounded by
            # close_timeout) and must still leave the task group it entered.
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            tg.cancel_scope.cancel()  # the reader ended with the socket; stop the rest
            # The body's own exception propagates as it is: handing it to the
            # task group would wrap it in an ExceptionGroup.
            await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the websocket (1000); requests still running end with ConnectionClosedError."""
        self._state = Lifecycle.CLOSED
        self._cancels_send.close()
        if self._ws is not None:
            await self._ws.close()
        self._fail_all(self._closed_error())

    @property
    def closed(self) -> bool:
        """True once the connection closed, from either side."""
        return self._closed is not None or self._state is Lifecycle.CLOSED

    @property
    def close_code(self) -> int | None:
        return None if self._closed is None else self._closed.close_code

    @property
    def close_reason(self) -> str:
        return "" if self._closed is None else self._closed.close_reason

    async def _connect(self) -> _Socket:
        kwargs: dict[str, Any] = {
            # The server never negotiates permessage-deflate (previews are
            # already compressed); do not offer it.
            "compression": None,
            "max_size": DEFAULT_MAX_SIZE,
            "open_timeout": 10.0,
            # Also how long a keepalive timeout waits on a frozen server's
            # closing handshake before dropping the connection.
            "close_timeout": DEFAULT_CLOSE_TIMEOUT,
        }
        kwargs.update(self._connect_kwargs)
        headers = list(dict(kwargs.pop("additional_headers", None) or {}).items())
        if self._token is not None:
            headers.append(("Authorization", f"Bearer {self._token}"))
        try:
            if current_backend() == "trio":
                return await self._connect_anyio(headers, kwargs)
            ws: ClientConnection = await _ws_connect(self.url, additional_headers=headers, **kwargs)
            return ws
        except InvalidStatus as exc:
            raise _refused(exc) from None
        except InvalidURI as exc:
            raise ParamsError(f"url {self.url!r} is not a websocket URL: {exc}", field="url") from None
        except TimeoutError as exc:
            raise ConnectError(f"timed out connecting to {self.url}") from exc
        except (OSError, InvalidHandshake) as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc}") from exc

    async def _connect_anyio(self, headers: list[tuple[str, str]], kwargs: dict[str, Any]) -> AnyioSocket:
        """The connection under trio (an AnyioSocket); ParamsError for a keyword it does not take."""
        other = sorted(set(kwargs) - _ANYIO_OPTIONS)
        if other:
            raise ParamsError(
                f"under trio the client takes {', '.join(sorted(_ANYIO_OPTIONS))} and additional_headers, "
                f"not {', '.join(other)} (those are websockets' asyncio client's)",
                field=other[0],
            )
        if kwargs.get("compression") is not None:
            raise ParamsError(
                "under trio the client sends no compression offer: pass compression=None", field="compression"
            )
        ssl_context = kwargs.get("ssl")
        return await AnyioSocket.open(
            self.url,
            headers=headers,
            max_size=kwargs["max_size"],
            open_timeout=kwargs["open_timeout"],
            close_timeout=kwargs["close_timeout"],
            ssl_context=ssl_context if isinstance(ssl_context, ssl.SSLContext) else None,
        )

    # -- requests --

    @overload
    def generate(
        self,
        params: Mapping[str, Any] | None = ...,
        *,
        preview: Mapping[str, Any] | None = ...,
        output: Mapping[str, Any] | None = ...,
        id: str | None = ...,
        detach: bool = ...,
        priority: int | None = ...,
        progress: Literal[False] = ...,
        model: str | None = ...,
        webhook: Mapping[str, Any] | None = ...,
    ) -> RequestStream[PreviewFrame]: ...

    @overload
    def generate(
        self,
        params: Mapping[str, Any] | None = ...,
        *,
        preview: Mapping[str, Any] | None = ...,
        output: Mapping[str, Any] | None = ...,
        id: str | None = ...,
        detach: bool = ...,
        priority: int | None = ...,
        progress: Literal[True],
        model: str | None = ...,
        webhook: Mapping[str, Any] | None = ...,
    ) -> RequestStream[PreviewFrame | Progress]: ...

    def generate(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        preview: Mapping[str, Any] | None = None,
        output: Mapping[str, Any] | None = None,
        id: str | None = None,
        detach: bool = False,
        priority: int | None = None,
        progress: bool = False,
        model: str | None = None,
        webhook: Mapping[str, Any] | None = None,
    ) -> RequestStream[Any]:
        """Start a request (on first iteration) and stream its previews, the final one last.

        ``preview``: ``every``, ``format``, ``max_size``, ``quality``,
        ``decoder``, ``video`` (docs/protocol.md); None for the server's defaults.
        ``output``: ``format`` and ``quality`` of the result (the final frame,
        full size; PNG by default, MP4 for video models).
        ``id``: None makes a random one (``uuid4``; needed to ``attach`` to a
        detached request from another connection). ``detach``: the request
        survives this connection and leaving the iteration early.
        ``priority``: -10 to 10, higher first (None: the server's 0).
        ``progress``: also yield :class:`Progress` items. ``model``: which of
        a server's models runs it (None: its first; ``/models`` lists them).
        ``webhook``: ``{"url", "events"}``, a signed delivery when it ends
        (docs/webhooks.md; the server must allow the URL). Raises ParamsError
        for a malformed id, priority, model name or webhook, params or preview that are not JSON
        objects, or values JSON cannot carry (NaN, infinities, other types).
        Iterating a request the server is too busy for raises BusyError
        (its ``retry_after_s`` says when to try again).
        """
        request_id = uuid.uuid4().hex if id is None else id
        message = Generate.build(
            request_id,
            params,
            preview,
            detach=detach,
            output=output,
            priority=priority,
            model=model,
            webhook=webhook,
        )
        if not isinstance(progress, bool):
            raise ParamsError(f"progress must be a bool, got {progress!r}", field="progress")
        return RequestStream(
            self,
            request_id,
            message.serialize(),
            kind="generate",
            cancel_on_exit=not detach,
            want_progress=progress,
            max_buffered=self._max_buffered,
        )

    @overload
    def attach(self, id: str, *, progress: Literal[False] = ...) -> RequestStream[PreviewFrame]: ...

    @overload
    def attach(self, id: str, *, progress: Literal[True]) -> RequestStream[PreviewFrame | Progress]: ...

    def attach(self, id: str, *, progress: bool = False) -> RequestStream[Any]:
        """Watch a request by id (after a reconnect): the latest preview, the rest, the result.

        Leaving early only stops watching; use :meth:`cancel` to stop the
        request. Iteration raises RequestRejectedError (``not_found``,
        ``already_attached``) and otherwise as :meth:`generate`. Raises
        ParamsError for a malformed id.
        """
        message = Attach.build(id)
        if not isinstance(progress, bool):
            raise ParamsError(f"progress must be a bool, got {progress!r}", field="progress")
        return RequestStream(
            self,
            message.id,
            message.serialize(),
            kind="attach",
            cancel_on_exit=False,
            want_progress=progress,
            max_buffered=self._max_buffered,
        )

    async def cancel(self, id: str) -> None:
        """Ask the server to cancel request ``id``; watchers then get ``cancelled``.

        No reply of its own: an unknown id is answered with a ``not_found``
        error that only a stream of that id would see. Raises ParamsError for
        a malformed id and ConnectionClosedError when the connection is gone.
        """
        await self._send(Cancel.build(id).serialize())

    async def pause(self, id: str, *, to_host: bool = False) -> None:
        """Ask the server to pause request ``id`` between two steps (``to_host``: its state to host
        memory meanwhile); watchers get ``paused``. No reply of its own (a request that is not
        running is answered with an error its stream sees). Raises as :meth:`cancel` does."""
        await self._send(Pause.build(id, to_host=to_host).serialize())

    async def resume(self, id: str) -> None:
        """Ask the server to resume paused request ``id``; watchers get ``resumed``."""
        await self._send(Resume.build(id).serialize())

    # -- internals shared with RequestStream --

    async def _open_request(self, inbox: Inbox, message: str) -> None:
        if self._state is not Lifecycle.RUNNING or self._closed is not None:
            raise self._closed_error(inbox.id)
        if inbox.id in self._inboxes:
            raise ParamsError(
                f"request {inbox.id!r} is already being watched on this connection",
                field="id",
                request_id=inbox.id,
            )
        self._inboxes[inbox.id] = inbox
        try:
            await self._send(message, request_id=inbox.id)
        except BaseException:
            self._forget(inbox)
            raise

    def _forget(self, inbox: Inbox) -> None:
        if self._inboxes.get(inbox.id) is inbox:
            del self._inboxes[inbox.id]

    def _abandon(self, inbox: Inbox, cancel: bool) -> None:
        # Runs from a weakref finalizer: inside whatever code dropped the last
        # reference, in theory on another thread. So it only hands the id to
        # the loop, where _send_queued_cancels sends it.
        unfinished = not inbox.finished
        self._forget(inbox)
        if not (unfinished and cancel) or self._loop is None or self.closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server cancels on disconnect
            self._loop.call_soon_threadsafe(self._queue_cancel, inbox.id)

    def _queue_cancel(self, request_id: str) -> None:
        with contextlib.suppress(anyio.ClosedResourceError):  # closing: the server cancels on disconnect
            self._cancels_send.send_nowait(request_id)

    async def _send_queued_cancels(self) -> None:
        async with self._cancels_receive:
            async for request_id in self._cancels_receive:
                try:
                    await self.cancel(request_id)
                except ClientError:
                    return  # the connection is gone: the server cancels on disconnect

    async def _send(self, text: str, *, request_id: str | None = None) -> None:
        if self._ws is None or self._state is not Lifecycle.RUNNING or self._closed is not None:
            raise self._closed_error(request_id)
        try:
            await self._ws.send(text)
        except ConnectionClosed:
            raise self._closed_error(request_id) from None

    def _closed_error(self, request_id: str | None = None) -> ConnectionClosedError:
        base = self._closed
        if base is None:
            if self._ws is not None and self._ws.close_code is not None:
                base = _closed_from(self._ws)
            else:
                base = ConnectionClosedError("the client is closed", close_code=None)
        return ConnectionClosedError(
            base.message,
            close_code=base.close_code,
            close_reason=base.close_reason,
            request_id=request_id,
        )

    def _fail_all(self, error: ConnectionClosedError | ProtocolError) -> None:
        for inbox in list(self._inboxes.values()):
            exc: ClientError
            if isinstance(error, ConnectionClosedError):
                exc = ConnectionClosedError(
                    error.message,
                    close_code=error.close_code,
                    close_reason=error.close_reason,
                    request_id=inbox.id,
                )
            else:
                exc = ProtocolError(error.message, code=error.code, request_id=inbox.id)
            inbox.fail(exc)

    # -- the reader --

    async def _read_loop(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            async for message in ws:
                try:
                    self._dispatch(message)
                except ProtocolError as exc:
                    logger.error("closing the connection to %s: %s", self.url, exc)
                    self._fail_all(exc)
                    await ws.close(CLOSE_PROTOCOL_ERROR, str(exc)[:120])
                    return
        except ConnectionClosed:
            pass
        finally:
            self._closed = _closed_from(ws)
            self._fail_all(self._closed)

    def _dispatch(self, message: str | bytes) -> None:
        event: Event | None
        if isinstance(message, str):
            event = parse_server_message(message)
            if event is None:
                logger.warning("ignoring a server message of an unknown type: %.200s", message)
                return
        else:
            event = parse_preview_frame(message)
        request_id = event.id
        if request_id is None:
            assert isinstance(event, ErrorMessage)
            # The server could not tell which message it rejected: it can only
            # be one still waiting for 'accepted'; failing those beats a hang.
            logger.warning("server error without a request id: %s: %s", event.code, event.message)
            for waiting in list(self._inboxes.values()):
                if waiting.accepted is None:
                    waiting.feed(event)
            return
        inbox = self._inboxes.get(request_id)
        if inbox is None:
            # Left early (cancel in flight), or watched without a stream.
            logger.debug("dropping %s for request %s: nobody iterates it", type(event).__name__, request_id)
            return
        if isinstance(event, ErrorMessage) and event.code == "busy" and inbox.accepted is None:
            # The inbox knows no retry_after_s: the error is made here, with it.
            inbox.fail(
                server_error(
                    event.code,
                    event.message,
                    field=event.field,
                    request_id=request_id,
                    accepted=False,
                    retry_after_s=event.retry_after_s,
                )
            )
            return
        inbox.feed(event)


def _closed_from(ws: _Socket) -> ConnectionClosedError:
    code = ws.close_code
    reason = ws.close_reason or ""
    if code == 1000:
        text = "the connection closed"
    elif code is None or code == 1006:
        text = "the connection dropped (no close frame)"
    else:
        text = f"the server closed the connection with {code}" + (f": {reason}" if reason else "")
    return ConnectionClosedError(text, close_code=code, close_reason=reason)


def _refused(exc: InvalidStatus) -> ConnectError:
    response = exc.response
    status = response.status_code
    code: str | None = None
    detail = ""
    try:
        body = json.loads(bytes(response.body or b"").decode())
        if isinstance(body, dict):
            if isinstance(body.get("error"), str):
                code = body["error"]
            if isinstance(body.get("message"), str):
                detail = body["message"]
    except (UnicodeDecodeError, ValueError):
        pass
    text = f"server refused the websocket connection: HTTP {status}"
    if code:
        text += f" {code}"
    if detail:
        text += f": {detail}"
    return ConnectError(text, code=code, status=status)


def connect(url: str, token: str | None = None, **kwargs: Any) -> Client:
    """A :class:`Client` for ``url`` (``ws://HOST:PORT/ws``); open it with ``async with``.

    >>> async with connect("ws://127.0.0.1:8765/ws", token="secret") as client:  # doctest: +SKIP
    ...     final = await client.generate({"steps": 20}).result()

    Keyword arguments are :class:`Client`'s. Raises ParamsError for a bad
    url or option; entering raises ConnectError.
    """
    return Client(url, token, **kwargs)
