"""The HTTP/1.1 protocol's bounds on a real uvicorn server (server/http11.py).

Bodies are bounded on the wire and in time, and every response's sends are
bounded: what a client does slowly or in pieces costs the server a bounded
amount of parsing, memory and time (issue #19, findings 2-4). Counted in
bytes and answers, never in wall time.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Any

import anyio
import pytest

from omni_stream.server import http11

from .conftest import SMALL, running, wait_for
from .test_http import parse, raw_http, request


async def open_raw(server: Any, *, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
    return await asyncio.open_connection(sock=sock, limit=1024)


async def send_then_read(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes) -> bytes:
    """Send ``data`` (the server may refuse part way: it reads and drops the rest), then read its answer."""
    with anyio.fail_after(30):
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        reply = await reader.read()
    writer.close()
    return reply


@pytest.mark.asyncio
async def test_a_body_in_one_byte_chunks_is_refused_once_its_framing_outweighs_it() -> None:
    # Finding 2: ~1 MiB in 1-byte chunks (6 MB on the wire) took 13 s of the
    # event loop to parse; now the framing is counted as it is parsed.
    async with running() as server:
        reader, writer = await open_raw(server)
        writer.write(
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        # 24 KiB of wire for 4 KiB of data (the server reads and drops what
        # follows its refusal up to http11.LINGER_BYTES, then closes).
        one_byte_chunks = b"1\r\n \r\n" * (4 << 10)
        status, headers, body = parse(await send_then_read(writer, reader, one_byte_chunks))
        answer = json.loads(body)
        assert (status, answer["error"], headers["connection"]) == (413, "limit_exceeded", "close")
        # Refused once the framing parsed outweighed the data: after a few
        # slices of wire, not the megabytes the client sent.
        framing, data = map(int, re.search(r"framing \((\d+) bytes for (\d+) of data\)", answer["message"]).groups())
        assert framing + data < 16 << 10
        assert (await raw_http(server, request("GET", "/health"))).startswith(b"HTTP/1.1 200")


@pytest.mark.asyncio
async def test_a_chunked_body_in_reasonable_chunks_is_accepted() -> None:
    async with running() as server:
        body = json.dumps({"params": {**SMALL, "steps": 2}, "id": "chunky"}).encode()
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 100]), body[i:i + 100]) for i in range(0, len(body), 100))
        reply = await raw_http(
            server,
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
        )
        status, _, answer = parse(reply)
        assert status == 202 and json.loads(answer)["id"] == "chunky"


@pytest.mark.asyncio
async def test_a_body_larger_than_max_message_bytes_is_refused_as_it_arrives() -> None:
    async with running(max_message_bytes=64 << 10) as server:
        reader, writer = await open_raw(server)
        writer.write(
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunks = (b"4000\r\n" + b" " * 0x4000 + b"\r\n") * 8  # 128 KiB in 16 KiB chunks
        status, _, body = parse(await send_then_read(writer, reader, chunks))
        assert (status, json.loads(body)["error"]) == (413, "limit_exceeded")
        assert "65536 bytes" in json.loads(body)["message"]


@pytest.mark.asyncio
async def test_a_body_that_stalls_is_dropped_at_its_deadline_with_408() -> None:
    # Finding 4: 10 bytes of a declared megabyte held a descriptor and a buffer forever.
    async with running(body_timeout_s=0.5) as server:
        reader, writer = await open_raw(server)
        writer.write(
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n{\"params\":"
        )
        await writer.drain()
        with anyio.fail_after(20):
            reply = await reader.read()  # the server answers and closes: EOF
        writer.close()
        status, headers, body = parse(reply)
        assert (status, json.loads(body)["error"]) == (408, "body_timeout")
        assert "OMNI_STREAM_BODY_TIMEOUT" in json.loads(body)["message"]
        await wait_for(lambda: not server.service.rules.clients, what="the call to be let go")


@pytest.mark.asyncio
async def test_an_open_post_counts_as_a_connection() -> None:
    # Findings 4 and 10: POSTs (an event stream answered to one too) were not connections.
    async with running(max_connections=2) as server:
        held = []
        for _ in range(2):
            reader, writer = await open_raw(server)
            writer.write(
                b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
                b"Content-Length: 200\r\n\r\n{"
            )
            await writer.drain()
            held.append(writer)
        await wait_for(lambda: len(server.service.rules.clients) == 2, what="both calls to be open")
        status, headers, body = parse(await raw_http(server, request("POST", "/v1/generations", "Content-Length: 2")
                                                     + b"{}"))
        assert (status, json.loads(body)["error"]) == (503, "too_many_connections")
        assert headers["connection"] == "close"
        # /health is no call of the API: it always answers.
        assert (await raw_http(server, request("GET", "/health"))).startswith(b"HTTP/1.1 200")
        for writer in held:
            writer.transport.abort()
        await wait_for(lambda: not server.service.rules.clients, what="the calls to be let go")


@pytest.mark.asyncio
async def test_a_client_that_never_reads_a_result_is_cut_off_and_holds_two_chunks_at_most() -> None:
    # Finding 3: each never-reading GET of a 3 MiB result held a fresh copy for as long as
    # its socket stayed open (200 of them: +600 MiB).
    async with running(send_timeout_s=1.0) as server:
        body = json.dumps({"id": "big", "params": {"shape": [3, 1024, 1024], "work": 0, "steps": 1},
                           "output": {"format": "raw"}}).encode()
        reply = await raw_http(
            server, request("POST", "/v1/generations?wait=true", f"Content-Length: {len(body)}") + body, timeout=60
        )
        assert parse(reply)[0] == 200 and len(parse(reply)[2]) == 3 << 20
        memory = server.service.memory
        baseline = memory.used
        sockets = []
        for _ in range(8):
            reader, writer = await open_raw(server, rcvbuf=4096)
            writer.write(request("GET", "/v1/generations/big/output"))
            await writer.drain()
            sockets.append((reader, writer))
        await wait_for(lambda: len(server.service.rules.clients) == 8, what="the 8 calls")
        # While they stall: what each holds in the budget is in flight to it, not the result.
        assert memory.used - baseline <= 8 * 2 * (64 << 10)
        # Cut off after send_timeout_s: released, every call let go.
        await wait_for(lambda: not server.service.rules.clients, timeout=30, what="the stalled calls to be cut off")
        assert memory.used == baseline
        for _, writer in sockets:
            writer.transport.abort()
        # The result itself is still there for a reader that reads.
        reply = await raw_http(server, request("GET", "/v1/generations/big/output"), timeout=30)
        assert parse(reply)[0] == 200 and len(parse(reply)[2]) == 3 << 20


def test_the_protocol_is_made_for_a_servers_limits() -> None:
    made = http11.h11_protocol(max_body_bytes=123, body_timeout_s=4.5)
    assert issubclass(made, http11.DeadlineH11Protocol)
    assert (made.max_body_bytes, made.body_timeout_s) == (123, 4.5)


@pytest.mark.asyncio
async def test_a_refusal_before_the_body_is_read_reaches_a_client_still_sending_it() -> None:
    # The HTTP fuzz: a body declared over max_message_bytes is refused (413)
    # before it is read, and the connection closed; closed at once, the
    # client's body still arriving answered with a reset that could discard
    # the 413 before the client read it. Now the server reads and drops it
    # first (a lingering close), up to max_message_bytes + LINGER_BYTES.
    async with running(max_message_bytes=256 << 10) as server:
        for _ in range(5):
            reader, writer = await open_raw(server, rcvbuf=4096)
            body = b"{" + b" " * (300 << 10)
            writer.write(
                b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            status, _, answer = parse(await send_then_read(writer, reader, body))
            assert (status, json.loads(answer)["error"]) == (413, "limit_exceeded")


@pytest.mark.asyncio
async def test_a_refusal_at_its_head_reaches_a_slow_client_of_a_small_body() -> None:
    # A slow client (a few KiB in pieces with pauses) refused before its body
    # is read, with Connection: close (503: one connection too many), wrote
    # on after the server had closed at once, and got a reset instead of the
    # answer (the HTTP fuzz's http_slow, under load). Now a small declared
    # body lingers, with pauses of up to LINGER_IDLE_S.
    async with running(max_connections=1) as server:
        held_reader, held = await open_raw(server)
        held.write(b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 200\r\n\r\n{")
        await held.drain()
        await wait_for(lambda: len(server.service.rules.clients) == 1, what="the first call to be open")
        reader, writer = await open_raw(server)
        body = b'{"params": {"steps": 1, "pad": "' + b"x" * 3000 + b'"}}'
        writer.write(
            b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[:100]
        )
        await writer.drain()
        with anyio.fail_after(30):
            for piece in (body[100:1000], body[1000:2000], body[2000:]):
                await asyncio.sleep(0.3)  # the server answered meanwhile
                writer.write(piece)
                await writer.drain()
            reply = await reader.read()
        writer.close()
        status, headers, answer = parse(reply)
        assert (status, json.loads(answer)["error"]) == (503, "too_many_connections")
        assert headers["connection"] == "close"
        held.transport.abort()


CHUNKED_HEAD = (
    b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
#: 1-byte chunks: refused (413) for their framing after about 1.2 KiB of wire.
ONE_BYTE_CHUNKS = b"1\r\n \r\n" * (2 << 10)


@pytest.mark.asyncio
async def test_a_client_that_pauses_while_sending_a_refused_body_still_reads_its_answer() -> None:
    # Issue #34: the HTTP fuzz's chunked POST, beside two CPU hogs, got BrokenPipeError: its
    # refused body's lingering close ended after 0.1 s of silence, and the client (starved,
    # or on a slow link) wrote its next piece to a closed socket and was reset. Pauses well
    # under LINGER_IDLE_S (Apache's 2 s) now keep it lingering until the body is in.
    async with running() as server:
        reader, writer = await open_raw(server)
        with anyio.fail_after(30):
            writer.write(CHUNKED_HEAD + ONE_BYTE_CHUNKS)
            await writer.drain()
            for _ in range(3):
                await asyncio.sleep(0.5)  # the refusal came meanwhile: a slow or starved client
                writer.write(ONE_BYTE_CHUNKS)
                await writer.drain()  # (a reset here: ConnectionResetError or BrokenPipeError)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            reply = await reader.read()
        writer.close()
    status, headers, body = parse(reply)
    assert (status, json.loads(body)["error"], headers["connection"]) == (413, "limit_exceeded", "close")


@pytest.mark.asyncio
async def test_refused_connections_linger_a_bounded_number_at_once_and_give_their_place_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lingering close must not let a flood of refused clients hold descriptors: past
    # LINGER_MAX lingering connections a refused one is closed at once. (Its time bounds out
    # of the way: the lingering ones end when their clients close, whatever the machine's load.)
    monkeypatch.setattr(http11, "LINGER_IDLE_S", 600.0)
    monkeypatch.setattr(http11, "LINGER_S", 600.0)
    async with running() as server:
        assert server._http is not None
        slots = server._http.config.http_protocol_class.linger_slots
        assert (slots.limit, slots.held) == (http11.LINGER_MAX, 0)
        slots.limit = 2
        clients = []
        for n in range(4):
            reader, writer = await open_raw(server)
            writer.write(CHUNKED_HEAD + ONE_BYTE_CHUNKS)
            await writer.drain()
            with anyio.fail_after(30):
                reply = await reader.read()  # its answer, then the server's FIN (lingering or closed)
            assert parse(reply)[0] == 413
            clients.append(writer)
            await wait_for(lambda: slots.held == min(n + 1, 2), what="the lingering connections")
        # The third and fourth were closed at once: what they send now is answered with a reset.
        for writer in clients[2:]:
            with pytest.raises(ConnectionError), anyio.fail_after(30):
                while True:
                    writer.write(ONE_BYTE_CHUNKS)
                    await writer.drain()
                    await asyncio.sleep(0.02)
        assert slots.held == 2
        for writer in clients:
            writer.close()
        await wait_for(lambda: slots.held == 0, what="every lingering connection to end")


def test_each_server_counts_its_own_lingering_connections() -> None:
    made = http11.h11_protocol(max_body_bytes=123, body_timeout_s=4.5, max_lingering=5)
    other = http11.h11_protocol(max_body_bytes=123, body_timeout_s=4.5)
    assert made.linger_slots is not other.linger_slots
    assert (made.linger_slots.limit, other.linger_slots.limit) == (5, http11.LINGER_MAX)
    slots = http11.LingerSlots(1)
    assert slots.take() and not slots.take() and slots.held == 1
    slots.give()
    assert slots.take()
