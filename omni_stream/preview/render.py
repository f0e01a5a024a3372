"""Rendering a frame to a preview: which steps, what format, and where the work runs.

``PreviewSpec`` is what a caller asks for (validated, also from its wire
form), ``should_preview`` picks the steps, and ``Previewer`` decodes, shrinks
and encodes a frame in a worker thread so that the event loop keeps serving
and the producer thread keeps computing the next step meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import torch

from ..errors import NonFiniteFrameError, ParamsError
from ..frame import Frame
from ..params import positive_int
from .decode import DECODERS, Decoder, _decode, check_decoder, decoder_for
from .encode import (
    DEFAULT_FPS,
    EncodedImage,
    check_options,
    encode,
    encode_animation,
    grid_cells,
    image_grid,
    video_strip,
)

__all__ = [
    "NonFiniteFrameError",
    "PreviewSpec",
    "Previewer",
    "check_finite",
    "should_preview",
    "render_sync",
    "VIDEO_MODES",
]

_WIRE_KEYS = ("every", "format", "max_size", "quality", "decoder", "video")

_T = TypeVar("_T")

#: How a video frame previews: all its frames side by side in one image,
#: its first frame, or an animated WebP of its frames.
VIDEO_MODES = ("strip", "first", "animated")


@dataclass(frozen=True, slots=True)
class PreviewSpec:
    """How to preview a request: every ``every``-th step (and the final one),
    as ``format`` with ``quality``, shrunk to ``max_size`` on the longer side,
    decoded by ``decoder`` (a name from ``DECODERS`` or a callable; None
    means ``"auto"``); a video frame as ``video`` says (``VIDEO_MODES``:
    ``"animated"`` is an animated WebP whatever ``format`` says).

    Raises ParamsError naming the field when constructed with a bad value.
    """

    every: int = 1
    format: str = "jpeg"
    max_size: int | None = 512
    quality: int | None = None
    decoder: str | Callable[[torch.Tensor], Any] = "auto"
    video: str = "strip"
    # Resolved once here, not on every step.
    decode: Decoder = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        positive_int(self.every, "every")
        check_options(self.format, self.quality, self.max_size)
        if not isinstance(self.video, str) or self.video not in VIDEO_MODES:
            raise ParamsError(
                f"video must be one of {', '.join(VIDEO_MODES)}; got {self.video!r}",
                field="video",
            )
        if self.decoder is None:
            object.__setattr__(self, "decoder", "auto")
        object.__setattr__(self, "decode", decoder_for(self.decoder))

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        decoder: str | Callable[[torch.Tensor], Any] | None = "auto",
        model: Any = None,
    ) -> PreviewSpec:
        """Build a spec from its wire form: ``{"every": 1, "format": "jpeg", "max_size": 512}``.

        Missing keys take the defaults; ``decoder`` is used when ``data``
        names none (the wire form may only name a built-in decoder, ``auto``
        included). With ``model``, the decoder must fit it
        (:func:`~omni_stream.preview.decode.check_decoder`: ``taesd`` needs
        a tiny autoencoder). Raises ParamsError for a non-object, an unknown
        key (listing the known ones) or a bad value, naming the field.
        """
        if not isinstance(data, Mapping):
            raise ParamsError(
                f"preview options must be an object, got {type(data).__name__}", field="preview"
            )
        unknown = sorted(str(k) for k in data if k not in _WIRE_KEYS)
        if unknown:
            raise ParamsError(
                f"unknown preview option(s) {', '.join(map(repr, unknown))}; known: {', '.join(_WIRE_KEYS)}",
                field=unknown[0],
            )
        if "decoder" in data and not (isinstance(data["decoder"], str) and data["decoder"] in DECODERS):
            # Never let a client pick a callable or anything but a known name.
            raise ParamsError(
                f"decoder must be one of {', '.join(DECODERS)}; got {data['decoder']!r}",
                field="decoder",
            )
        spec = cls(**{**{"decoder": decoder}, **data})
        if model is not None:
            check_decoder(spec.decoder, model)
        return spec


def should_preview(step: int, total: int, every: int) -> bool:
    """True for every ``every``-th step (1-based) and always for the final step.

    Raises ParamsError (field ``every``) when ``every`` < 1.
    """
    positive_int(every, "every")
    return step >= total or step % every == 0


def check_finite(frame: Frame | torch.Tensor) -> None:
    """Raise NonFiniteFrameError when ``frame``'s values are not all finite (floating frames only).

    A model that diverged (a NaN in its latents) would otherwise be drawn as
    black or garbage and reported as done. One pass over the frame, in
    numpy (single-threaded, on the host copy): a torch op here would start
    an OpenMP team in the preview thread beside the producer's, and every
    parallel region of both would pay for it (device/openmp.py: the server's
    CPU a frame doubled). Call it where the frame is rendered, in a worker
    thread.
    """
    data = frame.data if isinstance(frame, Frame) else frame
    if not data.is_floating_point() or not data.numel():
        return
    host = data.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    if host.dtype == torch.bfloat16:
        # numpy has no bfloat16: NaN and infinities are the all-ones exponent.
        bits = host.contiguous().view(torch.int16).numpy()
        bad = int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
    else:
        finite = np.isfinite(host.numpy())
        bad = int(finite.size - np.count_nonzero(finite))
    if bad:
        raise NonFiniteFrameError(f"{bad} of its {data.numel()} values are NaN or infinite")


def render_sync(frame: Frame | torch.Tensor, spec: PreviewSpec, *, finite: bool = False) -> EncodedImage:
    """Decode, shrink and encode one frame in the calling thread.

    A video frame (``decode.is_video``: ``[C, T, h, w]`` latents, ``[T, 3,
    H, W]`` pixels) renders per ``spec.video``; ``max_size`` bounds the whole
    strip, or each frame of an animation. A ``Frame`` says whether it is
    decoded pixels; for a bare 4-D tensor the ``auto`` decoder takes a second
    dimension of 3 as ``[T, 3, H, W]`` (``decode.decode_frame``). Raises
    ParamsError when the frame does not fit the spec's decoder (field
    ``frame``) or a custom decoder returns something other than an RGB array
    (field ``decoder``); with ``finite``, NonFiniteFrameError for a frame
    with NaN or infinite values (:func:`check_finite`).
    """
    if finite:
        check_finite(frame)
    # A name goes through the per-frame path; a callable is the resolved,
    # result-checked wrapper.
    decoder = spec.decoder if isinstance(spec.decoder, str) else spec.decode
    if isinstance(frame, Frame) and frame.image_count > 1:
        # Several images (num_images): one preview, a grid of them all.
        rgbs = [_decode(f.data, f.decoded, decoder, first_only=True)[0][0] for f in frame.split()]
        grid = encode(image_grid(rgbs), format=spec.format, quality=spec.quality, max_size=spec.max_size)
        # Where each image is in it: a door that shows them apart (OpenAI's partial images) crops.
        return dataclasses.replace(grid, cells=grid_cells(len(rgbs), grid.width, grid.height))
    if isinstance(frame, Frame):
        data, decoded = frame.data, frame.decoded
    else:
        data, decoded = frame, None
    images, video = _decode(data, decoded, decoder, first_only=spec.video == "first")
    if not video or spec.video == "first":
        rgb = images[0]
    elif spec.video == "strip":
        rgb = video_strip(images, spec.max_size)
    else:
        quality = spec.quality if spec.format == "webp" else None
        return encode_animation(images, quality=quality, max_size=spec.max_size, fps=DEFAULT_FPS)
    return encode(rgb, format=spec.format, quality=spec.quality, max_size=spec.max_size)


class Previewer:
    """Renders previews in worker threads, never on the event loop or the producer thread.

    Decoding and encoding (1-30 ms a frame at 512 px, more with PNG or WebP)
    would stall every connection if done on the loop, and would slow
    generation 2-2.5x if done between steps on the producer thread (the
    AUTOMATIC1111 experience). In a worker thread they overlap the next step:
    numpy ufuncs and simplejpeg's JPEG encoder release the GIL (Pillow's JPEG
    encoder mostly holds it, which is why JPEG goes through simplejpeg).

    One ``Previewer`` is shared by all requests: its own ``CapacityLimiter``
    bounds how many previews render at once (default 1). Our target boxes
    have as few as 2 cores and the producer thread needs one of them for
    the model's compute; more preview threads would take cycles from the
    producer, slowing generation for everyone to make previews arrive
    sooner. It is also separate from anyio's default 40-token limiter, so
    previews never starve (or are starved by) other ``to_thread`` work.
    """

    def __init__(self, *, threads: int = 1) -> None:
        """Raises ParamsError (field ``threads``) when ``threads`` < 1."""
        positive_int(threads, "threads", what="preview threads")
        self._threads = threads
        self._limiter = anyio.CapacityLimiter(threads)
        self._reserved = anyio.CapacityLimiter(threads)

    @property
    def threads(self) -> int:
        """How many previews may render at once."""
        return self._threads

    async def render(self, frame: Frame | torch.Tensor, spec: PreviewSpec) -> EncodedImage:
        """Render ``frame`` per ``spec`` in a worker thread.

        Waits for a free thread first (that wait is the backpressure a caller
        sees when previews are requested faster than they render). Raises
        what :func:`render_sync` raises. Cancellation takes effect once the
        frame in hand is rendered (milliseconds): abandoning the thread would
        hand its token back while it still runs, breaking the thread bound.
        """
        return await anyio.to_thread.run_sync(render_sync, frame, spec, limiter=self._limiter)

    async def run_sync(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` in a preview thread, under the same bound as ``render``.

        For other image work of the same kind, such as encoding a request's
        full-size output (``save.encode_output``), so that it neither runs
        on the loop nor adds a thread beside the previews. Raises what
        ``fn`` raises; cancellation as for ``render``.
        """
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    @contextlib.asynccontextmanager
    async def reserve(self) -> AsyncIterator[Callable[..., Awaitable[EncodedImage]]]:
        """Wait for a free preview thread, then yield a ``render`` that uses it.

        For callers that pick the frame only once a thread is free: a server
        behind on its previews renders the newest step it has, not the one
        it held while it queued (which would reach the client already stale).
        The returned callable, ``render(frame, spec, *, finite=False)`` (as
        :func:`render_sync`), may be awaited any number of times while the
        reservation is held, and only then; each call renders in the reserved
        slot. Calling ``render`` itself inside the reservation raises (anyio:
        the task already holds a token of this previewer).
        """
        async with self._limiter:
            yield self._render_reserved

    async def _render_reserved(
        self, frame: Frame | torch.Tensor, spec: PreviewSpec, *, finite: bool = False
    ) -> EncodedImage:
        # The reservation holds one of self._limiter's tokens; this limiter
        # only keeps the call off anyio's shared one (same bound).
        job = functools.partial(render_sync, frame, spec, finite=finite)
        return await anyio.to_thread.run_sync(job, limiter=self._reserved)

    def __repr__(self) -> str:
        return f"Previewer(threads={self._threads}, busy={self._limiter.borrowed_tokens})"
