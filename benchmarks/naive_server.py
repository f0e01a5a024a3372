"""The peer of the ``fanout`` figure: a ComfyUI-style server, one queue and one serial publish loop.

ComfyUI's ``PromptServer`` sends every message through one
``asyncio.Queue``: the sampler's callbacks put ``(event, data, client)`` on
it with ``call_soon_threadsafe``, and a single ``publish_loop`` takes them
one at a time and awaits each send before the next. Its websockets keep
the library's default compression (permessage-deflate), so every preview
is deflated again, on the event loop. Consequences this peer reproduces: a
send that blocks (one client that stopped reading, its socket full) blocks
every client's messages behind it (ComfyUI #15240), and the queue is
unbounded.

To compare the send path and nothing else, generation and previews are the
same as in ``omni_stream.server``: the same :class:`omni_stream.Engine`
(batching included), and previews rendered by the same
:class:`omni_stream.preview.Previewer` off the loop. It speaks enough of
docs/protocol.md for the benchmark's client: ``generate`` in; ``accepted``,
``progress``, binary previews and ``done`` out, every step (policy "all").
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType
from typing import Self

from websockets.asyncio.server import Server as WSServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import omni_stream as om
from omni_stream import protocol
from omni_stream.preview import Previewer, PreviewSpec

__all__ = ["NaiveServer"]

logger = logging.getLogger("benchmarks.naive_server")


class NaiveServer:
    """``async with NaiveServer(engine) as server: server.url``; the engine must be running."""

    def __init__(self, engine: om.Engine, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._engine = engine
        self._host = host
        self._port = port
        self._previewer = Previewer()
        # ComfyUI: self.messages = asyncio.Queue() -- unbounded.
        self._messages: asyncio.Queue[tuple[ServerConnection, str | bytes]] = asyncio.Queue()
        self._server: WSServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._publisher: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "NaiveServer is not started"
        port = self._server.sockets[0].getsockname()[1]
        return f"ws://{self._host}:{port}/ws"

    async def __aenter__(self) -> Self:
        # Default compression: permessage-deflate, as aiohttp's and websockets' defaults give.
        self._server = await serve(self._handle, self._host, self._port, max_size=1 << 20)
        self._publisher = asyncio.create_task(self._publish_loop())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        for t in [*self._tasks, self._publisher]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._publisher is not None:
            await asyncio.gather(self._publisher, return_exceptions=True)
        self._server.close()
        await self._server.wait_closed()

    async def _publish_loop(self) -> None:
        # ComfyUI's publish_loop: one message at a time, each send awaited.
        while True:
            ws, message = await self._messages.get()
            try:
                await ws.send(message)
            except ConnectionClosed:
                pass

    def _send(self, ws: ServerConnection, message: protocol.ServerMessage | protocol.Preview) -> None:
        self._messages.put_nowait((ws, message.wire))

    async def _handle(self, ws: ServerConnection) -> None:
        async for raw in ws:
            try:
                msg = protocol.parse_client_message(raw)
            except protocol.MessageError as exc:
                self._send(ws, protocol.ErrorMessage.build(exc.code, str(exc)))
                continue
            if not isinstance(msg, protocol.Generate):
                self._send(ws, protocol.ErrorMessage.build("unknown_type", "this peer only runs generate"))
                continue
            task = asyncio.create_task(self._run(ws, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, ws: ServerConnection, msg: protocol.Generate) -> None:
        spec = PreviewSpec.from_dict(msg.preview or {})
        request_id = msg.id or f"naive-{id(msg)}"
        stream = self._engine.stream(msg.params, request_id=request_id, policy="all")
        t0 = time.perf_counter()
        self._send(
            ws,
            protocol.Accepted.build(
                request_id,
                total=stream.total,
                detach=False,
                attached=False,
                preview={"every": spec.every, "format": spec.format, "max_size": spec.max_size,
                         "quality": spec.quality, "decoder": "rgb"},
            ),
        )
        async with stream:
            async for frame in stream:
                progress = protocol.Progress.build(request_id, step=frame.step, total=frame.total, eta_s=0.0)
                self._send(ws, progress)
                image = await self._previewer.render(frame, spec)
                header = protocol.PreviewHeader(
                    id=request_id,
                    step=frame.step,
                    total=frame.total,
                    final=frame.final,
                    format=image.format,
                    width=image.width,
                    height=image.height,
                    mime=image.mime,
                )
                self._send(ws, protocol.Preview.build(header, image.data))
        elapsed = time.perf_counter() - t0
        self._send(ws, protocol.Done.build(request_id, total=stream.total, elapsed_s=elapsed))

