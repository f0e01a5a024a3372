"""``load_image``: request images from data URLs, files and PIL, with their bounds."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

import pytest
from PIL import Image

import omni_stream as om
from omni_stream.models.inputs import ImageHeader, load_image, open_image, read_header


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def noise(width: int = 6, height: int = 4) -> Image.Image:
    return Image.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3))


def claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width`` x ``height`` (a decompression bomb's header)."""
    png = bytearray(encoded(Image.new("L", (1, 1))))
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # IHDR's CRC covers type + data
    return bytes(png)


def rejects(value, message: str, **bounds) -> om.ParamsError:
    with pytest.raises(om.ParamsError, match=message) as err:
        load_image(value, field="init", **bounds)
    assert err.value.field == "init"
    return err.value


def test_a_png_data_url_decodes_to_its_exact_pixels():
    image = noise()
    got = load_image(url(encoded(image)))
    assert got.mode == "RGB" and got.size == (6, 4) and got.tobytes() == image.tobytes()
    # Media types and the base64 marker are case-insensitive (RFC 2397).
    assert load_image("DATA:IMAGE/PNG;BASE64," + url(encoded(image)).split(",", 1)[1]).size == (6, 4)


def test_jpegs_decode_and_follow_their_exif_orientation():
    image = noise(8, 4)
    assert load_image(url(encoded(image, "JPEG"), "image/jpeg")).size == (8, 4)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    assert load_image(url(encoded(image, "JPEG", exif=exif), "image/jpeg")).size == (4, 8)


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA"])
def test_every_pixel_mode_becomes_rgb(mode):
    image = noise().convert(mode)
    assert load_image(url(encoded(image))).mode == "RGB"
    assert load_image(image).mode == "RGB"


def test_a_pil_image_is_checked_and_copied():
    image = noise()
    got = load_image(image)
    assert got is not image and got.tobytes() == image.tobytes()
    rejects(Image.new("RGB", (20, 20)), "400 pixels; at most 100", max_pixels=100)


def test_files_are_read_within_their_bounds(tmp_path):
    image = noise()
    path = tmp_path / "in.png"
    path.write_bytes(encoded(image))
    assert load_image(str(path)).tobytes() == image.tobytes()
    rejects(str(path), "larger than 10 bytes", max_bytes=10)
    rejects(str(tmp_path), "not a regular file")
    rejects(str(tmp_path / "missing.png"), "cannot read")
    rejects("", "empty")
    rejects(str(path), "not accepted", allow_paths=False)
    (tmp_path / "notes.txt").write_text("hello")
    rejects(str(tmp_path / "notes.txt"), "neither a PNG nor a JPEG")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,aGVsbG8=" + "\n", "not valid base64"),
        ("data:image/png;base64", "needs a ','"),
        ("data:image/png,rawdata", "must be base64"),
        ("data:image/gif;base64,R0lGODlh", "image/png or image/jpeg"),
        (url(b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0", "image/webp"), "cannot read the WEBP image's header"),
        ("data:;base64,aGVsbG8=", "image/png or image/jpeg"),
        (url(b"GIF89a" + bytes(20)), "neither a PNG nor a JPEG"),
        (url(encoded(noise(32, 32))[:500]), "cannot decode the PNG"),
        (url(claiming(5000, 5000)), "5000x5000 = 25000000 pixels; at most 16777216"),
        (url(claiming(20000, 20000)), "more pixels than PIL decodes"),
        (url(claiming(0, 5)), "do not parse as a PNG image|empty"),
        (3.5, "got float"),
        (b"\x89PNG", "got bytes"),
    ],
    ids=["bad-chars", "whitespace", "no-comma", "not-base64", "gif-type", "webp-truncated", "no-type", "gif",
         "truncated",
         "too-many-pixels", "pil-bomb-check", "zero-width", "float", "bytes"],
)
def test_bad_inputs_are_params_errors_naming_the_field(value, message):
    # In words for the client: never Pillow's name of the buffer it read (issue #39).
    assert "BytesIO" not in rejects(value, message).message


def test_the_byte_bound_applies_before_decoding():
    data = encoded(noise(64, 64))
    assert load_image(url(data), max_bytes=len(data)).size == (64, 64)
    rejects(url(data), f"larger than {len(data) - 10} bytes encoded", max_bytes=len(data) - 10)


@pytest.mark.parametrize(
    ("mode", "save", "chunk", "alpha"),
    [("RGB", {"quality": 80}, b"VP8 ", False), ("RGB", {"lossless": True}, b"VP8L", False),
     ("RGBA", {"lossless": True}, b"VP8L", True), ("RGBA", {"quality": 80}, b"VP8X", True)],
    ids=["lossy", "lossless", "lossless-alpha", "extended-alpha"],
)
def test_webps_are_read_from_their_own_header_then_decoded(mode, save, chunk, alpha):
    # The OpenAI doors take WebP uploads, so the core does (issue #39): every door reads the same formats.
    image = noise(37, 21).convert(mode)
    if alpha:
        image.putalpha(noise(37, 21).convert("L"))  # not all opaque: the encoder keeps it
    data = encoded(image, "WEBP", **save)
    assert data[12:16] == chunk
    assert read_header(data) == ImageHeader("WEBP", 37, 21, alpha)
    got = load_image(url(data, "image/webp"))
    assert got.mode == "RGB" and got.size == (37, 21)
    if save.get("lossless"):
        assert got.tobytes() == image.convert("RGB").tobytes()
    assert open_image(data).mode == ("RGBA" if alpha else "RGB")


def test_a_webp_declaring_a_huge_canvas_is_refused_before_pillow_opens_it(monkeypatch):
    # Pillow's WebP reader builds libwebp's decoder, canvas included, as it opens a file:
    # the declared size is read here first.
    from benchmarks.tenant_inputs import webp_bomb

    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow opened a WebP bomb"))
    assert read_header(webp_bomb(16000)) == ImageHeader("WEBP", 16000, 16000, False)
    rejects(url(webp_bomb(16000), "image/webp"), "16000x16000 = 256000000 pixels; at most 16777216")


def test_pngs_say_whether_they_have_an_alpha_channel():
    # An OpenAI mask is transparent where to paint: the door knows from the header whether to convert it.
    for mode, alpha in (("RGB", False), ("L", False), ("RGBA", True), ("LA", True)):
        assert read_header(encoded(noise().convert(mode))).alpha is alpha
    palette = noise().convert("P")
    assert read_header(encoded(palette, transparency=0)).alpha is True
