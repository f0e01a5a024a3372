"""Checks a ``generate`` must pass before it reaches the engine (pure, no I/O).

Each raises :class:`~omni_stream.server.protocol.MessageError` with the
``error`` code docs/protocol.md gives for it and the request id, so the
server can reply and keep the connection open.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ParamsError
from ..model import StepModel, split_output
from ..preview import PreviewSpec, check_output, has_video_encoder
from ..preview import default_decoder as preview_default_decoder
from .limits import ServerLimits, check_request_limits
from .protocol import MessageError

__all__ = [
    "cap_preview", "check_params", "default_decoder", "preview_spec", "OutputSpec", "output_spec",
    "IMAGE_FORMATS", "VIDEO_FORMATS",
]

#: What the final message of a request may be encoded as; the first is the default.
IMAGE_FORMATS = ("png", "jpeg", "webp", "raw")
VIDEO_FORMATS = ("mp4", "webp", "gif")
_QUALITY_FORMATS = ("jpeg", "webp", "mp4")
_OUTPUT_KEYS = ("format", "quality")


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's result goes out: ``format`` and ``quality`` (None: the encoder's default)."""

    format: str
    quality: int | None = None

    def wire(self) -> dict[str, Any]:
        return {"format": self.format, "quality": self.quality}


def output_spec(wire: Mapping[str, Any] | None, *, video: bool, request_id: str) -> OutputSpec:
    """The request's ``output`` settings from their wire form; ``video`` when the model makes videos.

    Raises MessageError ``invalid_field`` naming ``output.<option>``.
    """
    formats = VIDEO_FORMATS if video else IMAGE_FORMATS
    if video and not has_video_encoder():
        formats = tuple(f for f in formats if f != "mp4")  # animated WebP by default
    if wire is None:
        return OutputSpec(formats[0])

    def bad(field: str, message: str) -> MessageError:
        return MessageError("invalid_field", f"output: {message}", field=f"output.{field}",
                            request_id=request_id)

    unknown = sorted(str(k) for k in wire if k not in _OUTPUT_KEYS)
    if unknown:
        raise bad(unknown[0], f"unknown option {unknown[0]!r}; known: {', '.join(_OUTPUT_KEYS)}")
    fmt = wire.get("format", formats[0])
    if fmt not in formats:
        kind = "a video" if video else "an image"
        raise bad("format", f"format must be one of {', '.join(formats)} for {kind}; got {fmt!r}")
    quality = wire.get("quality")
    if quality is not None:
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise bad("quality", f"quality must be an integer from 1 to 100, got {quality!r}")
        if fmt not in _QUALITY_FORMATS:
            raise bad("quality", f"{fmt} takes no quality (only {', '.join(_QUALITY_FORMATS)} do)")
    try:
        check_output(fmt, quality)  # mp4 needs PyAV: say so now, not after the render
    except ParamsError as exc:
        raise bad(exc.field or "format", exc.message) from None
    return OutputSpec(fmt, quality)


def default_decoder(model: StepModel) -> str:
    """The preview decoder for ``model``: its ``preview_decoder``, else ``"auto"`` (by the frame's shape)."""
    return preview_default_decoder(model)


def cap_preview(spec: PreviewSpec, limits: ServerLimits) -> PreviewSpec:
    """``spec`` with ``max_size`` capped at ``limits.max_image_size``.

    ``max_size`` only ever shrinks an image; the cap bounds what one preview
    can cost to encode, to hold for replays and to send.
    """
    cap = limits.max_image_size
    if spec.max_size is None or spec.max_size > cap:
        return dataclasses.replace(spec, max_size=cap)
    return spec


def preview_spec(
    wire: Mapping[str, Any] | None,
    *,
    default: PreviewSpec,
    decoder: str | Callable[[torch.Tensor], Any],
    limits: ServerLimits,
    request_id: str,
) -> PreviewSpec:
    """The request's preview settings from its wire form (``default`` when None).

    Raises MessageError ``invalid_field`` naming ``preview.<option>``.
    """
    if wire is None:
        return default
    try:
        spec = PreviewSpec.from_dict(wire, decoder=decoder)
    except ParamsError as exc:
        field = f"preview.{exc.field}" if exc.field and exc.field != "preview" else "preview"
        raise MessageError(
            "invalid_field", f"preview: {exc.message}", field=field, request_id=request_id
        ) from None
    return cap_preview(spec, limits)


def check_params(
    model: StepModel, params: Mapping[str, Any], limits: ServerLimits, *, request_id: str
) -> int:
    """Validate ``params`` with the model and the server's limits; return the step count.

    Raises MessageError ``bad_params`` (the model refused them; ``field``
    names the param) or ``limit_exceeded`` (beyond this server's limits).
    """
    for spec in model.params:
        value = params.get(spec.name) if isinstance(params, Mapping) else None
        if spec.name == "image" and isinstance(value, str) and not value.startswith("data:"):
            # Checked before validate, which would read the file: a path
            # would let any client read the server's files.
            raise MessageError(
                "bad_params",
                f"{model.name} param 'image' must be a data: URL (PNG or JPEG, base64) over the wire",
                field="image",
                request_id=request_id,
            )
    try:
        rest, _ = split_output(model, params)
        checked = model.validate(rest)
    except ParamsError as exc:
        raise MessageError("bad_params", exc.message, field=exc.field, request_id=request_id) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise MessageError("bad_params", f"{model.name}: {exc}", request_id=request_id) from None
    size = getattr(checked.get("image"), "size", None)
    if isinstance(size, tuple) and max(size) > limits.max_image_size:
        raise MessageError(
            "limit_exceeded",
            f"input image of {size[0]}x{size[1]} has a side over this server's "
            f"max_image_size={limits.max_image_size} ({ServerLimits.env_name('max_image_size')})",
            field="image",
            request_id=request_id,
        )
    try:
        return check_request_limits(model, checked, limits)
    except MessageError as exc:
        exc.request_id = request_id
        raise
