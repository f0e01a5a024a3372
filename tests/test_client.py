"""omni_stream.client: the strict frame parser, the per-request inbox, and the client
against the real server (om.models.Synthetic, tiny frames) and a scripted fake server."""

from __future__ import annotations

import io
import json
import math
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
from PIL import Image
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve

import omni_stream as om
from omni_stream import client as omc
from omni_stream import protocol as server_protocol
from omni_stream.client import (
    ClientError,
    ConnectError,
    ConnectionClosedError,
    ParamsRejectedError,
    PreviewFrame,
    Progress,
    ProtocolError,
    RemoteCancelledError,
    RequestFailedError,
    RequestRejectedError,
    parse_preview_frame,
)
from omni_stream.protocol import client as wire
from omni_stream.protocol.client_messages import Generate
from omni_stream.protocol.server_messages import parse_server_message

from .conftest import Slow, running

SMALL: dict[str, Any] = {"shape": [3, 8, 6], "work": 0}
RID = "req-1"


def _png(width: int = 6, height: int = 8, color: tuple[int, int, int] = (200, 10, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def _frame(header: dict[str, Any] | bytes, image: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + image


def _header(**changes: Any) -> dict[str, Any]:
    header = {
        "id": RID, "step": 2, "total": 5, "final": False, "format": "png",
        "width": 6, "height": 8, "mime": "image/png",
    }
    header.update(changes)
    return {k: v for k, v in header.items() if v is not _DROP}


_DROP = object()


# ---- the wire constants and the frame parser (no I/O) -----------------------------


def test_preview_formats_match_the_encoder() -> None:
    # One MIME table (protocol/formats.py) for the encoders and the client:
    # every format a preview or a result may come in is in it.
    from omni_stream.preview import FORMATS, IMAGE_OUTPUTS, VIDEO_OUTPUTS

    # Previews, and the formats a result may come in.
    assert dict(omc.FORMATS) == {**FORMATS, **IMAGE_OUTPUTS, **VIDEO_OUTPUTS}


def test_the_client_does_not_load_the_server() -> None:
    import subprocess
    import sys

    code = (
        "import sys, omni_stream as om; om.client.connect; "
        "print(sorted(m for m in ('omni_stream.server.app', 'prometheus_client', "
        "'websockets.asyncio.server') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("fmt", ["png", "raw"])
def test_parser_reads_what_the_server_packs(fmt: str) -> None:
    image = _png() if fmt == "png" else bytes(range(6 * 8 * 3))
    header = server_protocol.PreviewHeader(
        id=RID, step=5, total=5, final=True, format=fmt, width=6, height=8,
        mime=omc.FORMATS[fmt],
    )
    frame = parse_preview_frame(server_protocol.pack_preview(header, image))
    assert frame == PreviewFrame(RID, 5, 5, True, fmt, 6, 8, image)
    assert frame.mime == omc.FORMATS[fmt]
    decoded = frame.image()
    assert decoded.size == (6, 8)
    if fmt == "raw":
        assert decoded.mode == "RGB" and decoded.tobytes() == image
    else:
        assert decoded.convert("RGB").getpixel((0, 0)) == (200, 10, 30)


def test_parser_allows_extra_header_fields() -> None:
    frame = parse_preview_frame(_frame(_header(added_later="x"), _png()))
    assert frame.step == 2 and not frame.final


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"", "shorter than its 4-byte length"),
        (b"\x00\x00\x01", "shorter than its 4-byte length"),
        (b"\x00\x00\x00\x40{}", "runs past the frame"),
        ((10**6).to_bytes(4, "big") + b"{}", "exceeds"),
        (_frame(b"\xff\xfe{}", _png()), "not UTF-8 JSON"),
        (_frame(b"{not json", _png()), "not UTF-8 JSON"),
        (_frame(b"[1, 2]", _png()), "must be a JSON object"),
        (_frame(_header(id=_DROP), _png()), "has no 'id'"),
        (_frame(_header(id="has space"), _png()), "malformed id"),
        (_frame(_header(id=7), _png()), "'id' must be a str"),
        (_frame(_header(step="2"), _png()), "'step' must be a int"),
        (_frame(_header(step=True), _png()), "'step' must be a int"),
        (_frame(_header(step=0), _png()), "step 0 of 5"),
        (_frame(_header(step=6), _png()), "step 6 of 5"),
        (_frame(_header(total=_DROP), _png()), "has no 'total'"),
        (_frame(_header(final=1), _png()), "'final' must be a bool"),
        (_frame(_header(format="tiff"), _png()), "not one of"),
        (_frame(_header(format="gif", mime="image/gif"), _png()), "do not start like one"),
        (_frame(_header(width=0), _png()), "not positive"),
        (_frame(_header(height=2.5), _png()), "'height' must be a int"),
        (_frame(_header(mime=_DROP), _png()), "has no 'mime'"),
        (_frame(_header(mime="image/jpeg"), _png()), "does not match format"),
        (_frame(_header(format="raw", mime="application/octet-stream"), b"\x00" * 143), "needs 144"),
        (_frame(_header(), b""), "do not start like one"),
        (_frame(_header(format="jpeg", mime="image/jpeg"), _png()), "claims jpeg"),
        (_frame(_header(format="webp", mime="image/webp"), b"RIFF0000WEBQ"), "claims webp"),
    ],
)
def test_parser_rejects_malformed_frames(frame: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(")):
        parse_preview_frame(frame)


def test_image_rejects_bytes_that_do_not_decode_as_the_header_says() -> None:
    truncated = parse_preview_frame(_frame(_header(), _png()[:20]))  # signature ok, body cut
    with pytest.raises(ProtocolError, match="does not decode as png") as info:
        truncated.image()
    assert info.value.request_id == RID
    wrong_size = parse_preview_frame(_frame(_header(width=7), _png()))
    with pytest.raises(ProtocolError, match="decodes to 6x8, its header says 7x8"):
        wrong_size.image()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"id": "a"}', "has no 'type'"),
        ('{"type": "progress", "id": "a", "step": 1, "total": 2}', "has no 'eta_s'"),
        ('{"type": "progress", "id": "a", "step": 1, "total": 2, "eta_s": -1}', "negative eta_s"),
        ('{"type": "progress", "id": "a", "step": 3, "total": 2, "eta_s": 0}', "step 3 of 2"),
        ('{"type": "accepted", "id": "a", "total": 2, "detach": false, "attached": false}',
         "has no 'preview'"),
        ('{"type": "done", "id": "a", "total": 2, "elapsed_s": "1"}', "must be a number"),
        ('{"type": "cancelled", "id": "a b", "reason": "client"}', "malformed id"),
        ('{"type": "error", "message": "x"}', "has no 'code'"),
    ],
)
def test_text_parser_rejects_malformed_messages(text: str, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_server_message(text)


def test_text_parser_ignores_unknown_types() -> None:
    assert parse_server_message('{"type": "hello", "id": "a"}') is None


def test_error_classes_are_also_the_engine_errors() -> None:
    params = ParamsRejectedError("x", code="bad_params", field="steps", request_id="r")
    assert isinstance(params, om.ParamsError) and isinstance(params, ClientError)
    assert isinstance(params, ValueError) and params.field == "steps" and params.code == "bad_params"
    failed = RequestFailedError("x", code="step_failed", request_id="r")
    assert isinstance(failed, om.RequestError) and str(failed) == "[request r] x"
    cancelled = RemoteCancelledError("x", reason="client", request_id="r")
    assert isinstance(cancelled, om.RequestCancelledError) and cancelled.reason == "client"


# ---- argument checks (no connection needed) -----------------------------------------


def test_bad_arguments_raise_params_error_naming_the_field() -> None:
    with pytest.raises(om.ParamsError) as info:
        omc.connect("http://127.0.0.1:1/ws")
    assert info.value.field == "url"
    with pytest.raises(om.ParamsError) as info:
        omc.connect("ws://127.0.0.1:1/ws", token="")
    assert info.value.field == "token"
    with pytest.raises(om.ParamsError) as info:
        omc.connect("ws://127.0.0.1:1/ws", max_buffered=0)
    assert info.value.field == "max_buffered"
    client = omc.connect("ws://127.0.0.1:1/ws")
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: client.generate({}, id="not ok!"), "id"),
        (lambda: client.generate({}, id="x" * 129), "id"),
        (lambda: client.generate([1, 2]), "params"),  # type: ignore[call-overload]
        (lambda: client.generate({"seed": math.nan}), "params"),
        (lambda: client.generate({"seed": object()}), "params"),
        (lambda: client.generate({}, preview="png"), "preview"),  # type: ignore[call-overload]
        (lambda: client.generate({}, detach="yes"), "detach"),  # type: ignore[call-overload]
        (lambda: client.attach(""), "id"),
    ]
    for call, field in cases:
        with pytest.raises(om.ParamsError) as info:
            call()
        assert info.value.field == field


