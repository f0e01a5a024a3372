"""Named tokens and their grants (core/tokens.py)."""

from __future__ import annotations

import pytest

from omni_stream.core.tokens import DEFAULT_TOKEN_NAME, TokenGrant, Tokens, parse_token, read_tokens_file
from omni_stream.errors import ParamsError


def test_a_token_is_named_or_one_unnamed_default() -> None:
    assert parse_token("NAME=s3cret") == TokenGrant("NAME", "s3cret")
    assert parse_token("just-a-secret") == TokenGrant(DEFAULT_TOKEN_NAME, "just-a-secret")
    # base64 padding is a secret, not a name with the secret "=" or "==".
    assert parse_token("abc==").name == DEFAULT_TOKEN_NAME and parse_token("abc==").secret == "abc=="
    assert parse_token("abc=") == TokenGrant(DEFAULT_TOKEN_NAME, "abc=")
    # A secret may contain '=' after a name.
    assert parse_token("ann=a=b") == TokenGrant("ann", "a=b")
    assert "s3cret" not in repr(parse_token("ann=s3cret"))  # secrets stay out of logs


@pytest.mark.parametrize("bad", ["", "   ", "ann=has space"])
def test_an_empty_token_or_one_with_whitespace_is_refused(bad: str) -> None:
    with pytest.raises(ParamsError) as info:
        parse_token(bad)
    assert info.value.field == "token"


def test_a_tokens_file_names_tenants_and_their_grants(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tenants\nann=aaa\n\nops=ooo priority=7  # may jump others\n")
    assert read_tokens_file(path) == [TokenGrant("ann", "aaa"), TokenGrant("ops", "ooo", priority=7)]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("ann=aaa\nbob\n", "line 2"),
        ("ann=aaa colour=red\n", "unknown grant"),
        ("ann=aaa priority=11\n", "priority="),
        ("ann=aaa priority=x\n", "priority="),
        ("# nothing\n", "holds no token"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_file_and_line(tmp_path, text: str, words: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ParamsError) as info:
        read_tokens_file(path)
    assert info.value.field == "tokens_file" and words in info.value.message and "tokens" in info.value.message


def test_a_missing_tokens_file_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(ParamsError) as info:
        read_tokens_file(tmp_path / "absent")
    assert "absent" in info.value.message and info.value.field == "tokens_file"


def test_identify_finds_whose_token_a_header_or_query_carries() -> None:
    tokens = Tokens.of(["ann=aaa", "bob=bbb"])
    assert tokens.identify({"authorization": "Bearer bbb"}, "").name == "bob"
    assert tokens.identify({"authorization": "bearer  aaa "}, "").name == "ann"
    assert tokens.identify({}, "x=1&token=aaa").name == "ann"
    assert tokens.identify({"authorization": "Bearer nope"}, "token=") is None
    assert tokens.identify({"authorization": "Basic aaa"}, "") is None
    assert tokens.identify({}, "") is None
    assert not Tokens() and len(tokens) == 2 and tokens.names == ("ann", "bob")


def test_two_tokens_of_one_name_or_one_secret_are_refused() -> None:
    with pytest.raises(ParamsError, match="two tokens are named"):
        Tokens.of(["ann=aaa", "ann=bbb"])
    with pytest.raises(ParamsError, match="share one secret"):
        Tokens.of(["ann=aaa", "bob=aaa"])


def test_tokens_come_from_strings_mappings_grants_and_a_file_together(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text("ops=ooo priority=3\n")
    tokens = Tokens.of({"ann": "aaa"}, tokens_file=path)
    assert tokens.names == ("ann", "ops")
    assert Tokens.of([TokenGrant("x", "y", priority=2)]).identify({}, "token=y").priority == 2
    assert Tokens.of(tokens).names == tokens.names
