"""protocol/messages.py: the server's functions over the message classes keep their names and results."""

from __future__ import annotations

import pytest

from omni_stream import protocol
from omni_stream.protocol import messages
from omni_stream.protocol.server_messages import Accepted, Cancelled, Done, ErrorMessage, Progress

# What the server package imports from omni_stream.protocol (see its modules).
SERVER_NAMES = [
    "accepted", "progress", "done", "cancelled", "error", "dumps", "pack_preview", "unpack_preview",
    "PreviewHeader", "parse_client_message", "parse_client_object", "decode_json", "check_id", "clip",
    "MessageError", "Generate", "Cancel", "Attach", "ClientMessage",
]


def test_the_servers_names_are_all_still_here() -> None:
    for name in SERVER_NAMES + messages.__all__:
        assert hasattr(protocol, name), name
        assert name in protocol.__all__, name
    assert set(messages.__all__) >= set(SERVER_NAMES)


def test_builders_match_the_docs() -> None:
    assert protocol.accepted("a", total=3, detach=False, attached=True, preview={"every": 1}) == {
        "type": "accepted",
        "id": "a",
        "total": 3,
        "detach": False,
        "attached": True,
        "preview": {"every": 1},
    }
    assert protocol.accepted(
        "a", total=3, detach=False, attached=True, preview={}, output={"format": "png"}
    )["output"] == {"format": "png"}
    assert protocol.progress("a", step=1, total=3, eta_s=-0.5)["eta_s"] == 0.0
    assert protocol.progress("a", step=1, total=3, eta_s=1.23456) == {
        "type": "progress",
        "id": "a",
        "step": 1,
        "total": 3,
        "eta_s": 1.235,
    }
    assert protocol.done("a", total=3, elapsed_s=2.0) == {
        "type": "done",
        "id": "a",
        "total": 3,
        "elapsed_s": 2.0,
    }
    assert protocol.cancelled("a", reason="disconnect") == {
        "type": "cancelled",
        "id": "a",
        "reason": "disconnect",
    }
    assert protocol.error("not_found", "no", request_id="a", field="id") == {
        "type": "error",
        "code": "not_found",
        "message": "no",
        "id": "a",
        "field": "id",
    }
    assert "id" not in protocol.error("bad_json", "no")


def test_each_builder_is_its_classes_build() -> None:
    preview = {"every": 2, "format": "raw"}
    assert protocol.accepted("a", total=3, detach=True, attached=False, preview=preview) == (
        Accepted.build("a", total=3, detach=True, attached=False, preview=preview).to_dict()
    )
    assert protocol.progress("a", step=1, total=3, eta_s=0.1234) == (
        Progress.build("a", step=1, total=3, eta_s=0.1234).to_dict()
    )
    assert protocol.done("a", total=3, elapsed_s=1.0) == Done.build("a", total=3, elapsed_s=1.0).to_dict()
    assert protocol.cancelled("a", reason="engine") == Cancelled.build("a", reason="engine").to_dict()
    assert protocol.error("busy", "full", request_id="a") == (
        ErrorMessage.build("busy", "full", request_id="a").to_dict()
    )


def test_the_server_may_extend_what_a_builder_returns() -> None:
    # service.py adds busy's retry_after_s to the dict: the wire keeps it last.
    reply = protocol.error("busy", "full", request_id="x")
    reply["retry_after_s"] = 2.5
    assert protocol.dumps(reply) == (
        '{"type":"error","code":"busy","message":"full","id":"x","retry_after_s":2.5}'
    )
    built = ErrorMessage.build("busy", "full", request_id="x", retry_after_s=2.5)
    assert protocol.dumps(reply) == built.serialize()


def test_builders_refuse_undocumented_values() -> None:
    with pytest.raises(ValueError):
        protocol.cancelled("a", reason="bored")
    with pytest.raises(ValueError):
        protocol.error("oops", "not a documented code")
    with pytest.raises(ValueError):
        protocol.dumps({"eta_s": float("nan")})


def test_error_clips_what_others_echo() -> None:
    # Errors built outside the protocol (model params, admission) may echo
    # client input in full: the wire message is clipped where it is built.
    wide = "\u4e2d" * 300_000
    message = protocol.error("bad_params", f"unknown param(s) '{wide}'", field=wide)
    reply = protocol.dumps(message)
    assert len(message["field"]) <= protocol.MAX_ECHO + 3
    assert len(message["message"]) <= protocol.MAX_ERROR_MESSAGE + 3
    # Even escaped (each of these is \\uXXXX on the wire) it is a few KB, not MBs.
    assert len(reply) < 4 * 1024


def test_an_unknown_key_in_a_rejected_message_makes_a_small_reply() -> None:
    key = "k" * 500_000
    with pytest.raises(protocol.MessageError) as info:
        protocol.parse_client_object({"type": "generate", "params": {}, key: 1})
    exc = info.value
    assert len(protocol.dumps(protocol.error(exc.code, exc.message, field=exc.field))) < 1024


def test_the_id_rule_is_the_shared_one() -> None:
    from omni_stream import ids

    assert protocol.ID_PATTERN is ids.ID_PATTERN and protocol.MAX_ID_LENGTH == ids.MAX_ID_LENGTH
    with pytest.raises(protocol.MessageError, match="not '.' or '..'"):
        protocol.check_id("..")