# ---- against the real server ----------------------------------------------------


async def _eventually(cond: Callable[[], bool], what: str) -> None:
    with anyio.fail_after(20):  # a bound against hanging, not a timing assertion
        while not cond():
            await anyio.sleep(0.01)


@pytest.mark.asyncio
async def test_generate_yields_progress_and_frames_in_order_final_last(tmp_path) -> None:
    async with running() as server, omc.connect(server.url) as client:
        stream = client.generate(dict(SMALL, steps=6, seed=4), preview={"format": "raw"},
                                 progress=True)
        items = [item async for item in stream]
        assert stream.accepted and stream.total == 6 and stream.finished
        assert stream.elapsed_s is not None and stream.elapsed_s >= 0
        assert stream.preview_settings is not None and stream.preview_settings["format"] == "raw"
        frames = [i for i in items if isinstance(i, PreviewFrame)]
        assert frames[-1] is items[-1] and frames[-1].final and frames[-1].step == 6
        assert not any(f.final for f in frames[:-1])
        assert all(f.id == stream.id and f.total == 6 and f.format == "raw" for f in frames[:-1])
        assert frames[-1].format == "png"  # the result: the request's output format
        steps = [(i.step, isinstance(i, PreviewFrame)) for i in items]
        assert steps == sorted(steps), "steps went backwards, or a preview came before its progress"
        assert stream.last_progress == Progress(stream.id, 6, 6, 0.0)
        image = frames[-1].image()
        assert image.size == (6, 8)

        # The same request, the plain way: frames only, and result().
        final = await client.generate(dict(SMALL, steps=6, seed=4), preview={"format": "raw"}).result()
        assert final.final and final.data == frames[-1].data

        # The result in another format, saved as the server sent it.
        final = await client.generate(dict(SMALL, steps=2), output={"format": "jpeg"}).result()
        assert final.format == "jpeg" and final.image().size == (6, 8)
        with pytest.raises(ValueError, match="cannot be saved as '.png'"):
            final.save(tmp_path / "result.png")
        assert final.save(tmp_path / "result.jpg").read_bytes() == final.data


