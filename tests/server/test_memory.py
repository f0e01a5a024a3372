"""What a client can make the server hold, over real websockets: freed on close, bounded, backpressured."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from omni_stream.server import Server

from .conftest import SMALL, RawClient, recv, running, send, until_end, wait_for

FLOOD = {
    "type": "generate",
    "id": "flood",
    "params": {"steps": 400, "shape": [3, 512, 512], "work": 0},
    "preview": {"format": "raw"},
}


class Big(bytearray):
    """A payload a weak reference can watch (bytes cannot be weakly referenced)."""


def _only_connection(server: Server) -> Any:
    (conn,) = server._connections.values()
    return conn


async def _stalled(server: Server) -> tuple[RawClient, Any]:
    """A client that never reads, its server-side connection, and that connection's writer blocked."""
    before = set(server._connections)
    raw = await RawClient.connect(server)
    await wait_for(lambda: set(server._connections) - before, what="the connection")
    (conn,) = [c for cid, c in server._connections.items() if cid not in before]
    conn.outbox.put(Big(4 << 20), "preview")  # more than the socket buffers take
    await wait_for(lambda: conn.ws.paused, what="the writer to block on the socket")
    return raw, conn


# -- a closed connection frees what it queued --------------------------------------


@pytest.mark.asyncio
async def test_a_closed_connection_frees_its_queue_without_the_cyclic_gc() -> None:
    async with running(close_timeout_s=0.3) as server:
        gc.collect()
        gc.disable()  # an idle server rarely runs it: the queue must not wait for it
        try:
            raw, conn = await _stalled(server)
            for _ in range(5):
                await raw.send_text("not json")  # replies it never reads
            payloads = [Big(1 << 20) for _ in range(4)]
            for payload in payloads:
                conn.outbox.put(payload, "done")
            assert conn.outbox.statistics().pending_must >= 4  # the writer is blocked
            refs = [weakref.ref(conn), weakref.ref(conn.outbox)] + [weakref.ref(p) for p in payloads]
            conn_id = conn.id
            del conn, payloads, payload
            raw.close()
            await wait_for(lambda: conn_id not in server._connections, what="the disconnect")
            await anyio.sleep(0.1)  # the connection's handler task returns
            alive = [ref() is not None for ref in refs]
            assert alive == [False] * len(refs), "connection, outbox, payloads still alive"
            assert server._memory.used == sum(r.retained_bytes() for r in server._registry)
        finally:
            gc.enable()


# -- error replies do not grow with the request ------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "message",
    [
        {"type": "generate", "params": {}, "k" * 500_000: 1},  # an unknown field
        {"type": "generate", "params": {"k" * 500_000: 1}},  # an unknown model param
        {"type": "attach", "id": "x" * 500_000},  # an ill-formed id
    ],
    ids=["field", "param", "id"],
)
async def test_error_replies_echo_a_short_prefix(message: dict[str, Any]) -> None:
    async with running() as server, connect(server.url) as ws:
        await ws.send(json.dumps(message))
        with anyio.fail_after(20):
            reply = await ws.recv()
        assert json.loads(reply)["type"] == "error"
        assert len(reply) < 1024


# -- a client reading a burst is never closed for it ---------------------------------


class BurstClient:
    """A websocket client that writes many frames in one TCP write, then reads the replies."""

    def __init__(
        self, proto: ClientProtocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._proto = proto
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, server: Server) -> BurstClient:
        proto = ClientProtocol(parse_uri(server.url))
        proto.send_request(proto.connect())
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"".join(proto.data_to_send()))
        await writer.drain()
        with anyio.fail_after(20):
            head = await reader.readuntil(b"\r\n\r\n")
        proto.receive_data(head)
        (response,) = proto.events_received()
        assert isinstance(response, Response) and response.status_code == 101, response
        return cls(proto, reader, writer)

    async def send_burst(self, texts: list[str]) -> None:
        for text in texts:
            self._proto.send_text(text.encode())
        self._writer.write(b"".join(self._proto.data_to_send()))  # one write
        await self._writer.drain()

    async def recv_texts(self, count: int, timeout: float = 30.0) -> list[str]:
        """``count`` text messages; raises AssertionError if the server closes first."""
        out: list[str] = []
        with anyio.fail_after(timeout):
            while True:
                for event in self._proto.events_received():
                    assert isinstance(event, Frame)
                    if event.opcode is Opcode.TEXT:
                        out.append(event.data.decode())
                    elif event.opcode is Opcode.CLOSE:
                        raise AssertionError(f"closed after {len(out)} replies: {self._proto.close_rcvd}")
                if len(out) >= count:
                    return out
                data = await self._reader.read(65536)
                assert data, f"connection dropped after {len(out)} replies"
                self._proto.receive_data(data)

    def close(self) -> None:
        self._writer.transport.abort()


