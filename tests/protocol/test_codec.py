"""protocol/codec.py: one serializer; the server's reading of a client, the client's of a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_stream.errors import MessageError, ProtocolError
from omni_stream.protocol import codec


def test_dumps_is_compact_ascii_and_refuses_what_json_cannot_carry() -> None:
    assert codec.dumps({"a": [1, 2], "b": "caf\u00e9"}) == '{"a":[1,2],"b":"caf\\u00e9"}'
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            codec.dumps({"x": bad})


def test_clip_cuts_long_text_and_says_so() -> None:
    assert codec.clip("short") == "short"
    assert codec.clip("x" * 100) == "x" * 64 + "..."
    assert codec.clip("abcdef", 3) == "abc..."


@pytest.mark.parametrize(
    ("value", "name"),
    [(None, "null"), (True, "a boolean"), (3, "a number"), (2.5, "a number"), ("s", "a string"),
     ([1], "an array"), ({}, "an object")],
)
def test_type_name_says_a_json_values_kind(value: Any, name: str) -> None:
    assert codec.type_name(value) == name


# ---- the server reading a client ---------------------------------------------------


def test_decode_json_reads_text_and_utf8_bytes() -> None:
    assert codec.decode_json('{"a": 1}') == {"a": 1}
    assert codec.decode_json('{"a": "\u00e9"}'.encode()) == {"a": "\u00e9"}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ('{"type": "generate", "params": {"steps": ' + "9" * 5000 + "}}", "integer literal is too long"),
        ("[" * 100_000, "nested too deeply"),
        ("not json", "invalid JSON at line 1 column 1"),
        ('{"type": "cancel",\n "id": }', "invalid JSON at line 2 column 8"),
        ('{"x": NaN}', "NaN is not valid JSON"),
        ('{"x": -Infinity}', "-Infinity is not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8 text"),
    ],
    ids=["huge-int", "deep", "not-json", "line-2", "nan", "infinity", "not-utf8"],
)
def test_bad_json_says_what_in_json_terms(data: str | bytes, expected: str) -> None:
    with pytest.raises(MessageError) as info:
        codec.decode_json(data)
    message = info.value.message
    assert info.value.code == "bad_json"
    assert expected in message
    for internal in ("sys.", "set_int_max_str_digits", "recursion", "Exceeds the limit", "(char "):
        assert internal not in message, message


# ---- the client reading the server -------------------------------------------------


def test_load_object_names_where_the_text_came_from() -> None:
    assert codec.load_object('{"a": 1}', "server message") == {"a": 1}
    assert codec.load_object(memoryview(b'{"a": 1}'), "preview header") == {"a": 1}
    with pytest.raises(ProtocolError, match="server message is not JSON"):
        codec.load_object("{", "server message")
    with pytest.raises(ProtocolError, match="preview header is not UTF-8 JSON"):
        codec.load_object(b"\xff{}", "preview header")
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        codec.load_object("[1]", "server message")
    with pytest.raises(ProtocolError, match="not JSON"):
        codec.load_object("[" * 100_000, "server message")  # not a RecursionError


@pytest.mark.parametrize(
    ("value", "kind", "ok"),
    [
        ("s", "str", True), (1, "str", False),
        (True, "bool", True), (1, "bool", False),
        (3, "int", True), (True, "int", False), (3.0, "int", False),
        (2.5, "number", True), (2, "number", True), (False, "number", False),
        (float("nan"), "number", False), (float("inf"), "number", False),
        ({}, "object", True), ([], "object", False),
    ],
)
def test_require_checks_a_fields_json_kind(value: Any, kind: codec.Kind, ok: bool) -> None:
    if ok:
        assert codec.require({"f": value}, "f", kind, "thing") is value
    else:
        with pytest.raises(ProtocolError, match=f"thing field 'f' must be a {kind}"):
            codec.require({"f": value}, "f", kind, "thing")


def test_require_names_a_missing_field_and_optional_allows_it() -> None:
    with pytest.raises(ProtocolError, match="thing has no 'f'"):
        codec.require({}, "f", "str", "thing")
    assert codec.optional({}, "f", "str", "thing") is None
    assert codec.optional({"f": None}, "f", "str", "thing") is None
    with pytest.raises(ProtocolError):
        codec.optional({"f": 3}, "f", "str", "thing")


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, ".", ".."])
def test_require_id_refuses_what_the_id_rule_refuses(bad: str) -> None:
    with pytest.raises(ProtocolError, match="malformed id"):
        codec.require_id({"id": bad}, "thing")
    assert codec.require_id({"id": "a.b"}, "thing") == "a.b"


@pytest.mark.parametrize(("step", "total"), [(0, 5), (6, 5), (1, 0)])
def test_require_steps_needs_one_to_total(step: int, total: int) -> None:
    with pytest.raises(ProtocolError, match=f"step {step} of {total}"):
        codec.require_steps({"step": step, "total": total}, "thing")
    assert codec.require_steps({"step": 5, "total": 5}, "thing") == (5, 5)


def test_json_decoded_by_one_side_is_what_the_other_dumped() -> None:
    message = {"type": "x", "n": 1.5, "s": "\u4e2d"}
    assert codec.decode_json(codec.dumps(message)) == message
    assert codec.load_object(codec.dumps(message), "m") == json.loads(json.dumps(message))
