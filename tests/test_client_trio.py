"""The Python client under trio (client/anyio_socket.py: websockets' Sans-I/O protocol over anyio).

Against the real server, itself under trio (hypercorn), and against a
scripted server made of the same Sans-I/O protocol (websockets'
ServerProtocol over an anyio listener) for what the real one never does:
fragmented messages, oversized ones, a frozen peer that answers no ping.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest

pytest.importorskip("trio")
pytest.importorskip("hypercorn")

from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.frames import Frame, Opcode  # noqa: E402
from websockets.http11 import Request  # noqa: E402
from websockets.server import ServerProtocol  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream import client as omc  # noqa: E402
from omni_stream.client import ConnectError, ConnectionClosedError  # noqa: E402
from omni_stream.client.anyio_socket import AnyioSocket  # noqa: E402
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.server import Server  # noqa: E402

from .conftest import Slow  # noqa: E402
from .test_client import watch_until_shutdown  # noqa: E402

pytestmark = pytest.mark.anyio

SMALL: dict[str, Any] = {"shape": [3, 8, 6], "work": 0}


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@asynccontextmanager
async def serving(model: Any = None, **options: Any) -> AsyncIterator[Server]:
    async with Server(model or Synthetic(), host="127.0.0.1", port=0, device="cpu", shutdown_timeout_s=0.5,
                      close_timeout_s=1.0, **options) as server:
        yield server


async def _eventually(cond: Callable[[], bool], what: str) -> None:
    with anyio.fail_after(20):  # a bound against hanging, not a timing assertion
        while not cond():
            await anyio.sleep(0.01)


# -- against the real server ----------------------------------------------------------------


async def test_generate_streams_every_frame_and_the_result_under_trio() -> None:
    async with serving(token="sesame") as server, omc.connect(server.url, token="sesame") as client:
        frames = [f async for f in client.generate(dict(SMALL, steps=5), progress=True)]
        steps = [f.step for f in frames if isinstance(f, omc.PreviewFrame)]
        # Previews are latest-wins (the server may skip one a slow reader has not taken).
        assert steps == sorted(set(steps)) and steps[-1] == 5 and frames[-1].final
        assert any(isinstance(f, omc.Progress) for f in frames)
        # Several requests at once on the one connection.
        results: dict[int, int] = {}

        async def one(seed: int) -> None:
            results[seed] = (await client.generate(dict(SMALL, steps=3, seed=seed)).result()).step

        async with anyio.create_task_group() as tg:
            for seed in range(4):
                tg.start_soon(one, seed)
        assert results == {0: 3, 1: 3, 2: 3, 3: 3}


async def test_a_refused_or_absent_server_raises_connect_error_under_trio() -> None:
    async with serving(token="sesame") as server:
        with pytest.raises(ConnectError) as info:
            async with omc.connect(server.url):
                pass
        assert info.value.status == 401 and info.value.code == "unauthorized"
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError, match="cannot connect"):
        async with omc.connect(f"ws://127.0.0.1:{port}/ws"):
            pass


async def test_leaving_early_cancels_and_attach_picks_up_a_detached_request_under_trio() -> None:
    async with serving(Slow(0.02)) as server:
        async with omc.connect(server.url) as client:
            stream = client.generate(dict(SMALL, steps=1000))
            async for _ in stream:
                break
            await stream.aclose()
            record = server.service.registry.get(stream.id)
            await _eventually(lambda: record is None or record.ended, "the cancel to reach the server")
            detached = client.generate(dict(SMALL, steps=20), id="kept", detach=True)
            await detached.__anext__()
            await detached.aclose()
        async with omc.connect(server.url) as again:
            frames = [f async for f in again.attach("kept")]
            assert frames[-1].final and frames[-1].step == 20


async def test_a_server_shutdown_ends_the_request_and_the_connection_under_trio() -> None:
    seen: dict[str, Any] = {}
    async with anyio.create_task_group() as tg, serving(Slow(0.02)) as server:
        await tg.start(watch_until_shutdown, server.url, seen)
    assert seen == {"reason": "shutdown", "code": 1001, "later": 1001}


async def test_options_websockets_asyncio_client_alone_takes_are_refused_under_trio() -> None:
    with pytest.raises(om.ParamsError) as info:
        async with omc.connect("ws://127.0.0.1:1/ws", user_agent_header="x"):
            pass
    assert info.value.field == "user_agent_header"


# -- against a scripted server ---------------------------------------------------------------

Script = Callable[["_Peer"], Awaitable[None]]


class _Peer:
    """The scripted server's side of one connection (websockets' ServerProtocol over anyio)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.protocol = ServerProtocol()

    async def handshake(self) -> None:
        while True:
            self.protocol.receive_data(await self.stream.receive())
            events = self.protocol.events_received()
            if events:
                request = events[0]
                assert isinstance(request, Request)
                self.protocol.send_response(self.protocol.accept(request))
                await self.flush()
                return

    async def flush(self) -> None:
        for chunk in self.protocol.data_to_send():
            if chunk:
                await self.stream.send(chunk)

    async def send_frame(self, opcode: Opcode, data: bytes, *, fin: bool = True) -> None:
        self.protocol.send_frame(Frame(opcode, data, fin))
        await self.flush()


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[str]:
    """A websocket server on a free port that runs ``script`` on each connection after the handshake."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            peer = _Peer(stream)
            await peer.handshake()
            await script(peer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield f"ws://127.0.0.1:{port}/ws"
        finally:
            tg.cancel_scope.cancel()


async def test_a_fragmented_message_arrives_whole_and_an_oversized_one_fails_with_1009() -> None:
    async def script(peer: _Peer) -> None:
        await peer.send_frame(Opcode.TEXT, b'{"a": ', fin=False)
        await peer.send_frame(Opcode.CONT, b"1}", fin=True)
        await peer.send_frame(Opcode.BINARY, b"\x01\x02", fin=False)
        await peer.send_frame(Opcode.CONT, b"\x03", fin=True)
        await peer.send_frame(Opcode.BINARY, b"x" * 600, fin=False)
        await peer.send_frame(Opcode.CONT, b"x" * 600, fin=True)
        await anyio.sleep(30)  # it never ends the TCP connection: the client drops it (close_timeout)

    async with scripted(script) as url:
        socket_ = await AnyioSocket.open(url, max_size=1000, close_timeout=1.0)
        assert json.loads(await socket_.__anext__()) == {"a": 1}
        assert await socket_.__anext__() == b"\x01\x02\x03"
        with anyio.fail_after(10), pytest.raises(ConnectionClosed):
            await socket_.__anext__()  # 1200 bytes against max_size 1000
        assert socket_._protocol.close_sent is not None and socket_._protocol.close_sent.code == 1009
        await socket_.close()


async def test_a_frozen_server_fails_the_requests_after_the_ping_timeout_under_trio() -> None:
    async def script(peer: _Peer) -> None:
        # Read the generate, answer accepted, then freeze: nothing read or answered, no pong.
        while True:
            peer.protocol.receive_data(await peer.stream.receive())
            frames = [e for e in peer.protocol.events_received() if isinstance(e, Frame)]
            text = next((f for f in frames if f.opcode is Opcode.TEXT), None)
            if text is not None:
                rid = json.loads(text.data)["id"]
                accepted = {"type": "accepted", "id": rid, "total": 5, "detach": False, "attached": False,
                            "preview": {"format": "raw"}}
                await peer.send_frame(Opcode.TEXT, json.dumps(accepted).encode())
                await anyio.sleep(30)
                return

    async with scripted(script) as url, omc.connect(
        url, ping_interval=0.1, ping_timeout=0.2, close_timeout=0.2
    ) as client:
        stream = client.generate({})
        with anyio.fail_after(10), pytest.raises(ConnectionClosedError) as info:
            async for _ in stream:
                pass
        # The frozen server never sent a close frame: 1006, as for a dropped link.
        assert info.value.close_code == 1006
