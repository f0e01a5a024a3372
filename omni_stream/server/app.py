"""``Server`` (async context manager) and ``serve()`` (blocking): the ASGI app on uvicorn
(asyncio, uvloop) or hypercorn (trio: hypercorn_trio.py).

One port serves everything :func:`~omni_stream.server.asgi.create_app`
routes: the page, ``/health``, ``/metrics``, ``/models``, the websocket
``/ws`` and the HTTP API ``/v1/generations`` with its event streams.
uvicorn runs the HTTP and websocket protocols (websockets' sans-I/O core
for ``/ws``, our bounds on HTTP/1.1: http11.py); the rules of every door
are :class:`~omni_stream.core.rules.Rules`, run by the
:class:`~omni_stream.server.service.Service` (one consumer task per
request, in one task group).

Who waits on whom: the engine never waits on the server ("latest" replaces
unread frames); a consumer waits only on its own preview renders; a
client's writer (websocket, event stream, an HTTP answer) waits on its own
socket, bounded by ``send_timeout_s``. Nothing waits on a slow client
except that client's writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import uvicorn

from .._backend import current_backend, require_asyncio
from ..config import run
from ..core import origin as security
from ..core.metrics import ServerMetrics
from ..engine.like import looks_like_engine
from ..errors import LifecycleError, OmniStreamError, ParamsError, ServerFailedError
from ..lifecycle import Lifecycle
from ..model import StepModel
from ..preview import Previewer
from .asgi import FrontDoor, app_for, build_front_door
from .http11 import h11_protocol
from .hypercorn_trio import HypercornServer
from .service import FdWarning
from .ws_protocol import LingeringWSProtocol

# ServerFailedError (errors.py's) is re-exported: the CLI imports it from here.
__all__ = ["Server", "ServerFailedError", "serve"]

logger = logging.getLogger("omni_stream.server")


class Server:
    """The omni_stream server on one port (docs/protocol.md, docs/http.md).

    ``engine_or_model``: a running engine (``Engine``, ``EngineGroup``,
    anything EngineLike: the caller starts and closes it), or a
    :class:`~omni_stream.StepModel`, for which the server creates an engine
    on ``device`` and owns it. ``port=0`` picks a free port; read it back
    from :attr:`port`. ``limits`` are the keyword arguments of
    :class:`ServerLimits`. Raises ParamsError for a bad option, TypeError for
    an engine that lacks what a server needs, naming it (docs/configuration.md,
    "An engine of your own behind the server").

    ``async with Server(model, port=0) as server: ...`` serves until the
    block ends, then shuts down gracefully (see :meth:`aclose`). When the
    engine dies or a task of the server fails, the server logs why and shuts
    itself down (:attr:`fatal` says why; ``serve()`` raises it), so that a
    supervisor replaces the process; ``stay_dead=True`` keeps it up instead
    (``/health`` answers 503 ``dead``), for debugging. ``webhook_allow`` and
    ``webhook_secret``: the URLs webhooks may call and their signing secret
    (docs/webhooks.md; no allow-list, no webhooks). ``state_dir``,
    ``checkpoint_every``, ``checkpoint_seconds``, ``state_max_bytes``: the
    state directory (server/state.py; docs/reliability.md, "The state
    directory"), passed with the limits; starting raises StoreError when
    the folder is in use by another process, damaged or newer.
    """

    def __init__(
        self,
        engine_or_model: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: Any = None,
        tokens_file: str | None = None,
        allow_origins: Sequence[str] | str | None = (),
        allowed_hosts: Sequence[str] | str | None = (),
        trusted_proxies: Sequence[str] | str | None = None,
        device: str = "auto",
        previewer: Previewer | None = None,
        stay_dead: bool = False,
        metrics_public: bool = False,
        webhook_secret: str | None = None,
        webhook_allow: Sequence[str] | str | None = None,
        **limits: Any,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ParamsError(f"port must be an integer from 0 to 65535, got {port!r}", field="port")
        if not isinstance(host, str):
            raise ParamsError(f"host must be a string, got {host!r}", field="host")
        self._door: FrontDoor = build_front_door(
            engine_or_model,
            token=token,
            tokens_file=tokens_file,
            allowed_hosts=allowed_hosts,
            trusted_proxies=trusted_proxies,
            allow_origins=allow_origins,
            device=device,
            previewer=previewer,
            stay_dead=stay_dead,
            metrics_public=metrics_public,
            limits=limits,
            on_fatal=self._fatal_error,
            webhook_secret=webhook_secret,
            webhook_allow=webhook_allow,
        )
        self._service = self._door.service
        self.app = app_for(self._door)
        self.model: StepModel = self._service.model
        self.limits = self._service.limits
        self.metrics: ServerMetrics = self._service.metrics
        self._host = host
        self._requested_port = port
        self._port: int | None = None
        self._http: _Uvicorn | HypercornServer | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._state = Lifecycle.NEW
        self._shutdown_requested = anyio.Event()
        self._force_shutdown = anyio.Event()
        self._shutdown_done = anyio.Event()

    # -- properties ------------------------------------------------------------

    @property
    def engine(self) -> Any:
        return self._service.engine

    @property
    def service(self) -> Any:
        """The core every front door shares (requests, their rules, metrics)."""
        return self._service

    @property
    def connections(self) -> dict[str, Any]:
        """The open websocket connections, by id."""
        return self._door.websockets

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port; raises LifecycleError before the server started."""
        if self._port is None:
            raise LifecycleError("the server is not started; use `async with Server(...)`")
        return self._port

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` (the page is at ``/``)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The websocket endpoint, ``ws://HOST:PORT/ws``."""
        return "ws" + self.http_url.removeprefix("http") + "/ws"

    @property
    def closing(self) -> bool:
        return self._state.ending

    @property
    def fatal(self) -> OmniStreamError | None:
        """Why the server shut itself down (or, with ``stay_dead``, would have); None if it did not.

        EngineDeadError when the engine died, ServerFailedError when a task
        of the server failed (``__cause__`` is what it raised).
        """
        return self._service.fatal

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the engine (if owned) and listen. Raises LifecycleError if started twice.

        Under asyncio (uvloop included) the HTTP server is uvicorn; under trio
        it is hypercorn (``hypercorn_trio.py``; the ``trio`` extra), serving
        the same app. UnsupportedBackendError elsewhere, or under trio
        without hypercorn.
        """
        on_trio = current_backend() == "trio"
        if not on_trio:
            require_asyncio("the omni_stream server (uvicorn; or hypercorn under trio)")
        if self._state is not Lifecycle.NEW:
            raise LifecycleError("a Server can be started once; create a new one")
        http: _Uvicorn | HypercornServer = (
            HypercornServer(self.app, self.limits) if on_trio else _Uvicorn(self._uvicorn_config())
        )
        self._state = Lifecycle.RUNNING
        stack = contextlib.AsyncExitStack()
        try:
            sockets = _bind(self._host, self._requested_port)
            stack.callback(_close_all, sockets)
            await stack.enter_async_context(self._service)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._http = http
            started = anyio.Event()
            http.on_started = started.set
            self._tg.start_soon(self._run_http, sockets, name="omni_stream http server")
            with anyio.fail_after(30):
                await started.wait()
        except BaseException:
            self._state = Lifecycle.CLOSED
            await stack.aclose()
            raise
        self._stack = stack
        self._port = sockets[0].getsockname()[1]
        names = list(self._service.rules.models)
        logger.info(
            "omni_stream server listening on %s (model%s %s)",
            self.http_url,
            "s" if len(names) > 1 else "",
            ", ".join(names),
        )
        bound = {str(sock.getsockname()[0]) for sock in sockets}
        exposed = sorted(h for h in bound if not security.is_loopback(h))
        if exposed and not self._service.tokens:
            logger.warning(
                "listening on %s, not a loopback address, without a token: anyone who can reach "
                "the port can run requests; set a token (--token, OMNI_STREAM_TOKEN) or bind 127.0.0.1",
                ", ".join(exposed),
            )

    def _uvicorn_config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            lifespan="off",  # this task runs the service (it must enter and leave it)
            # websockets' sans-I/O core, closing a failed connection so that the
            # client reads why (1009 for an oversize message): ws_protocol.py.
            ws=LingeringWSProtocol,
            http=h11_protocol(
                max_body_bytes=self.limits.max_message_bytes, body_timeout_s=self.limits.body_timeout_s
            ),
            ws_max_size=self.limits.max_message_bytes,
            # Previews are compressed images: deflating them again would
            # only burn the event loop.
            ws_per_message_deflate=False,
            log_config=None,
            access_log=False,
            server_header=False,
            # Who a client is is ours to decide (core/principal.py: X-Forwarded-For
            # counts only from a --trusted-proxy). uvicorn's default rewrote the
            # peer address from the header for any loopback peer before our
            # principal was computed: 40 spoofed POSTs all got in where 16 may
            # (issue #39, attack 5). forwarded_allow_ips is then unused: not set.
            proxy_headers=False,
            timeout_graceful_shutdown=max(1, int(self.limits.close_timeout_s)),
        )

    async def _run_http(self, sockets: list[socket.socket]) -> None:
        assert self._http is not None
        try:
            await self._http.serve(sockets)
        except Exception as exc:  # noqa: BLE001 - _fatal_error logs it
            error = ServerFailedError(f"the HTTP server failed: {exc!r}")
            error.__cause__ = exc
            self._service.die(error)

    def request_shutdown(self) -> None:
        """Ask :meth:`serve_forever` to return; a second call also skips the grace period."""
        if self._shutdown_requested.is_set():
            self._force_shutdown.set()
        self._shutdown_requested.set()

    async def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM or :meth:`request_shutdown`, then :meth:`shutdown`.

        A second signal during shutdown skips the wait for in-flight requests.
        Signals can only be watched from the main thread. Leaving ``async
        with`` (or :meth:`aclose`) afterwards releases the rest.
        """
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        logger.info(
                            "%s: shutting down%s",
                            signal.Signals(signum).name,
                            " now" if self._shutdown_requested.is_set() else "",
                        )
                        self.request_shutdown()

            tg.start_soon(watch_signals)
            await self._shutdown_requested.wait()
            await self.shutdown()
            tg.cancel_scope.cancel()

    async def shutdown(self) -> None:
        """Shut down gracefully (docs/protocol.md, "Shutdown"); idempotent, from any task.

        Refuses new work; gives running requests ``shutdown_timeout_s`` to
        finish (cut short by a second :meth:`request_shutdown`); cancels the
        rest; closes each websocket with 1001 once its queue is sent, ends
        event streams; stops listening. Returns when done, also to
        concurrent callers. The engine and the server's tasks are released
        by :meth:`aclose`.
        """
        if self._state is Lifecycle.NEW:
            self._state = Lifecycle.CLOSED
            return
        if self._state is not Lifecycle.RUNNING:
            await self._shutdown_done.wait()
            return
        self._state = Lifecycle.CLOSING
        self._shutdown_requested.set()
        try:
            # Keep listening through the grace period: probes see /health
            # 503 and new websockets get 503 shutting_down.
            await self._door.shutdown(forced=self._force_shutdown)
            if self._http is not None:
                self._http.stop()
                with anyio.move_on_after(self.limits.close_timeout_s * 2 + 1):
                    await self._http.exited.wait()
        finally:
            self._shutdown_done.set()

    async def aclose(self) -> None:
        """:meth:`shutdown`, then stop the server's tasks and close the engine if it owns it.

        Call it from the task that called :meth:`start` (``async with`` does),
        outside any task group or cancel scope opened since: the server's
        task group and the engine were entered there and must be left there.
        Idempotent.
        """
        await self.shutdown()
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        assert self._tg is not None
        if isinstance(self._http, _Uvicorn):
            self._http.force_exit = True
        self._tg.cancel_scope.cancel()
        try:
            await stack.aclose()
        finally:
            self._state = Lifecycle.CLOSED
            logger.info("omni_stream server on port %s closed", self._port)

    def _fatal_error(self, error: OmniStreamError) -> None:
        # Wakes serve_forever; shutdown() itself also runs here for servers
        # used without it (it is idempotent and answers concurrent callers).
        self.request_shutdown()
        if self._tg is not None and self._state is Lifecycle.RUNNING:
            self._tg.start_soon(self.shutdown, name="omni_stream fatal shutdown")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server without its signal handlers (``serve_forever`` watches signals)."""

    on_started: Any = None

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exited = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.on_started is not None:
            self.on_started()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().serve(sockets=sockets)
        finally:
            self.exited.set()

    def stop(self) -> None:
        """Graceful: stop accepting, finish open exchanges, return from :meth:`serve`."""
        self.should_exit = True


def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host``:``port`` (every address a name resolves to, one port)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos:
            if sockets and port == 0:
                # Every address on the port the first one got.
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(exc.errno, f"port {port} on {host} is in use ({exc.strerror})") from None
                raise
            sock.listen(1024)
            sock.setblocking(False)
    except BaseException:
        _close_all(sockets)
        raise
    return sockets


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _loop_exception_handler(warning: FdWarning) -> Any:
    """For serve()'s loop: asyncio's loop reports a failed accept() here, up to 100 times a tick.

    EMFILE / ENFILE become the once-a-minute warning; the rest goes to the
    loop's default handler.
    """

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            warning.warn(f"{context.get('message', 'accept failed')}: {exc.strerror}")
            return
        loop.default_exception_handler(context)

    return handle


def serve(
    model: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: Any = None,
    allow_origins: Sequence[str] | str | None = (),
    device: str = "auto",
    stay_dead: bool = False,
    metrics_public: bool = False,
    webhook_secret: str | None = None,
    webhook_allow: Sequence[str] | str | None = None,
    loop: str | None = None,
    **limits: Any,
) -> None:
    """Run the engine and the server (page, HTTP API, websocket) until SIGINT or SIGTERM (blocking).

    ``model`` is a StepModel, a name for ``omni_stream.models.load_model``
    (``"mixture"``, ``"synthetic"``, ``"module:attr"``), or a factory of
    models; with ``device`` naming several ("cuda:0,cuda:1", "all") it runs
    an :class:`~omni_stream.EngineGroup`, one model per device (a name or a
    factory then, not one StepModel). Uses uvloop when it is installed;
    ``loop`` names another (``"asyncio"``, ``"uvloop"``, or ``"trio"``: the
    server then runs on hypercorn, the ``trio`` extra). ``model`` may also
    be an engine (``Engine``, ``EngineGroup``, a Ray ``RemoteEngine``):
    serve() then starts and closes it. Inside async
    code use ``async with Server(...) as server: await
    server.serve_forever()`` instead.

    When the engine dies (or a task of the server fails) it answers the
    requests in flight, shuts down and raises EngineDeadError (or
    ServerFailedError), so that the process exits and a supervisor restarts
    it; ``stay_dead=True`` keeps serving ``/health`` 503 until a signal, then
    raises the same. Raises ParamsError for a bad option or model name.
    """
    if isinstance(model, str):
        from ..engine.group import names_group
        from ..models.registry import load_model

        spec = model
        model = (lambda: load_model(spec)) if names_group(device) else load_model(spec)
    options: dict[str, Any] = dict(
        host=host,
        port=port,
        token=token,
        allow_origins=allow_origins,
        device=device,
        stay_dead=stay_dead,
        metrics_public=metrics_public,
        webhook_secret=webhook_secret,
        webhook_allow=webhook_allow,
        **limits,
    )
    servers: list[Server] = []

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if looks_like_engine(model):
                # An engine given to serve() is serve()'s to run: nobody else
                # could (this call blocks). A remote one connects here.
                await stack.enter_async_context(model)
            server = Server(model, **options)
            servers.append(server)
            if current_backend() == "asyncio":
                # Our own loop: out-of-descriptors reports become one clear warning.
                asyncio.get_running_loop().set_exception_handler(
                    _loop_exception_handler(server.service.fd_warning)
                )
            async with server:
                await server.serve_forever()

    run(main, loop=loop)
    if servers and servers[0].fatal is not None:
        raise servers[0].fatal