@pytest.mark.asyncio
async def test_a_drawn_seed_is_reported_in_accepted_and_on_attach_and_reproduces_the_result() -> None:
    async with running() as server, omc.connect(server.url) as client:
        stream = client.generate(dict(SMALL, steps=3), detach=True, preview={"format": "raw"})
        first = [f async for f in stream]
        seed = stream.seed
        assert isinstance(seed, int) and 0 <= seed < 2**32
        # The engine ran with the seed the server reported: naming it gives the same result.
        again = await client.generate(dict(SMALL, steps=3, seed=seed), preview={"format": "raw"}).result()
        assert again.data == first[-1].data
        other = await client.generate(dict(SMALL, steps=3, seed=seed + 1), preview={"format": "raw"}).result()
        assert other.data != first[-1].data
        # Attach replays `accepted` with the same seed.
        watch = client.attach(stream.id)
        [f async for f in watch]
        assert watch.seed == seed
        named = client.generate(dict(SMALL, steps=1, seed=12), preview={"format": "raw"})
        [f async for f in named]
        assert named.seed == 12


@pytest.mark.asyncio
async def test_errors_and_cancellation_leave_the_client_block_unwrapped() -> None:
    async with running(Slow(0.02)) as server:
        # The body's error comes out as itself, not inside an ExceptionGroup.
        with pytest.raises(ParamsRejectedError):
            async with omc.connect(server.url) as client:
                await client.generate({"steps": 0}).result()
        with pytest.raises(KeyError):
            async with omc.connect(server.url) as client:
                raise KeyError("mine")
        # An outer cancellation mid-request closes the client and cancels the request.
        with anyio.move_on_after(0.3) as scope:
            async with omc.connect(server.url) as client:
                async for _frame in client.generate(dict(SMALL, steps=1000)):
                    pass
        assert scope.cancelled_caught and client.closed
        await _eventually(lambda: server.engine.statistics().cancelled == 1, "the cancel")


