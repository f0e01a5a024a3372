"""The binary preview frame: one layout, one pack, one strict parse (pure)::

    4 bytes  big-endian unsigned length N of the header
    N bytes  UTF-8 JSON object: id, step, total, final, format, width, height, mime
             (and index, images on each result of a request for several images)
    rest     the image: a complete file in ``format``, or for raw width * height * 3 RGB bytes

The server lays a frame out with :func:`pack_preview` (or
:meth:`PreviewFrame.pack`); the client reads one with
:func:`parse_preview_frame`, which checks everything the header claims
(ProtocolError). :func:`unpack_preview` is the cheap reading of a frame
the server packed itself (it keeps the result for ``attach`` and the HTTP
API): a view of the image, no copy, no checks of the bytes (ValueError
when the layout is broken).
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

from ..errors import ProtocolError
from .codec import dumps, load_object, require, require_id, require_steps
from .formats import FORMATS, has_signature

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "MAX_HEADER_BYTES",
    "Cell",
    "Preview",
    "PreviewFrame",
    "PreviewHeader",
    "pack_preview",
    "parse_preview_frame",
    "unpack_preview",
]

_LENGTH = struct.Struct(">I")
# A real header is ~150 bytes; a length far beyond that is a corrupt frame
# (or not a preview at all), not a header worth allocating for.
MAX_HEADER_BYTES: Final = 64 * 1024

_PILLOW_FORMATS: Final = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF"}
_SUFFIXES: Final[Mapping[str, tuple[str, ...]]] = {
    "png": (".png",),
    "raw": (".png",),
    "jpeg": (".jpg", ".jpeg"),
    "webp": (".webp",),
    "gif": (".gif",),
    "mp4": (".mp4",),
}


@dataclass(frozen=True, slots=True)
class PreviewHeader:
    """The JSON header of a binary preview frame."""

    id: str
    step: int
    total: int
    final: bool
    format: str
    width: int
    height: int
    mime: str
    #: A request for several images (``num_images``) has one final frame per
    #: image: ``index`` (0-based) of ``images``. Previews (a grid) and single
    #: results keep the defaults, which the wire leaves out.
    index: int = 0
    images: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The header as a JSON object, in wire order."""
        out: dict[str, Any] = {
            "id": self.id,
            "step": self.step,
            "total": self.total,
            "final": self.final,
            "format": self.format,
            "width": self.width,
            "height": self.height,
            "mime": self.mime,
        }
        if self.images != 1:
            out["index"] = self.index
            out["images"] = self.images
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> PreviewHeader:
        """The header a server sent, checked; raises ProtocolError naming what is wrong.

        Every field is required and typed, the format known, the size
        positive and the MIME type the format's; unknown extra fields are
        allowed (a newer server may add some).
        """
        where = "preview header"
        request_id = require_id(obj, where)
        step, total = require_steps(obj, where)
        final = require(obj, "final", "bool", where)
        fmt = require(obj, "format", "str", where)
        if fmt not in FORMATS:
            raise ProtocolError(f"preview format {fmt!r:.40} is not one of {', '.join(FORMATS)}")
        width = require(obj, "width", "int", where)
        height = require(obj, "height", "int", where)
        if width < 1 or height < 1:
            raise ProtocolError(f"preview size {width}x{height} is not positive")
        mime = require(obj, "mime", "str", where)
        if mime != FORMATS[fmt]:
            raise ProtocolError(f"preview mime {mime!r:.60} does not match format {fmt!r}")
        index, images = 0, 1
        if "images" in obj or "index" in obj:
            index = require(obj, "index", "int", where)
            images = require(obj, "images", "int", where)
            if not final or images < 1 or not 0 <= index < images:
                raise ProtocolError(
                    f"preview index {index} of {images} images is not a result's (final, 0 <= index < images)"
                )
        return cls(request_id, step, total, final, fmt, width, height, mime, index, images)


