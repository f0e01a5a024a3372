"""The wire format: client message parsing, server message builders, binary previews."""

from __future__ import annotations

import json
import struct

import pytest

from omni_stream import protocol
from omni_stream.errors import ParamsError
from omni_stream.protocol import (
    Attach,
    Cancel,
    Generate,
    MessageError,
    PreviewHeader,
    pack_preview,
    parse_client_message,
    unpack_preview,
)


def parse(obj: object) -> protocol.ClientMessage:
    return parse_client_message(json.dumps(obj))


def test_generate_minimal_and_full() -> None:
    assert parse({"type": "generate", "params": {}}) == Generate(
        id=None, params={}, preview=None, detach=False
    )
    msg = parse(
        {
            "type": "generate",
            "id": "req-1.a:b_c",
            "params": {"steps": 3},
            "preview": {"every": 2},
            "detach": True,
        }
    )
    assert msg == Generate(id="req-1.a:b_c", params={"steps": 3}, preview={"every": 2}, detach=True)


def test_null_id_means_server_made() -> None:
    assert parse({"type": "generate", "id": None, "params": {}}).id is None


def test_cancel_and_attach() -> None:
    assert parse({"type": "cancel", "id": "x"}) == Cancel("x")
    assert parse({"type": "attach", "id": "x"}) == Attach("x")


def test_message_error_is_a_params_error() -> None:
    # Callers that handle ParamsError for bad input also handle these.
    with pytest.raises(ParamsError):
        parse_client_message("{")


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        (b'{"type": "cancel", "id": "x"}', "bad_message", None),
        ("not json", "bad_json", None),
        ('{"type": "generate", "params": {"x": NaN}}', "bad_json", None),
        ("[" * 100_000, "bad_json", None),
        ("[1, 2]", "bad_message", None),
        ('"generate"', "bad_message", None),
        ("{}", "invalid_field", "type"),
        ('{"type": 3}', "invalid_field", "type"),
        ('{"type": "explode"}', "unknown_type", "type"),
        ('{"type": "generate"}', "invalid_field", "params"),
        ('{"type": "generate", "params": []}', "invalid_field", "params"),
        ('{"type": "generate", "params": null}', "invalid_field", "params"),
        ('{"type": "generate", "params": {}, "detatch": true}', "invalid_field", "detatch"),
        ('{"type": "generate", "params": {}, "detach": "yes"}', "invalid_field", "detach"),
        ('{"type": "generate", "params": {}, "preview": "jpeg"}', "invalid_field", "preview"),
        ('{"type": "generate", "params": {}, "id": 7}', "invalid_field", "id"),
        ('{"type": "generate", "params": {}, "id": ""}', "invalid_field", "id"),
        ('{"type": "generate", "params": {}, "id": "a b"}', "invalid_field", "id"),
        ('{"type": "generate", "params": {}, "id": "' + "x" * 129 + '"}', "invalid_field", "id"),
        ('{"type": "cancel"}', "invalid_field", "id"),
        ('{"type": "attach", "id": ["x"]}', "invalid_field", "id"),
        ('{"type": "cancel", "id": "x", "params": {}}', "invalid_field", "params"),
    ],
)
def test_bad_messages_name_the_problem(data: str | bytes, code: str, field: str | None) -> None:
    with pytest.raises(MessageError) as info:
        parse_client_message(data)
    assert info.value.code == code
    assert info.value.field == field
    assert info.value.message
    assert code in protocol.REJECTION_CODES


def test_error_carries_the_id_when_valid() -> None:
    with pytest.raises(MessageError) as info:
        parse({"type": "generate", "id": "mine", "params": 3})
    assert info.value.request_id == "mine"
    with pytest.raises(MessageError) as info:
        parse({"type": "generate", "id": "not valid!", "params": {}})
    assert info.value.request_id is None


