"""What a client can make the server hold, over real websockets: freed on close, bounded, backpressured."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import weakref
from typing import Any

import anyio
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

import omni_stream as om
from omni_stream import protocol
from omni_stream.models import Synthetic
from omni_stream.server import Server
from omni_stream.core.admission import estimate_memory
from omni_stream.core.outbox import MemoryBudget, Outbox

from ..core.test_outbox import U, done, preview
from .conftest import (
    SMALL,
    RawClient,
    Slow,
    recv,
    running,
    send,
    until,
    until_end,
    wait_for,
)

MIB = 1 << 20

FLOOD = {
    "type": "generate",
    "id": "flood",
    "params": {"steps": 400, "shape": [3, 512, 512], "work": 0},
    "preview": {"format": "raw"},
}


class Big(bytearray):
    """A payload a weak reference can watch (bytes cannot be weakly referenced)."""


def big(nbytes: int) -> protocol.Preview:
    """A result ``nbytes`` long on the wire, whose wire is a :class:`Big` a weak reference can watch.

    Laid out as ``Preview.build`` lays it (pack_preview), the wire kept as a Big:
    ``build`` packs into bytes, which cannot be weakly referenced.
    """
    header = protocol.PreviewHeader("big", 1, 1, True, "raw", 1, 1, "application/octet-stream")
    head = protocol.pack_preview(header, b"")
    frame = protocol.Preview(header, Big(head + bytes(nbytes - len(head))), len(head))  # type: ignore[arg-type]
    assert len(frame.wire) == nbytes
    return frame


def _budget(server: Server) -> Any:
    """The server's MemoryBudget (``server.service.memory`` once the server has a service)."""
    service = getattr(server, "service", None)
    return service.memory if service is not None else server._memory


def _registry(server: Server) -> Any:
    service = getattr(server, "service", None)
    return service.registry if service is not None else server._registry


def _connections(server: Server) -> dict[str, Any]:
    conns = getattr(server, "_connections", None)
    return conns if conns is not None else server.connections


def _writer_blocked(conn: Any) -> bool:
    """Whether the connection's writer is blocked on a client that does not read."""
    if hasattr(conn.ws, "paused"):  # a websockets connection
        return bool(conn.ws.paused)
    from omni_stream.server.http11 import transport_of

    transport = transport_of(conn.ws)
    return transport is not None and transport.get_write_buffer_size() > 64 * 1024


def _close_text(conn: Any) -> str:
    """``"CODE reason"`` of the close frame the server sent the connection."""
    if hasattr(conn, "close_text"):
        return str(conn.close_text())
    close = conn.ws.protocol.close_sent
    return f"{close.code} {close.reason}"


def _only_connection(server: Server) -> Any:
    (conn,) = _connections(server).values()
    return conn


