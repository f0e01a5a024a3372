"""docs/protocol.md's rules, driven through the core (``Service``) with no sockets.

Each test feeds client messages with ``service.rules.handle(client,
text)`` and reads the replies from the :class:`Outbox` a front door would
drain: an ``Engine`` on the CPU with the tiny ``Synthetic`` model (``Slow``:
steps that sleep a few ms), the real limits (``ServerLimits.from_env``).
``handle`` is synchronous, so what one message answers is in the outbox as
soon as it returns: a reply is checked with ``get_nowait`` before anything
else can run. Waits are on conditions, with bounded timeouts.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from omni_stream import Engine
from omni_stream.protocol import (
    REJECTION_CODES,
    MessageError,
    Preview,
    PreviewHeader,
    unpack_preview,
)
from omni_stream.core.limits import ServerLimits
from omni_stream.core.tokens import TokenGrant, Tokens
from omni_stream.core.outbox import Outbox
from omni_stream.server.service import Service

from .conftest import SMALL, Slow

#: A short request: 20 steps of ~5 ms, raw previews (cheap to render).
SHORT: dict[str, Any] = {**SMALL, "steps": 20}
RAW = {"format": "raw"}
#: A request that runs until cancelled (or the service closes).
LONG: dict[str, Any] = {**SMALL, "steps": 10_000}
TERMINAL = ("done", "cancelled")
WAIT_S = 10.0  # a bound against hanging only; conditions are met in ms


# -- helpers -------------------------------------------------------------------


@asynccontextmanager
async def serving(
    model: Any = None, *, token: Any = None, start: bool = True, scheduling: str | None = None, **limits: Any
) -> AsyncIterator[Service]:
    """A Service over its own CPU Engine (``scheduling``: its policy, else the default), entered
    (``start``) with ``limits``."""
    options = {} if scheduling is None else {"scheduling": scheduling}
    engine = Engine(model or Slow(0.005), device="cpu", torch_threads=1, **options)
    tokens = token if isinstance(token, Tokens) else Tokens.of(token)
    service = Service(engine, limits=ServerLimits.from_env(limits), tokens=tokens, owns_engine=True)
    if not start:
        yield service
        return
    async with service:
        yield service


def decode(data: str | bytes) -> dict[str, Any]:
    if isinstance(data, bytes):
        header, image = unpack_preview(data)
        return {"type": "preview", **header.to_dict(), "nbytes": len(image)}
    return json.loads(data)


class Client:
    """One websocket connection as the door would hold it: a client of the core and its outbox.

    ``token``: the token it presented (its principal is that token's; else
    the connection's own).
    """

    def __init__(self, service: Service, *, token: str | None = None, **outbox: Any) -> None:
        self.service = service
        outbox.setdefault("max_pending", service.limits.max_pending)
        outbox.setdefault("max_pending_bytes", service.limits.max_pending_bytes)
        self.outbox = Outbox(budget=service.memory, **outbox)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        principal = service.rules.principal_of_connection("pending", headers=headers, query="")
        self.client = service.rules.connect(principal, "websocket")
        self.client.outbox = self.outbox  # this test's bounds, not the server's (Rules.open_outbox)
        self.id = self.client.id
        self._backlog: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        self.send_raw(json.dumps(message))

    def send_raw(self, data: str | bytes) -> None:
        self.service.rules.handle(self.client, data)

    def _take(self) -> list[dict[str, Any]]:
        out = []
        while (item := self.outbox.get_nowait()) is not None:
            out.append(decode(item.message.wire))
        return out

    def pending(self) -> list[dict[str, Any]]:
        """Everything queued now, without waiting."""
        out, self._backlog = [*self._backlog, *self._take()], []
        return out

    def exchange(self, data: str | bytes) -> list[dict[str, Any]]:
        """Send ``data``; what it queued at once (what was queued before is kept for ``recv``)."""
        self._backlog.extend(self._take())
        self.send_raw(data)
        return self._take()

    def reply(self, **message: Any) -> dict[str, Any]:
        """Send one message; its one and only reply, there at once (a generate that waits is also
        told where: its ``queued``, kept for ``recv``)."""
        replies = self.exchange(json.dumps(message))
        if len(replies) == 2 and replies[1]["type"] == "queued" and replies[0]["type"] == "accepted":
            self._backlog.append(replies.pop())
        assert len(replies) == 1, replies
        return replies[0]

    def generate(self, rid: str | None, params: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        extra.setdefault("preview", RAW)
        msg: dict[str, Any] = {"type": "generate", "params": SHORT if params is None else params, **extra}
        if rid is not None:
            msg["id"] = rid
        return self.reply(**msg)

    async def recv(self, timeout: float = WAIT_S) -> dict[str, Any]:
        if self._backlog:
            return self._backlog.pop(0)
        with anyio.fail_after(timeout):
            item = await self.outbox.get()
        return decode(item.message.wire)

    async def until_end(self, rid: str, timeout: float = WAIT_S) -> list[dict[str, Any]]:
        """This request's messages up to and including its terminal one.

        Other requests' messages are kept, in order, for the next ``recv``.
        """
        out: list[dict[str, Any]] = []
        others: list[dict[str, Any]] = []
        try:
            with anyio.fail_after(timeout):
                while True:
                    msg = await self.recv()
                    if msg.get("id") != rid:
                        others.append(msg)
                        continue
                    out.append(msg)
                    if msg["type"] in TERMINAL or (
                        msg["type"] == "error" and msg["code"] not in REJECTION_CODES
                    ):
                        return out
        finally:
            self._backlog[:0] = others

    def close(self) -> None:
        self.service.rules.disconnect(self.client)
        self.outbox.abort()


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``cond``; the bound only guards against hanging."""
    try:
        with anyio.fail_after(timeout):
            while not cond():
                await anyio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def reject(client: Client, code: str, data: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """Send ``data``; assert exactly one ``error`` ``code`` comes back and nothing started."""
    before = {r.id for r in client.service.registry}
    replies = client.exchange(json.dumps(data) if isinstance(data, dict) else data)
    assert [(m["type"], m.get("code")) for m in replies] == [("error", code)], replies
    assert {r.id for r in client.service.registry} == before, "a rejection started something"
    return replies[0]


def check_stream(
    msgs: list[dict[str, Any]], rid: str, total: int, *, end: str = "done", after: int = 0
) -> None:
    """docs/protocol.md's ordering for one request's messages on one connection.

    ``after``: the step of the ``progress`` an attach replayed (the live
    messages start from there; ``msgs`` then holds ``accepted`` and them).
    """
    assert msgs[0]["type"] == "accepted" and msgs[0]["id"] == rid and msgs[0]["total"] == total
    assert [m["type"] for m in msgs].count("accepted") == 1
    if len(msgs) > 2 and msgs[1]["type"] == "queued":  # it waited for a place: where, once
        assert msgs[1]["id"] == rid and msgs[1]["position"] >= 0
        msgs = [msgs[0], *msgs[2:]]
    assert msgs[-1]["type"] == end
    assert sum(m["type"] in ("done", "cancelled", "error") for m in msgs) == 1
    last_step = last_progress = after
    for m in msgs[1:-1]:
        assert m["type"] in ("progress", "preview"), m
        assert m["step"] >= last_step, f"steps went backwards: {m}"
        last_step = m["step"]
        assert m["total"] == total
        if m["type"] == "progress":
            assert m["step"] > last_progress, f"progress of step {m['step']} twice"
            assert isinstance(m["eta_s"], (int, float)) and m["eta_s"] >= 0
            last_progress = m["step"]
        else:
            assert m["step"] == last_progress, f"preview of step {m['step']} not right after its progress"
    if end == "done":
        final = [m for m in msgs if m["type"] == "preview" and m["final"]]
        assert len(final) == 1 and final[0]["step"] == total
        assert msgs[-2] is final[0], "the final preview must come right before done"
        assert msgs[-1]["total"] == total and msgs[-1]["elapsed_s"] >= 0


# -- one reply per message -------------------------------------------------------


@pytest.mark.asyncio
async def test_generate_gets_exactly_one_accepted_at_once_with_the_effective_settings() -> None:
    async with serving(max_image_size=64) as service:
        a = Client(service)
        acc = a.generate("g-1", SHORT, preview={"every": 2, "format": "jpeg"})
        assert acc["type"] == "accepted"
        assert (acc["id"], acc["total"], acc["detach"], acc["attached"]) == ("g-1", 20, False, False)
        # max_size capped at max_image_size; quality defaults per format.
        preview = acc["preview"]
        assert {k: preview[k] for k in ("every", "format", "max_size", "quality", "decoder")} == {
            "every": 2,
            "format": "jpeg",
            "max_size": 64,
            "quality": 85,
            "decoder": "auto",
        }
        assert acc["output"] == {"format": "png", "quality": None}
        msgs = await a.until_end("g-1")
        check_stream([acc, *msgs], "g-1", 20)


@pytest.mark.asyncio
async def test_png_and_raw_previews_have_null_quality() -> None:
    async with serving() as service:
        a = Client(service)
        for rid, fmt in (("p", "png"), ("r", "raw")):
            acc = a.generate(rid, LONG, preview={"format": fmt})
            assert acc["preview"]["quality"] is None and acc["preview"]["format"] == fmt


@pytest.mark.asyncio
async def test_a_generate_without_id_gets_a_server_made_uuid4_hex() -> None:
    async with serving() as service:
        a = Client(service)
        acc = a.generate(None, SHORT)
        assert acc["type"] == "accepted" and re.fullmatch(r"[0-9a-f]{32}", acc["id"])
        assert acc["id"] in service.registry
        assert (await a.until_end(acc["id"]))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_cancel_has_no_reply_of_its_own_and_ends_the_request_cancelled_client() -> None:
    async with serving() as service:
        a = Client(service)
        a.generate("c-1", LONG)
        await wait_for(lambda: service.registry.get("c-1").latest_step >= 1, "a step")
        a.send(type="cancel", id="c-1")
        assert [m for m in a.pending() if m["type"] not in ("progress", "preview")] == []
        msgs = await a.until_end("c-1")
        assert msgs[-1] == {"type": "cancelled", "id": "c-1", "reason": "client"}
        assert [m["type"] for m in msgs].count("cancelled") == 1
        # Not detached: forgotten as soon as it ended.
        assert "c-1" not in service.registry


@pytest.mark.asyncio
async def test_every_rejection_is_one_error_and_the_connection_goes_on() -> None:
    async with serving() as service:
        a = Client(service)
        reject(a, "bad_json", "{")
        reject(a, "not_found", {"type": "attach", "id": "nope"})
        # The same connection still works.
        assert a.generate("after", SHORT)["type"] == "accepted"
        assert (await a.until_end("after"))[-1]["type"] == "done"


# -- each rejection code, with its field ------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("{", "invalid JSON at line 1 column 2"),
        ('{"type": "generate", "params": }', "invalid JSON at line 1 column 32"),
        ('{"type": "generate", "params": {"seed": NaN}}', "invalid JSON: NaN is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
        ('{"type": "generate", "params": {"seed": ' + "9" * 5000 + "}}", "an integer literal is too long"),
    ],
)
async def test_bad_json_says_where_or_what(text: str, where: str) -> None:
    async with serving(start=False) as service:
        err = reject(Client(service), "bad_json", text)
        assert where in err["message"]
        assert "id" not in err and "field" not in err


@pytest.mark.asyncio
@pytest.mark.parametrize("data", ["[1, 2]", '"generate"', "null", b'{"type": "cancel", "id": "x"}'])
async def test_bad_message_for_json_that_is_not_an_object_or_a_binary_frame(data: str | bytes) -> None:
    async with serving(start=False) as service:
        err = reject(Client(service), "bad_message", data)
        assert "field" not in err


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("message", "field", "rid"),
    [
        ({}, "type", None),
        ({"type": 3}, "type", None),
        ({"type": "generate"}, "params", None),
        ({"type": "generate", "params": {}, "detatch": True}, "detatch", None),
        ({"type": "generate", "id": "bad id!", "params": {}}, "id", None),
        ({"type": "generate", "id": "", "params": {}}, "id", None),
        ({"type": "generate", "id": "x" * 129, "params": {}}, "id", None),
        ({"type": "generate", "id": "f1", "params": []}, "params", "f1"),
        ({"type": "generate", "id": "f2", "params": {}, "detach": "yes"}, "detach", "f2"),
        ({"type": "generate", "id": "f3", "params": {}, "preview": "jpeg"}, "preview", "f3"),
        (
            {"type": "generate", "id": "f4", "params": {}, "preview": {"format": "gif"}},
            "preview.format",
            "f4",
        ),
        ({"type": "generate", "id": "f5", "params": {}, "preview": {"every": 0}}, "preview.every", "f5"),
        ({"type": "generate", "id": "f6", "params": {}, "output": {"format": "bmp"}}, "output.format", "f6"),
        ({"type": "generate", "id": "f7", "params": {}, "priority": 11}, "priority", "f7"),
        ({"type": "cancel"}, "id", None),
        ({"type": "cancel", "id": "c", "why": 1}, "why", "c"),
        ({"type": "attach", "id": 5}, "id", None),
    ],
)
async def test_invalid_field_names_the_field(message: dict[str, Any], field: str, rid: str | None) -> None:
    async with serving() as service:
        err = reject(Client(service), "invalid_field", message)
        assert err["field"] == field
        assert err.get("id") == rid


