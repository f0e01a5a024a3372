"""Checks a ``generate`` must pass before it reaches the engine (pure, no I/O).

Each raises :class:`~omni_stream.protocol.MessageError` with the
``error`` code docs/protocol.md gives for it and the request id, so the
server can reply and keep the connection open: its params (the model's
rules, the server's limits, its input images from their header:
inputs.py), its preview and output settings. The load (``busy``, the fair
share: load.py) and memory (the estimate and the reservation: estimate.py)
checks live beside this module and are re-exported here, where a request
meets all of them (core/rules.py calls them in that order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import intake
from ..engine.intake import CheckedParams
from ..errors import MessageError, ParamsError, ServerBusyError
from ..model import StepModel
from ..preview import (
    DEFAULT_QUALITY,
    IMAGE_OUTPUTS,
    VIDEO_OUTPUTS,
    PreviewSpec,
    check_output,
    default_decoder as preview_default_decoder,
    has_video_encoder,
)
from .estimate import (
    DEVICE_FRAMES_PER_REQUEST,
    HOST_BATCH_RETAINED_BYTES,
    HOST_FRAMES_PER_BATCH,
    HOST_FRAMES_PER_LARGE_BATCH,
    HOST_FRAMES_PER_REQUEST,
    INPUT_BYTES_PER_PIXEL,
    LATENT_RATIO,
    MAX_REQUEST_MEMORY_SHARE,
    REQUEST_BASE_BYTES,
    RESULT_COPIES,
    MemoryEstimate,
    check_memory,
    estimate_memory,
    frame_bytes,
    host_batch_cost,
    host_engines,
    reserve_memory,
    state_on_host,
)
from .inputs import check_images, image_params
from .limits import ServerLimits, check_request_limits
from .load import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Load, check_load, retry_after

__all__ = [
    "cap_preview",
    "check_params",
    "default_decoder",
    "preview_spec",
    "preview_wire",
    "OutputSpec",
    "output_spec",
    "IMAGE_FORMATS",
    "VIDEO_FORMATS",
    "ServerBusyError",
    # load.py's
    "Load",
    "check_load",
    "retry_after",
    "RETRY_AFTER_MIN_S",
    "RETRY_AFTER_MAX_S",
    # estimate.py's
    "MemoryEstimate",
    "check_memory",
    "estimate_memory",
    "frame_bytes",
    "host_engines",
    "reserve_memory",
    "state_on_host",
    "HOST_FRAMES_PER_REQUEST",
    "HOST_FRAMES_PER_BATCH",
    "HOST_BATCH_RETAINED_BYTES",
    "HOST_FRAMES_PER_LARGE_BATCH",
    "DEVICE_FRAMES_PER_REQUEST",
    "REQUEST_BASE_BYTES",
    "RESULT_COPIES",
    "LATENT_RATIO",
    "INPUT_BYTES_PER_PIXEL",
    "MAX_REQUEST_MEMORY_SHARE",
    "host_batch_cost",
]

#: What the final message of a request may be encoded as (preview.save's
#: tables); the first is the default.
IMAGE_FORMATS = tuple(IMAGE_OUTPUTS)
VIDEO_FORMATS = tuple(VIDEO_OUTPUTS)
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
        return MessageError(
            "invalid_field", f"output: {message}", field=f"output.{field}", request_id=request_id
        )

    unknown = sorted(str(k) for k in wire if k not in _OUTPUT_KEYS)
    if unknown:
        raise bad(unknown[0], f"unknown option {unknown[0]!r}; known: {', '.join(_OUTPUT_KEYS)}")
    fmt = wire.get("format", formats[0])
    if fmt not in formats:
        kind = "a video" if video else "an image"
        raise bad("format", f"format must be one of {', '.join(formats)} for {kind}; got {fmt!r}")
    quality = wire.get("quality")
    try:
        # The encoder's own rules (quality per format; mp4 needs PyAV): said
        # now, not after the render.
        check_output(fmt, quality)
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
    model: StepModel | None = None,
) -> PreviewSpec:
    """The request's preview settings from its wire form (``default`` when None).

    ``model`` checks a decoder that depends on it (``taesd``: the model's tiny
    autoencoder). Raises MessageError ``invalid_field`` naming ``preview.<option>``.
    """
    if wire is None:
        return default
    try:
        spec = PreviewSpec.from_dict(wire, decoder=decoder, model=model)
    except ParamsError as exc:
        field = f"preview.{exc.field}" if exc.field and exc.field != "preview" else "preview"
        raise MessageError(
            "invalid_field", f"preview: {exc.message}", field=field, request_id=request_id
        ) from None
    return cap_preview(spec, limits)


def check_params(
    model: StepModel, params: Mapping[str, Any], limits: ServerLimits, *, request_id: str
) -> tuple[int, CheckedParams]:
    """Validate ``params`` with the model and the server's limits; the step count and the checked params.

    The request's one validation in this process: the engine of ``model``
    takes the CheckedParams as they are (engine/intake.py), the model's
    ``validate`` as ``checked``. Image params are checked from their header
    first (inputs.py): a path or an image with a side over
    ``max_image_size`` is refused before ``validate`` could read or decode
    it. Raises MessageError ``bad_params`` (the model refused them;
    ``field`` names the param) or ``limit_exceeded`` (beyond this server's
    limits).
    """
    # Images a door has not decoded yet (a caller of the core without one):
    # their headers first, so nothing oversize is ever decoded.
    check_images(model, params, limits, request_id=request_id)
    try:
        pinned = intake.check_params(model, params)
    except ParamsError as exc:
        raise MessageError("bad_params", exc.message, field=exc.field, request_id=request_id) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise MessageError("bad_params", f"{model.name}: {exc}", request_id=request_id) from None
    checked = pinned.checked
    for name in image_params(model):
        size = getattr(checked.get(name), "size", None)
        if isinstance(size, tuple) and max(size) > limits.max_image_size:
            # A PIL image given to the core directly (a door decodes only what fits).
            raise MessageError(
                "limit_exceeded",
                f"input image {name!r} of {size[0]}x{size[1]} has a side over this server's "
                f"max_image_size={limits.max_image_size} ({ServerLimits.env_name('max_image_size')})",
                field=name,
                request_id=request_id,
            )
    try:
        return check_request_limits(model, checked, limits), pinned
    except MessageError as exc:
        exc.request_id = request_id
        raise


def preview_wire(spec: PreviewSpec) -> dict[str, Any]:
    """The effective preview settings as ``accepted`` and ``/models`` report them."""
    decoder = spec.decoder
    name = decoder if isinstance(decoder, str) else getattr(decoder, "__name__", "custom")
    quality = spec.quality if spec.quality is not None else DEFAULT_QUALITY.get(spec.format)
    return {
        "every": spec.every,
        "format": spec.format,
        "max_size": spec.max_size,
        "quality": quality,
        "decoder": name,
        "video": spec.video,
    }
