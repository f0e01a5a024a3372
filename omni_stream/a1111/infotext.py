"""A PNG's infotext read back: ``/sdapi/v1/png-info`` (pure).

A result PNG carries AUTOMATIC1111's ``parameters`` text, written and read
by ``preview/infotext.py``: the prompt (with its ``<lora:NAME:WEIGHT>``
tags), ``Negative prompt: ...``, then one line of ``Key: value`` pairs
(``Steps``, ``Sampler``, ``CFG scale``, ``Seed``, ``Size``, ``Model``,
``Lora hashes``, our other params under their own names).
:func:`a1111_fields` is that text as A1111's ``/png-info`` gives it (every
value a string, ``Size`` as ``Size-1`` / ``Size-2``), the sampler under
A1111's name with its ``Schedule type``; :func:`request_of` turns those
fields into the ``txt2img`` body that makes the picture again (the same
model, prompt and LoRAs, seed, sampler, size and batch: on the same
server, the same pixels).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any, Final

from ..models.diffusers import samplers
from ..preview.infotext import parse_infotext
from .names import display

__all__ = ["a1111_fields", "png_text", "request_of"]

#: Every sampler name of ours (``canonical`` passes those through as they are).
_OURS: Final = frozenset(s.name for s in (*samplers.NOISE, *samplers.FLOW))


def png_text(data: bytes) -> dict[str, str]:
    """A PNG's text chunks (those before its pixels: where Pillow and A1111 write them), without
    decoding a pixel; ``{}`` for bytes that are no PNG. For a worker thread."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "PNG":
                return {}
            return {k: v for k, v in image.info.items() if isinstance(k, str) and isinstance(v, str)}
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return {}


def a1111_fields(text: str) -> dict[str, Any]:
    """An infotext's fields as A1111's ``/png-info`` gives them (``parse_infotext``), a
    ``Sampler`` named as A1111 names it, with its ``Schedule type`` (``dpmpp_2m_karras`` is
    ``DPM++ 2M`` and ``Karras``), as A1111 1.6 and later normalise it."""
    out: dict[str, Any] = dict(parse_infotext(text))
    sampler = out.get("Sampler")
    if isinstance(sampler, str):
        ours = samplers.canonical(sampler, None)
        if ours in _OURS:
            name, schedule = display(ours)
            out["Sampler"] = name
            out.setdefault("Schedule type", schedule)
    return out


def request_of(fields: Mapping[str, Any], chunks: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``txt2img`` body that makes the picture ``fields`` (:func:`a1111_fields`) describe
    again: an image of a batch with its batch (``num_images``, else the ``omni_stream`` JSON of
    ``chunks``, the PNG's other text). Fields it lacks are left out (the server's defaults)."""
    body: dict[str, Any] = {
        "prompt": fields.get("Prompt", ""),
        "negative_prompt": fields.get("Negative prompt", ""),
    }
    for key, name, kind in (
        ("Steps", "steps", int),
        ("CFG scale", "cfg_scale", float),
        ("Seed", "seed", int),
        ("Size-1", "width", int),
        ("Size-2", "height", int),
    ):
        value = _as(fields.get(key), kind)
        if value is not None:
            body[name] = value
    if isinstance(fields.get("Sampler"), str):
        body["sampler_name"] = fields["Sampler"]
        body["scheduler"] = str(fields.get("Schedule type", "Automatic")).lower()
    if isinstance(fields.get("Model"), str):
        body["override_settings"] = {"sd_model_checkpoint": fields["Model"]}
    batch = _as(fields.get("num_images"), int) or _batch(chunks or {})
    if batch > 1:
        body["batch_size"] = batch
    return body


def _as(value: Any, kind: type) -> Any:
    if not isinstance(value, str):
        return None
    try:
        return kind(value)
    except ValueError:
        return None


def _batch(chunks: Mapping[str, str]) -> int:
    try:
        ours = json.loads(chunks.get("omni_stream", "{}"))
    except ValueError:
        return 1
    count = ours.get("num_images") if isinstance(ours, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
