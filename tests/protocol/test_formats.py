"""protocol/formats.py: one format table, shared by the encoder, the server and the client."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from omni_stream.protocol.formats import FORMATS, PREVIEW_FORMATS, has_signature


def _file(pillow_format: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 200, 30)).save(out, pillow_format)
    return out.getvalue()


def test_every_format_has_its_mime_type() -> None:
    assert dict(FORMATS) == {
        "jpeg": "image/jpeg",
        "png": "image/png",
        "webp": "image/webp",
        "raw": "application/octet-stream",
        "mp4": "video/mp4",
        "gif": "image/gif",
    }


def test_preview_formats_are_the_still_image_ones_in_models_order() -> None:
    assert list(PREVIEW_FORMATS) == ["jpeg", "png", "webp", "raw"]
    assert all(PREVIEW_FORMATS[name] == FORMATS[name] for name in PREVIEW_FORMATS)


def test_the_encoder_and_the_client_read_this_very_table() -> None:
    import importlib

    from omni_stream import client, preview

    # (omni_stream.preview.encode, the attribute, is the encode() function.)
    assert importlib.import_module("omni_stream.preview.encode").FORMATS is PREVIEW_FORMATS
    assert preview.FORMATS is PREVIEW_FORMATS
    assert client.FORMATS is FORMATS


def test_the_table_cannot_be_changed_by_one_of_its_readers() -> None:
    with pytest.raises(TypeError):
        FORMATS["tiff"] = "image/tiff"  # type: ignore[index]


@pytest.mark.parametrize(
    ("fmt", "data"),
    [
        ("jpeg", _file("JPEG")),
        ("png", _file("PNG")),
        ("webp", _file("WEBP")),
        ("gif", _file("GIF")),
        ("mp4", b"\x00\x00\x00\x18ftypisom"),
        ("raw", b"\x00" * 36),
    ],
)
def test_a_real_file_has_its_formats_signature_and_no_other(fmt: str, data: bytes) -> None:
    assert has_signature(fmt, data)
    others = [name for name in FORMATS if name not in (fmt, "raw") and has_signature(name, data)]
    assert others == []


def test_an_unknown_format_has_no_signature() -> None:
    assert not has_signature("tiff", b"II*\x00")