@pytest.mark.asyncio
async def test_a_burst_in_one_tcp_write_is_answered_in_full() -> None:
    # websockets hands over frames it already holds without yielding: the
    # server used to queue every reply before sending one, and closed this
    # client (1008) past max_pending, though it reads everything.
    count = 600  # over twice max_pending
    async with running(max_pending=256) as server:
        client = await BurstClient.connect(server)
        try:
            await client.send_burst(["not json"] * count)
            replies = await client.recv_texts(count)
            assert all(json.loads(r)["code"] == "bad_json" for r in replies)
            assert len(server._connections) == 1
        finally:
            client.close()
    assert "omni_stream_slow_client_disconnects_total 0.0" in server.metrics.render().decode()


@pytest.mark.asyncio
async def test_the_reader_waits_for_a_slow_writer_instead_of_overflowing() -> None:
    # Backpressure: while the outbox is full and the writer is not blocked on
    # the socket (here: each send takes a while), the reader stops reading.
    async with running(max_pending=8) as server:
        client = await BurstClient.connect(server)
        try:
            await wait_for(lambda: len(server._connections) == 1, what="the connection")
            conn = _only_connection(server)
            send = conn.ws.send

            async def slow_send(data: Any) -> None:
                await anyio.sleep(0.005)
                await send(data)

            conn.ws.send = slow_send
            await client.send_burst(["not json"] * 60)
            replies = await client.recv_texts(60)
            assert all(json.loads(r)["code"] == "bad_json" for r in replies)
            assert not conn.outbox.overflowed
        finally:
            client.close()


# -- the per-connection byte bound -------------------------------------------------------


@pytest.mark.asyncio
async def test_must_deliver_bytes_over_the_bound_close_a_client_not_reading() -> None:
    async with running(max_pending=10_000, max_pending_bytes=256 * 1024, close_timeout_s=0.3) as server:
        raw, conn = await _stalled(server)
        try:
            for _ in range(3):  # large must-deliver messages (results): the third does not fit
                conn.outbox.put(Big(100 * 1024), "preview")
            await wait_for(lambda: conn.id not in server._connections, what="the disconnect")
            close = conn.ws.protocol.close_sent
            assert close.code == 1008
            assert close.reason.startswith("client not reading")
            assert "max_pending_bytes=262144" in close.reason
            assert "OMNI_STREAM_MAX_PENDING_BYTES" in close.reason
        finally:
            raw.close()


@pytest.mark.asyncio
async def test_previews_give_way_to_must_deliver_bytes() -> None:
    # A client that reads slowly gets its result, not a close: the previews
    # queued behind a blocked send are shed to make room for it.
    async with running(max_pending_bytes=1 << 20, close_timeout_s=0.3) as server:
        raw = await RawClient.connect(server)
        try:
            await raw.send_text(json.dumps(FLOOD))
            await wait_for(lambda: len(server._connections) == 1, what="the connection")
            conn = _only_connection(server)
            # A preview (~770 KiB), not only a progress, waits behind the blocked send.
            await wait_for(
                lambda: conn.ws.paused and conn.outbox.pending_bytes > (512 << 10), what="a preview queued"
            )
            conn.outbox.put(b"r" * (900 << 10), "preview")  # must-deliver; a preview is ~770 KiB
            stats = conn.outbox.statistics()
            assert not stats.overflowed
            assert stats.pending_bytes <= 1 << 20
            assert 'omni_stream_messages_dropped_total{kind="preview"}' in server.metrics.render().decode()
        finally:
            raw.close()


