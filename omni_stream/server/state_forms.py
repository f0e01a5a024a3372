"""A request's forms in the state directory, both ways: what is written, what is read back.

The state directory (``state.py``) writes a request down as the JSON the
store keeps (``omni_stream/store/``) and, after a restart (``restore.py``),
turns what it reads back into the server's own objects again: a
``generate``'s params with their decoded images as ``data:`` URLs again
(:func:`wire_message`), a stored result as the ``preview`` it was
(:func:`pack_result`), the terminal message (:func:`stored_terminal`), a
recorded restart (:func:`restart_notice`), the principal counted as before
(:func:`principal_of`). Pure: no store, no thread, no event loop (a stored
end this server cannot read is logged, and read as ``internal``); so each
form is one function, tested without a folder.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Mapping
from typing import Any, Final

from .. import protocol
from ..core import inputs
from ..core.principal import Principal
from ..core.records import Terminal
from ..errors import ProtocolError
from ..store import RequestEntry, StoredResult

__all__ = [
    "NOTES",
    "REPEAT_SCOPE",
    "pack_result",
    "principal_of",
    "restart_notice",
    "stored_terminal",
    "wire_message",
]

logger = logging.getLogger("omni_stream.server")

#: Where a recorded request keeps what doors wrote with it (StateKeeper.written_with).
NOTES: Final = "notes"
#: Where a recorded request keeps whose repeats its result answers, where not its principal's
#: (core/repeats.py ``repeat_scope``: a browser session's digest).
REPEAT_SCOPE: Final = "repeat_scope"


def wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as JSON can carry it: a decoded input image back to a ``data:`` URL.

    (Worker thread.) An image decoded from what the client sent goes back as
    those bytes, a JPEG as the same JPEG (core/inputs.py keeps them on the
    image), so a restart decodes the same pixels; one that came another way
    (a model's own param object) as the PNG of its pixels.
    """
    params = message.get("params")
    if not isinstance(params, Mapping):
        return message
    out = dict(params)
    for name, value in params.items():
        if hasattr(value, "save") and hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
            source = inputs.source_of(value)
            if source is not None:
                kind, data = source
            else:
                buffer = io.BytesIO()
                value.save(buffer, format="PNG")
                kind, data = "PNG", buffer.getvalue()
            out[name] = f"data:image/{kind.lower()};base64," + base64.b64encode(data).decode()
    return {**message, "params": out}


def pack_result(entry: RequestEntry, result: StoredResult) -> protocol.Preview:
    """A stored result as the final ``preview`` it was (what ``attach`` and a result replay)."""
    header = protocol.PreviewHeader(
        entry.request_id,
        result.step,
        entry.total,
        True,
        result.format,
        result.width,
        result.height,
        result.mime,
        index=result.index,
        images=result.images,
    )
    return protocol.Preview.build(header, result.data)


def stored_terminal(entry: RequestEntry) -> Terminal:
    """The message a stored request ended with, read back from its JSON object (the store's form);
    ``internal`` when the store has none or one this server does not read."""
    stored = entry.terminal or {}
    kind = stored.get("type")
    try:
        if kind == "done":
            return protocol.Done.from_dict(stored)
        if kind == "cancelled":
            return protocol.Cancelled.from_dict(stored)
        if kind == "error":
            return protocol.ErrorMessage.from_dict(stored)
    except ProtocolError as exc:
        logger.warning("request %s: its stored end is unreadable: %s", entry.request_id, exc)
    return protocol.ErrorMessage.build("internal", "ended before a restart", request_id=entry.request_id)


def restart_notice(value: Any) -> tuple[int, str] | None:
    """A recorded restart (``{"from_step", "reason"}``, ``StateKeeper._said_restarted``), else None."""
    if not isinstance(value, Mapping):
        return None
    step, reason = value.get("from_step"), value.get("reason")
    if isinstance(step, int) and not isinstance(step, bool) and isinstance(reason, str):
        return step, reason
    return None


def principal_of(key: str, request_id: str, *, grant: int = 0) -> Principal:
    """The principal of ``key`` (``kind:name``), counted as it was before the restart; a token's
    with ``grant`` (``Restorer._grant_of``, restore.py), so the request ranks against other
    principals' as it did."""
    kind, _, name = key.partition(":")
    if kind == "token":
        return Principal("token", name, priority_grant=grant)
    if kind == "address":
        return Principal("address", name)
    return Principal.of_connection(name or request_id)