@pytest.mark.asyncio
async def test_an_error_echoes_only_a_short_prefix_of_what_was_sent() -> None:
    async with serving(start=False) as service:
        a = Client(service)
        long_name = "k" * 200
        err = reject(a, "invalid_field", {"type": "generate", "params": {}, long_name: 1})
        assert err["field"] == "k" * 64 + "..."
        assert len(err["message"]) <= 512 and "k" * 65 not in err["message"]
        many = {f"u{i}": 1 for i in range(5)}
        err = reject(a, "invalid_field", {"type": "generate", "params": {}, **many})
        assert err["field"] == "u0" and "'u0', 'u1', 'u2' and 2 more" in err["message"]


@pytest.mark.asyncio
async def test_unknown_type() -> None:
    async with serving(start=False) as service:
        err = reject(Client(service), "unknown_type", {"type": "generat", "id": "u1", "params": {}})
        assert err["field"] == "type" and "generate, cancel, attach" in err["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"steps": "x"}, "steps"),
        ({"shape": [3, 2048, 2048]}, "shape"),
        ({"work": 1001}, "work"),
    ],
)
async def test_bad_params_names_the_param(params: dict[str, Any], field: str) -> None:
    async with serving() as service:
        err = reject(Client(service), "bad_params", {"type": "generate", "id": "bp", "params": params})
        assert (err["id"], err["field"]) == ("bp", field)


