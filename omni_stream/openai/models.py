"""``GET /v1/models`` in OpenAI's list shape (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["models_list"]


def models_list(names: Iterable[str], *, created: int, owned_by: str = "omni_stream") -> dict[str, Any]:
    """``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}``: the
    served models under the names a request's ``model`` takes (the default first)."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": owned_by} for name in names],
    }
