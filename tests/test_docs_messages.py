"""The protocol's listings of its message types name every one the code has (issue 34).

docs/protocol.md said the only client messages were generate, cancel and
attach, and ``omni_stream/protocol/__init__.py`` listed 3 of 5 client and 5
of 9 server messages, long after pause, resume, loading, paused, resumed and
restarted were added. Adding a message class now fails here until both say so.
"""

from __future__ import annotations

import re
from pathlib import Path

import omni_stream.protocol as protocol
from omni_stream.protocol.client_messages import CLIENT_MESSAGES
from omni_stream.protocol.server_messages import SERVER_MESSAGES

PROTOCOL_MD = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _section(markdown: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", markdown,
                      re.MULTILINE | re.DOTALL)
    assert match, f"docs/protocol.md has no section '## {heading}'"
    return match.group(1)


def test_the_package_docstring_names_every_message_class():
    doc = protocol.__doc__ or ""
    named = set(re.findall(r"\w+", doc))
    missing = [cls.__name__ for cls in [*CLIENT_MESSAGES.values(), *SERVER_MESSAGES.values()]
               if cls.__name__ not in named]
    assert not missing, f"omni_stream/protocol/__init__.py's docstring does not list {missing}"


def test_protocol_md_has_a_section_for_every_client_message_and_refuses_only_others():
    markdown = PROTOCOL_MD.read_text(encoding="utf-8")
    client = _section(markdown, "Messages from the client")
    headings = " ".join(re.findall(r"^### (.*)$", client, re.MULTILINE))
    missing = [kind for kind in CLIENT_MESSAGES if f"`{kind}`" not in headings]
    assert not missing, f"docs/protocol.md, 'Messages from the client', has no ### section for {missing}"
    (unknown_type,) = re.findall(r"^\| `unknown_type` \|(.*)$", markdown, re.MULTILINE)
    assert set(re.findall(r"`(\w+)`", unknown_type)) - {"type"} == set(CLIENT_MESSAGES), (
        f"docs/protocol.md's unknown_type row names other types than {sorted(CLIENT_MESSAGES)}: "
        f"{unknown_type.strip()}"
    )


def test_protocol_md_server_table_has_a_row_for_every_server_message():
    server = _section(PROTOCOL_MD.read_text(encoding="utf-8"), "Messages from the server")
    first_cells = re.findall(r"^\| ([^|]*) \|", server, re.MULTILINE)
    rows = {kind for cell in first_cells for kind in re.findall(r"`(\w+)`", cell)}
    missing = sorted(set(SERVER_MESSAGES) - rows)
    assert not missing, f"docs/protocol.md's table of server messages has no row for {missing}"