@pytest.mark.asyncio
async def test_a_rejected_generate_without_an_id_gets_no_id() -> None:
    async with serving() as service:
        err = reject(Client(service), "bad_params", {"type": "generate", "params": {"steps": 0}})
        assert "id" not in err


@pytest.mark.asyncio
async def test_limit_exceeded_names_the_limit_and_its_variable() -> None:
    async with serving(max_steps=30, max_image_size=32) as service:
        a = Client(service)
        err = reject(a, "limit_exceeded", {"type": "generate", "id": "l1", "params": {**SMALL, "steps": 31}})
        assert (err["id"], err["field"]) == ("l1", "steps")
        assert "max_steps=30" in err["message"] and "OMNI_STREAM_MAX_STEPS" in err["message"]
        err = reject(a, "limit_exceeded", {"type": "generate", "id": "l2", "params": {"shape": [3, 16, 33]}})
        assert (err["id"], err["field"]) == ("l2", "shape")
        assert "max_image_size=32" in err["message"] and "OMNI_STREAM_MAX_IMAGE_SIZE" in err["message"]
        # At the bound: accepted.
        assert a.generate("l3", {**SMALL, "steps": 30, "shape": [3, 32, 32]})["type"] == "accepted"


class Sized(Slow):
    """Slow, whose requests say they hold ``seed`` bytes while they run (``memory_bytes``)."""

    def memory_bytes(self, params: dict[str, Any]) -> int:
        return int(params["seed"])