async def _stalled(server: Server) -> tuple[RawClient, Any]:
    """A client that never reads, its server-side connection, and that connection's writer blocked."""
    before = set(_connections(server))
    raw = await RawClient.connect(server)
    await wait_for(lambda: set(_connections(server)) - before, what="the connection")
    (conn,) = [c for cid, c in _connections(server).items() if cid not in before]
    conn.outbox.put(big(4 << 20))  # more than the socket buffers take
    await wait_for(lambda: _writer_blocked(conn), what="the writer to block on the socket")
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
            payloads = [big(1 << 20) for _ in range(4)]
            for payload in payloads:
                conn.outbox.put(payload)
            assert conn.outbox.statistics().pending_must >= 4  # the writer is blocked
            refs = [weakref.ref(conn), weakref.ref(conn.outbox)] + [weakref.ref(p.wire) for p in payloads]
            conn_id = conn.id
            del conn, payloads, payload
            raw.close()
            await wait_for(lambda: conn_id not in _connections(server), what="the disconnect")
            await anyio.sleep(0.1)  # the connection's handler task returns
            alive = [ref() is not None for ref in refs]
            assert alive == [False] * len(refs), "connection, outbox, payloads still alive"
            assert _budget(server).used == sum(r.retained_bytes() for r in _registry(server))
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
    # Not paced (max_messages_per_s): this is about replies, not reading.
    async with running(max_pending=256, max_messages_per_s=1e6) as server:
        client = await BurstClient.connect(server)
        try:
            await client.send_burst(["not json"] * count)
            replies = await client.recv_texts(count)
            assert all(json.loads(r)["code"] == "bad_json" for r in replies)
            assert len(_connections(server)) == 1
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
            await wait_for(lambda: len(_connections(server)) == 1, what="the connection")
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
                conn.outbox.put(big(100 * 1024))
            await wait_for(lambda: conn.id not in _connections(server), what="the disconnect")
            close = _close_text(conn)
            assert close.startswith("1008 client not reading")
            assert "max_pending_bytes=262144" in close
            assert "OMNI_STREAM_MAX_PENDING_BYTES" in close
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
            await wait_for(lambda: len(_connections(server)) == 1, what="the connection")
            conn = _only_connection(server)
            # A preview (~770 KiB), not only a progress, waits behind the blocked send.
            await wait_for(
                lambda: _writer_blocked(conn) and conn.outbox.pending_bytes > (512 << 10),
                what="a preview queued",
            )
            conn.outbox.put(big(900 << 10))  # must-deliver; a preview is ~770 KiB
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
                a.outbox.put(big(mib))
            b.outbox.put(big(mib))
            assert not a.outbox.overflowed  # 4 MiB: under the bound
            b.outbox.put(big(mib))  # 5 MiB: the connection holding 3 goes
            assert _budget(server).used == 2 * mib
            assert a.outbox.overflowed and not b.outbox.overflowed
            await wait_for(lambda: a.id not in _connections(server), what="the disconnect")
            close = _close_text(a)
            assert close.startswith("1008 ")
            assert "max_memory_bytes=4718592" in close
            assert "OMNI_STREAM_MAX_MEMORY_BYTES" in close
            assert b.id in _connections(server)
            # Over the budget, new previews are refused.
            held = _budget(server).used
            b.outbox.put(preview("x", 4 * mib), latest_key=("x", "preview"))
            assert _budget(server).used == held
        finally:
            raw_a.close()
            raw_b.close()
    text = server.metrics.render().decode()
    assert "omni_stream_memory_bytes" in text


class Stated(Synthetic):
    """Synthetic stating a tiny memory per request: the budget holds messages only."""

    def memory_bytes(self, params: Any) -> int:
        return 1


@pytest.mark.asyncio
async def test_over_max_memory_retained_results_go_oldest_first() -> None:
    # Each result: 64x64 raw (12288 bytes) plus its header, progress and done.
    one = {"params": {**SMALL, "shape": [3, 64, 64], "steps": 2}, "output": {"format": "raw"}, "detach": True}
    async with running(Stated(), max_memory_bytes=44_000) as server, connect(server.url) as ws:
        for rid in ("r1", "r2", "r3"):
            await send(ws, type="generate", id=rid, **one)
            assert (await until_end(ws, rid))[-1]["type"] == "done"
        assert "r1" not in _registry(server)
        for rid in ("r2", "r3"):
            await send(ws, type="attach", id=rid)
            assert (await until_end(ws, rid))[-1]["type"] == "done"
        await send(ws, type="attach", id="r1")
        reply = await recv(ws)
        assert reply["type"] == "error" and reply["code"] == "not_found"
        assert _budget(server).used == sum(r.retained_bytes() for r in _registry(server))


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
    # Not paced (max_messages_per_s): this is about the writer, not reading.
    async with running(max_messages_per_s=1e6) as server:
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


# -- what running requests hold: reservations --------------------------------------------


def test_reservations_count_against_the_bound_and_previews_give_way() -> None:
    budget = MemoryBudget(100 * U)
    dropped: list[str] = []
    box = Outbox(max_pending=8, budget=budget, on_replaced=dropped.append)
    held = budget.reserve(90 * U)
    assert (budget.reserved, budget.total) == (90 * U, 90 * U) and budget.over(11 * U)
    box.put(preview("i", 20 * U), latest_key="k")  # would go over: refused
    assert dropped == ["preview"] and budget.used == 0
    held.release()
    box.put(preview("i", 20 * U), latest_key="k")
    assert budget.used == 20 * U


def test_over_the_bound_with_reservations_retained_results_go_before_connections() -> None:
    class Retained:
        def __init__(self) -> None:
            self.sizes = [30 * U]
            budget.add(30 * U)

        def evict_oldest_retained(self) -> bool:
            if not self.sizes:
                return False
            budget.release(self.sizes.pop(0))
            return True

    budget = MemoryBudget(100 * U)
    retained = Retained()
    budget.set_retained(retained)
    running_request = budget.reserve(60 * U)
    box = Outbox(max_pending=8, budget=budget)
    box.put(done("m", 30 * U))  # 120: reserved + retained (90) > queued (30): the result goes
    assert retained.sizes == [] and not box.overflowed and budget.total == 90 * U
    box.put(done("n", 20 * U))  # 110: nothing retained left; the running request holds the most
    assert not box.overflowed and budget.total == 110 * U
    box.put(done("o", 30 * U))  # queued (80) > reserved (60): this connection goes
    assert box.overflowed and budget.total == 60 * U
    running_request.release()
    assert budget.total == 0


