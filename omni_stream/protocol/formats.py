"""The formats a binary frame may carry: each one's MIME type and how its bytes begin (pure).

One table for everyone: the server's encoders (``omni_stream.preview``)
produce these formats, the frame header names one and its MIME type, and
the client checks the pair and the bytes against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = ["FORMATS", "PREVIEW_FORMATS", "has_signature"]

#: Format -> the MIME type a frame header carrying it must name.
FORMATS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "jpeg": "image/jpeg",
        "png": "image/png",
        "webp": "image/webp",
        # Bare RGB bytes, row-major, 3 bytes a pixel; width and height travel beside them.
        "raw": "application/octet-stream",
        # Results of video models only (docs/protocol.md, ``output``).
        "mp4": "video/mp4",
        "gif": "image/gif",
    }
)

#: The formats a still image is encoded in (``preview.format``'s choices, in
#: the order ``/models`` lists them), with their MIME types.
PREVIEW_FORMATS: Final[Mapping[str, str]] = MappingProxyType(
    {name: FORMATS[name] for name in ("jpeg", "png", "webp", "raw")}
)


def has_signature(format: str, data: bytes) -> bool:
    """Whether ``data`` starts as a file in ``format`` does (raw has no signature: True)."""
    if format == "raw":
        return True
    if format == "jpeg":
        return data[:3] == b"\xff\xd8\xff"
    if format == "png":
        return data[:8] == b"\x89PNG\r\n\x1a\n"
    if format == "gif":
        return data[:4] == b"GIF8"
    if format == "mp4":
        return data[4:8] == b"ftyp"
    if format == "webp":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return False