@pytest.mark.asyncio
async def test_memory_over_half_of_max_memory_bytes_is_limit_exceeded_and_not_fitting_is_busy() -> None:
    async with serving(Sized(), max_memory_bytes=1_000_000) as service:
        a = Client(service)
        err = reject(
            a, "limit_exceeded", {"type": "generate", "id": "m0", "params": {**LONG, "seed": 600_000}}
        )
        assert (err["id"], err["field"]) == ("m0", "params")
        assert (
            "max_memory_bytes=1000000" in err["message"] and "OMNI_STREAM_MAX_MEMORY_BYTES" in err["message"]
        )
        assert a.generate("m1", {**LONG, "seed": 400_000})["type"] == "accepted"
        assert a.generate("m2", {**LONG, "seed": 400_000})["type"] == "accepted"
        err = reject(a, "busy", {"type": "generate", "id": "m3", "params": {**LONG, "seed": 400_000}})
        assert err["id"] == "m3" and 1 <= err["retry_after_s"] <= 60
        # The reservation goes with the request.
        a.send(type="cancel", id="m1")
        await a.until_end("m1")
        await wait_for(lambda: service.memory.reservations == 1, "m1's reservation to go")
        assert a.generate("m3", {**LONG, "seed": 400_000})["type"] == "accepted"


@pytest.mark.asyncio
async def test_duplicate_id_while_running_from_any_connection_leaves_the_first_alone() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        assert a.generate("dup", SHORT)["type"] == "accepted"
        for client in (a, b):
            err = reject(client, "duplicate_id", {"type": "generate", "id": "dup", "params": SHORT})
            assert (err["id"], err["field"]) == ("dup", "id")
        msgs = await a.until_end("dup")
        check_stream([{"type": "accepted", "id": "dup", "total": 20}, *msgs], "dup", 20)
        assert b.pending() == []  # b never watched it


@pytest.mark.asyncio
async def test_duplicate_id_for_a_retained_detached_request_but_not_for_a_forgotten_one() -> None:
    async with serving() as service:
        a = Client(service)
        a.generate("kept", SHORT, detach=True)
        a.generate("gone", SHORT)
        await a.until_end("kept")
        await a.until_end("gone")
        err = reject(a, "duplicate_id", {"type": "generate", "id": "kept", "params": SHORT})
        assert err["field"] == "id"
        # A request that was not detached is forgotten as soon as it ends: its id is free.
        assert a.generate("gone", SHORT)["type"] == "accepted"


@pytest.mark.asyncio
async def test_too_many_requests_per_principal() -> None:
    async with serving(max_requests_per_principal=2) as service:
        a, b = Client(service), Client(service)
        a.generate("a1", LONG)
        a.generate("a2", LONG)
        err = reject(a, "too_many_requests", {"type": "generate", "id": "a3", "params": SHORT})
        assert err["id"] == "a3" and "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL" in err["message"]
        # Per connection: another one is not affected.
        assert b.generate("b1", SHORT)["type"] == "accepted"
        # Once one of a's ends, a may start another.
        a.send(type="cancel", id="a1")
        await a.until_end("a1")
        assert a.generate("a3", SHORT)["type"] == "accepted"


@pytest.mark.asyncio
async def test_too_many_requests_when_max_retained_detached_requests_are_running() -> None:
    async with serving(max_retained=2) as service:
        a, b = Client(service), Client(service)
        a.generate("d1", SHORT, detach=True)
        a.generate("d2", LONG, detach=True)
        err = reject(
            b, "too_many_requests", {"type": "generate", "id": "d3", "params": SHORT, "detach": True}
        )
        assert err["id"] == "d3" and "OMNI_STREAM_MAX_RETAINED" in err["message"]
        # Not detached: not counted against max_retained.
        assert b.generate("n1", SHORT)["type"] == "accepted"
        # Once one has ended, the oldest ended one is forgotten to make room.
        await a.until_end("d1")
        assert b.generate("d3", SHORT, detach=True)["type"] == "accepted"
        assert "d1" not in service.registry
        reject(b, "not_found", {"type": "attach", "id": "d1"})


@pytest.mark.asyncio
async def test_not_found_for_cancel_and_attach_of_an_unknown_id() -> None:
    async with serving() as service:
        a = Client(service)
        for kind in ("cancel", "attach"):
            err = reject(a, "not_found", {"type": kind, "id": "ghost"})
            assert (err["id"], err["field"]) == ("ghost", "id")


@pytest.mark.asyncio
async def test_already_attached_for_a_request_this_connection_watches() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("w", LONG, detach=True)
        # The creator watches its own request.
        err = reject(a, "already_attached", {"type": "attach", "id": "w"})
        assert (err["id"], err["field"]) == ("w", "id")
        assert b.reply(type="attach", id="w")["type"] == "accepted"
        b.pending()
        err = reject(b, "already_attached", {"type": "attach", "id": "w"})
        assert err["field"] == "id"


