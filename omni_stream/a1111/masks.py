"""An img2img mask as AUTOMATIC1111 prepares it before use: ``mask_blur`` (pure, numpy + Pillow).

A1111 (``StableDiffusionProcessingImg2Img.init``) reads the mask as one
grey channel (``create_binary_mask``: the alpha channel, thresholded at
128, of an RGBA mask that has transparent pixels; else the image as grey),
then blurs it with OpenCV's ``GaussianBlur``, across (``mask_blur_x``) and
then down (``mask_blur_y``), each a one-dimensional Gaussian of sigma the
blur and of kernel size ``2 * int(2.5 * blur + 0.5) + 1``, edges reflected
as OpenCV's default border does (``dcb|abcd|cba``), and rounded back to
8 bits after each pass. :func:`grey_mask` and :func:`blurred` do the same
here with numpy in place of OpenCV, in OpenCV's own fixed-point arithmetic
for 8-bit images (its kernel's taps in 256ths), so the pipeline is handed
the mask A1111's own sampler would have been, pixel for pixel
(``inpaint_area.py`` reads the mask with them).

For a worker thread: a mask of the server's largest side (2048) at the
largest blur (:data:`MAX_MASK_BLUR`) takes a few seconds here.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

__all__ = ["DEFAULT_MASK_BLUR", "MAX_MASK_BLUR", "blurred", "gaussian_kernel", "grey_mask"]

#: A1111's ``mask_blur_x`` / ``mask_blur_y`` when a request names neither (nor ``mask_blur``).
DEFAULT_MASK_BLUR: Final = 4
#: The largest blur taken: A1111's UI slider's end (the kernel grows with it, its cost too).
MAX_MASK_BLUR: Final = 64


def gaussian_kernel(sigma: int) -> np.ndarray:
    """A1111's one-dimensional kernel for a blur of ``sigma``, as OpenCV's bit-exact 8-bit
    ``GaussianBlur`` uses it: ``getGaussianKernel`` of size ``2 * int(2.5 * sigma + 0.5) + 1``
    in fixed point of 8 fraction bits (``getGaussianKernelFixedPoint_ED``: each tap rounded
    with the error carried to the next, towards the centre, which takes what makes the sum
    exactly 256). ``int64`` taps."""
    size = 2 * int(2.5 * sigma + 0.5) + 1
    half = size // 2
    x = np.arange(-half, 0, dtype=np.float64)
    side = np.exp(-(x * x) / (2.0 * sigma * sigma))
    scale = 1.0 / (2.0 * float(side.sum()) + 1.0)
    taps = np.zeros(size, dtype=np.int64)
    error = 0.0
    for i, value in enumerate(side):
        adjusted = float(value) * scale * 256.0 + error
        rounded = round(adjusted)  # half to even, as cvRound
        error = adjusted - rounded
        taps[i] = taps[size - 1 - i] = rounded
    taps[half] = 256 - 2 * int(taps[:half].sum())
    return taps


def _blur_axis(mask: np.ndarray, sigma: int, axis: int) -> np.ndarray:
    kernel = gaussian_kernel(sigma)
    radius = len(kernel) // 2
    padding = [(0, 0), (0, 0)]
    padding[axis] = (radius, radius)
    # numpy's "reflect" is OpenCV's BORDER_REFLECT_101 (the edge pixel is not repeated), the
    # default border of the GaussianBlur A1111 calls.
    padded = np.pad(mask.astype(np.int32), padding, mode="reflect")
    out = np.zeros(mask.shape, dtype=np.int32)  # at most 255 x 256
    length = mask.shape[axis]
    for i, weight in enumerate(kernel):
        if weight:
            window = [slice(None), slice(None)]
            window[axis] = slice(i, i + length)
            out += int(weight) * padded[tuple(window)]
    # 8 fraction bits, rounded to the nearest 8-bit value (OpenCV's fixed-point cast).
    rounded: np.ndarray = np.clip((out + 128) >> 8, 0, 255).astype(np.uint8)
    return rounded


def blurred(mask: np.ndarray, blur_x: int, blur_y: int) -> np.ndarray:
    """A grey ``uint8`` mask ``[H, W]`` blurred as A1111 blurs it: across by ``blur_x``, then
    down by ``blur_y`` (0: that pass is not run)."""
    out = mask
    if blur_x > 0:
        out = _blur_axis(out, blur_x, axis=1)
    if blur_y > 0:
        out = _blur_axis(out, blur_y, axis=0)
    return out


def grey_mask(image: Any) -> tuple[Any, bool]:
    """A1111's ``create_binary_mask`` of a PIL image: its alpha thresholded (over 128: white)
    when it is RGBA with transparent pixels, else its grey (``L``); and whether it was the alpha."""
    if image.mode == "RGBA" and image.getextrema()[-1] != (255, 255):
        return image.getchannel("A").point(lambda v: 255 if v > 128 else 0), True
    return image.convert("L"), False