@pytest.mark.asyncio
async def test_concurrent_generates_share_one_connection() -> None:
    specs = {f"seed-{seed}": dict(SMALL, steps=3 + seed, seed=seed) for seed in range(4)}
    results: dict[str, list[PreviewFrame]] = {}
    async with running(Slow(0.005)) as server, omc.connect(server.url) as client:

        async def run(rid: str) -> None:
            results[rid] = [f async for f in client.generate(specs[rid], id=rid,
                                                             preview={"format": "raw"})]

        async with anyio.create_task_group() as tg:
            for rid in specs:
                tg.start_soon(run, rid)
        solo = {rid: await client.generate(specs[rid], preview={"format": "raw"}).result()
                for rid in specs}
    for rid, frames in results.items():
        assert all(f.id == rid for f in frames)
        assert frames[-1].final and frames[-1].step == specs[rid]["steps"]
        assert frames[-1].data == solo[rid].data  # demultiplexed, not mixed up
    assert len({frames[-1].data for frames in results.values()}) == len(specs)


@pytest.mark.asyncio
async def test_cancel_ends_the_iteration_with_remote_cancelled() -> None:
    async with running(Slow(0.02)) as server, omc.connect(server.url) as client:
        stream = client.generate(dict(SMALL, steps=500), preview={"format": "raw"})
        with pytest.raises(RemoteCancelledError) as info:
            async for frame in stream:
                await client.cancel(stream.id)
        assert info.value.reason == "client" and info.value.request_id == stream.id
        assert frame.step < 500
        # The connection is still good for more work.
        assert (await client.generate(dict(SMALL, steps=2)).result()).final


@pytest.mark.asyncio
async def test_breaking_out_cancels_unless_detached() -> None:
    async with running(Slow(0.02)) as server, omc.connect(server.url) as client:
        engine = server.engine
        # A plain break: the stream is dropped, which sends the cancel.
        async for _frame in client.generate(dict(SMALL, steps=500), preview={"format": "raw"}):
            break
        await _eventually(lambda: engine.statistics().cancelled == 1, "the cancel")
        # Leaving `async with` cancels at once.
        async with client.generate(dict(SMALL, steps=500), preview={"format": "raw"}) as stream:
            async for _frame in stream:
                break
        await _eventually(lambda: engine.statistics().cancelled == 2, "the cancel")
        # Leaving `async with` because an outer scope was cancelled cancels too.
        with anyio.move_on_after(0.2):
            async with client.generate(dict(SMALL, steps=500), preview={"format": "raw"}) as stream:
                async for _frame in stream:
                    pass
        await _eventually(lambda: engine.statistics().cancelled == 3, "the cancel")
        # A detached request runs on after the break.
        async for _frame in client.generate(dict(SMALL, steps=20), detach=True,
                                            preview={"format": "raw"}):
            break
        await _eventually(lambda: engine.statistics().completed == 1, "the detached result")
        assert engine.statistics().cancelled == 3


@pytest.mark.asyncio
async def test_attach_after_reconnect_replays_and_finishes() -> None:
    async with running(Slow(0.02)) as server:
        async with omc.connect(server.url) as first:
            stream = first.generate(dict(SMALL, steps=40, seed=9), detach=True,
                                    preview={"format": "raw"})
            async for frame in stream:
                if frame.step >= 3:
                    break
            rid = stream.id
        # The first connection is gone; a detached request survives it.
        async with omc.connect(server.url) as second:
            watch = second.attach(rid, progress=True)
            items = [item async for item in watch]
            assert watch.total == 40
            frames = [i for i in items if isinstance(i, PreviewFrame)]
            assert frames[0].step >= 3, "the replay is the latest preview, not the first"
            assert frames[-1].final and frames[-1].step == 40 and items[-1] is frames[-1]
            # After it ended it stays retained: attaching again gives the result at once.
            again = [f async for f in second.attach(rid)]
            assert [f.final for f in again] == [True] and again[0].data == frames[-1].data
            with pytest.raises(RequestRejectedError) as info:
                async for _ in second.attach("no-such-request"):
                    pass
            assert info.value.code == "not_found" and info.value.request_id == "no-such-request"


