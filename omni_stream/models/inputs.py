"""Image inputs of requests: a data URL, a file path or a PIL image, checked and decoded.

A request carries an input image (img2img, ControlNet, image-to-video) as a
string param: a ``data:image/png;base64,...``, ``data:image/jpeg;base64,...``
or ``data:image/webp;base64,...`` URL, or the path of a PNG, JPEG or WebP
file on the machine running the engine; a Python caller may also pass a
``PIL.Image.Image``. No other format is read: each format's parser is code
that untrusted bytes reach, and Pillow has 43 of them. :func:`load_image` turns
any of them into an RGB PIL image or raises :class:`ParamsError` naming the
field. Bounds come first, before anything is decoded: the encoded size
(``max_bytes``) and the pixel count the file's header declares
(``max_pixels``), so a small file that claims a huge image (a decompression
bomb) is refused without being expanded. A WebP's header is read here,
not by Pillow, whose WebP reader builds the decoder (and its canvas) as it
opens the file.

Paths read files from the engine's machine: a server that exposes a model
with an image param to untrusted clients should pass ``allow_paths=False``
(the callback adapter's ``image_paths=False``), or any image file the server
can read becomes a request's input.

A server reads a data URL in two steps (omni_stream/core/inputs.py):
:func:`read_data_url` on the event loop, which decodes the base64 and reads
the image's header only (format and size: a few hundred bytes), so a
request whose image is too large is refused before a pixel is expanded;
then :func:`decode_image` in a worker thread. An uploaded file (the OpenAI
doors' multipart forms) is the same bytes without the URL: its header is
read by :func:`read_header`.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from dataclasses import dataclass
from typing import Any

from ..errors import ParamsError

__all__ = [
    "ImageHeader",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "decode_image",
    "load_image",
    "open_image",
    "read_data_url",
    "read_header",
]

#: Default bound on an input image's decoded pixel count (width * height).
MAX_IMAGE_PIXELS = 4096 * 4096
#: Default bound on an input image's encoded size in bytes (the PNG, JPEG or WebP file).
MAX_IMAGE_BYTES = 16 * 2**20

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
_MEDIA_WORDS = "image/webp, image/png or image/jpeg"
#: Pixel modes whose alpha channel a header declares (a palette's is its ``transparency``).
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What an encoded image's header says: ``kind`` (``PNG`` / ``JPEG`` / ``WEBP``), its size,
    and whether it has an alpha channel (``alpha``)."""

    kind: str
    width: int
    height: int
    alpha: bool = False


def read_data_url(
    value: str, *, field: str = "image", max_bytes: int = MAX_IMAGE_BYTES
) -> tuple[bytes, ImageHeader]:
    """A ``data:`` URL's image bytes and header, without decoding a pixel.

    Raises ParamsError (``field``) as :func:`load_image` does for a URL that
    is not a PNG/JPEG/WebP base64 data URL, larger than ``max_bytes``, or whose
    header does not parse.
    """
    where = f"param {field!r}"
    if not isinstance(value, str) or value[:5].lower() != "data:":
        raise ParamsError(
            f"{where} must be a data:image/png;base64 URL (or image/jpeg, image/webp)", field=field
        )
    data = _data_url_bytes(value, max_bytes, where, field)
    return data, _header(data, where, field)


def read_header(data: bytes, *, field: str = "image") -> ImageHeader:
    """An encoded image's header (its format, size and alpha), without decoding a pixel.

    Raises ParamsError (``field``) for bytes that are not a PNG, JPEG or
    WebP image, or whose header does not parse.
    """
    return _header(data, f"param {field!r}", field)


