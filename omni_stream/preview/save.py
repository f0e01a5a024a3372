"""Outputs: full-size images and videos to files or bytes, and the CLI's previews sink.

Unlike ``encode`` (previews: fast settings, shrunk), everything here keeps
the full size and favours quality: PNG at Pillow's default compression,
JPEG and WebP at quality 95, H.264 at CRF 18.

- ``save_image`` / ``save_video``: a decoded RGB array to a file, the format
  from the path's suffix. PNGs carry the request's params (AUTOMATIC1111's
  ``parameters`` text, written by :mod:`.infotext`, and JSON under ``omni_stream``).
- ``encode_output``: a final frame to bytes for the server's last message.
- ``PreviewWriter``: collects a request's previews into a GIF, an animated
  WebP, an MP4 or a folder of numbered PNGs.

MP4 needs PyAV (``pip install "omni-stream[video]"``); it is imported only
when an MP4 is written.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..errors import ParamsError
from ..frame import Frame
from .decode import _decode
from .encode import (
    _RESAMPLE,
    DEFAULT_FPS,
    FORMATS,
    EncodedImage,
    _check_frames,
    _check_rgb,
    check_fps,
    image_grid,
    video_strip,
)
from .infotext import parameters_text

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "IMAGE_OUTPUTS",
    "VIDEO_OUTPUTS",
    "OUTPUT_QUALITY",
    "PREVIEW_SUFFIXES",
    "PreviewWriter",
    "check_output",
    "check_output_path",
    "encode_output",
    "has_video_encoder",
    "parameters_text",
    "save_frame",
    "save_image",
    "save_video",
]

#: File suffix -> format, for still images and for videos (``.webp`` is both:
#: a still for an image frame, animated for a video frame).
IMAGE_SUFFIXES: dict[str, str] = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
VIDEO_SUFFIXES: dict[str, str] = {".mp4": "mp4", ".webp": "webp", ".gif": "gif"}

#: Output format -> MIME type (``encode_output``).
IMAGE_OUTPUTS: dict[str, str] = {
    "png": FORMATS["png"],
    "jpeg": FORMATS["jpeg"],
    "webp": FORMATS["webp"],
    "raw": FORMATS["raw"],
}
VIDEO_OUTPUTS: dict[str, str] = {"mp4": "video/mp4", "webp": "image/webp", "gif": "image/gif"}

#: Quality when none is given, for the output formats that take one (1-100;
#: for mp4 it maps to x264's CRF: 100 -> 0, 1 -> 50; None is CRF 18).
OUTPUT_QUALITY: dict[str, int | None] = {"jpeg": 95, "webp": 95, "mp4": None}

#: What ``PreviewWriter`` writes: a folder (no suffix) or one of these files.
PREVIEW_SUFFIXES = (".gif", ".webp", ".mp4")

_VIDEO_HINT = 'MP4 needs PyAV: pip install "omni-stream[video]" (or pip install av)'
_DEFAULT_CRF = 18
# H.264 encoders in the order we try them: PyAV's wheels ship libx264;
# "h264" picks whatever H.264 encoder the FFmpeg build has; MPEG-4 part 2 is
# the last resort that every FFmpeg has (still an .mp4, still plays).
_MP4_CODECS = ("libx264", "h264", "libopenh264", "mpeg4")
# Lossless formats need no speed setting here: an output is encoded once.
_PNG_LEVEL = 6
_WEBP_METHOD = 4
# How long the preview animations hold their last (the final) image.
_PREVIEW_HOLD_S = 1.0
_PREVIEW_FPS = 10


# -- metadata -------------------------------------------------------------------


def _json_value(value: Any) -> str:
    if isinstance(value, Image.Image):
        # Not its repr: that names a memory address, and says nothing useful.
        return f"<{value.mode} image {value.width}x{value.height}>"
    return str(value)


def _png_info(params: Mapping[str, Any] | None, width: int, height: int) -> PngInfo | None:
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"params must be a mapping, got {type(params).__name__}", field="params")
    info = PngInfo()
    info.add_text("parameters", parameters_text(params, width=width, height=height))
    # Params may hold values JSON cannot: a tensor, a Path, an input image.
    info.add_text("omni_stream", json.dumps(dict(params), default=_json_value, ensure_ascii=False))
    return info


# -- checks ----------------------------------------------------------------------


def _check_quality(format: str, quality: Any) -> None:
    if quality is None:
        return
    if format not in OUTPUT_QUALITY:
        raise ParamsError(
            f"quality applies to {', '.join(OUTPUT_QUALITY)} only, not {format}", field="quality"
        )
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ParamsError(f"quality must be an integer from 1 to 100, got {quality!r}", field="quality")


def _require_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise ImportError(_VIDEO_HINT) from exc
    return av


def has_video_encoder() -> bool:
    """Whether MP4 can be written here (PyAV, the ``video`` extra, is installed)."""
    return _has_av()


def _has_av() -> bool:
    try:
        _require_av()
    except ImportError:
        return False
    return True


def check_output(format: Any, quality: Any = None) -> None:
    """Validate output options before any work (a server at submission).

    ``format`` is None (the default for the frame's kind) or one of
    ``IMAGE_OUTPUTS`` / ``VIDEO_OUTPUTS``; ``quality`` 1-100 for jpeg, webp
    and mp4 only. Raises ParamsError naming ``format`` (also when it is mp4
    and PyAV is not installed) or ``quality``.
    """
    if format is None:
        if quality is not None:
            raise ParamsError("quality needs an explicit format", field="quality")
        return
    known = {**IMAGE_OUTPUTS, **VIDEO_OUTPUTS}
    if not isinstance(format, str) or format not in known:
        raise ParamsError(f"output format must be one of {', '.join(known)}; got {format!r}", field="format")
    if format == "mp4" and not _has_av():
        raise ParamsError(_VIDEO_HINT, field="format")
    _check_quality(format, quality)


def check_output_path(path: str | os.PathLike[str], *, video: bool | None = None) -> str:
    """The format ``path``'s suffix saves as: for an image (``video=False``), a video
    (True), or either (None, when the model's output is not known yet).

    For a CLI to check ``--output`` before any model work. Raises ValueError
    naming the suffix and the known ones.
    """
    path = Path(path)
    if video is not None:
        return _suffix_format(path, video)
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return IMAGE_SUFFIXES[suffix]
    return _suffix_format(path, video=True)


def _suffix_format(path: Path, video: bool) -> str:
    suffix = path.suffix.lower()
    table = VIDEO_SUFFIXES if video else IMAGE_SUFFIXES
    if suffix in table:
        return table[suffix]
    kind = "a video" if video else "an image"
    if suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES:
        raise ValueError(f"cannot save {kind} as {suffix!r} ({str(path)!r}); use {', '.join(table)}")
    raise ValueError(
        f"unknown file suffix {suffix or '(none)'!r} in {str(path)!r}; known: "
        f"{', '.join(IMAGE_SUFFIXES)} for images, {', '.join(VIDEO_SUFFIXES)} for videos"
    )


# -- encoding ---------------------------------------------------------------------


def _image_bytes(
    rgb: np.ndarray, format: str, quality: int | None, params: Mapping[str, Any] | None
) -> bytes:
    if format == "raw":
        return rgb.tobytes()
    image = Image.fromarray(rgb)
    buf = io.BytesIO()
    if format == "png":
        image.save(
            buf,
            "PNG",
            pnginfo=_png_info(params, image.width, image.height),
            compress_level=_PNG_LEVEL,
        )
    elif format == "jpeg":
        image.save(buf, "JPEG", quality=quality or OUTPUT_QUALITY["jpeg"])
    else:
        image.save(buf, "WEBP", quality=quality or OUTPUT_QUALITY["webp"], method=_WEBP_METHOD)
    return buf.getvalue()


def _durations(count: int, fps: float, hold_s: float) -> list[int]:
    frame_ms = max(1, round(1000 / fps))
    durations = [frame_ms] * count
    durations[-1] = max(frame_ms, round(hold_s * 1000))
    return durations


def _animation(
    frames: list[np.ndarray],
    format: str,
    target: Any,
    fps: float,
    quality: int | None,
    hold_s: float,
) -> None:
    images = [Image.fromarray(f) for f in frames]
    options: dict[str, Any] = {
        "save_all": True,
        "append_images": images[1:],
        "duration": _durations(len(images), fps, hold_s),
        "loop": 0,
    }
    if format == "webp":
        options.update(quality=quality or OUTPUT_QUALITY["webp"], method=_WEBP_METHOD)
        images[0].save(target, "WEBP", **options)
    else:
        images[0].save(target, "GIF", **options)


def _mp4_codec(av: Any) -> str:
    for name in _MP4_CODECS:
        try:
            av.codec.Codec(name, "w")
        except Exception:  # noqa: BLE001 - PyAV raises its own error types per version
            continue
        return name
    raise RuntimeError(f"this PyAV build has none of the video encoders {', '.join(_MP4_CODECS)}")


def _mp4(
    frames: list[np.ndarray], target: Any, fps: float, quality: int | None, hold_s: float
) -> tuple[int, int]:
    av = _require_av()
    height, width = frames[0].shape[:2]
    # yuv420p halves the chroma planes: both sides must be even. Pad by
    # repeating the edge (a pixel of its own colour, not a black line).
    even_h, even_w = height + height % 2, width + width % 2
    pad = ((0, even_h - height), (0, even_w - width), (0, 0))
    rate = Fraction(fps).limit_denominator(1001)
    # The hold shows the last frame for hold_s more: repeat it (constant rate).
    repeats = max(0, round(hold_s * fps) - 1)
    with av.open(target, mode="w", format="mp4") as container:
        codec = _mp4_codec(av)
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = even_w, even_h, "yuv420p"
        if codec == "libx264":
            crf = _DEFAULT_CRF if quality is None else round((100 - quality) * 50 / 99)
            stream.options = {"crf": str(crf)}
        else:
            stream.bit_rate = even_w * even_h * max(1, round(fps))  # ~1 bit a pixel a frame
        for index, rgb in enumerate(frames):
            if pad != ((0, 0), (0, 0), (0, 0)):
                rgb = np.pad(rgb, pad, mode="edge")
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            copies = 1 + (repeats if index == len(frames) - 1 else 0)
            for _ in range(copies):
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return even_w, even_h


def _write_video(
    frames: list[np.ndarray],
    format: str,
    target: Any,
    *,
    fps: float,
    quality: int | None,
    hold_s: float = 0.0,
) -> tuple[int, int]:
    """Write ``frames`` as ``format`` to ``target`` (a path or a binary file); return its size."""
    if format == "mp4":
        return _mp4(frames, target, fps, quality, hold_s)
    _animation(frames, format, target, fps, quality, hold_s)
    return frames[0].shape[1], frames[0].shape[0]


# -- files --------------------------------------------------------------------------


def save_image(
    rgb: np.ndarray,
    path: str | os.PathLike[str],
    *,
    params: Mapping[str, Any] | None = None,
    quality: int | None = None,
) -> Path:
    """Write ``rgb`` (uint8 ``[H, W, 3]``) to ``path`` at full size; return the path.

    The format comes from the suffix: ``.png``, ``.jpg``/``.jpeg``, ``.webp``.
    A PNG carries ``params`` (``parameters`` and ``omni_stream`` text
    chunks); other formats ignore them. Parent folders are created. Raises
    ValueError for another suffix (naming it and the known ones),
    ParamsError for a bad ``rgb`` (field ``rgb``), ``quality`` or ``params``.
    """
    path = Path(path)
    format = _suffix_format(path, video=False)
    _check_quality(format, quality)
    data = _image_bytes(_check_rgb(rgb), format, quality, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def save_video(
    frames: np.ndarray | list[np.ndarray],
    path: str | os.PathLike[str],
    *,
    fps: float | None = None,
    quality: int | None = None,
) -> Path:
    """Write ``frames`` (uint8 ``[T, H, W, 3]``) to ``path``; return the path.

    The format comes from the suffix: ``.mp4`` (H.264, yuv420p, odd sides
    padded to even), ``.webp`` (animated) or ``.gif``; looped animations.
    ``fps`` defaults to ``DEFAULT_FPS``. Raises ValueError for another
    suffix, ImportError (naming the ``video`` extra) for ``.mp4`` without
    PyAV, ParamsError for bad ``frames``, ``fps`` or ``quality``.
    """
    path = Path(path)
    format = _suffix_format(path, video=True)
    fps = DEFAULT_FPS if fps is None else fps
    check_fps(fps)
    _check_quality(format, quality)
    checked = _check_frames(frames)
    if format == "mp4":
        _require_av()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        _write_video(checked, format, out, fps=fps, quality=quality)
    return path


# -- frames -------------------------------------------------------------------------


_DecoderSpec = str | Callable[[torch.Tensor], Any] | None


def decode_frame(frame: Frame, decoder: _DecoderSpec = "auto") -> tuple[list[np.ndarray], bool]:
    """A frame's RGB arrays and whether they are a video's frames; one per image of a
    several-image frame (``Frame.image_count``), each decoded on its own."""
    if frame.image_count == 1:
        return _decode(frame.data, frame.decoded, decoder)
    return [_decode(f.data, f.decoded, decoder, first_only=True)[0][0] for f in frame.split()], False


def frame_pictures(frame: Frame, decoder: _DecoderSpec = "auto") -> list[Image.Image]:
    """``Frame.images``: the frame's images, one per video frame or image (see there)."""
    images, _ = decode_frame(frame, decoder)
    return [Image.fromarray(rgb) for rgb in images]


def frame_picture(frame: Frame, decoder: _DecoderSpec = "auto") -> Image.Image:
    """``Frame.image``: the frame as one image; a video's frames side by side, several
    images as a grid (see there)."""
    images, video = decode_frame(frame, decoder)
    if frame.image_count > 1:
        return Image.fromarray(image_grid(images))
    if video:
        # The strip, as a video previews by default (PreviewSpec.video):
        # full size, no shrinking.
        return Image.fromarray(video_strip(images))
    return Image.fromarray(images[0])


def save_frame(
    frame: Frame,
    path: str | os.PathLike[str],
    *,
    params: Mapping[str, Any] | None = None,
    quality: int | None = None,
    fps: float | None = None,
    decoder: _DecoderSpec = "auto",
) -> Path:
    """``Frame.save``: an image frame as an image, a video frame as a video (see there)."""
    path = Path(path)
    # Check the suffix before decoding: a mistyped name should cost nothing.
    suffix = path.suffix.lower()
    # A still saved under a video-only suffix is a one-frame video: what a
    # video model asked for one frame (num_frames=1) makes, saved where its
    # videos go.
    still_as_video = suffix in VIDEO_SUFFIXES and suffix not in IMAGE_SUFFIXES
    _suffix_format(path, video=frame.is_video or still_as_video)
    images, video = decode_frame(frame, decoder)
    if frame.image_count > 1:
        images = [image_grid(images)]
    if video or still_as_video:
        return save_video(images, path, fps=fps, quality=quality)
    if fps is not None:
        raise ParamsError("fps applies to video frames only", field="fps")
    return save_image(images[0], path, params=params, quality=quality)


def encode_output(
    frame: Frame | torch.Tensor,
    format: str | None = None,
    quality: int | None = None,
    params: Mapping[str, Any] | None = None,
    *,
    decoder: _DecoderSpec = "auto",
    fps: float | None = None,
) -> EncodedImage:
    """A request's output at full size (never shrunk), for the server's final message.

    Images: ``png`` (the default; with ``params`` as PNG text chunks),
    ``jpeg``, ``webp``, ``raw``. Videos: ``mp4`` (the default when PyAV is
    installed, else ``webp``), ``webp`` (animated), ``gif``; ``frames`` on
    the result is T. Raises ParamsError naming ``format`` (unknown, or not
    for this kind of frame), ``quality``, ``fps`` or ``frame`` (does not fit
    ``decoder``); ImportError (naming the extra) for an explicit ``mp4``
    without PyAV.
    """
    if isinstance(frame, Frame):
        if frame.image_count > 1:
            raise ParamsError(
                f"a frame of {frame.images} images has one output per image: encode each of frame.split()",
                field="frame",
            )
        images, video = _decode(frame.data, frame.decoded, decoder)
    else:
        images, video = _decode(frame, None, decoder)
    table = VIDEO_OUTPUTS if video else IMAGE_OUTPUTS
    if format is None:
        format = ("mp4" if _has_av() else "webp") if video else "png"
    if not video and format not in table and format in VIDEO_OUTPUTS:
        # A still in a video format: a one-frame video (a video model asked
        # for num_frames=1 still answers in the format it was asked for).
        video, table = True, VIDEO_OUTPUTS
    if format not in table:
        kind = "a video" if video else "an image"
        raise ParamsError(f"{kind} output can be {', '.join(table)}; got {format!r}", field="format")
    _check_quality(format, quality)
    if not video:
        rgb = images[0]
        data = _image_bytes(rgb, format, quality, params)
        return EncodedImage(data, format, rgb.shape[1], rgb.shape[0], table[format])
    fps = DEFAULT_FPS if fps is None else fps
    check_fps(fps)
    buf = io.BytesIO()
    width, height = _write_video(images, format, buf, fps=fps, quality=quality)
    return EncodedImage(buf.getvalue(), format, width, height, table[format], len(images))


# -- previews sink ----------------------------------------------------------------


class PreviewWriter:
    """Collects a request's previews into one file or a folder.

    ``path`` with no suffix (or an existing folder): numbered images
    ``step_0001.png``, ... written as they come. ``.gif``, ``.webp``
    (animated), ``.mp4``: frames kept until :meth:`close`, then written at
    ``fps`` (default 10), the last frame held for a second; frames of other
    sizes than the last (latent previews before the decoded final image)
    are scaled to it. Ask the Previewer for :attr:`format`.

    Raises, at construction so that it fails before any model work:
    ValueError for any other suffix or a file where a folder should be,
    ImportError (naming the ``video`` extra) for ``.mp4`` without PyAV,
    ParamsError (field ``fps``) for a bad ``fps``.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fps: float | None = None, total: int | None = None
    ) -> None:
        self.path = Path(path)
        suffix = self.path.suffix.lower()
        self.fps = _PREVIEW_FPS if fps is None else fps
        check_fps(self.fps)
        self.written = 0
        self._frames: list[np.ndarray] = []
        self._closed = False
        self._digits = max(4, len(str(total or 0)))
        if self.path.is_dir() or not suffix:
            self.kind = "folder"
            if self.path.exists() and not self.path.is_dir():
                raise ValueError(f"previews path {str(self.path)!r} exists and is not a folder")
            self.path.mkdir(parents=True, exist_ok=True)
            return
        if suffix not in PREVIEW_SUFFIXES:
            raise ValueError(
                f"previews path {str(self.path)!r}: unsupported suffix {suffix!r}; "
                f"use {', '.join(PREVIEW_SUFFIXES)} or a folder (no suffix)"
            )
        self.kind = suffix[1:]
        if self.kind == "mp4":
            _require_av()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def format(self) -> str:
        """The preview format to render for this writer: ``png`` for a folder, else ``raw``."""
        return "png" if self.kind == "folder" else "raw"

    def add(self, step: int, image: EncodedImage | np.ndarray) -> None:
        """Add the preview of ``step``: an EncodedImage (any format) or uint8 ``[H, W, 3]``.

        Raises ValueError once closed, ParamsError (field ``rgb``) for a bad array.
        """
        if self._closed:
            raise ValueError("PreviewWriter is closed")
        if self.kind == "folder":
            if isinstance(image, EncodedImage) and image.format in ("png", "jpeg", "webp"):
                suffix = {"png": ".png", "jpeg": ".jpg", "webp": ".webp"}[image.format]
                data = image.data
            else:
                rgb = _check_rgb(self._pixels(image))
                buf = io.BytesIO()
                Image.fromarray(rgb).save(buf, "PNG", compress_level=1)
                suffix, data = ".png", buf.getvalue()
            (self.path / f"step_{step:0{self._digits}d}{suffix}").write_bytes(data)
            self.written += 1
        else:
            self._frames.append(_check_rgb(self._pixels(image)))

    @staticmethod
    def _pixels(image: EncodedImage | np.ndarray) -> np.ndarray:
        if not isinstance(image, EncodedImage):
            return image
        if image.format == "raw":
            return np.frombuffer(image.data, dtype=np.uint8).reshape(image.height, image.width, 3)
        # An encoded still (or an animation's first frame).
        with Image.open(io.BytesIO(image.data)) as opened:
            return np.asarray(opened.convert("RGB"))

    def close(self) -> None:
        """Write the collected frames (a file writer); a second call does nothing.

        Raises ImportError for ``.mp4`` without PyAV (checked at construction too).
        """
        if self._closed:
            return
        self._closed = True
        if self.kind == "folder" or not self._frames:
            return
        last = self._frames[-1]
        size = (last.shape[1], last.shape[0])
        frames = [
            f if f.shape == last.shape else np.asarray(Image.fromarray(f).resize(size, _RESAMPLE))
            for f in self._frames
        ]
        self._frames = []
        tmp = self.path.with_name(self.path.name + ".partial")
        try:
            with tmp.open("wb") as out:
                _write_video(frames, self.kind, out, fps=self.fps, quality=None, hold_s=_PREVIEW_HOLD_S)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self.written = len(frames)

    def __enter__(self) -> PreviewWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PreviewWriter({str(self.path)!r}, kind={self.kind!r}, written={self.written})"
