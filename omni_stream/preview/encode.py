"""Encoders: an RGB ``uint8`` array to JPEG, PNG, WebP or raw bytes (pure, no I/O).

Videos preview as one strip of their frames (``video_strip``, then
``encode``) or as an animated WebP (``encode_animation``).

JPEG goes through simplejpeg (libjpeg-turbo) when it is installed, because
it releases the GIL while it encodes (``_encode_jpeg``); Pillow does the
rest (and JPEG without simplejpeg). The defaults favour speed, because a preview is encoded on every step (or
every Nth) while the next step computes. Pillow, measured on one of our
2-core x86-64 machines (more in ``docs/previews.md``):

=========================  ==============  ==============
milliseconds               512 x 512       1024 x 1024
=========================  ==============  ==============
JPEG q90                   1.0-1.4         4.4-5.4
WebP q80, method 4 / 0     27.5 / 6.6      104 / 22.7
PNG level 6 / 1            65 / 36         242 / 128
=========================  ==============  ==============

Hence JPEG by default (quality 85: a preview, not an archive), WebP at
method 0, PNG at compress_level 1. Shrinking with ``max_size`` first is the
cheapest speed-up of all: encode time scales with the pixel count.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from PIL import Image

try:  # libjpeg-turbo without the GIL; Pillow is the fallback (see _encode_jpeg)
    import simplejpeg
except ImportError:  # pragma: no cover - tests set it to None for the fallback
    simplejpeg = None

from ..errors import ParamsError
from ..params import positive_int
from ..protocol.formats import PREVIEW_FORMATS

__all__ = [
    "FORMATS",
    "DEFAULT_QUALITY",
    "EncodedImage",
    "encode",
    "encode_animation",
    "grid_cells",
    "image_grid",
    "video_strip",
    "check_options",
    "fit_size",
    "DEFAULT_FPS",
    "check_fps",
]

#: Format name -> MIME type of the bytes ``encode`` returns: the protocol's
#: table (omni_stream/protocol/formats.py), so what the encoder labels a
#: frame is what the client checks it against.
FORMATS: Final[Mapping[str, str]] = PREVIEW_FORMATS

#: Quality used when none is given, for the formats that take one.
DEFAULT_QUALITY: dict[str, int] = {"jpeg": 85, "webp": 80}

#: Frames a second of animated previews and saved videos when none is given
#: (the rate Wan and similar video models output).
DEFAULT_FPS = 16

# Lossless/no-op formats take no quality; PNG's only knob is speed (level 1).
_PNG_COMPRESS_LEVEL = 1
# WebP method 0 is ~4x faster than the default 4 for a few percent more bytes.
_WEBP_METHOD = 0
# BILINEAR in Pillow widens its support when shrinking, so it antialiases (a
# triangle filter); with reducing_gap Pillow first does a cheap integer box
# reduce and resamples only the remainder. Measured here: 1024 -> 512 px took
# 6 ms bilinear vs 14 ms LANCZOS; 2048 -> 512 px 12 ms with the gap vs 27 ms
# without (43 ms LANCZOS). No visible gain from LANCZOS at preview sizes.
_RESAMPLE = Image.Resampling.BILINEAR
_REDUCING_GAP = 2.0


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An encoded preview: ``data`` in ``format`` (``mime``), ``width`` x ``height`` pixels.

    ``frames`` is above 1 for an animation or a video (each frame ``width`` x ``height``).
    """

    data: bytes
    format: str
    width: int
    height: int
    mime: str
    frames: int = 1
    #: A grid of several images (:func:`image_grid`): each image's box
    #: ``(left, top, right, bottom)``, in order; empty for one image.
    cells: tuple[tuple[int, int, int, int], ...] = ()

    def __repr__(self) -> str:
        frames = f", {self.frames} frames" if self.frames != 1 else ""
        return (
            f"EncodedImage(format={self.format!r}, {self.width}x{self.height}{frames}, "
            f"{len(self.data)} bytes)"
        )


def check_options(format: Any, quality: Any, max_size: Any) -> None:
    """Validate encoder options; raise ParamsError naming ``format``, ``quality``, ``max_size``."""
    if not isinstance(format, str) or format not in FORMATS:
        raise ParamsError(f"format must be one of {', '.join(FORMATS)}; got {format!r}", field="format")
    if quality is not None:
        if format not in DEFAULT_QUALITY:
            raise ParamsError(
                f"quality applies to {' and '.join(DEFAULT_QUALITY)} only, not {format}",
                field="quality",
            )
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ParamsError(f"quality must be an integer from 1 to 100, got {quality!r}", field="quality")
    if max_size is not None:
        positive_int(max_size, "max_size", what="max_size (or null)")


