"""A request's input images: checked from their header, decoded off the event loop.

An image param (``image``, ``mask_image``, ``control_image``) arrives over
the wire as a ``data:`` URL (PNG, JPEG or WebP), or as a file in an OpenAI
door's multipart form (an edit's ``image`` and ``mask``, a video's
``input_reference``). A PNG of a few KB can declare 4096x4096
pixels; decoding it takes 250-380 ms of the event loop before its size can
be refused, and a few such requests a second stall every client (issue #19,
finding 6). So a door does it in two steps:

1. :func:`check_images`, on the loop: the base64 decoded, each image's
   header read (its format and size, a few hundred bytes), its sides
   checked against ``max_image_size``: refused (``limit_exceeded``) before
   a pixel is expanded; :func:`check_encoded` is the same check of a
   file's bytes, which the OpenAI doors run on each upload before anything
   reads its pixels, and :func:`data_url` makes of a checked upload the
   URL every door's request carries into the core (issue #39: an edit's
   door decoded a 13000x13000 PNG, +1.29 GB, before this check saw it);
2. :func:`decode_images`, in a worker thread: the pixels, which replace the
   URLs in the params (:func:`with_images`), so the model's ``validate``
   on the loop finds an image it has no decoding left to do for.

Paths are never accepted over the wire (a client would choose which of the
server's files a request reads). The decoded image counts in the request's
memory estimate at its decoded size (admission.py).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from ..errors import MessageError, ParamsError
from ..model import StepModel
from ..models.inputs import ImageHeader, decode_image, read_data_url, read_header
from .limits import ServerLimits

__all__ = [
    "IMAGE_PARAM_NAMES",
    "SOURCE_INFO",
    "PendingImage",
    "Sized",
    "check_encoded",
    "check_images",
    "data_url",
    "decode_images",
    "image_params",
    "source_of",
    "with_images",
]

#: Params with these names (declared as strings) are input images; a model
#: may list its own in an ``image_params`` attribute instead.
IMAGE_PARAM_NAMES: Final = frozenset({"image", "mask_image", "control_image"})
#: Where a decoded image keeps the file it was decoded from (its ``info``): the
#: state directory writes those bytes down as given, so a restart decodes the
#: same pixels from the same JPEG (a PNG of the pixels would be larger, and a
#: JPEG encoded again would not decode to the same pixels).
SOURCE_INFO: Final = "omni_stream.source"


@dataclasses.dataclass(frozen=True, slots=True)
class Sized:
    """An image not decoded yet, as the memory estimate sees it: its ``size`` (width, height)."""

    size: tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class PendingImage:
    """An image param read as far as its header: ``data`` is the encoded file."""

    name: str
    data: bytes = dataclasses.field(repr=False)
    header: ImageHeader


def image_params(model: StepModel) -> tuple[str, ...]:
    """The names of ``model``'s input-image params."""
    declared = getattr(model, "image_params", None)
    if declared is not None:
        return tuple(declared)
    return tuple(p.name for p in model.params if p.name in IMAGE_PARAM_NAMES and p.kind == "str")


def check_images(
    model: StepModel, params: Mapping[str, Any], limits: ServerLimits, *, request_id: str | None
) -> list[PendingImage]:
    """Read each string image param's header; the images still to decode.

    Raises MessageError ``bad_params`` (not a PNG/JPEG/WebP ``data:`` URL, a
    path, bytes that are no image) or ``limit_exceeded`` (a side over
    ``max_image_size``), naming the param.
    """
    if not isinstance(params, Mapping):
        return []
    pending: list[PendingImage] = []
    for name in image_params(model):
        value = params.get(name)
        if not isinstance(value, str):
            continue  # absent, None, or not a string: the model's validate says what it takes
        if value[:5].lower() != "data:":
            raise MessageError(
                "bad_params",
                f"{model.name} param {name!r} must be a data: URL (PNG, JPEG or WebP, base64) over the wire",
                field=name,
                request_id=request_id,
            )
        try:
            data, header = read_data_url(value, field=name)
        except ParamsError as exc:
            raise MessageError("bad_params", exc.message, field=name, request_id=request_id) from None
        pending.append(_within(PendingImage(name, data, header), limits, field=name, request_id=request_id))
    return pending


def check_encoded(
    name: str, data: bytes, limits: ServerLimits, *, request_id: str | None, field: str | None = None
) -> PendingImage:
    """An uploaded image file for the param ``name``, read as far as its header and checked as
    :func:`check_images` checks a ``data:`` URL's: the image still to decode.

    ``field`` is what the caller called it (an OpenAI form's ``mask`` for
    ``mask_image``), named in the errors. Raises MessageError ``bad_params``
    (not a PNG, JPEG or WebP, a header that does not parse) or
    ``limit_exceeded`` (a side over ``max_image_size``).
    """
    field = field or name
    try:
        header = read_header(data, field=field)
    except ParamsError as exc:
        raise MessageError("bad_params", exc.message, field=field, request_id=request_id) from None
    return _within(PendingImage(name, data, header), limits, field=field, request_id=request_id)


def _within(image: PendingImage, limits: ServerLimits, *, field: str, request_id: str | None) -> PendingImage:
    header, cap = image.header, limits.max_image_size
    if max(header.width, header.height) > cap:
        raise MessageError(
            "limit_exceeded",
            f"input image {field!r} of {header.width}x{header.height} has a side over this server's "
            f"max_image_size={cap} ({ServerLimits.env_name('max_image_size')})",
            field=field,
            request_id=request_id,
        )
    return image


def data_url(image: PendingImage) -> str:
    """A checked image as the ``data:`` URL an image param takes (its bytes as they came)."""
    return f"data:image/{image.header.kind.lower()};base64," + base64.b64encode(image.data).decode("ascii")


def decode_images(pending: list[PendingImage], *, request_id: str | None) -> dict[str, Any]:
    """Decode checked images (in a worker thread): param name -> RGB PIL image.

    Raises MessageError ``bad_params`` naming the param whose bytes do not decode.
    """
    out: dict[str, Any] = {}
    for image in pending:
        try:
            decoded = decode_image(image.data, field=image.name)
        except ParamsError as exc:
            raise MessageError("bad_params", exc.message, field=image.name, request_id=request_id) from None
        # (Encoded, already bounded by the message's size: no copy beyond the one the message held.)
        decoded.info[SOURCE_INFO] = (image.header.kind, image.data)
        out[image.name] = decoded
    return out


def source_of(image: Any) -> tuple[str, bytes] | None:
    """The (``PNG`` / ``JPEG`` / ``WEBP``, file bytes) ``image`` was decoded from by :func:`decode_images`;
    None for an image that came another way."""
    info = getattr(image, "info", None)
    source = info.get(SOURCE_INFO) if isinstance(info, dict) else None
    if (
        isinstance(source, tuple)
        and len(source) == 2
        and isinstance(source[0], str)
        and isinstance(source[1], bytes)
    ):
        return source[0], source[1]
    return None


def with_images(params: Mapping[str, Any], decoded: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with the decoded images in place of their URLs."""
    return {**params, **decoded}