@pytest.mark.asyncio
async def test_bad_params_raise_params_error_naming_the_field() -> None:
    async with running() as server, omc.connect(server.url) as client:
        cases = [
            ({"steps": 0}, None, "steps", "bad_params"),
            ({"stepz": 3}, None, "stepz", "bad_params"),
            (SMALL, {"format": "gif"}, "preview.format", "invalid_field"),
            ({"shape": [3, 8, 3000], "work": 0}, None, None, "limit_exceeded"),
        ]
        for params, preview, field, code in cases:
            stream = client.generate(params, preview=preview)
            with pytest.raises(ParamsRejectedError) as info:
                await stream.result()
            err = info.value
            assert isinstance(err, om.ParamsError) and err.code == code
            assert err.request_id == stream.id
            if field is not None:
                assert err.field == field and field.split(".")[-1] in str(err)
        # The connection survives rejections.
        assert (await client.generate(dict(SMALL, steps=1)).result()).step == 1


@pytest.mark.asyncio
async def test_one_id_per_connection_and_duplicate_ids_across_connections() -> None:
    async with running(Slow(0.02)) as server, omc.connect(server.url) as client:
        first = client.generate(dict(SMALL, steps=200), id="shared-id")
        await first.__anext__()
        with pytest.raises(om.ParamsError, match="already being watched") as info:
            await client.generate(dict(SMALL, steps=2), id="shared-id").__anext__()
        assert info.value.field == "id"
        async with omc.connect(server.url) as other:
            with pytest.raises(RequestRejectedError) as rejected:
                await other.generate(dict(SMALL, steps=2), id="shared-id").result()
            assert rejected.value.code == "duplicate_id"
        await first.aclose()


@pytest.mark.asyncio
async def test_token_and_refused_connections_raise_connect_error() -> None:
    async with running(token="sesame") as server:
        with pytest.raises(ConnectError) as info:
            async with omc.connect(server.url):
                pass
        assert info.value.status == 401 and info.value.code == "unauthorized"
        assert "token" in str(info.value)
        async with omc.connect(server.url, token="sesame") as client:
            assert (await client.generate(dict(SMALL, steps=1)).result()).final
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError, match="cannot connect"):
        async with omc.connect(f"ws://127.0.0.1:{port}/ws"):
            pass


