"""protocol/server_messages.py: accepted ... error, built by the server and parsed by the client."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_stream.errors import ProtocolError
from omni_stream.protocol import MAX_ECHO, MAX_ERROR_MESSAGE
from omni_stream.protocol.server_messages import (
    SERVER_MESSAGES,
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Queued,
    Paused,
    Progress,
    Restarted,
    Resumed,
    ServerMessage,
    parse_server_message,
)

PREVIEW = {"every": 1, "format": "jpeg", "max_size": 512, "quality": 85, "decoder": "rgb", "video": "strip"}

# ---- the wire bytes: what the server sent before these classes, it sends now ---------


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (
            Accepted.build("r-1", total=30, detach=True, attached=False, preview=PREVIEW,
                           output={"format": "png", "quality": None}),
            '{"type":"accepted","id":"r-1","total":30,"detach":true,"attached":false,'
            '"preview":{"every":1,"format":"jpeg","max_size":512,"quality":85,"decoder":"rgb",'
            '"video":"strip"},"output":{"format":"png","quality":null}}',
        ),
        (
            Accepted.build("r-1", total=30, detach=False, attached=True, preview={"every": 2}),
            '{"type":"accepted","id":"r-1","total":30,"detach":false,"attached":true,"preview":{"every":2}}',
        ),
        (
            Accepted.build("r-1", total=3, detach=False, attached=False, preview={}, seed=7, model="sd"),
            '{"type":"accepted","id":"r-1","total":3,"detach":false,"attached":false,"preview":{},'
            '"seed":7,"model":"sd"}',
        ),
        (Loading.build("r-1", model="sd"), '{"type":"loading","id":"r-1","model":"sd"}'),
        (
            Restarted.build("r-1", from_step=10, reason="checkpoint"),
            '{"type":"restarted","id":"r-1","from_step":10,"reason":"checkpoint"}',
        ),
        (
            Progress.build("r-1", step=12, total=30, eta_s=1.23456),
            '{"type":"progress","id":"r-1","step":12,"total":30,"eta_s":1.235}',
        ),
        (
            Done.build("r-1", total=30, elapsed_s=4.56789),
            '{"type":"done","id":"r-1","total":30,"elapsed_s":4.568}',
        ),
        (Cancelled.build("r-1", reason="client"), '{"type":"cancelled","id":"r-1","reason":"client"}'),
        (
            ErrorMessage.build(
                "busy", "server busy; try again in about 2 s", request_id="r-1", retry_after_s=2.0
            ),
            '{"type":"error","code":"busy","message":"server busy; try again in about 2 s","id":"r-1",'
            '"retry_after_s":2.0}',
        ),
        (
            ErrorMessage.build("invalid_field", "detach must be true or false, got a string",
                               request_id="r-1", field="detach"),
            '{"type":"error","code":"invalid_field","message":"detach must be true or false, got a string",'
            '"id":"r-1","field":"detach"}',
        ),
        (
            ErrorMessage.build("bad_params", "caf\u00e9 \u4e2d", field="prompt"),
            '{"type":"error","code":"bad_params","message":"caf\\u00e9 \\u4e2d","field":"prompt"}',
        ),
    ],
    ids=["accepted", "accepted-no-output", "accepted-model", "loading", "restarted", "progress", "done",
         "cancelled", "error-busy", "error-field", "error-non-ascii"],
)
def test_the_wire_bytes_are_pinned(message: ServerMessage, text: str) -> None:
    assert message.serialize() == text
    assert message.to_dict() == json.loads(text)


# ---- server builds -> client parses ------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        Accepted.build("r", total=3, detach=True, attached=False, preview=PREVIEW, output={"format": "png"}),
        Accepted.build("r", total=1, detach=False, attached=True, preview={}),
        Accepted.build("r", total=1, detach=False, attached=False, preview={}, model="mix"),
        Loading.build("r", model="mix"),
        Queued.build("r", position=0),
        Queued.build("r", position=17),
        Paused.build("r", step=2),
        Paused.build("r", step=2, reason="client"),
        Resumed.build("r", step=2, reason="max_pause"),
        Resumed.build("r", step=2, reason="preempted"),
        Restarted.build("r", from_step=0, reason="no_checkpoint"),
        Restarted.build("r", from_step=0, reason="cannot_resume"),
        Restarted.build("r", from_step=5, reason="replica_lost"),
        Progress.build("r", step=2, total=3, eta_s=0.5),
        Progress.build("r", step=3, total=3, eta_s=0),
        Done.build("r", total=3, elapsed_s=2),
        Done.build("r", total=3, elapsed_s=0.0004),
        Cancelled.build("r", reason="disconnect"),
        ErrorMessage.build("not_found", "no", request_id="r", field="id"),
        ErrorMessage.build("bad_json", "invalid JSON"),
        ErrorMessage.build("busy", "full", request_id="r", retry_after_s=60),
    ],
)
def test_what_the_server_builds_the_client_parses_back_equal(message: ServerMessage) -> None:
    assert parse_server_message(message.serialize()) == message
    assert type(message).from_dict(message.to_dict()) == message


def test_every_type_is_registered_under_its_own_name() -> None:
    assert {name: cls.TYPE for name, cls in SERVER_MESSAGES.items()} == {
        name: name for name in ("accepted", "queued", "loading", "paused", "resumed", "restarted", "progress", "done",
                                 "cancelled", "error")
    }


# ---- the server's rules ------------------------------------------------------------------


def test_progress_eta_is_clamped_and_rounded() -> None:
    assert Progress.build("a", step=1, total=3, eta_s=-0.5).eta_s == 0.0
    assert Progress.build("a", step=1, total=3, eta_s=1.23456).eta_s == 1.235


def test_done_elapsed_is_rounded() -> None:
    assert Done.build("a", total=3, elapsed_s=2.0004).elapsed_s == 2.0


def test_undocumented_reasons_and_codes_are_refused_by_the_server() -> None:
    with pytest.raises(ValueError):
        Cancelled.build("a", reason="bored")
    with pytest.raises(ValueError):
        Paused.build("a", step=1, reason="bored")
    with pytest.raises(ValueError):
        Resumed.build("a", step=1, reason="bored")
    with pytest.raises(ValueError):
        ErrorMessage.build("oops", "not a documented code")
    with pytest.raises(ValueError):
        Progress.build("a", step=1, total=3, eta_s=float("inf")).serialize()


def test_an_error_clips_what_a_client_sent() -> None:
    wide = "\u4e2d" * 300_000
    message = ErrorMessage.build("bad_params", f"unknown param(s) '{wide}'", field=wide)
    assert message.field is not None and len(message.field) <= MAX_ECHO + 3
    assert len(message.message) <= MAX_ERROR_MESSAGE + 3
    # Even escaped (each of these is \\uXXXX on the wire) it is a few KB, not MBs.
    assert len(message.serialize()) < 4 * 1024


def test_accepted_keeps_its_own_copy_of_the_settings() -> None:
    preview = {"every": 1}
    message = Accepted.build("a", total=3, detach=False, attached=False, preview=preview)
    preview["every"] = 2
    message.to_dict()["preview"]["every"] = 3
    assert message.preview == {"every": 1}


# ---- the client's strictness --------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"id": "a"}, "has no 'type'"),
        ({"type": 3}, "'type' must be a str"),
        ({"type": "progress", "id": "a", "step": 1, "total": 2}, "has no 'eta_s'"),
        ({"type": "progress", "id": "a", "step": 1, "total": 2, "eta_s": -1}, "negative eta_s"),
        ({"type": "progress", "id": "a", "step": 3, "total": 2, "eta_s": 0}, "step 3 of 2"),
        ({"type": "progress", "id": "a", "step": True, "total": 2, "eta_s": 0}, "'step' must be a int"),
        ({"type": "accepted", "id": "a", "total": 2, "detach": False, "attached": False}, "has no 'preview'"),
        ({"type": "accepted", "id": "a", "total": 0, "detach": False, "attached": False, "preview": {}},
         "total 0"),
        ({"type": "accepted", "id": "a", "total": 2, "detach": 0, "attached": False, "preview": {}},
         "'detach' must be a bool"),
        ({"type": "accepted", "id": "a", "total": 2, "detach": False, "attached": False, "preview": {},
          "output": "png"}, "'output' must be a object"),
        ({"type": "done", "id": "a", "total": 2, "elapsed_s": "1"}, "must be a number"),
        ({"type": "cancelled", "id": "a b", "reason": "client"}, "malformed id"),
        ({"type": "cancelled", "id": "..", "reason": "client"}, "malformed id"),
        ({"type": "cancelled", "id": "a"}, "has no 'reason'"),
        ({"type": "error", "message": "x"}, "has no 'code'"),
        ({"type": "error", "code": "x", "message": "m", "field": 3}, "'field' must be a str"),
        ({"type": "error", "code": "x", "message": "m", "retry_after_s": -1}, "negative retry_after_s"),
        ({"type": "error", "code": "x", "message": "m", "retry_after_s": "soon"}, "retry_after_s"),
    ],
)
def test_the_client_refuses_malformed_messages_naming_the_field(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_server_message(json.dumps(obj))


@pytest.mark.parametrize("text", ["{", "[]", '"accepted"', "[" * 100_000])
def test_the_client_refuses_text_that_is_not_a_json_object(text: str) -> None:
    with pytest.raises(ProtocolError, match="server message"):
        parse_server_message(text)


def test_the_client_accepts_what_a_newer_server_may_add() -> None:
    assert parse_server_message('{"type": "hello", "id": "a"}') is None
    assert parse_server_message(
        '{"type": "error", "code": "brand_new", "message": "m", "added": 1}'
    ) == ErrorMessage("brand_new", "m", None, None)
    assert parse_server_message(
        '{"type": "cancelled", "id": "a", "reason": "maintenance"}'
    ) == Cancelled("a", "maintenance")


def test_from_dict_parses_one_type_only() -> None:
    with pytest.raises(ProtocolError, match="expected a 'done' message, got 'cancelled'"):
        Done.from_dict({"type": "cancelled", "id": "a", "reason": "client"})


def test_restarted_is_built_with_a_documented_reason_and_a_step_of_0_or_more() -> None:
    with pytest.raises(ValueError, match="restart reason"):
        Restarted.build("r", from_step=3, reason="because")
    with pytest.raises(ValueError, match="from_step"):
        Restarted.build("r", from_step=-1, reason="checkpoint")


def test_restarted_is_parsed_strictly_but_takes_a_newer_servers_reason() -> None:
    newer = parse_server_message('{"type":"restarted","id":"r","from_step":4,"reason":"moved"}')
    assert newer == Restarted("r", 4, "moved")
    for text, field in (
        ('{"type":"restarted","id":"r","reason":"checkpoint"}', "from_step"),
        ('{"type":"restarted","id":"r","from_step":-2,"reason":"checkpoint"}', "from_step"),
        ('{"type":"restarted","id":"r","from_step":1}', "reason"),
    ):
        with pytest.raises(ProtocolError, match=field):
            parse_server_message(text)


def test_queued_refuses_a_negative_position() -> None:
    with pytest.raises(ValueError, match="negative"):
        Queued.build("r", position=-1)
    with pytest.raises(ProtocolError, match="position -2"):
        Queued.from_dict({"type": "queued", "id": "r", "position": -2})
