"""Checks a ``generate`` must pass before it reaches the engine (pure, no I/O).

Each raises :class:`~omni_stream.server.protocol.MessageError` with the
``error`` code docs/protocol.md gives for it and the request id, so the
server can reply and keep the connection open.

Load (docs/protocol.md, "Busy"): the engine steps every request it holds
in turn, a batch a model call, so every request admitted slows every
other's steps. :class:`Load` measures the engine against ``max_active`` +
``max_queued``; :func:`check_load` refuses a ``generate`` past them, or
past its connection's fair share once the queue is over half full, with
:class:`BusyError` and a ``retry_after_s`` from :func:`retry_after`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from ..errors import ParamsError
from ..model import StepModel, split_output
from ..preview import IMAGE_OUTPUTS, VIDEO_OUTPUTS, PreviewSpec, check_output, has_video_encoder
from ..preview import default_decoder as preview_default_decoder
from .limits import ServerLimits, check_request_limits
from .protocol import MessageError

__all__ = [
    "cap_preview", "check_params", "default_decoder", "preview_spec", "OutputSpec", "output_spec",
    "IMAGE_FORMATS", "VIDEO_FORMATS",
    "BusyError", "Load", "check_load", "retry_after", "RETRY_AFTER_MIN_S", "RETRY_AFTER_MAX_S",
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


# -- load -------------------------------------------------------------------------

#: The range of ``busy``'s ``retry_after_s``: sooner is a retry storm, later
#: an estimate too uncertain to be worth waiting for (ask again).
RETRY_AFTER_MIN_S: Final = 1.0
RETRY_AFTER_MAX_S: Final = 60.0


class BusyError(MessageError):
    """A ``generate`` refused with ``busy``; ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, *, retry_after_s: float, request_id: str | None = None) -> None:
        super().__init__("busy", message, request_id=request_id)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's requests against the server's bound.

    ``held``: requests the engine holds (started, or waiting for their first
    step). The first ``max_active`` count as ``active``, the rest as
    ``queued``: each of those costs every request a share of a model call
    per step, so there may be at most ``max_queued``.
    """

    held: int
    max_active: int
    max_queued: int

    @classmethod
    def of(cls, active: int, queued: int, limits: ServerLimits, *, engine_batch_size: int) -> Load:
        """From the engine's statistics (``active``, ``queued``) and the server's limits."""
        return cls(active + queued, limits.active_bound(engine_batch_size), limits.max_queued)

    @property
    def active(self) -> int:
        return min(self.held, self.max_active)

    @property
    def queued(self) -> int:
        return max(0, self.held - self.max_active)

    @property
    def capacity(self) -> int:
        return self.max_active + self.max_queued

    @property
    def busy(self) -> bool:
        """True when a ``generate`` now gets ``busy`` whoever sends it."""
        return self.held >= self.capacity

    @property
    def crowded(self) -> bool:
        """True when the queue is over half full: each connection gets a fair share only."""
        return 2 * self.queued > self.max_queued

    def fair_share(self, connections: int) -> int:
        """Requests one of ``connections`` open connections may hold while crowded."""
        return max(1, self.capacity // max(1, connections))

    def to_dict(self) -> dict[str, int]:
        return {
            "active": self.active,
            "queued": self.queued,
            "max_active": self.max_active,
            "max_queued": self.max_queued,
        }


def retry_after(
    remaining: Iterable[int],
    *,
    held: int,
    step_s: float | None,
    batch_size: float | None,
    whole_requests: bool = False,
) -> float:
    """Seconds until one of the requests the engine holds likely ends, in [1, 60].

    ``remaining``: their steps left. The engine steps each in turn,
    ``batch_size`` requests a model call of ``step_s`` seconds (the recent
    means), so one with ``r`` steps left ends in about ``r * held /
    batch_size`` calls; a whole-request model runs one request at a time,
    ``r`` calls. Unknown timings give the minimum.
    """
    left = [r for r in remaining if r > 0]
    if step_s is None or not left:
        return RETRY_AFTER_MIN_S
    if whole_requests:
        calls_per_step = 1.0
    else:
        calls_per_step = max(1.0, held / max(1.0, batch_size or 1.0))
    estimate = min(left) * calls_per_step * step_s
    if not math.isfinite(estimate):
        return RETRY_AFTER_MAX_S
    # Rounded up to a tenth: a client waiting exactly that long is not early.
    return min(max(math.ceil(estimate * 10) / 10, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def check_load(
    load: Load,
    *,
    own: int,
    connections: int,
    retry_after_s: Callable[[], float],
    request_id: str,
) -> None:
    """Refuse one more request when the engine is full, or this connection has its share.

    ``own``: requests the asking connection runs; ``connections``: open
    connections, counted whether or not they hold work (one just refused
    holds none, and must still count, or whoever holds the queue refills
    each slot first). Raises BusyError with ``retry_after_s()``.
    """
    names = "max_active + max_queued, OMNI_STREAM_MAX_ACTIVE / OMNI_STREAM_MAX_QUEUED"
    share = load.fair_share(connections)
    if load.busy:
        why = f"the server is busy: it holds {load.held} requests ({names} = {load.capacity})"
    elif load.crowded and own >= share:
        why = (
            f"the server is crowded ({load.queued} of max_queued={load.max_queued} queued) and this "
            f"connection holds {own} requests, its fair share of {share} among {connections} "
            "connections"
        )
    else:
        return
    retry = retry_after_s()
    raise BusyError(f"{why}; try again in about {retry:g} s", retry_after_s=retry, request_id=request_id)
