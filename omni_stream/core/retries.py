"""A client's retry of a submit is its job again, not an error (pure).

A client that times out or loses its connection mid-submit cannot know
whether the request was taken; submitting again must not make a second
job, nor answer ``duplicate_id`` for its own. So a ``generate`` whose id
names a request of the same principal, with the same message (params,
preview, output, model, priority, detach, webhook), is that request again
(``Rules.retried``); the same id with another message is still
``duplicate_id``. HTTP's ``Idempotency-Key`` header names the job the
same way when the body gives no id: the id is derived from the principal
and the key, so two tenants' keys never meet.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .. import protocol

if TYPE_CHECKING:
    from .records import RequestRecord
    from .registry import RequestRegistry

__all__ = ["IDEMPOTENCY_HEADER", "fingerprint", "id_for_key", "retry_of"]

#: The header a caller names its job with (Stripe's and the IETF draft's spelling).
IDEMPOTENCY_HEADER = "idempotency-key"
#: The longest key read: a key is a client's token for one job, not data.
MAX_KEY_LENGTH = 255


def fingerprint(msg: protocol.Generate) -> str:
    """What makes two ``generate`` messages the same job: a digest of everything but the id,
    as sent (before any input image is decoded: a retry is recognised before that work)."""
    sent: dict[str, Any] = {
        "params": msg.params,
        "preview": msg.preview,
        "output": msg.output,
        "model": msg.model,
        "priority": msg.priority,
        "detach": msg.detach,
        "webhook": msg.webhook,
    }
    text = json.dumps(sent, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def id_for_key(principal_key: str, key: str) -> str:
    """The request id an ``Idempotency-Key`` names for ``principal_key``; raises MessageError
    (``bad_message``, field ``Idempotency-Key``) for an empty or over-long key."""
    if not key or len(key) > MAX_KEY_LENGTH:
        raise protocol.MessageError(
            "bad_message",
            f"the Idempotency-Key header must be 1 to {MAX_KEY_LENGTH} characters, got {len(key)}",
            field="Idempotency-Key",
        )
    digest = hashlib.sha256(f"{principal_key}\0{key}".encode()).hexdigest()
    return f"idem-{digest[:40]}"


def retry_of(
    registry: RequestRegistry, principal_key: str, msg: protocol.Generate, sent: str
) -> RequestRecord | None:
    """The request ``msg`` submits again: the one its id names, of the same principal, submitted
    with the same message (``sent``: its :func:`fingerprint`); None for anything else."""
    record = registry.get(msg.id) if msg.id is not None else None
    if record is None or record.fingerprint != sent or record.principal != principal_key:
        return None
    return record