@dataclass(frozen=True, slots=True)
class PreviewFrame:
    """One binary preview: its header's fields and the encoded image in ``data``.

    ``data`` is a complete JPEG, PNG or WebP file (for a video's result an
    MP4, WebP or GIF file), or for ``raw`` ``width * height * 3`` bytes of
    8-bit RGB, rows top to bottom. ``final`` marks the result.
    """

    id: str
    step: int
    total: int
    final: bool
    format: str
    width: int
    height: int
    data: bytes = field(repr=False)
    #: Which of a request's several results this is (``num_images``): index of images.
    index: int = 0
    images: int = 1

    @property
    def mime(self) -> str:
        return FORMATS[self.format]

    @property
    def header(self) -> PreviewHeader:
        """The frame's header (its MIME type the format's)."""
        return PreviewHeader(
            self.id,
            self.step,
            self.total,
            self.final,
            self.format,
            self.width,
            self.height,
            self.mime,
            self.index,
            self.images,
        )

    @classmethod
    def from_header(cls, header: PreviewHeader, data: bytes) -> PreviewFrame:
        """The frame of ``header`` and its image bytes (unchecked: :func:`parse_preview_frame` checks)."""
        return cls(
            header.id,
            header.step,
            header.total,
            header.final,
            header.format,
            header.width,
            header.height,
            data,
            header.index,
            header.images,
        )

    def pack(self) -> bytes:
        """The frame's wire bytes (:func:`pack_preview`)."""
        return pack_preview(self.header, self.data)

    def image(self) -> Image.Image:
        """Decode ``data`` with Pillow (an RGB image for raw).

        Raises ProtocolError when the bytes do not decode as the header's
        format, or decode to a size other than the header's; ValueError for
        an MP4 (save() it instead).
        """
        from PIL import Image  # here: parsing frames needs no imaging library

        size = (self.width, self.height)
        if self.format == "raw":
            return Image.frombytes("RGB", size, self.data)
        if self.format == "mp4":
            raise ValueError(f"request {self.id}: the result is an MP4 video; write .data to a file (save())")
        try:
            image = Image.open(io.BytesIO(self.data), formats=[_PILLOW_FORMATS[self.format]])
            image.load()
        except (OSError, ValueError, SyntaxError) as exc:
            raise ProtocolError(
                f"preview of step {self.step} does not decode as {self.format}: {exc}",
                request_id=self.id,
            ) from exc
        if image.size != size:
            raise ProtocolError(
                f"preview of step {self.step} decodes to {image.size[0]}x{image.size[1]}, "
                f"its header says {self.width}x{self.height}",
                request_id=self.id,
            )
        return image

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the image or video as the server encoded it (raw: as a PNG); returns the path.

        Raises ValueError when the suffix does not fit the format (``.png``
        for png and raw, ``.jpg``/``.jpeg``, ``.webp``, ``.gif``, ``.mp4``).
        """
        path = Path(path)
        suffix = path.suffix.lower()
        fits = _SUFFIXES.get(self.format, ())
        if suffix not in fits:
            raise ValueError(
                f"request {self.id}: a {self.format} result cannot be saved as {suffix or 'no suffix'!r}; "
                f"use {', '.join(fits)} (or ask the server for another output format)"
            )
        if self.format == "raw":
            self.image().save(path, format="PNG")
        else:
            path.write_bytes(self.data)
        return path


#: A picture's box in a preview of several: ``(left, top, right, bottom)`` in pixels.
Cell = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True, eq=False)
class Preview:
    """A preview or result as the server publishes it: the header, and the frame packed once.

    What the core hands around (records, outboxes, replays): the websocket
    writer sends :attr:`wire`, shared by every watcher; the other doors
    read :attr:`header` and :attr:`image` (a view into the wire: no copy,
    no parse). ``cells`` are the boxes of the images in a preview of a
    request for several (a grid, drawn by ``preview.image_grid``); empty
    for one image and for results (one frame per image).
    """

    kind: ClassVar[str] = "preview"

    header: PreviewHeader
    wire: bytes = field(repr=False)
    #: Where the image starts in ``wire``.
    offset: int = field(repr=False)
    cells: tuple[Cell, ...] = ()

    @classmethod
    def build(
        cls, header: PreviewHeader, image: bytes | bytearray | memoryview, *, cells: tuple[Cell, ...] = ()
    ) -> Preview:
        """The preview of ``header`` and its encoded ``image``, laid out as its frame (pack_preview)."""
        wire = pack_preview(header, image)
        return cls(header, wire, len(wire) - len(image), tuple(cells))

    @property
    def image(self) -> memoryview:
        """The encoded image (or video) bytes, a view into :attr:`wire`."""
        return memoryview(self.wire)[self.offset :]

    @property
    def final(self) -> bool:
        return self.header.final


def pack_preview(header: PreviewHeader, image: bytes | bytearray | memoryview) -> bytes:
    """Lay out one binary preview frame: length, JSON header, image."""
    head = dumps(header.to_dict()).encode()
    return b"".join((_LENGTH.pack(len(head)), head, image))


def parse_preview_frame(frame: bytes | bytearray | memoryview) -> PreviewFrame:
    """Parse one binary preview frame as the client must: strictly.

    Raises ProtocolError (naming what is wrong) for a truncated frame, a
    header length over MAX_HEADER_BYTES, a header that is not a UTF-8 JSON
    object, a header field :meth:`PreviewHeader.from_dict` refuses, a raw
    image whose size is not ``width * height * 3``, or an encoded image
    whose first bytes are not its format's signature.
    """
    head, image = _split(frame, ProtocolError)
    header = PreviewHeader.from_dict(load_object(head, "preview header"))
    data = bytes(image)
    if header.format == "raw":
        need = header.width * header.height * 3
        if len(data) != need:
            raise ProtocolError(
                f"raw preview of {header.width}x{header.height} needs {need} bytes, got {len(data)}"
            )
    elif not has_signature(header.format, data):
        raise ProtocolError(
            f"preview of step {header.step} claims {header.format} but its bytes do not start "
            f"like one ({len(data)} bytes)"
        )
    return PreviewFrame.from_header(header, data)


def unpack_preview(frame: bytes | bytearray | memoryview) -> tuple[PreviewHeader, memoryview]:
    """Split a frame the server packed itself into its header and a view of the image bytes.

    Raises ValueError when the frame is truncated or its header is not the
    JSON object of :class:`PreviewHeader`'s fields. Nothing else is
    checked: a client reads frames with :func:`parse_preview_frame`.
    """
    head, image = _split(frame, ValueError)
    try:
        header = PreviewHeader(**json.loads(bytes(head).decode()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"preview header is not valid: {exc}") from None
    return header, image


def _split(
    frame: bytes | bytearray | memoryview, error: Callable[[str], Exception]
) -> tuple[memoryview, memoryview]:
    """The header's bytes and the image's, as views; raises ``error`` for a broken layout."""
    view = memoryview(frame)
    if len(view) < _LENGTH.size:
        raise error(f"preview frame of {len(view)} bytes is shorter than its 4-byte length")
    (length,) = _LENGTH.unpack_from(view)
    if length > MAX_HEADER_BYTES:
        raise error(f"preview header length {length} exceeds {MAX_HEADER_BYTES} bytes")
    end = _LENGTH.size + length
    if end > len(view):
        raise error(f"preview header length {length} runs past the frame ({len(view)} bytes)")
    return view[_LENGTH.size : end], view[end:]