@pytest.mark.asyncio
async def test_busy_past_max_active_plus_max_queued_with_retry_after() -> None:
    async with serving(max_active=1, max_queued=1) as service:
        a, b = Client(service), Client(service)
        a.generate("r0", LONG)
        a.generate("r1", LONG)
        for client, rid in ((a, "r2"), (b, "b0")):
            err = reject(client, "busy", {"type": "generate", "id": rid, "params": SHORT})
            assert err["id"] == rid
            assert isinstance(err["retry_after_s"], (int, float)) and 1 <= err["retry_after_s"] <= 60
            assert "OMNI_STREAM_MAX_QUEUED" in err["message"]
        # A slot frees: the next generate is taken.
        a.send(type="cancel", id="r0")
        await a.until_end("r0")
        await wait_for(lambda: not service.rules.load().busy, "the engine to let go of r0")
        assert b.generate("b0", SHORT)["type"] == "accepted"


@pytest.mark.asyncio
async def test_busy_is_checked_before_preview_output_and_params() -> None:
    async with serving(max_active=1, max_queued=1) as service:
        a = Client(service)
        a.generate("r0", LONG)
        a.generate("r1", LONG)
        bad = {
            "type": "generate",
            "id": "x",
            "params": {"steps": 0},
            "preview": {"format": "gif"},
            "output": {"format": "bmp"},
        }
        reject(a, "busy", bad)


@pytest.mark.asyncio
async def test_busy_for_a_connection_past_its_fair_share_while_crowded() -> None:
    # Capacity 5; crowded once more than 2 are queued (held >= 4); with two
    # connections open, a fair share is 5 // 2 = 2.
    async with serving(max_active=1, max_queued=4) as service:
        a, b = Client(service), Client(service)
        for i in range(4):
            assert a.generate(f"a{i}", LONG)["type"] == "accepted"
        err = reject(a, "busy", {"type": "generate", "id": "a4", "params": LONG})
        assert "fair share of 2" in err["message"] and 1 <= err["retry_after_s"] <= 60
        assert b.generate("b0", LONG)["type"] == "accepted"
        err = reject(b, "busy", {"type": "generate", "id": "b1", "params": LONG})
        assert "holds 5 requests" in err["message"]


@pytest.mark.asyncio
async def test_shutting_down_after_begin_shutdown_while_what_runs_goes_on() -> None:
    async with serving() as service:
        a = Client(service)
        a.generate("before", SHORT)
        service.begin_shutdown()
        err = reject(a, "shutting_down", {"type": "generate", "id": "after", "params": SHORT})
        assert err["id"] == "after"
        assert (await a.until_end("before"))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_engine_unavailable_when_the_service_is_not_started() -> None:
    async with serving(start=False) as service:
        a = Client(service)
        err = reject(a, "engine_unavailable", {"type": "generate", "id": "e1", "params": SHORT})
        assert err["id"] == "e1" and "not started" in err["message"]
        code, health = service.health_payload()
        # Not "closed": the engine is not started because the service is not.
        assert (code, health["status"], health["ok"]) == (503, "not_started", False)
        assert "lifespan" in health["reason"]


# -- ownership and security ---------------------------------------------------------


@pytest.mark.asyncio
async def test_another_connection_cannot_cancel_or_attach_a_request_that_is_not_detached() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("mine", SHORT)
        for kind in ("cancel", "attach"):
            err = reject(b, "not_found", {"type": kind, "id": "mine"})
            assert (err["id"], err["field"]) == ("mine", "id")
        # The same answer as for an id that does not exist.
        unknown = reject(b, "not_found", {"type": "cancel", "id": "other"})
        assert err["message"].replace("mine", "other") == unknown["message"]
        assert (await a.until_end("mine"))[-1]["type"] == "done"  # b's cancel did nothing
        assert b.pending() == []


@pytest.mark.asyncio
async def test_a_detached_request_is_visible_by_id_to_any_connection() -> None:
    async with serving() as service:
        a, b, c = Client(service), Client(service), Client(service)
        a.generate("cap", LONG, detach=True)
        acc = b.reply(type="attach", id="cap")
        assert (acc["type"], acc["id"], acc["attached"], acc["detach"]) == ("accepted", "cap", True, True)
        c.send(type="cancel", id="cap")  # c does not watch it, but may cancel it
        assert c.pending() == []
        for client in (a, b):
            assert (await client.until_end("cap"))[-1] == {
                "type": "cancelled",
                "id": "cap",
                "reason": "client",
            }


@pytest.mark.asyncio
async def test_a_watchers_disconnect_does_not_cancel_a_request_it_did_not_start() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("shared", SHORT, detach=True)
        b.reply(type="attach", id="shared")
        record = service.registry.get("shared")
        b.close()
        assert record.watchers == (a.id,)
        assert (await a.until_end("shared"))[-1]["type"] == "done"