def test_a_reservation_dropped_unreleased_gives_its_bytes_back() -> None:
    budget = MemoryBudget(100)
    gc.disable()  # by reference counting, not the cyclic collector
    try:
        budget.reserve(60, 10, group="g", batch_size=4, batch_cost=lambda n: 3 * n)
        assert budget.reserved == 0 and budget.reservations == 0
    finally:
        gc.enable()


def test_a_reservation_grows_when_frames_are_larger_than_estimated() -> None:
    budget = MemoryBudget(1 << 30)
    r = budget.reserve(1000 + 6 * 10, 10, group="g", batch_size=4, batch_cost=lambda n: 20 * n,
                       own_per_byte=6, shared_per_byte=1, frame_bytes=10)
    assert budget.reserved == 1060 + 200 == r.nbytes
    r.observe_frame(5)  # smaller: unchanged
    assert (r.own, r.shared) == (1060, 10)
    r.observe_frame(100)
    assert (r.own, r.shared, r.frame_bytes) == (1600, 100, 100)
    assert budget.reserved == 1600 + 2000
    r.release()
    r.observe_frame(1000)  # released: nothing counts any more
    assert budget.reserved == 0


def test_a_grown_reservation_over_the_bound_sheds_previews() -> None:
    budget = MemoryBudget(1000 * U)
    box = Outbox(max_pending=8, budget=budget)
    box.put(preview("i", 300 * U), latest_key="k")
    r = budget.reserve(100 * U, own_per_byte=10, frame_bytes=10 * U)
    r.observe_frame(80 * U)  # 800 + 300 > 1000
    assert budget.used == 0 and len(box) == 0


# -- over the wire ---------------------------------------------------------------

RAW = {"format": "raw", "max_size": 2048}


@pytest.mark.asyncio
async def test_a_request_whose_frames_alone_exceed_the_memory_bound_is_refused() -> None:
    # The red team's attack: raw previews of the largest frames, 8 at once,
    # took 1.2 GiB against a 64 MiB max_memory_bytes.
    async with running(max_memory_bytes=64 * MIB) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="big", params={"shape": [3, 1024, 1024], "steps": 30}, preview=RAW)
        reply = await recv(ws)
        assert (reply["type"], reply["code"], reply["field"], reply["id"]) == (
            "error", "limit_exceeded", "shape", "big"
        )
        assert "max_memory_bytes=67108864" in reply["message"]
        assert "OMNI_STREAM_MAX_MEMORY_BYTES" in reply["message"]
        assert _budget(server).reserved == 0


@pytest.mark.asyncio
async def test_requests_beyond_the_memory_bound_get_busy_until_one_ends() -> None:
    params = {"shape": [3, 128, 128], "steps": 10_000, "work": 0}
    model = Slow(0.02)
    est = estimate_memory(model, params)
    # Room for two such requests (one batch) and their messages, not three.
    bound = 2 * est.alone + 256 * 1024
    async with running(model, max_memory_bytes=bound) as server, connect(server.url) as ws:
        for rid in ("r1", "r2"):
            await send(ws, type="generate", id=rid, params=params, preview={"max_size": 16})
            assert (await until(ws, lambda m, rid=rid: m.get("id") == rid))["type"] == "accepted"
        budget = _budget(server)
        assert budget.reserved == 2 * est.alone
        await send(ws, type="generate", id="r3", params=params, preview={"max_size": 16})
        reply = await until(ws, lambda m: m.get("id") == "r3")
        assert (reply["type"], reply["code"]) == ("error", "busy")
        assert 1.0 <= reply["retry_after_s"] <= 60.0
        assert "max_memory_bytes" in reply["message"] and "OMNI_STREAM_MAX_MEMORY_BYTES" in reply["message"]
        await send(ws, type="cancel", id="r1")
        await wait_for(lambda: budget.reserved == est.alone, what="r1's reservation released")
        await send(ws, type="generate", id="r3", params=params, preview={"max_size": 16})
        assert (await until(ws, lambda m: m.get("id") == "r3"))["type"] == "accepted"
        for rid in ("r2", "r3"):
            await send(ws, type="cancel", id=rid)
        await wait_for(lambda: budget.reserved == 0, what="every reservation released")


