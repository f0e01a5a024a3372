"""Encoders: formats decode back, shrinking only, raw layout, option errors."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
from PIL import Image

from omni_stream.errors import ParamsError
from omni_stream.preview.encode import DEFAULT_QUALITY, encode, fit_size


def _image(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(
        np.uint8
    )


@pytest.mark.parametrize(
    "fmt, pil_format, mime",
    [("jpeg", "JPEG", "image/jpeg"), ("png", "PNG", "image/png"), ("webp", "WEBP", "image/webp")],
)
def test_formats_decode_back_with_pillow_at_the_right_size(fmt, pil_format, mime):
    rgb = _image(48, 80)
    out = encode(rgb, format=fmt)
    assert (out.format, out.mime, out.width, out.height) == (fmt, mime, 80, 48)
    assert isinstance(out.data, bytes)
    back = Image.open(io.BytesIO(out.data))
    assert back.format == pil_format
    assert back.size == (80, 48)
    assert back.mode == "RGB"
    pixels = np.asarray(back)
    if fmt == "png":
        np.testing.assert_array_equal(pixels, rgb)  # lossless
    else:
        assert np.abs(pixels.astype(int) - rgb).mean() < 8


def test_raw_is_the_rgb_bytes_row_major():
    rgb = _image(3, 5)
    out = encode(rgb, format="raw")
    assert (out.width, out.height, out.mime) == (5, 3, "application/octet-stream")
    assert len(out.data) == 3 * 5 * 3
    # pixel (y, x) channel k lives at ((y * width) + x) * 3 + k
    for y, x, k in [(0, 0, 0), (2, 4, 2), (1, 3, 1)]:
        assert out.data[(y * 5 + x) * 3 + k] == rgb[y, x, k]


def test_raw_of_a_non_contiguous_array_is_row_major():
    planes = np.ascontiguousarray(_image(4, 6).transpose(2, 0, 1))
    view = planes.transpose(1, 2, 0)  # [H, W, 3], not C-contiguous
    assert not view.flags.c_contiguous
    assert encode(view, format="raw").data == np.ascontiguousarray(view).tobytes()


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp", "raw"])
def test_max_size_shrinks_the_longer_side_keeping_aspect(fmt):
    out = encode(_image(300, 600), format=fmt, max_size=100)
    assert (out.width, out.height) == (100, 50)
    if fmt == "raw":
        assert len(out.data) == 100 * 50 * 3
    else:
        assert Image.open(io.BytesIO(out.data)).size == (100, 50)


@pytest.mark.parametrize("max_size", [64, 65, 1000, None])
def test_max_size_never_enlarges(max_size):
    out = encode(_image(40, 64), format="png", max_size=max_size)
    assert (out.width, out.height) == (64, 40)


def test_fit_size():
    assert fit_size(1024, 768, 512) == (512, 384)
    assert fit_size(768, 1024, 512) == (384, 512)
    assert fit_size(512, 512, 512) == (512, 512)
    assert fit_size(100, 50, None) == (100, 50)
    assert fit_size(1000, 1, 10) == (10, 1)  # never below one pixel


def test_shrunk_raw_matches_shrunk_png():
    rgb = _image(90, 120)
    raw = encode(rgb, format="raw", max_size=40)
    png = encode(rgb, format="png", max_size=40)
    assert np.asarray(Image.open(io.BytesIO(png.data))).tobytes() == raw.data


def test_quality_changes_jpeg_size_and_defaults_apply():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    low = encode(rgb, format="jpeg", quality=10)
    high = encode(rgb, format="jpeg", quality=95)
    default = encode(rgb, format="jpeg")
    assert len(low.data) < len(default.data) < len(high.data)
    assert default.data == encode(rgb, format="jpeg", quality=DEFAULT_QUALITY["jpeg"]).data


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"format": "gif"}, "format"),
        ({"format": "JPEG"}, "format"),
        ({"format": None}, "format"),
        ({"format": "jpeg", "quality": 0}, "quality"),
        ({"format": "jpeg", "quality": 101}, "quality"),
        ({"format": "jpeg", "quality": 90.0}, "quality"),
        ({"format": "jpeg", "quality": True}, "quality"),
        ({"format": "png", "quality": 90}, "quality"),
        ({"format": "raw", "quality": 90}, "quality"),
        ({"format": "jpeg", "max_size": 0}, "max_size"),
        ({"format": "jpeg", "max_size": -5}, "max_size"),
        ({"format": "jpeg", "max_size": 512.0}, "max_size"),
        ({"format": "jpeg", "max_size": "512"}, "max_size"),
        ({"format": "jpeg", "max_size": False}, "max_size"),
    ],
)
def test_bad_options_raise_params_error_naming_the_field(kwargs, field):
    with pytest.raises(ParamsError) as info:
        encode(_image(4, 4), **kwargs)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    "rgb",
    [
        np.zeros((4, 4, 3), dtype=np.float32),
        np.zeros((3, 4, 4), dtype=np.uint8),
        np.zeros((4, 4, 4), dtype=np.uint8),
        np.zeros((4, 4), dtype=np.uint8),
        np.zeros((0, 4, 3), dtype=np.uint8),
        [[[0, 0, 0]]],
    ],
)
def test_bad_rgb_raises_params_error(rgb):
    with pytest.raises(ParamsError) as info:
        encode(rgb)
    assert info.value.field == "rgb"


def test_encoded_image_is_frozen_and_its_repr_is_short():
    out = encode(_image(4, 4), format="raw")
    with pytest.raises(AttributeError):
        out.width = 3  # type: ignore[misc]
    assert repr(out) == "EncodedImage(format='raw', 4x4, 48 bytes)"


def _decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


@pytest.mark.parametrize("shape, max_size", [((96, 128), None), ((200, 300), 120)])
def test_jpeg_encodes_through_simplejpeg_when_installed(shape, max_size, monkeypatch):
    # simplejpeg releases the GIL for the whole encode (Pillow's encoder holds
    # it), which is what lets a preview overlap the producer's next step.
    encode_module = sys.modules["omni_stream.preview.encode"]  # the package exports a function of that name

    simplejpeg = pytest.importorskip("simplejpeg")
    calls = []
    real = simplejpeg.encode_jpeg

    def spy(image, **kwargs):
        calls.append((image.shape, kwargs))
        return real(image, **kwargs)

    monkeypatch.setattr(encode_module.simplejpeg, "encode_jpeg", spy)
    out = encode(_image(*shape), format="jpeg", max_size=max_size)
    assert len(calls) == 1
    (got_shape, kwargs) = calls[0]
    assert got_shape == (out.height, out.width, 3)
    assert kwargs["quality"] == DEFAULT_QUALITY["jpeg"] and kwargs["colorspace"] == "RGB"
    assert _decoded(out.data).shape == (out.height, out.width, 3)


def test_jpeg_falls_back_to_pillow_with_the_same_picture(monkeypatch):
    encode_module = sys.modules["omni_stream.preview.encode"]  # the package exports a function of that name

    pytest.importorskip("simplejpeg")
    rgb = _image(64, 96)
    fast = encode(rgb, format="jpeg", quality=90)
    monkeypatch.setattr(encode_module, "simplejpeg", None)
    pillow = encode(rgb, format="jpeg", quality=90)
    assert (fast.width, fast.height) == (pillow.width, pillow.height) == (96, 64)
    a, b = _decoded(fast.data), _decoded(pillow.data)
    # Two libjpeg builds at the same quality and subsampling: the same picture
    # to within JPEG noise, and both close to the source.
    assert np.abs(a - b).mean() < 2.0
    assert np.abs(a - rgb.astype(np.int16)).mean() < 4.0
    assert 0.5 < len(fast.data) / len(pillow.data) < 2.0


def test_grid_cells_are_where_image_grid_draws_each_image_and_scale_with_it():
    from omni_stream.preview import grid_cells, image_grid

    images = [np.full((2, 4, 3), 10 * (k + 1), np.uint8) for k in range(3)]
    grid = image_grid(images)  # 3 images: 2 columns, 2 rows, the last cell black
    assert grid.shape == (4, 8, 3)
    cells = grid_cells(3, 8, 4)
    assert cells == ((0, 0, 4, 2), (4, 0, 8, 2), (0, 2, 4, 4))
    for (left, top, right, bottom), rgb in zip(cells, images, strict=True):
        assert np.array_equal(grid[top:bottom, left:right], rgb)
    # Once the grid is shrunk (max_size), the boxes are the shrunk grid's.
    assert grid_cells(3, 4, 2) == ((0, 0, 2, 1), (2, 0, 4, 1), (0, 1, 2, 2))
    assert grid_cells(1, 8, 4) == ((0, 0, 8, 4),)


def test_an_encoded_image_has_no_cells_unless_it_is_a_grid():
    out = encode(_image(4, 4), format="png")
    assert out.cells == ()

