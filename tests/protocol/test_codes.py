"""protocol/codes.py: the codes the docs list are the codes the protocol knows."""

from __future__ import annotations

import re
from pathlib import Path

from omni_stream.protocol import codes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _section(title: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_error_codes_are_the_ones_docs_protocol_md_tabulates() -> None:
    tables = _section("Errors").split("`error` messages ending a request")
    rejecting, ending = (set(re.findall(r"^\| `([a-z_]+)` \|", t, re.M)) for t in tables)
    assert rejecting == codes.REJECTION_CODES
    assert ending == codes.REQUEST_ENDING_CODES


def test_an_error_code_either_rejects_a_message_or_ends_a_request() -> None:
    assert not codes.REJECTION_CODES & codes.REQUEST_ENDING_CODES


def test_the_close_codes_are_the_ones_docs_protocol_md_tabulates() -> None:
    listed = {int(c) for c in re.findall(r"^\| (\d{4}) \|", _section("Close codes"), re.M)}
    ours = {getattr(codes, name) for name in codes.__all__ if name.startswith("CLOSE_")}
    # 1000 is plain closure and 1002 the client's own (a server that breaks the protocol).
    assert ours | {1000} == listed | {codes.CLOSE_PROTOCOL_ERROR}


def test_cancel_reasons_and_priorities_are_the_documented_ones() -> None:
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    row = next(line for line in lines if line.startswith("| `cancelled` |"))
    assert set(re.findall(r"`([a-z]+)` \(", row)) == codes.CANCEL_REASONS
    generate = _section("Messages from the client (text frames, JSON objects)")
    found = re.search(r"`priority` \| no \| int from (-?\d+) to (-?\d+)", generate)
    assert found is not None
    low, high = found.groups()
    assert (int(low), int(high)) == (codes.MIN_PRIORITY, codes.MAX_PRIORITY)


def test_restart_reasons_are_the_documented_ones() -> None:
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    row = next(line for line in lines if line.startswith("| `restarted` |"))
    # The reasons, each with its "(why)", listed after `reason`: in the fields column.
    fields = row.split(" | ")[1].split("`reason`:", 1)[1]
    assert set(re.findall(r"`([a-z_]+)` \(", fields)) == codes.RESTART_REASONS