@pytest.mark.asyncio
async def test_reservations_are_released_however_requests_end() -> None:
    params = {"shape": [3, 64, 64], "steps": 3, "work": 0}
    async with running(max_memory_bytes=64 * MIB) as server:
        budget = _budget(server)
        async with connect(server.url) as ws:
            await send(ws, type="generate", id="done", params=params, output={"format": "raw"})
            assert (await until_end(ws, "done"))[-1]["type"] == "done"
            await send(ws, type="generate", id="failed", params={**params, "fail_at": 2})
            assert (await until_end(ws, "failed"))[-1]["code"] == "step_failed"
            await send(ws, type="generate", id="gone", params={**params, "steps": 10_000})
            await until(ws, lambda m: m.get("id") == "gone" and m["type"] == "progress")
        # ... and the last one by the disconnect.
        await wait_for(lambda: budget.reserved == 0, what="every reservation released")
        assert budget.reservations == 0


@pytest.mark.asyncio
async def test_frames_larger_than_the_params_say_grow_the_reservation() -> None:
    # A model whose params do not give its frame size: the server learns it
    # from the first frame, and counts it from then on.
    def frames(params: Any) -> Any:
        for _ in range(params["steps"]):
            time.sleep(0.01)
            yield torch.zeros(3, 256, 256)

    model = om.from_generator(frames, name="opaque")
    frame = 3 * 256 * 256 * 4
    async with running(model, max_memory_bytes=64 * MIB) as server, connect(server.url) as ws:
        budget = _budget(server)
        await send(ws, type="generate", id="o", params={"steps": 10_000}, preview={"max_size": 16})
        await until(ws, lambda m: m.get("id") == "o" and m["type"] == "progress")
        assert budget.reserved >= 6 * frame  # its own frames, not only the base
        await send(ws, type="cancel", id="o")
        await wait_for(lambda: budget.reserved == 0, what="the reservation released")


class _Record:
    """Stands in for a RequestRecord: notes what the budget held when the result was published."""

    def __init__(self, budget: MemoryBudget, total: int) -> None:
        self.id = "r"
        self.total = total
        self.model = None  # a server of one (the metrics' model label: its default)
        self.previews_sent = 0
        self.created_at = time.monotonic()
        self.cancel_reason = None
        self.budget = budget
        self.reserved_at_result: int | None = None
        from omni_stream.core.eta import StepRate

        self.rate = StepRate()

    def publish_progress(self, message: protocol.Progress) -> None:
        pass

    def restart_settled(self) -> None:
        return None  # never restarted

    def publish_preview(self, frame: protocol.Preview) -> None:
        if frame.final:
            self.reserved_at_result = self.budget.reserved

    def wants_preview(self) -> bool:
        return True

    def has_reader(self) -> bool:
        return True


class _Metrics:
    class _Histogram:
        def observe(self, value: float) -> None:
            pass

        def labels(self, *values: str) -> _Metrics._Histogram:
            return self

    preview_encode = _Histogram()
    first_preview = _Histogram()

    def observe_timings(self, timings: Any, model: str | None = None) -> None:
        pass

    def model(self, name: str | None) -> str:
        return name or "model"


@pytest.mark.asyncio
async def test_the_consumer_releases_the_reservation_before_the_result_is_published() -> None:
    # Else a finished request is counted twice, its reservation and its
    # result, and a reading client could be closed for it.
    from omni_stream.preview import Previewer, PreviewSpec
    from omni_stream.core.admission import OutputSpec
    from omni_stream.server.consumer import stream_request

    budget = MemoryBudget(1 << 30)
    params = {"shape": [3, 32, 32], "steps": 3, "work": 0}
    async with om.Engine(Synthetic(), device="cpu") as engine:
        stream = engine.stream(params, policy="latest")
        memory = budget.reserve(12345)
        record = _Record(budget, total=3)
        message = await stream_request(
            record, stream, PreviewSpec(format="raw"), output=OutputSpec("raw"),
            previewer=Previewer(), metrics=_Metrics(), memory=memory,  # type: ignore[arg-type]
        )
    assert message.kind == "done"
    assert record.reserved_at_result == 0
    assert memory.released and budget.reserved == 0
