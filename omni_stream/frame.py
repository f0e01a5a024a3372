"""Frame: one step's output, handed to the caller, and its timings."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # Pillow is imported by the methods that need it, not here.
    from PIL import Image

    from .preview.encode import EncodedImage

__all__ = ["Frame", "StepTimings"]


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Where one step's time went, in seconds.

    ``queued_s``: from the moment the request could run this step (submitted,
    or its previous step computed) until the step started; waiting for a
    batch slot, for other requests' steps, or for this request's reader to
    catch up all count here.
    ``compute_s``: the step call itself (for a batched step, the whole batch).
    ``copy_s``: from issuing the device-to-host copy until the frame was on
    the host and owned by the caller.
    ``batch_size``: how many requests advanced in the same model call.
    ``decode_s``: the part of ``compute_s`` spent decoding this frame on the
    device (the final decode, or a preview decoder network), 0 when none ran.
    ``cached``: the step reused the request's step cache (its model's
    ``step_reused``: the transformer's blocks after the first were skipped).
    """

    queued_s: float
    compute_s: float
    copy_s: float
    batch_size: int = 1
    decode_s: float = 0.0
    cached: bool = False


@dataclass(frozen=True, slots=True)
class Frame:
    """One step's output.

    ``data`` is a CPU tensor the caller owns: it stays valid after later
    frames and after other requests run, and nothing else writes to it. A
    large frame from an accelerator is the pinned host buffer its copy
    landed in, lent by the engine's pool (no second copy on the host): the
    pool takes it back only once every reference to it (views included) is
    gone, so keeping the frame keeps the buffer.
    ``step`` is 1-based; ``final`` is True on the last frame only.
    ``decoded`` is True when ``data`` is pixels the model decoded on its
    device: the request's output (an image ``[3, H, W]`` or a video
    ``[T, 3, H, W]``, floats in ``[-1, 1]`` or ``uint8``) or a preview made
    by a decoder network; False for a frame in the model's own space (a
    latent, or an image for models that work in pixels).

    ``encoded`` is set only on frames rendered where they were made, for a
    server that asked for that (``preview.RenderRequest``, a Ray replica):
    the step's preview, or the request's result in its output format, and
    None for a step not previewed; ``data`` is then an empty tensor, since
    the pixels never crossed.

    ``image_count`` is how many images the frame holds (a request's
    ``num_images``): more than one stacks them along a leading dimension
    (``[n, C, h, w]`` latents, ``[n, 3, H, W]`` pixels), and :meth:`split`
    gives one frame per image. :meth:`image` shows them as one grid.
    """

    request_id: str
    step: int
    total: int
    data: torch.Tensor
    timings: StepTimings = field(default_factory=lambda: StepTimings(0.0, 0.0, 0.0))
    decoded: bool = False
    encoded: EncodedImage | None = None
    image_count: int = 1

    @property
    def final(self) -> bool:
        return self.step == self.total

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.data.shape)
        encoded = f", encoded={self.encoded!r}" if self.encoded is not None else ""
        images = f", image_count={self.image_count}" if self.image_count != 1 else ""
        return (
            f"Frame(request_id={self.request_id!r}, step={self.step}/{self.total}, "
            f"data={shape} {self.data.dtype}{', decoded' if self.decoded else ''}{images}{encoded})"
        )

    def split(self) -> list[Frame]:
        """One frame per image, in order (views of ``data``, which the caller owns anyway).

        A frame of one image gives ``[self]``. The frames share this one's
        step and timings; ``encoded`` is not carried (it pictures them all).
        """
        if self.image_count == 1:
            return [self]
        return [
            Frame(self.request_id, self.step, self.total, self.data[i], self.timings, self.decoded)
            for i in range(self.image_count)
        ]

    # The methods below import omni_stream.preview when called: the engine
    # imports this module, and should not load Pillow to do so.

    @property
    def is_video(self) -> bool:
        """True when ``data`` is a video: ``[C, T, h, w]`` latents or ``[T, 3, H, W]``
        pixels (4-D, or 5-D with a leading batch of 1, first dimension not 1);
        never for a frame of several images."""
        from .preview.decode import is_video

        return self.image_count == 1 and is_video(self.data)

    def image(self, *, decoder: str | Callable[[torch.Tensor], Any] | None = "auto") -> Image.Image:
        """This frame as a PIL RGB image, at full size.

        Decoded pixels are read as they are; a latent goes through
        ``decoder`` (default ``"auto"``; pass
        ``omni_stream.preview.default_decoder(model)`` for the model's own).
        A video frame is its frames side by side, left to right: the strip
        its previews show by default (:meth:`images` gives the frames); a
        frame of several images is a grid of them.
        Raises ParamsError (a ValueError) when the frame does not fit
        ``decoder``.
        """
        from .preview.save import frame_picture

        return frame_picture(self, decoder)

    def images(self, *, decoder: str | Callable[[torch.Tensor], Any] | None = "auto") -> list[Image.Image]:
        """This frame's images: one per video frame, one per image of a
        several-image frame, else one.

        Raises ParamsError when the frame does not fit ``decoder``.
        """
        from .preview.save import frame_pictures

        return frame_pictures(self, decoder)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        params: Mapping[str, Any] | None = None,
        quality: int | None = None,
        fps: float | None = None,
        decoder: str | Callable[[torch.Tensor], Any] | None = "auto",
    ) -> Path:
        """Write this frame at full size to ``path``; return the path.

        The format comes from the suffix: ``.png``, ``.jpg``/``.jpeg``,
        ``.webp`` for an image; ``.mp4`` (needs the ``video`` extra),
        ``.webp`` (animated), ``.gif`` for a video (``fps``, default 16).
        A PNG carries ``params`` (AUTOMATIC1111's ``parameters`` text and
        JSON under ``omni_stream``). ``quality`` 1-100 for jpeg, webp, mp4.
        Raises ValueError for an unknown suffix or one for the other kind
        (naming the known ones), ImportError for ``.mp4`` without PyAV,
        ParamsError for a bad ``quality``/``fps`` or a frame that does not
        fit ``decoder``. A frame of several images is saved as its grid
        (:meth:`split` for a file each).
        """
        from .preview.save import save_frame

        return save_frame(self, path, params=params, quality=quality, fps=fps, decoder=decoder)


