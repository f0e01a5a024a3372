"""An img2img mask blurred as A1111 blurs it (a1111/masks.py)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from omni_stream.a1111.masks import blurred, gaussian_kernel, grey_mask


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


def test_a_transparent_masks_alpha_is_the_mask_as_a1111_reads_it() -> None:
    # Red everywhere, opaque on the left half only: A1111 reads the alpha (over 128: repaint).
    rgba = Image.new("RGBA", (16, 16), (255, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 8, 16))
    hard, from_alpha = grey_mask(rgba)
    assert from_alpha and (np.asarray(hard) == np.asarray(half().convert("L"))).all()
    grey, from_alpha = grey_mask(half(mode="RGBA"))  # all opaque: its grey, as it came
    assert not from_alpha and (np.asarray(grey) == np.asarray(half().convert("L"))).all()