async def watch_until_shutdown(
    url: str, seen: dict[str, Any], *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """Run a long request on ``url`` and note in ``seen`` how a server shutdown ends it: the
    cancel's reason, the close code, and the code a later request on the connection fails with.
    (Also tests/test_client_trio.py's, under trio.)"""
    async with omc.connect(url) as client:
        stream = client.generate(dict(SMALL, steps=1000))
        await stream.__anext__()
        task_status.started()
        with pytest.raises(RemoteCancelledError) as info:
            async for _ in stream:
                pass
        seen["reason"] = info.value.reason
        await _eventually(lambda: client.closed, "the close")
        seen["code"] = client.close_code
        with pytest.raises(ConnectionClosedError) as closed:
            await client.generate(dict(SMALL, steps=1)).result()
        seen["later"] = closed.value.close_code


@pytest.mark.asyncio
async def test_server_shutdown_cancels_with_reason_and_closes() -> None:
    seen: dict[str, Any] = {}
    # The server shuts down (leaving `async with`) while the request runs.
    async with anyio.create_task_group() as tg, running(Slow(0.02)) as server:
        await tg.start(watch_until_shutdown, server.url, seen)
    assert seen == {"reason": "shutdown", "code": 1001, "later": 1001}


# ---- against a scripted fake server: what the real one never does --------------------

Script = Callable[[ServerConnection, dict[str, Any]], Any]


@asynccontextmanager
async def fake_server(script: Script) -> AsyncIterator[str]:
    """A websocket server that answers the first client message with ``script``."""

    async def handler(ws: ServerConnection) -> None:
        message = json.loads(await ws.recv())
        await script(ws, message)
        await ws.wait_closed()

    # close_timeout: a script may leave the server unable to finish a closing handshake (a
    # frozen server stops reading); its shutdown then waits this long, not websockets' 10 s.
    async with ws_serve(handler, "127.0.0.1", 0, close_timeout=0.5) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/ws"


def _accepted_text(rid: str, total: int = 5) -> str:
    return json.dumps({"type": "accepted", "id": rid, "total": total, "detach": False,
                       "attached": False, "preview": {"format": "raw"}})


def _raw(rid: str, step: int, *, final: bool = False, total: int = 5) -> bytes:
    return _frame({"id": rid, "step": step, "total": total, "final": final, "format": "raw",
                   "width": 1, "height": 1, "mime": "application/octet-stream"}, b"\x01\x02\x03")


@pytest.mark.asyncio
async def test_a_malformed_frame_fails_every_request_and_closes_with_1002() -> None:
    async def script(ws: ServerConnection, message: dict[str, Any]) -> None:
        await ws.send(_accepted_text(message["id"]))
        await ws.send(b"\x00\x00\x00\x05{}")

    async with fake_server(script) as url, omc.connect(url) as client:
        with pytest.raises(ProtocolError, match="runs past the frame") as info:
            await client.generate({}).result()
        assert info.value.request_id is not None
        await _eventually(lambda: client.closed, "the close")
        assert client.close_code == 1002


@pytest.mark.asyncio
async def test_a_dropped_connection_raises_connection_closed_with_the_code() -> None:
    async def script(ws: ServerConnection, message: dict[str, Any]) -> None:
        await ws.send(_accepted_text(message["id"]))
        await ws.send(_raw(message["id"], 1))
        await ws.close(1011, "internal error")

    async with fake_server(script) as url, omc.connect(url) as client:
        stream = client.generate({})
        with pytest.raises(ConnectionClosedError) as info:
            async for _ in stream:
                pass
        err = info.value
        assert err.close_code == 1011 and err.close_reason == "internal error"
        assert err.request_id == stream.id and "1011" in str(err)


@pytest.mark.asyncio
async def test_a_slow_consumer_never_blocks_the_reader_and_keeps_the_final() -> None:
    async def script(ws: ServerConnection, message: dict[str, Any]) -> None:
        rid = message["id"]
        await ws.send(_accepted_text(rid, total=50))
        for step in range(1, 50):
            await ws.send(_raw(rid, step, total=50))
        await ws.send(_raw(rid, 50, final=True, total=50))
        await ws.send(json.dumps({"type": "done", "id": rid, "total": 50, "elapsed_s": 0.1}))

    async with fake_server(script) as url, omc.connect(url, max_buffered=4) as client:
        stream = client.generate({})
        await stream.__aenter__()
        await _eventually(lambda: stream.finished, "everything to arrive unread")
        frames = [f async for f in stream]
        assert len(frames) == 4 and stream.dropped == 46
        assert frames[-1].final and [f.step for f in frames] == [47, 48, 49, 50]


# ---- keepalive ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_keepalive_defaults_notice_a_frozen_server_within_about_20_s() -> None:
    async def script(ws: ServerConnection, message: dict[str, Any]) -> None:
        await ws.send(_accepted_text(message["id"]))

    async with fake_server(script) as url, omc.connect(url) as client:
        ws = client._ws
        assert ws is not None
        # websockets' own 20 s + 20 s (+ 10 s close_timeout) noticed a
        # SIGSTOPped server after ~48 s; now ping + pong timeout + close wait
        # is ~20 s, at most 25 s.
        assert (ws.ping_interval, ws.ping_timeout, ws.close_timeout) == (10.0, 15.0, 5.0)
    async with fake_server(script) as url, omc.connect(url, ping_interval=None, ping_timeout=3) as client:
        assert client._ws is not None and (client._ws.ping_interval, client._ws.ping_timeout) == (None, 3)


@pytest.mark.asyncio
async def test_a_frozen_server_fails_the_requests_after_the_ping_timeout() -> None:
    async def script(ws: ServerConnection, message: dict[str, Any]) -> None:
        await ws.send(_accepted_text(message["id"]))
        # Frozen (as under SIGSTOP): the socket stays open, nothing is read,
        # so no pong ever answers the client's pings.
        ws.transport.pause_reading()

    async with fake_server(script) as url, omc.connect(
        url, ping_interval=0.1, ping_timeout=0.2, close_timeout=0.2
    ) as client:
        stream = client.generate({})
        with anyio.fail_after(10), pytest.raises(ConnectionClosedError) as info:
            async for _ in stream:
                pass
        # The frozen server never sent a close frame: 1006, as for a dropped link.
        assert info.value.close_code == 1006


def test_bad_keepalive_options_raise_params_error() -> None:
    for name, value in [("ping_interval", 0), ("ping_timeout", -1.0), ("ping_interval", math.inf),
                        ("ping_timeout", "10"), ("ping_interval", True)]:
        with pytest.raises(om.ParamsError) as info:
            omc.connect("ws://127.0.0.1:1/ws", **{name: value})
        assert info.value.field == name


# ---- busy and priority ------------------------------------------------------------


def test_busy_parses_to_busy_error_with_retry_after() -> None:
    text = json.dumps({"type": "error", "code": "busy", "message": "full", "id": RID, "retry_after_s": 2.5})
    event = parse_server_message(text)
    assert isinstance(event, wire.ErrorMessage) and event.retry_after_s == 2.5
    err = wire.server_error("busy", "full", field=None, request_id=RID, accepted=False, retry_after_s=2.5)
    assert isinstance(err, omc.BusyError) and isinstance(err, RequestRejectedError)
    assert (err.code, err.retry_after_s, err.request_id) == ("busy", 2.5, RID)
    # Other errors carry none; a negative one breaks the protocol.
    assert parse_server_message(json.dumps({"type": "error", "code": "x", "message": "m"})).retry_after_s is None
    with pytest.raises(ProtocolError, match="retry_after_s"):
        parse_server_message(text.replace("2.5", "-1"))
    with pytest.raises(ProtocolError, match="retry_after_s"):
        parse_server_message(text.replace("2.5", '"soon"'))


def test_generate_carries_a_checked_priority() -> None:
    assert "priority" not in json.loads(Generate.build(RID, {}, None, detach=False).serialize())
    assert json.loads(Generate.build(RID, {}, None, detach=False, priority=-3).serialize())["priority"] == -3
    for bad in (11, True, 2.0, "1"):
        with pytest.raises(om.ParamsError) as info:
            Generate.build(RID, {}, None, detach=False, priority=bad)
        assert info.value.field == "priority"


@pytest.mark.asyncio
async def test_a_busy_server_raises_busy_error_and_priority_reaches_it() -> None:
    from omni_stream.core.tokens import TokenGrant, Tokens

    # Its token is granted priority 4 (core/tokens.py): it reaches the engine.
    tokens = Tokens([TokenGrant("ops", "s3cret", priority=4)])
    async with running(Slow(0.02), max_active=1, max_queued=1, token=tokens) as server, omc.connect(
        server.url, token="s3cret"
    ) as client:
        first = client.generate(dict(SMALL, steps=5000), priority=4)
        await first.__anext__()
        second = client.generate(dict(SMALL, steps=5000))
        async with anyio.create_task_group() as tg:
            # Sent on first iteration; it waits in the server's gate (max_active=1).
            tg.start_soon(second.__anext__)
            await _eventually(lambda: server.service.gate.waiting == 1, "the second to be queued")
            assert server.engine._by_id[first.id].priority == 4
            third = client.generate(dict(SMALL, steps=2))
            with pytest.raises(omc.BusyError) as info:
                await third.result()
            err = info.value
            assert err.code == "busy" and err.request_id == third.id
            assert err.retry_after_s is not None and 1.0 <= err.retry_after_s <= 60.0
            with pytest.raises(om.ParamsError):
                client.generate(SMALL, priority=99)
            # A slot frees: the queued one goes into the engine (its first frame arrives).
            await first.aclose()
        await second.aclose()
        await _eventually(lambda: server.service.rules.load().held == 0, "both to leave the engine")
        assert (await client.generate(dict(SMALL, steps=2)).result()).final
