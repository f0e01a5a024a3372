"""One log line per request as it ends: ``request done id=... outcome=... steps=...``.

The service (``service.py``) calls :func:`log_request_done` as each
request's consumer ends: one INFO line of ``key=value`` text (a value with
a space, a quote or an ``=`` in JSON quotes), the same fields in the
record's ``extra`` for a structured handler. It only formats and logs what
the record counted (frames taken, dropped, previews sent, elapsed); it
decides nothing. Its own module so the line's shape, which operators grep
and tests read, is written in one place.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from .. import protocol

if TYPE_CHECKING:
    from ..core.records import RequestRecord, Terminal

__all__ = ["log_request_done"]

logger = logging.getLogger("omni_stream.server")


def _kv(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def log_request_done(record: RequestRecord, message: Terminal, *, model: str) -> None:
    """One INFO line per request as it ends: key=value text, the same fields in ``extra``."""
    outcome = record.outcome or message.kind
    same = outcome == message.kind  # (shutdown may have ended it first)
    fields: dict[str, Any] = {
        "request_id": record.id,
        "connection": record.owner,
        "principal": record.principal,
        "model": model,
        "outcome": outcome,
        "code": message.code if same and isinstance(message, protocol.ErrorMessage) else None,
        "reason": message.reason if same and isinstance(message, protocol.Cancelled) else None,
        "steps": record.latest_step,
        "total_steps": record.total,
        # Frames the server took from the engine, those the engine replaced
        # with newer ones while the server was busy (latest-wins), previews sent.
        "frames": record.frames_taken,
        "frames_dropped": max(0, record.latest_step - record.frames_taken),
        "previews": record.previews_sent,
        "elapsed_s": round((record.ended_at or time.monotonic()) - record.created_at, 3),
        "detach": record.detach,
    }
    names = {"request_id": "id", "connection": "conn", "total_steps": "total"}
    text = " ".join(f"{names.get(k, k)}={_kv(v)}" for k, v in fields.items() if v is not None)
    logger.info("request done %s", text, extra=fields)
