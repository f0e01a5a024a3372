"""``GET /v1/models`` and ``GET /v1/models/{id}`` in OpenAI's shapes (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["model_object", "models_list"]


def model_object(name: str, *, created: int, owned_by: str = "omni_stream") -> dict[str, Any]:
    """One served model as OpenAI's ``model`` object (``models.retrieve``)."""
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by}


def models_list(names: Iterable[str], *, created: int, owned_by: str = "omni_stream") -> dict[str, Any]:
    """``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}``: the
    served models under the names a request's ``model`` takes (the default first)."""
    return {
        "object": "list",
        "data": [model_object(name, created=created, owned_by=owned_by) for name in names],
    }