def test_builders_match_the_docs() -> None:
    assert protocol.accepted("a", total=3, detach=False, attached=True, preview={"every": 1}) == {
        "type": "accepted",
        "id": "a",
        "total": 3,
        "detach": False,
        "attached": True,
        "preview": {"every": 1},
    }
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


def test_builders_refuse_undocumented_values() -> None:
    with pytest.raises(ValueError):
        protocol.cancelled("a", reason="bored")
    with pytest.raises(ValueError):
        protocol.error("oops", "not a documented code")
    with pytest.raises(ValueError):
        protocol.dumps({"eta_s": float("nan")})


def test_error_code_sets_do_not_overlap() -> None:
    assert not protocol.REJECTION_CODES & protocol.REQUEST_ENDING_CODES


def test_preview_frame_layout() -> None:
    header = PreviewHeader(
        id="a", step=2, total=5, final=False, format="raw", width=2, height=1,
        mime="application/octet-stream",
    )
    image = bytes(range(6))
    frame = pack_preview(header, image)
    (length,) = struct.unpack(">I", frame[:4])
    head = json.loads(frame[4 : 4 + length].decode("utf-8"))
    assert head == {
        "id": "a", "step": 2, "total": 5, "final": False, "format": "raw",
        "width": 2, "height": 1, "mime": "application/octet-stream",
    }
    assert frame[4 + length :] == image
    back, view = unpack_preview(frame)
    assert back == header and bytes(view) == image


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x00\x00", struct.pack(">I", 50) + b"{}", struct.pack(">I", 2) + b"{}", struct.pack(">I", 3) + b"nop"],
)
def test_unpack_rejects_broken_frames(frame: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_preview(frame)


# -- replies stay small whatever the client sent ---------------------------------------


def test_an_unknown_key_is_echoed_only_as_a_prefix() -> None:
    key = "k" * 500_000
    with pytest.raises(MessageError) as info:
        parse_client_message(json.dumps({"type": "generate", "params": {}, key: 1}))
    exc = info.value
    reply = protocol.dumps(protocol.error(exc.code, exc.message, field=exc.field))
    assert len(reply) < 1024
    assert exc.field is not None and exc.field.startswith("kkkk") and len(exc.field) <= 70


def test_many_unknown_keys_are_counted_not_listed() -> None:
    obj = {"type": "cancel", "id": "x", **{f"extra{i:05}": 1 for i in range(10_000)}}
    with pytest.raises(MessageError) as info:
        parse_client_message(json.dumps(obj))
    assert "and 9997 more" in info.value.message
    assert len(info.value.message) < 300


def test_error_clips_what_others_echo() -> None:
    # Errors built outside this module (model params, admission) may echo
    # client input in full: the wire message is clipped where it is built.
    wide = "\u4e2d" * 300_000
    message = protocol.error("bad_params", f"unknown param(s) '{wide}'", field=wide)
    reply = protocol.dumps(message)
    assert len(message["field"]) <= protocol.MAX_ECHO + 3
    assert len(message["message"]) <= protocol.MAX_ERROR_MESSAGE + 3
    # Even escaped (each of these is \\uXXXX on the wire) it is a few KB, not MBs.
    assert len(reply) < 4 * 1024


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ('{"type": "generate", "params": {"steps": ' + "9" * 5000 + "}}", "integer literal is too long"),
        ("[" * 100_000, "nested too deeply"),
        ("not json", "invalid JSON at line 1 column 1"),
        ('{"type": "cancel",\n "id": }', "invalid JSON at line 2 column 8"),
        ('{"x": NaN}', "NaN is not valid JSON"),
    ],
    ids=["huge-int", "deep", "not-json", "line-2", "nan"],
)
def test_bad_json_says_what_in_json_terms(data: str, expected: str) -> None:
    with pytest.raises(MessageError) as info:
        parse_client_message(data)
    message = info.value.message
    assert info.value.code == "bad_json"
    assert expected in message
    for internal in ("sys.", "set_int_max_str_digits", "recursion", "Exceeds the limit", "(char "):
        assert internal not in message, message
