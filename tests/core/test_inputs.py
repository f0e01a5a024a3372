"""Input images checked from their header, decoded apart (core/inputs.py)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

import omni_stream as om
from omni_stream.core import inputs
from omni_stream.core.limits import ServerLimits
from omni_stream.errors import MessageError
from omni_stream.models import Synthetic
from omni_stream.models.inputs import ImageHeader


class TakesImages(Synthetic):
    params = (*Synthetic.params, om.Param("image", "str", None), om.Param("mask_image", "str", None))


def png_url(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bomb_url(width: int, height: int) -> str:
    """A PNG whose header declares ``width`` x ``height`` and whose data is a few bytes.

    A real one of 4096x4096 is 87 KB; decoding it took 250-380 ms of the
    event loop before its size was checked (issue #19, finding 6).
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_the_image_params_are_the_models_image_named_strings() -> None:
    assert inputs.image_params(TakesImages()) == ("image", "mask_image")
    assert inputs.image_params(Synthetic()) == ()

    class Declares(Synthetic):
        image_params = ("reference",)

    assert inputs.image_params(Declares()) == ("reference",)


def test_an_image_whose_header_is_too_large_is_refused_without_a_decode(monkeypatch) -> None:
    decoded = []
    monkeypatch.setattr(inputs, "decode_image", lambda *a, **k: decoded.append(1))
    with pytest.raises(MessageError) as info:
        inputs.check_images(TakesImages(), {"image": bomb_url(4096, 4096)}, ServerLimits(), request_id="r")
    assert (info.value.code, info.value.field, info.value.request_id) == ("limit_exceeded", "image", "r")
    assert "4096x4096" in info.value.message and "OMNI_STREAM_MAX_IMAGE_SIZE" in info.value.message
    assert decoded == []


def test_images_within_bounds_are_read_to_their_header_then_decoded_apart() -> None:
    model = TakesImages()
    pending = inputs.check_images(
        model, {"image": png_url(40, 30), "mask_image": png_url(40, 30), "steps": 3}, ServerLimits(), request_id="r"
    )
    assert [(p.name, p.header.width, p.header.height, p.header.kind) for p in pending] == [
        ("image", 40, 30, "PNG"),
        ("mask_image", 40, 30, "PNG"),
    ]
    decoded = inputs.decode_images(pending, request_id="r")
    assert decoded["image"].size == (40, 30) and decoded["image"].mode == "RGB"
    params = inputs.with_images({"image": "data:...", "steps": 3}, decoded)
    assert params["steps"] == 3 and params["image"] is decoded["image"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("/etc/passwd", "data: URL"),
        ("data:text/plain;base64,aGk=", "image/png or image/jpeg"),
        ("data:image/png;base64,!!!", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(), "neither a PNG nor a JPEG"),
    ],
)
def test_anything_but_a_png_or_jpeg_data_url_is_refused_naming_the_param(value: str, words: str) -> None:
    with pytest.raises(MessageError) as info:
        inputs.check_images(TakesImages(), {"mask_image": value}, ServerLimits(), request_id="r")
    assert (info.value.code, info.value.field) == ("bad_params", "mask_image")
    assert words in info.value.message


def test_a_truncated_image_is_refused_when_decoded_naming_the_param() -> None:
    (pending,) = inputs.check_images(TakesImages(), {"image": bomb_url(8, 8)}, ServerLimits(), request_id="r")
    with pytest.raises(MessageError) as info:
        inputs.decode_images([pending], request_id="r")
    assert (info.value.code, info.value.field) == ("bad_params", "image")


def test_values_that_are_not_strings_are_left_to_the_model() -> None:
    image = Image.new("RGB", (4, 4))
    assert inputs.check_images(TakesImages(), {"image": image, "mask_image": None}, ServerLimits(), request_id="r") == []


def test_an_upload_is_checked_from_its_header_as_a_data_url_is_naming_its_field(monkeypatch) -> None:
    # An OpenAI door's file (an edit's mask becomes mask_image): the same check as a data: URL's,
    # before a pixel is decoded, in the words the caller knows (issue #39, attack 2).
    decoded = []
    monkeypatch.setattr(inputs, "decode_image", lambda *a, **k: decoded.append(1))
    bomb = base64.b64decode(bomb_url(5000, 5000).partition(",")[2])
    with pytest.raises(MessageError) as info:
        inputs.check_encoded("mask_image", bomb, ServerLimits(), request_id="r", field="mask")
    assert (info.value.code, info.value.field, info.value.request_id) == ("limit_exceeded", "mask", "r")
    assert "'mask' of 5000x5000" in info.value.message
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="BMP")
    with pytest.raises(MessageError) as other:
        inputs.check_encoded("image", buf.getvalue(), ServerLimits(), request_id="r", field="input_reference")
    assert (other.value.code, other.value.field) == ("bad_params", "input_reference")
    assert "neither a PNG nor a JPEG nor a WebP" in other.value.message
    assert "BytesIO" not in other.value.message
    assert decoded == []


def test_a_checked_upload_goes_on_as_the_data_url_of_its_own_bytes() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (12, 8), (1, 2, 3)).save(buf, format="WEBP", lossless=True)
    pending = inputs.check_encoded("image", buf.getvalue(), ServerLimits(), request_id="r")
    assert (pending.name, pending.header) == ("image", ImageHeader("WEBP", 12, 8, False))
    url = inputs.data_url(pending)
    assert url.startswith("data:image/webp;base64,")
    (again,) = inputs.check_images(TakesImages(), {"image": url}, ServerLimits(), request_id="r")
    assert again.data == pending.data  # no decode and encode on the way: the bytes as they came
    image = inputs.decode_images([again], request_id="r")["image"]
    assert image.size == (12, 8) and inputs.source_of(image) == ("WEBP", pending.data)
