"""Encoders: an RGB ``uint8`` array to JPEG, PNG, WebP or raw bytes (pure, no I/O).

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
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

try:  # libjpeg-turbo without the GIL; Pillow is the fallback (see _encode_jpeg)
    import simplejpeg
except ImportError:  # pragma: no cover - tests set it to None for the fallback
    simplejpeg = None

from ..errors import ParamsError

__all__ = [
    "FORMATS",
    "DEFAULT_QUALITY",
    "EncodedImage",
    "encode",
    "check_options",
    "fit_size",
]

#: Format name -> MIME type of the bytes ``encode`` returns.
FORMATS: dict[str, str] = {
    "jpeg": "image/jpeg",
    "png": "image/png",
    "webp": "image/webp",
    # Bare RGB bytes, row-major, 3 bytes a pixel; width and height travel beside them.
    "raw": "application/octet-stream",
}

#: Quality used when none is given, for the formats that take one.
DEFAULT_QUALITY: dict[str, int] = {"jpeg": 85, "webp": 80}

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
    """An encoded preview: ``data`` in ``format`` (``mime``), ``width`` x ``height`` pixels."""

    data: bytes
    format: str
    width: int
    height: int
    mime: str

    def __repr__(self) -> str:
        return (
            f"EncodedImage(format={self.format!r}, {self.width}x{self.height}, "
            f"{len(self.data)} bytes)"
        )


def check_options(format: Any, quality: Any, max_size: Any) -> None:
    """Validate encoder options; raise ParamsError naming ``format``, ``quality``, ``max_size``."""
    if not isinstance(format, str) or format not in FORMATS:
        raise ParamsError(
            f"format must be one of {', '.join(FORMATS)}; got {format!r}", field="format"
        )
    if quality is not None:
        if format not in DEFAULT_QUALITY:
            raise ParamsError(
                f"quality applies to {' and '.join(DEFAULT_QUALITY)} only, not {format}",
                field="quality",
            )
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ParamsError(
                f"quality must be an integer from 1 to 100, got {quality!r}", field="quality"
            )
    if max_size is not None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ParamsError(
                f"max_size must be a positive integer or null, got {max_size!r}",
                field="max_size",
            )


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
        return simplejpeg.encode_jpeg(rgb, quality=quality, colorspace="RGB", colorsubsampling="420")
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()
