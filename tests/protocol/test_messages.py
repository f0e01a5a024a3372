"""The server's messages: each class's ``build`` applies the wire's rules; ``.wire`` is what is sent."""

from __future__ import annotations

import json

import pytest

from omni_stream import protocol
from omni_stream.protocol import messages
from omni_stream.protocol.server_messages import (
    Accepted,
    Cancelled,
    Done,
    ErrorMessage,
    Loading,
    Paused,
    Progress,
    Restarted,
    Resumed,
)

# What the server package imports from omni_stream.protocol (see its modules).
SERVER_NAMES = [
    "Accepted", "Progress", "Done", "Cancelled", "ErrorMessage", "Loading", "Paused", "Resumed",
    "Restarted", "ServerMessage", "Preview", "PreviewHeader", "Cell", "dumps", "pack_preview",
    "unpack_preview", "parse_client_message", "parse_client_object", "decode_json", "check_id", "clip",
    "MessageError", "Generate", "Cancel", "Attach", "Pause", "Resume", "ClientMessage",
    "CANCEL_REASONS", "PAUSE_REASONS", "RESUME_REASONS", "RESTART_REASONS",
]

#: The dict builders that issue #36 replaced with the classes' ``build``: gone, not shadowing them.
REMOVED_SHIMS = [
    "accepted", "progress", "done", "cancelled", "error", "paused", "resumed", "restarted", "loading",
]


def test_the_servers_names_are_all_still_here() -> None:
    for name in SERVER_NAMES + messages.__all__:
        assert hasattr(protocol, name), name
        assert name in protocol.__all__, name
    for name in REMOVED_SHIMS:
        assert not hasattr(protocol, name), name
        assert not hasattr(messages, name), name


def test_builders_match_the_docs() -> None:
    assert Accepted.build("a", total=3, detach=False, attached=True, preview={"every": 1}).to_dict() == {
        "type": "accepted",
        "id": "a",
        "total": 3,
        "detach": False,
        "attached": True,
        "preview": {"every": 1},
    }
    assert Accepted.build(
        "a", total=3, detach=False, attached=True, preview={}, output={"format": "png"}
    ).to_dict()["output"] == {"format": "png"}
    assert Progress.build("a", step=1, total=3, eta_s=-0.5).eta_s == 0.0
    assert Progress.build("a", step=1, total=3, eta_s=1.23456).to_dict() == {
        "type": "progress",
        "id": "a",
        "step": 1,
        "total": 3,
        "eta_s": 1.235,
    }
    assert Done.build("a", total=3, elapsed_s=2.0).to_dict() == {
        "type": "done",
        "id": "a",
        "total": 3,
        "elapsed_s": 2.0,
    }
    assert Done.build("a", total=3, elapsed_s=2.00049).elapsed_s == 2.0
    assert Cancelled.build("a", reason="disconnect").to_dict() == {
        "type": "cancelled",
        "id": "a",
        "reason": "disconnect",
    }
    assert ErrorMessage.build("not_found", "no", request_id="a", field="id").to_dict() == {
        "type": "error",
        "code": "not_found",
        "message": "no",
        "id": "a",
        "field": "id",
    }
    assert "id" not in ErrorMessage.build("bad_json", "no").to_dict()
    assert Loading.build("a", model="sd").to_dict() == {"type": "loading", "id": "a", "model": "sd"}
    assert Paused.build("a", step=2, reason="client").to_dict() == {
        "type": "paused", "id": "a", "step": 2, "reason": "client",
    }
    assert Resumed.build("a", step=2, reason="client").to_dict() == {
        "type": "resumed", "id": "a", "step": 2, "reason": "client",
    }
    reason = sorted(protocol.RESTART_REASONS)[0]
    assert Restarted.build("a", from_step=2, reason=reason).to_dict() == {
        "type": "restarted", "id": "a", "from_step": 2, "reason": reason,
    }


def test_the_wire_is_the_serialized_message_encoded_once() -> None:
    built = [
        Accepted.build("a", total=3, detach=True, attached=False, preview={"every": 2, "format": "raw"}),
        Progress.build("a", step=1, total=3, eta_s=0.1234),
        Done.build("a", total=3, elapsed_s=1.0),
        Cancelled.build("a", reason="engine"),
        ErrorMessage.build("busy", "full", request_id="a", retry_after_s=1.5),
        Loading.build("a", model="sd"),
    ]
    for message in built:
        assert message.kind == message.TYPE == message.to_dict()["type"]
        assert message.wire == message.serialize() == protocol.dumps(message.to_dict())
        assert json.loads(message.wire) == message.to_dict()
        assert message.wire is message.wire  # cached: a fan-out encodes it once
        # The cache is not state: equal messages stay equal, and parse back to themselves.
        assert protocol.parse_server_message(message.wire) == message
    assert Progress.build("a", step=1, total=3, eta_s=0.1234).wire == (
        '{"type":"progress","id":"a","step":1,"total":3,"eta_s":0.123}'
    )


def test_busys_retry_after_s_comes_last_on_the_wire() -> None:
    built = ErrorMessage.build("busy", "full", request_id="x", retry_after_s=2.5)
    assert built.wire == '{"type":"error","code":"busy","message":"full","id":"x","retry_after_s":2.5}'
    assert built.retry_after_s == 2.5 and built.to_dict()["retry_after_s"] == 2.5


def test_builders_refuse_undocumented_values() -> None:
    with pytest.raises(ValueError):
        Cancelled.build("a", reason="bored")
    with pytest.raises(ValueError):
        ErrorMessage.build("oops", "not a documented code")
    with pytest.raises(ValueError):
        Paused.build("a", step=1, reason="bored")
    with pytest.raises(ValueError):
        Resumed.build("a", step=1, reason="bored")
    with pytest.raises(ValueError):
        Restarted.build("a", from_step=1, reason="bored")
    with pytest.raises(ValueError):
        protocol.dumps({"eta_s": float("nan")})


def test_error_clips_what_others_echo() -> None:
    # Errors built outside the protocol (model params, admission) may echo
    # client input in full: the wire message is clipped where it is built.
    wide = "\u4e2d" * 300_000
    message = ErrorMessage.build("bad_params", f"unknown param(s) '{wide}'", field=wide)
    reply = message.wire
    assert message.field is not None and len(message.field) <= protocol.MAX_ECHO + 3
    assert len(message.message) <= protocol.MAX_ERROR_MESSAGE + 3
    # Even escaped (each of these is \\uXXXX on the wire) it is a few KB, not MBs.
    assert len(reply) < 4 * 1024


def test_an_unknown_key_in_a_rejected_message_makes_a_small_reply() -> None:
    key = "k" * 500_000
    with pytest.raises(protocol.MessageError) as info:
        protocol.parse_client_object({"type": "generate", "params": {}, key: 1})
    exc = info.value
    assert len(ErrorMessage.build(exc.code, exc.message, field=exc.field).wire) < 1024


def test_the_id_rule_is_the_shared_one() -> None:
    from omni_stream import ids

    assert protocol.ID_PATTERN is ids.ID_PATTERN and protocol.MAX_ID_LENGTH == ids.MAX_ID_LENGTH
    with pytest.raises(protocol.MessageError, match="not '.' or '..'"):
        protocol.check_id("..")