@pytest.mark.asyncio
async def test_with_a_token_every_connection_of_its_principal_may_cancel_and_attach_its_requests() -> None:
    async with serving(token="t") as service:
        a, b, c = Client(service, token="t"), Client(service, token="t"), Client(service, token="t")
        a.generate("t1", LONG)
        assert b.reply(type="attach", id="t1")["attached"] is True
        assert service.rules.lookup(c.client, "t1").id == "t1"
        c.send(type="cancel", id="t1")
        assert c.pending() == []
        for client in (a, b):
            assert (await client.until_end("t1"))[-1]["reason"] == "client"


@pytest.mark.asyncio
async def test_a_tenant_sees_its_own_principals_requests_and_not_another_tenants() -> None:
    async with serving(token=["ann=sa", "bob=sb"]) as service:
        a1, a2, b = Client(service, token="sa"), Client(service, token="sa"), Client(service, token="sb")
        a1.generate("priv", LONG)
        assert service.rules.lookup(a2.client, "priv").id == "priv"
        assert service.rules.lookup(a1.client, "priv").id == "priv"
        with pytest.raises(MessageError) as info:
            service.rules.lookup(b.client, "priv")
        assert (info.value.code, info.value.field) == ("not_found", "id")


@pytest.mark.asyncio
async def test_without_a_token_a_connection_sees_its_own_requests_only() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("priv", LONG)
        assert service.rules.lookup(a.client, "priv").id == "priv"
        with pytest.raises(MessageError) as info:
            service.rules.lookup(b.client, "priv")
        assert (info.value.code, info.value.field) == ("not_found", "id")


# -- lifetimes: disconnect, detach, retention ----------------------------------------------


@pytest.mark.asyncio
async def test_disconnect_cancels_the_connections_own_requests_but_not_detached_or_others() -> None:
    async with serving(token="t") as service:
        a, b, watcher = Client(service, token="t"), Client(service, token="t"), Client(service, token="t")
        a.generate("own", LONG)
        a.generate("kept", SHORT, detach=True)
        b.generate("other", LONG)
        for rid in ("own", "kept", "other"):
            watcher.reply(type="attach", id=rid)
        own, kept, other = (service.registry.get(r) for r in ("own", "kept", "other"))
        a.close()
        assert (await watcher.until_end("own"))[-1] == {
            "type": "cancelled",
            "id": "own",
            "reason": "disconnect",
        }
        assert "own" not in service.registry
        assert (await watcher.until_end("kept"))[-1]["type"] == "done"
        assert kept.outcome == "done" and "kept" in service.registry  # retained for attach
        assert not other.ended and own.outcome == "cancelled"
        assert a.id not in service.rules.clients


@pytest.mark.asyncio
async def test_a_detached_request_survives_its_connection_and_can_be_resumed_by_id() -> None:
    async with serving() as service:
        a = Client(service)
        a.generate("resume", {**SMALL, "steps": 40}, detach=True)
        record = service.registry.get("resume")
        await wait_for(lambda: record.latest_step >= 2 and record.latest_preview() is not None, "a preview")
        a.close()
        again = Client(service)  # the reconnect: a new connection id
        replay = again.exchange(json.dumps({"type": "attach", "id": "resume"}))
        assert [m["type"] for m in replay] == ["accepted", "progress", "preview"]
        assert replay[0]["attached"] is True and replay[1]["step"] >= 2
        msgs = await again.until_end("resume")
        check_stream([replay[0], *msgs], "resume", 40, after=replay[1]["step"])
        # Nothing the replay held comes again.
        assert all(m["step"] > replay[1]["step"] for m in msgs if m["type"] == "progress")
        assert all(m["step"] > replay[2]["step"] for m in msgs if m["type"] == "preview")


@pytest.mark.asyncio
async def test_cancelling_an_ended_detached_request_is_ignored() -> None:
    async with serving() as service:
        a = Client(service)
        a.generate("fin", SHORT, detach=True)
        await a.until_end("fin")
        a.send(type="cancel", id="fin")
        assert a.pending() == []
        assert service.registry.get("fin").terminal_message().kind == "done"  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_a_detached_result_is_retained_for_retention_s_then_forgotten() -> None:
    async with serving(retention_s=0.5) as service:
        a, b = Client(service), Client(service)
        a.generate("ret", SHORT, detach=True)
        await a.until_end("ret")
        record = service.registry.get("ret")
        assert record is not None and service.health_payload()[1]["server"]["retained"] == 1
        # Within retention_s: attach replays the whole outcome.
        assert [m["type"] for m in b.exchange(json.dumps({"type": "attach", "id": "ret"}))] == [
            "accepted",
            "progress",
            "preview",
            "done",
        ]
        await wait_for(
            lambda: "ret" not in service.registry or bool(service.registry.prune()), "retention over"
        )
        assert "ret" not in service.registry
        err = reject(Client(service), "not_found", {"type": "attach", "id": "ret"})
        assert err["field"] == "id"
        assert service.health_payload()[1]["server"]["retained"] == 0


# -- attach: replay, then live -----------------------------------------------------------


@pytest.mark.asyncio
async def test_attach_to_an_ended_request_replays_final_progress_final_preview_and_done() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("end", SHORT, detach=True)
        created = await a.until_end("end")
        b.send(type="attach", id="end")
        replay = b.pending()
        assert [m["type"] for m in replay] == ["accepted", "progress", "preview", "done"]
        assert replay[0]["attached"] is True and replay[0]["preview"]["format"] == "raw"
        assert (replay[1]["step"], replay[2]["step"], replay[2]["final"]) == (20, 20, True)
        assert replay[2]["format"] == "png" and replay[3] == created[-1]