# -- built once a frame, on the loop ----------------------------------------------------------
#
# A frozen dataclass's __init__ sets each field through object.__setattr__, a
# Python-level call per field: 1.8 us for a Frame and its timings, once a frame
# on the event loop, whose every microsecond the producer's next torch call may
# wait on for the GIL. The engine builds them here instead, setting each slot
# through its descriptor (a C call): the same objects, as frozen as ever once
# made. tests/test_frame.py checks every field against the dataclass's own
# __init__, so a field added to either class fails there until added here.

_set_queued_s, _set_compute_s, _set_copy_s, _set_batch_size, _set_decode_s, _set_cached = (
    StepTimings.__dict__[n].__set__
    for n in ("queued_s", "compute_s", "copy_s", "batch_size", "decode_s", "cached")
)
_frame_slots = {name: Frame.__dict__[name].__set__ for name in Frame.__slots__}
_set_request_id, _set_step, _set_total, _set_data = (
    _frame_slots[n] for n in ("request_id", "step", "total", "data")
)
_set_timings, _set_decoded, _set_encoded, _set_image_count = (
    _frame_slots[n] for n in ("timings", "decoded", "encoded", "image_count")
)
_new = object.__new__


def engine_frame(
    request_id: str,
    step: int,
    total: int,
    data: torch.Tensor,
    queued_s: float,
    compute_s: float,
    copy_s: float,
    batch_size: int,
    decode_s: float,
    decoded: bool,
    image_count: int,
    cached: bool = False,
) -> Frame:
    """``Frame(request_id, step, total, data, StepTimings(queued_s, compute_s, copy_s, batch_size,
    decode_s, cached), decoded, None, image_count)``, built faster (see above)."""
    t = _new(StepTimings)
    _set_queued_s(t, queued_s)
    _set_compute_s(t, compute_s)
    _set_copy_s(t, copy_s)
    _set_batch_size(t, batch_size)
    _set_decode_s(t, decode_s)
    _set_cached(t, cached)
    f = _new(Frame)
    _set_request_id(f, request_id)
    _set_step(f, step)
    _set_total(f, total)
    _set_data(f, data)
    _set_timings(f, t)
    _set_decoded(f, decoded)
    _set_encoded(f, None)
    _set_image_count(f, image_count)
    return f