def fit_size(width: int, height: int, max_size: int | None) -> tuple[int, int]:
    """The size to encode at: shrunk (aspect kept) so the longer side is <= ``max_size``.

    Never enlarges; each side stays at least 1 pixel.
    """
    longer = max(width, height)
    if max_size is None or longer <= max_size:
        return width, height
    scale = max_size / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def _check_rgb(rgb: Any) -> np.ndarray:
    if not isinstance(rgb, np.ndarray):
        raise ParamsError(f"rgb must be a numpy array, got {type(rgb).__name__}", field="rgb")
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ParamsError(
            f"rgb must be a non-empty uint8 array shaped [H, W, 3], got {rgb.dtype} "
            f"shaped [{', '.join(map(str, rgb.shape))}]",
            field="rgb",
        )
    return np.ascontiguousarray(rgb)


def encode(
    rgb: np.ndarray,
    *,
    format: str = "jpeg",
    quality: int | None = None,
    max_size: int | None = None,
) -> EncodedImage:
    """Encode ``rgb`` (uint8 ``[H, W, 3]``), first shrinking it to fit ``max_size``.

    ``format``: ``jpeg``, ``png``, ``webp`` or ``raw`` (the RGB bytes,
    row-major). ``quality`` (1-100) applies to jpeg and webp only.
    ``max_size`` bounds the longer side; the image is never enlarged.
    Raises ParamsError naming ``rgb``, ``format``, ``quality`` or ``max_size``.
    """
    check_options(format, quality, max_size)
    rgb = _check_rgb(rgb)
    height, width = rgb.shape[:2]
    size = fit_size(width, height, max_size)
    if size == (width, height):
        if format == "raw":
            return EncodedImage(rgb.tobytes(), "raw", width, height, FORMATS["raw"])
        if format == "jpeg":
            # Straight from the array: Image.fromarray alone costs ~1 ms at 512 px.
            data = _encode_jpeg(rgb, quality or DEFAULT_QUALITY["jpeg"])
            return EncodedImage(data, format, width, height, FORMATS[format])
    image = Image.fromarray(rgb)
    if size != (width, height):
        image = image.resize(size, _RESAMPLE, reducing_gap=_REDUCING_GAP)
    if format == "raw":
        data = image.tobytes()
    elif format == "jpeg":
        data = _encode_jpeg(image, quality or DEFAULT_QUALITY["jpeg"])
    else:
        buf = io.BytesIO()
        if format == "webp":
            image.save(buf, "WEBP", quality=quality or DEFAULT_QUALITY["webp"], method=_WEBP_METHOD)
        else:
            image.save(buf, "PNG", compress_level=_PNG_COMPRESS_LEVEL)
        data = buf.getvalue()
    return EncodedImage(data, format, image.width, image.height, FORMATS[format])


def _encode_jpeg(image: Image.Image | np.ndarray, quality: int) -> bytes:
    """JPEG bytes of an RGB image, 4:2:0 chroma (Pillow's default too).

    simplejpeg (libjpeg-turbo) releases the GIL for the whole encode; Pillow's
    JPEG encoder holds it for most of the encode (measured: a pure-Python
    thread beside a Pillow encode loop ran at 40% of its solo speed, beside
    simplejpeg at 99%). A preview thread that holds the GIL stalls the
    producer thread between its torch ops and the event loop between frames,
    so the preview no longer overlaps the next step (docs/performance.md).
    Same speed, same size, same pixels to within JPEG noise.
    """
    if simplejpeg is not None:
        rgb = np.ascontiguousarray(image)
        data: bytes = simplejpeg.encode_jpeg(rgb, quality=quality, colorspace="RGB", colorsubsampling="420")
        return data
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _check_frames(frames: Any) -> list[np.ndarray]:
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ParamsError(
            "frames must be a non-empty list of uint8 [H, W, 3] arrays or a [T, H, W, 3] array",
            field="frames",
        )
    out = [_check_rgb(f) for f in frames]
    if any(f.shape != out[0].shape for f in out):
        raise ParamsError("every frame must have the same size", field="frames")
    return out