@pytest.mark.asyncio
async def test_attach_replays_the_latest_state_then_goes_live_without_duplicates_or_gaps() -> None:
    async with serving(Slow(0.01)) as service:
        a, b = Client(service), Client(service)
        a.generate("live", {**SMALL, "steps": 40}, detach=True)
        record = service.registry.get("live")
        await wait_for(lambda: record.latest_step >= 3 and record.latest_preview() is not None, "a preview")
        # No await from here to the replay: the creator's backlog, then the attach.
        a.pending()
        latest_step = record.latest_step
        latest_preview = record.latest_preview().header.step  # type: ignore[union-attr]
        b.send(type="attach", id="live")
        replay = b.pending()
        assert [m["type"] for m in replay] == ["accepted", "progress", "preview"]
        assert replay[0]["attached"] is True and replay[0]["total"] == 40
        assert replay[1]["step"] == latest_step
        assert replay[2]["step"] == latest_preview <= latest_step and replay[2]["final"] is False
        # From here both outboxes get the same puts: drained in lockstep, they match.
        live_a: list[dict[str, Any]] = []
        live_b: list[dict[str, Any]] = []
        with anyio.fail_after(WAIT_S):
            while not live_a or live_a[-1]["type"] not in TERMINAL:
                live_a.append(await a.recv())
                item = b.outbox.get_nowait()
                assert item is not None, f"b missed {live_a[-1]}"
                live_b.append(decode(item.message.wire))
        assert b.pending() == []
        assert live_b == live_a
        assert live_b[-1]["type"] == "done"
        progress = [m["step"] for m in live_b if m["type"] == "progress"]
        previews = [m["step"] for m in live_b if m["type"] == "preview"]
        assert progress and progress[0] > latest_step and progress == sorted(set(progress))
        assert previews and previews[0] > latest_preview and previews == sorted(set(previews))
        assert progress[-1] == previews[-1] == 40


@pytest.mark.asyncio
async def test_a_request_ending_error_goes_to_every_watcher_once_and_last() -> None:
    async with serving() as service:
        a, b = Client(service), Client(service)
        a.generate("boom", {**SMALL, "steps": 20, "fail_at": 5}, detach=True)
        b.exchange(json.dumps({"type": "attach", "id": "boom"}))
        for client in (a, b):
            msgs = await client.until_end("boom")
            end = msgs[-1]
            assert (end["type"], end["code"], end["id"]) == ("error", "step_failed", "boom")
            assert "step 5" in end["message"]
            assert sum(m["type"] in ("done", "cancelled", "error") for m in msgs) == 1
            assert all(m["step"] < 5 for m in msgs[:-1] if m["type"] in ("progress", "preview"))


@pytest.mark.asyncio
async def test_shutdown_lets_short_requests_finish_and_cancels_the_rest_with_reason_shutdown() -> None:
    async with serving(close_timeout_s=2.0) as service:
        a = Client(service)
        a.generate("quick", SHORT)
        a.generate("endless", LONG, detach=True)
        quick = service.registry.get("quick")
        # The grace ends as soon as "quick" is done (``forced``), not on a clock.
        forced = anyio.Event()

        async def cut_short() -> None:
            await quick.wait_ended()
            forced.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cut_short)
            with anyio.fail_after(WAIT_S):
                await service.shutdown_requests(grace_s=WAIT_S, forced=forced)
        assert (await a.until_end("quick"))[-1]["type"] == "done"
        assert (await a.until_end("endless"))[-1] == {
            "type": "cancelled",
            "id": "endless",
            "reason": "shutdown",
        }
        assert service.registry.running() == []


# -- ordering and what is never dropped ------------------------------------------------------


@pytest.mark.asyncio
async def test_each_preview_right_after_its_progress_and_the_final_preview_right_before_done() -> None:
    async with serving() as service:
        a = Client(service)
        acc = a.generate("ord", {**SMALL, "steps": 30}, preview={"every": 1, "format": "raw"})
        msgs = await a.until_end("ord")
        check_stream([acc, *msgs], "ord", 30)
        previews = [m for m in msgs if m["type"] == "preview"]
        assert len(previews) >= 2
        for m in previews[:-1]:
            assert (m["final"], m["format"], m["mime"]) == (False, "raw", "application/octet-stream")
            assert (m["width"], m["height"], m["nbytes"]) == (16, 16, 16 * 16 * 3)
        final = previews[-1]
        assert (final["final"], final["format"], final["mime"]) == (True, "png", "image/png")
        assert (final["width"], final["height"]) == (16, 16)


@pytest.mark.asyncio
async def test_every_n_previews_at_most_every_nth_step_and_always_the_final() -> None:
    async with serving() as service:
        a = Client(service)
        acc = a.generate("ev", {**SMALL, "steps": 20}, preview={"every": 7, "format": "raw"})
        msgs = await a.until_end("ev")
        check_stream([acc, *msgs], "ev", 20)
        steps = [m["step"] for m in msgs if m["type"] == "preview"]
        assert steps[-1] == 20 and all(s % 7 == 0 for s in steps[:-1])