def decode_image(data: bytes, *, field: str = "image", max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Encoded PNG/JPEG/WebP bytes as an RGB PIL image (the whole decode: for a worker thread).

    Raises ParamsError (``field``) as :func:`load_image` does.
    """
    where = f"param {field!r}"
    image = _decode(data, max_pixels, where, field)
    return _rgb(image, where, field)


def open_image(data: bytes, *, field: str = "image", max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Encoded PNG/JPEG/WebP bytes as a PIL image in the mode they were stored in (its alpha kept),
    EXIF orientation applied: for a caller that reads the alpha channel (a worker thread).

    Raises ParamsError (``field``) as :func:`load_image` does.
    """
    return _decode(data, max_pixels, f"param {field!r}", field)


def load_image(
    value: Any,
    *,
    field: str = "image",
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_bytes: int = MAX_IMAGE_BYTES,
    allow_paths: bool = True,
) -> Any:
    """Return ``value`` as an RGB ``PIL.Image.Image``.

    ``value`` is a PNG/JPEG/WebP ``data:`` URL (base64), a path to such a
    file (unless ``allow_paths`` is False) or a PIL image. Alpha is dropped,
    not composited; a JPEG's EXIF orientation is applied, as diffusers'
    ``load_image`` does. Raises ParamsError (``field``) for anything else:
    not base64, not a PNG, JPEG or WebP, larger than ``max_bytes`` encoded or
    ``max_pixels`` decoded, a missing file, or data that does not decode.
    """
    from PIL import Image

    where = f"param {field!r}"
    if isinstance(value, Image.Image):
        _check_pixels(value.size, max_pixels, where, field)
        try:
            return value.convert("RGB")
        except Exception as exc:  # an unconvertible mode, a lazily opened broken file
            raise ParamsError(f"{where}: cannot convert the image to RGB: {exc}", field=field) from None
    if not isinstance(value, str):
        raise ParamsError(
            f"{where} must be a data:image/png;base64 URL (or image/jpeg, image/webp)"
            f"{', a file path' if allow_paths else ''} or a PIL image, got {type(value).__name__}",
            field=field,
        )
    if value[:5].lower() == "data:":
        data = _data_url_bytes(value, max_bytes, where, field)
    elif allow_paths:
        data = _file_bytes(value, max_bytes, where, field)
    else:
        raise ParamsError(
            f"{where} must be a data:image/png;base64 URL (or image/jpeg, image/webp; "
            "file paths are not accepted here)",
            field=field,
        )
    return _rgb(_decode(data, max_pixels, where, field), where, field)


def _data_url_bytes(url: str, max_bytes: int, where: str, field: str) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ParamsError(f"{where}: a data URL needs a ',' before its data", field=field)
    parts = [p.strip().lower() for p in header.split(";")]
    if parts[0] not in _MEDIA_TYPES:
        raise ParamsError(
            f"{where}: the data URL's media type must be {_MEDIA_WORDS}, got {parts[0] or 'none'!r}",
            field=field,
        )
    if "base64" not in parts[1:]:
        raise ParamsError(f"{where}: the data URL must be base64 (data:{parts[0]};base64,...)", field=field)
    # Checked on the encoded text, before decoding: 4 characters per 3 bytes.
    if len(payload) > 4 * ((max_bytes + 2) // 3):
        raise ParamsError(f"{where}: the image is larger than {max_bytes} bytes encoded", field=field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParamsError(f"{where}: the data URL's data is not valid base64", field=field) from None
    if len(data) > max_bytes:  # the text bound above allows up to 2 bytes over
        raise ParamsError(f"{where}: the image is larger than {max_bytes} bytes encoded", field=field)
    return data


def _file_bytes(path: str, max_bytes: int, where: str, field: str) -> bytes:
    if not path:
        raise ParamsError(f"{where} is empty; give a data URL or a file path", field=field)
    try:
        info = os.stat(path)
        # Only regular files: a FIFO or a device (/dev/zero) would block or never end.
        if not stat.S_ISREG(info.st_mode):
            raise ParamsError(f"{where}: {path!r} is not a regular file", field=field)
        if info.st_size > max_bytes:
            raise ParamsError(f"{where}: {path!r} is larger than {max_bytes} bytes", field=field)
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since stat
    except OSError as exc:
        raise ParamsError(
            f"{where}: cannot read {path[:200]!r} ({exc.strerror or exc}); give a "
            "data:image/png;base64 URL or the path of a PNG, JPEG or WebP file",
            field=field,
        ) from None
    if len(data) > max_bytes:
        raise ParamsError(f"{where}: {path!r} is larger than {max_bytes} bytes", field=field)
    return data


def _kind(data: bytes, where: str, field: str) -> str:
    if data.startswith(_PNG_MAGIC):
        return "PNG"
    if data.startswith(_JPEG_MAGIC):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    # The first bytes say what it is, so the caller knows what it sent (an
    # exception's text would name a BytesIO object).
    raise ParamsError(
        f"{where}: the data is neither a PNG nor a JPEG nor a WebP image (it starts with {data[:8]!r})",
        field=field,
    )


def _header(data: bytes, where: str, field: str) -> ImageHeader:
    from PIL import Image

    kind = _kind(data, where, field)
    if kind == "WEBP":
        width, height, alpha = _webp_header(data, where, field)
    else:
        try:
            # open() parses the header only; nothing is decoded until load().
            with Image.open(io.BytesIO(data), formats=(kind,)) as opened:
                width, height = opened.size
                alpha = opened.mode in _ALPHA_MODES or "transparency" in opened.info
        except Image.DecompressionBombError:
            raise ParamsError(
                f"{where}: the image declares more pixels than PIL decodes", field=field
            ) from None
        except Exception as exc:  # untrusted bytes: a header that does not parse
            raise ParamsError(
                f"{where}: cannot read the {kind} image's header: {_problem(exc, kind)}", field=field
            ) from None
    if width < 1 or height < 1:
        raise ParamsError(f"{where}: the image is empty ({width}x{height})", field=field)
    return ImageHeader(kind, width, height, alpha)


def _webp_header(data: bytes, where: str, field: str) -> tuple[int, int, bool]:
    """A WebP's (width, height, alpha) from its first chunk (the RIFF container's layout, RFC 9649).

    Read here and not by Pillow: its WebP plugin builds libwebp's decoder as
    it opens a file, which allocates the declared canvas before anyone can
    look at its size.
    """
    chunk = data[12:16]
    payload = data[20:]
    if chunk == b"VP8X" and len(payload) >= 10:
        # Flags (alpha: bit 4), 3 reserved bytes, then the canvas's sides - 1 in 24 bits each.
        width = 1 + int.from_bytes(payload[4:7], "little")
        height = 1 + int.from_bytes(payload[7:10], "little")
        return width, height, bool(payload[0] & 0x10)
    if chunk == b"VP8L" and len(payload) >= 5 and payload[0] == 0x2F:
        # The lossless signature, then 14 bits of width - 1, 14 of height - 1, 1 of alpha.
        bits = int.from_bytes(payload[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF), bool((bits >> 28) & 1)
    if chunk == b"VP8 " and len(payload) >= 10 and payload[3:6] == b"\x9d\x01\x2a":
        # A lossy key frame: 3 bytes of frame tag, the start code, then 14 bits a side.
        width = int.from_bytes(payload[6:8], "little") & 0x3FFF
        height = int.from_bytes(payload[8:10], "little") & 0x3FFF
        return width, height, False
    raise ParamsError(f"{where}: cannot read the WEBP image's header (a {chunk!r} chunk)", field=field)


def _decode(data: bytes, max_pixels: int, where: str, field: str) -> Any:
    """The image ``data`` holds, loaded, in its own mode, EXIF orientation applied."""
    from PIL import Image, ImageOps

    # Its header first, read without Pillow's decoders: nothing over
    # max_pixels reaches them.
    header = _header(data, where, field)
    _check_pixels((header.width, header.height), max_pixels, where, field)
    kind = header.kind
    try:
        # Restricting the formats keeps PIL from trying its other parsers on untrusted bytes.
        opened = Image.open(io.BytesIO(data), formats=(kind,))
        _check_pixels(opened.size, max_pixels, where, field)
        opened.load()
        return ImageOps.exif_transpose(opened)
    except ParamsError:
        raise
    except Image.DecompressionBombError:
        # PIL's own bound (far above ours by default) tripped in open().
        raise ParamsError(
            f"{where}: the image declares more pixels than PIL decodes; at most {max_pixels} are accepted",
            field=field,
        ) from None
    except Exception as exc:  # untrusted bytes: truncated, corrupt, PIL's own bomb check
        raise ParamsError(
            f"{where}: cannot decode the {kind} image: {_problem(exc, kind)}", field=field
        ) from None


def _problem(exc: Exception, kind: str) -> str:
    """What Pillow said was wrong with untrusted bytes, in words for the client who sent them."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        # Its text names the BytesIO object the bytes were read from (issue #39).
        return f"the bytes do not parse as a {kind} image"
    return str(exc) or type(exc).__name__


def _rgb(image: Any, where: str, field: str) -> Any:
    try:
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - an unconvertible mode of an untrusted file
        raise ParamsError(f"{where}: cannot convert the image to RGB: {exc}", field=field) from None


def _check_pixels(size: tuple[int, int], max_pixels: int, where: str, field: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ParamsError(f"{where}: the image is empty ({width}x{height})", field=field)
    if width * height > max_pixels:
        raise ParamsError(
            f"{where}: the image is {width}x{height} = {width * height} pixels; at most "
            f"{max_pixels} are accepted",
            field=field,
        )