def _shrink(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    if size == (rgb.shape[1], rgb.shape[0]):
        return rgb
    image = Image.fromarray(rgb).resize(size, _RESAMPLE, reducing_gap=_REDUCING_GAP)
    return np.asarray(image)


def video_strip(frames: Any, max_size: int | None = None) -> np.ndarray:
    """A video's frames side by side, left to right: uint8 ``[H, T * W, 3]``.

    With ``max_size``, each frame is shrunk first so that the whole strip's
    longer side is at most ``max_size`` (cheaper than shrinking the strip,
    which may be tens of thousands of pixels wide); a strip of more frames
    than ``max_size`` pixels stays 1 pixel a frame, for ``encode`` to shrink.
    Raises ParamsError (field ``frames``, ``rgb`` or ``max_size``) for bad input.
    """
    check_options("raw", None, max_size)
    frames = _check_frames(frames)
    height, width = frames[0].shape[:2]
    longer = max(len(frames) * width, height)
    if max_size is not None and longer > max_size:
        scale = max_size / longer
        # Floor the width: rounding up could push T frames past max_size.
        size = (max(1, math.floor(width * scale)), max(1, round(height * scale)))
        frames = [_shrink(f, size) for f in frames]
    return np.ascontiguousarray(np.concatenate(frames, axis=1))


def image_grid(images: Any) -> np.ndarray:
    """Several images in one picture: uint8 ``[rows * H, cols * W, 3]``.

    The preview of a request for several images (``num_images``): as many
    columns as the smallest square holding them takes, filled row by row,
    left to right; a cell left over is black. Images of one request share
    a size; a smaller one sits in its cell's top-left corner. Raises
    ParamsError (field ``frames`` or ``rgb``) for bad input.
    """
    images = _check_frames(images)
    cols, rows = _grid_shape(len(images))
    height = max(i.shape[0] for i in images)
    width = max(i.shape[1] for i in images)
    grid = np.zeros((rows * height, cols * width, 3), dtype=np.uint8)
    cells = grid_cells(len(images), cols * width, rows * height)
    for rgb, (left, top, _, _) in zip(images, cells, strict=True):
        grid[top : top + rgb.shape[0], left : left + rgb.shape[1]] = rgb
    return grid


def grid_cells(images: int, width: int, height: int) -> tuple[tuple[int, int, int, int], ...]:
    """The boxes ``(left, top, right, bottom)`` of the ``images`` cells of a grid of
    ``width`` x ``height`` pixels (:func:`image_grid`'s layout, also once scaled down)."""
    cols, rows = _grid_shape(images)
    cell_w, cell_h = width // cols, height // rows
    return tuple(
        ((k % cols) * cell_w, (k // cols) * cell_h, (k % cols + 1) * cell_w, (k // cols + 1) * cell_h)
        for k in range(images)
    )


def _grid_shape(images: int) -> tuple[int, int]:
    # The smallest square holding them, filled row by row: (columns, rows).
    cols = math.ceil(math.sqrt(images))
    return cols, math.ceil(images / cols)


def encode_animation(
    frames: Any,
    *,
    quality: int | None = None,
    max_size: int | None = None,
    fps: float = DEFAULT_FPS,
) -> EncodedImage:
    """An animated WebP of ``frames`` (uint8 ``[T, H, W, 3]`` or a list of ``[H, W, 3]``).

    Each frame is shrunk to fit ``max_size`` (the animation's canvas is the
    frame size); ``quality`` 1-100 (default 80, method 0 as for stills);
    looped, ``fps`` frames a second. Raises ParamsError naming ``frames``,
    ``rgb``, ``quality``, ``max_size`` or ``fps``.
    """
    check_options("webp", quality, max_size)
    check_fps(fps)
    frames = _check_frames(frames)
    height, width = frames[0].shape[:2]
    size = fit_size(width, height, max_size)
    images = [Image.fromarray(_shrink(f, size)) for f in frames]
    buf = io.BytesIO()
    images[0].save(
        buf,
        "WEBP",
        save_all=True,
        append_images=images[1:],
        duration=max(1, round(1000 / fps)),
        loop=0,
        quality=quality or DEFAULT_QUALITY["webp"],
        method=_WEBP_METHOD,
    )
    return EncodedImage(buf.getvalue(), "webp", size[0], size[1], FORMATS["webp"], len(images))


def check_fps(fps: Any) -> None:
    """Raise ParamsError (field ``fps``) unless ``fps`` is a positive finite number."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ParamsError(f"fps must be a positive number, got {fps!r}", field="fps")