# -- the server-wide bound ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_over_max_memory_the_connection_holding_most_is_closed() -> None:
    mib = 1 << 20
    async with running(max_memory_bytes=9 * mib // 2, close_timeout_s=0.3) as server:
        raw_a, a = await _stalled(server)
        raw_b, b = await _stalled(server)
        try:
            while a.outbox.pending_bytes < 3 * mib:
                a.outbox.put(Big(mib), "done")
            b.outbox.put(Big(mib), "done")
            assert not a.outbox.overflowed  # 4 MiB: under the bound
            b.outbox.put(Big(mib), "done")  # 5 MiB: the connection holding 3 goes
            assert server._memory.used == 2 * mib
            assert a.outbox.overflowed and not b.outbox.overflowed
            await wait_for(lambda: a.id not in server._connections, what="the disconnect")
            close = a.ws.protocol.close_sent
            assert close.code == 1008
            assert "max_memory_bytes=4718592" in close.reason
            assert "OMNI_STREAM_MAX_MEMORY_BYTES" in close.reason
            assert b.id in server._connections
            # Over the budget, new previews are refused.
            held = server._memory.used
            b.outbox.put(b"p" * (4 * mib), "preview", latest_key=("x", "preview"))
            assert server._memory.used == held
        finally:
            raw_a.close()
            raw_b.close()
    text = server.metrics.render().decode()
    assert "omni_stream_memory_bytes" in text


@pytest.mark.asyncio
async def test_over_max_memory_retained_results_go_oldest_first() -> None:
    # Each result: 64x64 raw (12288 bytes) plus its header, progress and done.
    one = {"params": {**SMALL, "shape": [3, 64, 64], "steps": 2}, "output": {"format": "raw"}, "detach": True}
    async with running(max_memory_bytes=44_000) as server, connect(server.url) as ws:
        for rid in ("r1", "r2", "r3"):
            await send(ws, type="generate", id=rid, **one)
            assert (await until_end(ws, rid))[-1]["type"] == "done"
        assert "r1" not in server._registry
        for rid in ("r2", "r3"):
            await send(ws, type="attach", id=rid)
            assert (await until_end(ws, rid))[-1]["type"] == "done"
        await send(ws, type="attach", id="r1")
        reply = await recv(ws)
        assert reply["type"] == "error" and reply["code"] == "not_found"
        assert server._memory.used == sum(r.retained_bytes() for r in server._registry)


@pytest.mark.asyncio
async def test_a_result_over_the_byte_bound_reaches_a_reading_client_with_its_done() -> None:
    # The result may be larger than max_pending_bytes; the "done" queued
    # right behind it once overflowed the outbox and lost it (1008).
    async with running(max_pending_bytes=100_000) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="big", params={"steps": 2, "work": 0, "shape": [3, 256, 256]},
                   output={"format": "raw"})
        msgs = await until_end(ws, "big")
    final = [m for m in msgs if m["type"] == "preview" and m["final"]]
    assert len(final) == 1 and len(final[0]["image"]) == 3 * 256 * 256 > 100_000
    assert msgs[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_a_reading_client_bursting_while_a_big_preview_is_sent_is_not_closed() -> None:
    # websockets pauses writing in the middle of every send larger than its
    # write_limit, even to a client that reads: such a pause is not a stall.
    async with running() as server:
        async with connect(server.url, max_size=None, compression=None) as ws:
            answered = 0
            closed: str | None = None

            async def reader() -> None:
                nonlocal answered, closed
                try:
                    async for m in ws:
                        if isinstance(m, str) and '"bad_json"' in m:
                            answered += 1
                        elif isinstance(m, bytes):
                            await anyio.sleep(len(m) / 10e6)  # a 10 MB/s link
                except Exception as exc:  # noqa: BLE001 - reported below
                    closed = repr(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await ws.send(json.dumps(FLOOD))
                await anyio.sleep(0.5)
                for _ in range(2):
                    for _ in range(600):
                        await ws.send("not json")
                    await anyio.sleep(0.2)
                await wait_for(lambda: answered == 1200 or closed is not None, what="every reply")
                tg.cancel_scope.cancel()
    assert closed is None, closed
    assert answered == 1200
