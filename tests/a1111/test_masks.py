"""An img2img mask blurred as A1111 blurs it (a1111/masks.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni_stream.a1111.masks import blurred, gaussian_kernel, prepared_mask
from omni_stream.errors import MessageError


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def half(width: int = 16, height: int = 16, mode: str = "RGB") -> Image.Image:
    """White (repaint) on the left half, black on the right."""
    pixels = np.zeros((height, width), dtype=np.uint8)
    pixels[:, : width // 2] = 255
    return Image.fromarray(pixels).convert(mode)


def test_the_kernel_is_opencvs_fixed_point_gaussian() -> None:
    # cv2.GaussianBlur's 8-bit kernel for sigma 4 (size 2 * int(2.5 * 4 + 0.5) + 1 = 21), in 256ths.
    assert gaussian_kernel(4).tolist() == [1, 2, 4, 5, 9, 11, 16, 19, 23, 25, 26, 25, 23, 19, 16, 11, 9, 5, 4, 2, 1]
    for sigma in (1, 4, 64):
        kernel = gaussian_kernel(sigma)
        assert len(kernel) == 2 * int(2.5 * sigma + 0.5) + 1 and kernel.sum() == 256


def test_the_blur_is_a1111s_pixel_for_pixel() -> None:
    # A1111's (cv2.GaussianBlur across, then down, kernel 21, sigma 4) of a half mask, row 0.
    row = [241, 240, 233, 223, 207, 188, 165, 140, 115, 90, 67, 48, 32, 22, 15, 14]
    out = blurred(np.asarray(half().convert("L")), 4, 4)
    assert out.dtype == np.uint8 and (out == np.array(row, dtype=np.uint8)).all()  # every row: the edge is vertical
    across = np.zeros((9, 9), dtype=np.uint8)
    across[4, 4] = 255
    only_x = blurred(across, 1, 0)
    assert only_x[3].sum() == 0 and only_x[4].sum() > 0  # across only: the other rows untouched


def test_the_mask_the_door_passes_on_is_blurred_and_a_blur_of_0_leaves_it_as_it_came() -> None:
    sent = png(half())
    soft = Image.open(io.BytesIO(prepared_mask(sent, 4, 4)))
    assert soft.mode == "L" and soft.size == (16, 16)
    pixels = np.asarray(soft)
    assert (pixels == blurred(np.asarray(half().convert("L")), 4, 4)).all()
    assert len(np.unique(pixels)) > 2  # softened: not black and white any more
    assert prepared_mask(sent, 0, 0) is sent  # the same bytes, not a copy of its pixels


def test_a_transparent_masks_alpha_is_the_mask_as_a1111_reads_it() -> None:
    # Red everywhere, opaque on the left half only: A1111 reads the alpha (over 128: repaint).
    rgba = Image.new("RGBA", (16, 16), (255, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 8, 16))
    hard = np.asarray(Image.open(io.BytesIO(prepared_mask(png(rgba), 0, 0))))
    assert (hard == np.asarray(half().convert("L"))).all()
    opaque = png(half(mode="RGBA"))
    assert prepared_mask(opaque, 0, 0) is opaque  # all opaque: its grey, as it came


def test_bytes_that_are_no_image_are_refused_naming_the_mask() -> None:
    with pytest.raises(MessageError) as info:
        prepared_mask(b"\x89PNG\r\n\x1a\n" + b"\0" * 40, 4, 4)
    assert (info.value.code, info.value.field) == ("bad_params", "mask")
