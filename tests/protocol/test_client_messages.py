"""protocol/client_messages.py: generate, cancel, attach, built by the client and parsed by the server."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from omni_stream.errors import MessageError, ParamsError
from omni_stream.protocol import REJECTION_CODES
from omni_stream.protocol.client_messages import (
    CLIENT_MESSAGES,
    Attach,
    Cancel,
    ClientMessage,
    Generate,
    check_id,
    check_request_id,
    parse_client_message,
    parse_client_object,
)


def parse(obj: object) -> ClientMessage:
    return parse_client_message(json.dumps(obj))


# ---- the wire bytes: what a client sent before these classes, it sends now ---------


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (
            Generate.build(
                "r-1", {"prompt": "red circle", "steps": 30, "seed": 7}, {"every": 1, "format": "jpeg"},
                detach=True, output={"format": "png"}, priority=-3,
            ),
            '{"type":"generate","id":"r-1","params":{"prompt":"red circle","steps":30,"seed":7},'
            '"detach":true,"preview":{"every":1,"format":"jpeg"},"output":{"format":"png"},"priority":-3}',
        ),
        (Generate.build("r-1"), '{"type":"generate","id":"r-1","params":{},"detach":false}'),
        (
            Generate.build("r-1", {"prompt": "caf\u00e9"}),
            '{"type":"generate","id":"r-1","params":{"prompt":"caf\\u00e9"},"detach":false}',
        ),
        (Cancel.build("r-1"), '{"type":"cancel","id":"r-1"}'),
        (Attach.build("r-1"), '{"type":"attach","id":"r-1"}'),
    ],
    ids=["generate-full", "generate-minimal", "generate-non-ascii", "cancel", "attach"],
)
def test_the_wire_bytes_are_pinned(message: ClientMessage, text: str) -> None:
    assert message.serialize() == text
    assert message.to_dict() == json.loads(text)


def test_the_default_priority_is_not_written() -> None:
    # The server reads an absent priority as 0; only a real choice is sent.
    assert "priority" not in Generate.build("r", priority=0).to_dict()
    assert "priority" not in Generate.build("r").to_dict()
    assert Generate.build("r", priority=10).to_dict()["priority"] == 10


# ---- client builds -> server parses ------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        Generate.build("r-1"),
        Generate.build("a:b_c.d-e", {"steps": 3, "shape": [1, 2]}, {"every": 2}, detach=True,
                       output={"format": "webp", "quality": None}, priority=10),
        Generate.build("r", priority=-10),
        Cancel.build("r-1"),
        Attach.build("x" * 128),
    ],
    ids=["minimal", "full", "low-priority", "cancel", "attach-longest-id"],
)
def test_what_the_client_builds_the_server_parses_back_equal(message: ClientMessage) -> None:
    assert parse_client_message(message.serialize()) == message
    assert type(message).from_dict(message.to_dict()) == message


def test_every_type_is_registered_under_its_own_name() -> None:
    assert {name: cls.TYPE for name, cls in CLIENT_MESSAGES.items()} == {
        "generate": "generate", "cancel": "cancel", "attach": "attach", "pause": "pause", "resume": "resume"
    }


# ---- the client's argument checks ----------------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Generate.build("not ok!"), "id"),
        (lambda: Generate.build("x" * 129), "id"),
        (lambda: Generate.build(7), "id"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", [1, 2]), "params"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", {"seed": math.nan}), "params"),
        (lambda: Generate.build("r", {"seed": object()}), "params"),
        (lambda: Generate.build("r", {}, "png"), "preview"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", {}, {"every": math.inf}), "preview"),
        (lambda: Generate.build("r", output=3), "output"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", detach="yes"), "detach"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", priority=11), "priority"),
        (lambda: Generate.build("r", priority=True), "priority"),
        (lambda: Generate.build("r", priority=2.0), "priority"),  # type: ignore[arg-type]
        (lambda: Generate.build("r", priority="1"), "priority"),  # type: ignore[arg-type]
        (lambda: Cancel.build(""), "id"),
        (lambda: Attach.build(None), "id"),  # type: ignore[arg-type]
    ],
)
def test_build_refuses_bad_arguments_naming_the_field(build: Any, field: str) -> None:
    with pytest.raises(ParamsError) as info:
        build()
    assert info.value.field == field
    assert not isinstance(info.value, MessageError)  # the caller's error, not a wire reply


def test_build_copies_the_callers_mappings() -> None:
    params = {"steps": 3}
    message = Generate.build("r", params)
    params["steps"] = 4
    assert message.params == {"steps": 3}


# ---- ids '.' and '..' are refused on both sides -------------------------------------


@pytest.mark.parametrize("dots", [".", ".."])
def test_dot_ids_are_refused_by_the_client_before_sending(dots: str) -> None:
    for build in (lambda: Generate.build(dots), lambda: Cancel.build(dots), lambda: Attach.build(dots)):
        with pytest.raises(ParamsError, match="not '.' or '..'") as info:
            build()
        assert info.value.field == "id"
    with pytest.raises(ParamsError):
        check_request_id(dots)


@pytest.mark.parametrize("dots", [".", ".."])
@pytest.mark.parametrize("kind", ["generate", "cancel", "attach"])
def test_dot_ids_are_refused_by_the_server(dots: str, kind: str) -> None:
    obj: dict[str, Any] = {"type": kind, "id": dots}
    if kind == "generate":
        obj["params"] = {}
    with pytest.raises(MessageError) as info:
        parse(obj)
    assert (info.value.code, info.value.field) == ("invalid_field", "id")
    assert info.value.request_id is None  # not an id a reply may name
    assert "not '.' or '..'" in info.value.message


def test_ids_with_dots_inside_are_fine() -> None:
    assert check_id("..a") == "..a" and check_request_id("a.") == "a."
    assert parse({"type": "cancel", "id": "..."}) == Cancel("...")


def test_check_id_names_the_field_it_checks() -> None:
    with pytest.raises(MessageError) as info:
        check_id(7, field="ids[0]")
    assert info.value.field == "ids[0]" and info.value.message.startswith("ids[0] must be a string")


# ---- the server's parsing rules ------------------------------------------------------


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
            "output": {"format": "jpeg"},
            "detach": True,
            "priority": -4,
        }
    )
    assert msg == Generate(
        id="req-1.a:b_c", params={"steps": 3}, preview={"every": 2}, detach=True,
        output={"format": "jpeg"}, priority=-4,
    )


def test_null_id_means_server_made() -> None:
    message = parse({"type": "generate", "id": None, "params": {}})
    assert message.id is None
    assert "id" not in message.to_dict()


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
        ('{"type": "generate", "params": {}, "output": []}', "invalid_field", "output"),
        ('{"type": "generate", "params": {}, "priority": 11}', "invalid_field", "priority"),
        ('{"type": "generate", "params": {}, "priority": true}', "invalid_field", "priority"),
        ('{"type": "generate", "params": {}, "priority": 1.0}', "invalid_field", "priority"),
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
    assert code in REJECTION_CODES


def test_the_problems_are_worded_for_the_client() -> None:
    def message(obj: dict[str, Any]) -> str:
        with pytest.raises(MessageError) as info:
            parse_client_object(obj)
        return info.value.message

    assert message({}) == "message has no 'type'"
    assert message({"type": 3}) == "type must be a string, got a number"
    assert message({"type": "explode"}) == (
        "unknown message type 'explode'; known: generate, cancel, attach, pause, resume"
    )
    assert message({"type": "generate"}) == "generate needs 'params'"
    assert message({"type": "attach", "id": "x", "b": 1, "a": 2}) == (
        "unknown field(s) 'a', 'b' in attach; known: id"
    )
    assert message({"type": "generate", "params": {}, "priority": 99}) == (
        "priority must be an integer from -10 to 10, got 99"
    )
    assert message({"type": "generate", "params": {}, "detach": 1}) == (
        "detach must be true or false, got a number"
    )


def test_error_carries_the_id_when_valid() -> None:
    with pytest.raises(MessageError) as info:
        parse({"type": "generate", "id": "mine", "params": 3})
    assert info.value.request_id == "mine"
    with pytest.raises(MessageError) as info:
        parse({"type": "explode", "id": "mine"})
    assert info.value.request_id == "mine"
    with pytest.raises(MessageError) as info:
        parse({"type": "cancel", "id": "mine", "extra": 1})
    assert info.value.request_id == "mine"
    with pytest.raises(MessageError) as info:
        parse({"type": "generate", "id": "not valid!", "params": {}})
    assert info.value.request_id is None


def test_from_dict_parses_one_type_with_the_same_rules() -> None:
    assert Cancel.from_dict({"type": "cancel", "id": "x"}) == Cancel("x")
    with pytest.raises(MessageError) as info:
        Cancel.from_dict({"type": "attach", "id": "x"})
    assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", "type", "x")
    with pytest.raises(MessageError) as info:
        Generate.from_dict({"type": "generate", "id": "x", "params": {}, "detatch": True})
    assert (info.value.field, info.value.request_id) == ("detatch", "x")


# ---- replies stay small whatever the client sent ---------------------------------------


def test_an_unknown_key_is_echoed_only_as_a_prefix() -> None:
    key = "k" * 500_000
    with pytest.raises(MessageError) as info:
        parse_client_message(json.dumps({"type": "generate", "params": {}, key: 1}))
    exc = info.value
    assert len(exc.message) < 512
    assert exc.field is not None and exc.field.startswith("kkkk") and len(exc.field) <= 70


def test_many_unknown_keys_are_counted_not_listed() -> None:
    obj = {"type": "cancel", "id": "x", **{f"extra{i:05}": 1 for i in range(10_000)}}
    with pytest.raises(MessageError) as info:
        parse_client_message(json.dumps(obj))
    assert "and 9997 more" in info.value.message
    assert len(info.value.message) < 300


def test_a_long_bad_id_or_type_is_echoed_only_as_a_prefix() -> None:
    for obj in ({"type": "cancel", "id": "!" * 100_000}, {"type": "t" * 100_000}):
        with pytest.raises(MessageError) as info:
            parse(obj)
        assert len(info.value.message) < 300



def test_pause_and_resume_round_trip_and_to_host_is_checked() -> None:
    from omni_stream.protocol import Pause, Resume

    assert parse_client_object(Pause.build("r", to_host=True).to_dict()) == Pause("r", True)
    assert parse_client_object({"type": "pause", "id": "r"}) == Pause("r", False)
    assert parse_client_object(Resume.build("r").to_dict()) == Resume("r")
    with pytest.raises(MessageError) as info:
        parse_client_object({"type": "pause", "id": "r", "to_host": "yes"})
    assert info.value.field == "to_host" and info.value.request_id == "r"