@pytest.mark.asyncio
async def test_final_preview_and_outcome_reach_a_watcher_whose_outbox_is_full_of_previews() -> None:
    # The outbox is filled to its byte bound with intermediate previews (of
    # other requests, as a fan-out would leave them), then four requests run
    # with nobody reading. "n0" ends first; the other three go on putting
    # previews into the full outbox after its final preview and ``done`` are
    # queued: those must stay (previews give way instead) and the client is
    # not closed.
    bound = 4000
    totals = {"n0": 10, "n1": 40, "n2": 40, "n3": 40}
    async with serving() as service:
        a = Client(service, max_pending_bytes=bound)
        filler = [
            Preview.build(
                PreviewHeader(
                    id=f"other{i}",
                    step=1,
                    total=9,
                    final=False,
                    format="raw",
                    width=16,
                    height=16,
                    mime="application/octet-stream",
                ),
                bytes(768),
            )
            for i in range(4)
        ]
        for i, frame in enumerate(filler):
            a.outbox.put(frame, latest_key=(f"other{i}", "preview"))
        assert a.outbox.pending_bytes > bound - len(filler[0].wire)  # no room for one more
        for rid, total in totals.items():
            a.send(type="generate", id=rid, params={**SMALL, "steps": total}, preview=RAW)
        records = [service.registry.get(rid) for rid in totals]
        await wait_for(lambda: all(r is not None and r.ended for r in records), "all to end")
        assert not a.outbox.overflowed
        msgs = a.pending()
        assert sum(m["id"].startswith("other") for m in msgs) < len(filler), "nothing gave way"
        for rid, total in totals.items():
            mine = [m for m in msgs if m["id"] == rid]
            check_stream(mine, rid, total)
            assert sum(m["type"] == "preview" and not m["final"] for m in mine) <= 1


@pytest.mark.asyncio
async def test_a_slow_reader_sees_fewer_steps_never_stale_ones_nor_out_of_order() -> None:
    async with serving(Slow(0.002)) as service:
        a = Client(service)
        acc = a.generate("slow", {**SMALL, "steps": 60})
        record = service.registry.get("slow")
        msgs: list[dict[str, Any]] = []
        with anyio.fail_after(WAIT_S):
            while not msgs or msgs[-1]["type"] not in TERMINAL:
                # Read only after the request moved on: latest wins meanwhile.
                step = record.latest_step
                await wait_for(lambda s=step: record.latest_step > s or record.ended, "a step")
                msgs.append(await a.recv())
        check_stream([acc, *msgs], "slow", 60)


# -- queue positions and health ----------------------------------------------------------


@pytest.mark.asyncio
async def test_queue_positions_by_granted_priority_then_arrival_for_requests_not_yet_stepped() -> None:
    # Room in the engine for all five: the engine's own order (the gate's is
    # tested below). The engine ranks every request it holds, whoever's, so
    # it is given only the priority a principal may use against others (its
    # token's grant): here "high" and "low" carry their own up to it.
    async with serving(max_active=16, token=Tokens([TokenGrant("ops", "s", priority=5)])) as service:
        a = Client(service, token="s")
        a.generate("first", LONG)
        await wait_for(lambda: service.registry.get("first").latest_step >= 1, "a step")
        assert service.rules.queue_positions() == {}
        # No await between the generates and the check: none can have stepped.
        a.generate("low", LONG, priority=-3)
        a.generate("mid", LONG)
        a.generate("high", LONG, priority=5)
        a.generate("mid2", LONG)
        assert service.rules.queue_positions() == {"high": 0, "low": 1, "mid": 2, "mid2": 3}
        await wait_for(lambda: service.rules.queue_positions() == {}, "every request to step")


@pytest.mark.asyncio
async def test_health_payload_ok_with_counts() -> None:
    async with serving() as service:
        a = Client(service)
        Client(service)
        a.generate("h1", LONG)
        a.generate("h2", SHORT, detach=True)
        code, body = service.health_payload()
        assert (code, body["status"], body["ok"], body["reason"]) == (200, "ok", True, None)
        assert body["device"] == "cpu"
        assert body["server"] == {"connections": 2, "principals": 2, "requests": 2, "retained": 1}
        # max_active's default on the CPU device (limits.HOST_ACTIVE_PER_ENGINE).
        assert body["load"] == {"active": 2, "queued": 0, "max_active": 4, "max_queued": 128}


@pytest.mark.asyncio
async def test_health_payload_busy_is_200_and_ok_with_retry_after() -> None:
    async with serving(max_active=1, max_queued=1) as service:
        a = Client(service)
        a.generate("b0", LONG)
        a.generate("b1", LONG)
        code, body = service.health_payload()
        assert (code, body["status"], body["ok"]) == (200, "busy", True)
        assert "max_active + max_queued" in body["reason"]
        load = body["load"]
        assert {k: load[k] for k in ("active", "queued", "max_active", "max_queued")} == {
            "active": 1,
            "queued": 1,
            "max_active": 1,
            "max_queued": 1,
        }
        assert 1 <= load["retry_after_s"] <= 60


@pytest.mark.asyncio
async def test_health_payload_shutting_down_is_503() -> None:
    async with serving() as service:
        service.begin_shutdown()
        code, body = service.health_payload()
        assert (code, body["status"], body["ok"]) == (503, "shutting_down", False)
        assert body["reason"] == "the server is shutting down"
