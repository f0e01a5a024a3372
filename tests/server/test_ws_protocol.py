"""The lingering close (ws_protocol.py): a client whose message is too big reads 1009, over a real server."""

from __future__ import annotations

import json
import socket

import anyio.to_thread
import pytest
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close
from websockets.uri import parse_uri

from omni_stream.protocol import CLOSE_MESSAGE_TOO_BIG

from .conftest import recv, running

#: Four times the default max_message_bytes (1 MiB): far more than one read
#: of the server's, so the server fails the connection while the client is
#: still sending, as a real client's oversize upload does.
BIG = 4 << 20


def _oversize_generate() -> str:
    return json.dumps({"type": "generate", "params": {}, "pad": "y" * BIG})


def _send_all_then_read(url: str, host: str, port: int) -> tuple[Close | None, list[OSError]]:
    """websockets' client (its sans-I/O core) on a blocking socket: send it all, then read to the end.

    Returns the close frame it read and the socket errors it met on the way.
    """
    proto = ClientProtocol(parse_uri(url), max_size=None)
    proto.send_request(proto.connect())
    errors: list[OSError] = []
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"".join(proto.data_to_send()))
        while not proto.events_received():
            proto.receive_data(sock.recv(65536))
        proto.send_text(_oversize_generate().encode())
        try:
            sock.sendall(b"".join(proto.data_to_send()))
        except OSError as exc:  # the server reset the connection under the upload
            errors.append(exc)
        try:
            while data := sock.recv(65536):
                proto.receive_data(data)
                sock.sendall(b"".join(proto.data_to_send()))  # its close reply
        except OSError as exc:
            errors.append(exc)
    return proto.close_rcvd, errors


@pytest.mark.asyncio
async def test_a_client_sending_an_oversize_message_reads_1009_and_a_clean_close() -> None:
    async with running() as server:
        close, errors = await anyio.to_thread.run_sync(
            _send_all_then_read, server.url, server.host, server.port
        )
    # Not a reset: the server read (and dropped) the rest of the message and closed after the client.
    assert errors == []
    assert close is not None and close.code == CLOSE_MESSAGE_TOO_BIG
    assert "exceeds limit of 1048576 bytes" in close.reason


@pytest.mark.asyncio
async def test_the_asyncio_client_sees_1009_with_no_reset_under_it() -> None:
    async with running() as server:
        # Not `async with connect()`: its close, after this one, trips over the closed transport.
        ws = await connect(server.url, max_size=None)
        with pytest.raises(ConnectionClosed) as info:
            await ws.send(_oversize_generate())
            await recv(ws)
        await ws.wait_closed()
    assert info.value.rcvd is not None and info.value.rcvd.code == CLOSE_MESSAGE_TOO_BIG
    assert info.value.__cause__ is None  # no ConnectionResetError: the close handshake completed
