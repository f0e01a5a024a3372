"""An img2img with a mask as AUTOMATIC1111 runs it around its sampler (pure, numpy + Pillow).

A1111 (``StableDiffusionProcessingImg2Img.init`` in ``modules/processing.py``)
does three things in pixels that a diffusers inpaint pipeline does not, each
done here with A1111's own Pillow calls, so the pixels are A1111's:

- **Only masked** (``inpaint_full_res``): the blurred mask's bounding box,
  grown by ``inpaint_full_res_padding`` (``get_crop_region_v2``), then
  grown to the aspect ratio of ``width`` x ``height``
  (``expand_crop_region``); the init image and the mask are cropped to it
  and resized to ``width`` x ``height`` ("resize and fill", resize mode 2),
  and that is what the sampler repaints. The result is resized back to the
  region ("crop and resize", mode 1) and pasted into the picture at its
  place. A blank mask has no region: A1111 says so (:data:`BLANK_MASK_NOTE`)
  and runs a plain img2img, which for an inpaint pipeline is a white mask.
- **The fill** (``inpainting_fill`` other than 1, "original"):
  ``masking.fill``, the masked pixels of the init image replaced by blurred
  colours of the pixels around them, before it is encoded. A1111 does it for
  0 ("fill") and, before its latent step, for 2 and 3 too.
- **The overlay**, always: the init image's pixels where the mask is not
  (RGBA, the inverted mask as alpha: ``mask_for_overlay``, doubled when the
  whole picture is repainted), composited over each result
  (``apply_overlay``), so pixels outside the mask come back as they were
  sent, not through the VAE.

:func:`inpainting` prepares a request's images and its :class:`Overlay`;
:func:`overlaid` lays that over a result PNG, its text chunks kept. Both for
a worker thread: an image of the server's largest side takes a second or so.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ..errors import MessageError, ParamsError
from ..models.inputs import open_image
from .masks import blurred, grey_mask

__all__ = [
    "BLANK_MASK_NOTE",
    "Inpainting",
    "Overlay",
    "apply_overlay",
    "crop_region",
    "expand_crop_region",
    "fill",
    "flatten",
    "inpainting",
    "overlaid",
    "resize_image",
]

#: A1111's comment (and log line) when "Only masked" meets a blank mask (its spelling).
BLANK_MASK_NOTE: Final = (
    'Unable to perform "Inpaint Only mask" because mask is blank, switch to img2img mode.'
)
#: ``masking.fill``'s layers: (Gaussian blur radius, times composited), in that order.
_FILL_LAYERS: Final = ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1))
#: A1111's ``img2img_background_color``: what a transparent init image is flattened onto.
_BACKGROUND: Final = "#ffffff"
#: The PNG compression of a result (preview/save.py's).
_PNG_LEVEL: Final = 6


@dataclass(frozen=True, slots=True)
class Overlay:
    """What is laid over each result: ``image`` (RGBA, the init image where the mask is not) and,
    for "Only masked", ``paste_to`` (x, y, width, height: where the result goes in it)."""

    image: Any
    paste_to: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class Inpainting:
    """A masked img2img as A1111 prepares it: the init image and mask to pass on (PNG; None: as
    they came), the :class:`Overlay` of its results (None: none), the ``extra`` generation params
    A1111 writes for it, and A1111's ``note`` (None: none)."""

    image: bytes | None
    mask: bytes | None
    overlay: Overlay | None
    extra: dict[str, Any] = field(default_factory=dict)
    note: str | None = None


# -- A1111's functions, one for one ----------------------------------------------------


def crop_region(mask: Any, pad: int = 0) -> tuple[int, int, int, int] | None:
    """``masking.get_crop_region_v2``: the box (x1, y1, x2, y2) of a grey mask's non-black
    pixels, grown by ``pad`` on each side within the mask; None for a blank mask."""
    box = mask.getbbox()
    if not box:
        return None
    x1, y1, x2, y2 = box
    if not pad:
        return x1, y1, x2, y2
    return max(x1 - pad, 0), max(y1 - pad, 0), min(x2 + pad, mask.width), min(y2 + pad, mask.height)


def expand_crop_region(
    region: tuple[int, int, int, int], width: int, height: int, image_width: int, image_height: int
) -> tuple[int, int, int, int]:
    """``masking.expand_crop_region``: ``region`` grown (across or down) to the aspect ratio of
    ``width`` x ``height``, shifted back inside the image where it would leave it."""
    x1, y1, x2, y2 = region
    ratio = width / height
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _grown(y1, y2, int((x2 - x1) / ratio - (y2 - y1)), image_height)
    else:
        x1, x2 = _grown(x1, x2, int((y2 - y1) * ratio - (x2 - x1)), image_width)
    return x1, y1, x2, y2


def _grown(low: int, high: int, by: int, limit: int) -> tuple[int, int]:
    """One side of ``expand_crop_region``: ``low``-``high`` grown by ``by`` about its middle, then
    shifted back inside ``0``-``limit`` (A1111's steps, in its order)."""
    low -= by // 2
    high += by - by // 2
    if high >= limit:
        low -= high - limit
        high = limit
    if low < 0:
        high -= low
        low = 0
    return low, min(high, limit)


def resize_image(mode: int, image: Any, width: int, height: int) -> Any:
    """``images.resize_image`` without an upscaler (A1111's default): 0 just resize, 1 crop and
    resize (cover, centred), 2 resize and fill (fit, centred, the bands stretched from the
    image's edge rows or columns). Modes 1 and 2 give RGB, as A1111's do."""
    from PIL import Image

    lanczos = Image.Resampling.LANCZOS
    if image.mode == "RGBA":
        image = image.convert("RGB")
    if mode == 0:
        return image.resize((width, height), resample=lanczos)
    ratio = width / height
    src_ratio = image.width / image.height
    if mode == 1:
        src_w = width if ratio > src_ratio else image.width * height // image.height
        src_h = height if ratio <= src_ratio else image.height * width // image.width
    else:
        src_w = width if ratio < src_ratio else image.width * height // image.height
        src_h = height if ratio >= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=lanczos)
    out = Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if mode == 2:
        # (Pillow's default filter for the bands, as A1111 calls it.)
        if ratio < src_ratio:
            band = height // 2 - src_h // 2
            if band > 0:
                out.paste(resized.resize((width, band), box=(0, 0, width, 0)), box=(0, 0))
                bottom = resized.resize((width, band), box=(0, resized.height, width, resized.height))
                out.paste(bottom, box=(0, band + src_h))
        elif ratio > src_ratio:
            band = width // 2 - src_w // 2
            if band > 0:
                out.paste(resized.resize((band, height), box=(0, 0, 0, height)), box=(0, 0))
                right = resized.resize((band, height), box=(resized.width, 0, resized.width, height))
                out.paste(right, box=(band + src_w, 0))
    return out


def fill(image: Any, mask: Any) -> Any:
    """``masking.fill``: ``image`` (RGB) with the pixels under ``mask`` (white) replaced by the
    blurred colours of those around them; pixels where the mask is black are kept as they are."""
    from PIL import Image, ImageFilter, ImageOps

    out = Image.new("RGBA", (image.width, image.height))
    masked = Image.new("RGBa", (image.width, image.height))
    masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    for radius, repeats in _FILL_LAYERS:
        layer = masked.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            out.alpha_composite(layer)
    return out.convert("RGB")


def flatten(image: Any) -> Any:
    """``images.flatten``: an image with transparency composited onto A1111's white, as RGB."""
    from PIL import Image

    if _has_alpha(image):
        background = Image.new("RGBA", image.size, _BACKGROUND)
        background.alpha_composite(image.convert("RGBA"))
        image = background
    return image.convert("RGB")


def _has_alpha(image: Any) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _overlay_image(image: Any, mask: Any) -> Any:
    """A1111's ``overlay_images`` entry: ``image`` where ``mask`` is not (RGBA)."""
    from PIL import Image, ImageOps

    masked = Image.new("RGBa", (image.width, image.height))
    masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    return masked.convert("RGBA")


def apply_overlay(image: Any, overlay: Overlay) -> Any:
    """``apply_overlay``: a result (RGB) under ``overlay``; for "Only masked", first resized to its
    region (mode 1) and put in place on a transparent picture of the overlay's size."""
    from PIL import Image

    if overlay.paste_to is not None:
        x, y, w, h = overlay.paste_to
        base = Image.new("RGBA", overlay.image.size)
        base.paste(resize_image(1, image, w, h), (x, y))
        image = base
    elif image.size != overlay.image.size:
        # (Ours: A1111's results are always the size asked for; a pipeline's may not be.)
        image = resize_image(0, image, *overlay.image.size)
    image = image.convert("RGBA")
    image.alpha_composite(overlay.image)
    return image.convert("RGB")


# -- the door's two calls ---------------------------------------------------------------


def _png(image: Any, pnginfo: Any = None) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", pnginfo=pnginfo, compress_level=_PNG_LEVEL)
    return out.getvalue()


def _opened(data: bytes, field: str) -> Any:
    try:
        return open_image(data, field=field)
    except ParamsError as exc:
        raise MessageError("bad_params", exc.message, field=field) from None


def inpainting(
    init: bytes,
    mask: bytes,
    *,
    size: tuple[int, int] | None,
    blur_x: int,
    blur_y: int,
    full_res: bool,
    padding: int,
    fill_mode: int,
) -> Inpainting:
    """The init image ``init`` and mask ``mask`` (encoded, their sides already checked) of a
    request that makes ``size`` (width, height; None: the init image's) as A1111 prepares them:
    the mask read and blurred (``a1111/masks.py``), "Only masked" when ``full_res`` (``padding``),
    ``fill_mode`` (A1111's ``inpainting_fill``: all but 1 fill the masked pixels), the overlay.

    Raises MessageError ``bad_params`` naming ``init_images`` or ``mask`` for bytes that do not
    decode.
    """
    from PIL import Image

    with _opened(init, "init_images") as opened:
        had_alpha = _has_alpha(opened)
        image = flatten(opened)
    with _opened(mask, "mask") as opened:
        grey, from_alpha = grey_mask(opened)
        soft = Image.fromarray(blurred(np.asarray(grey, dtype=np.uint8), blur_x, blur_y))
    mask_changed = from_alpha or blur_x > 0 or blur_y > 0
    width, height = size or image.size
    extra: dict[str, Any] = {}
    if full_res:
        if soft.size != image.size:
            # (Ours: A1111 crops the image where the region is in the mask, whatever its size.)
            soft = resize_image(0, soft, *image.size)
        region = crop_region(soft, padding)
        if region is None:
            # A1111 drops the mask and runs a plain img2img; an inpaint pipeline's is a white mask.
            white = Image.new("L", image.size, 255)
            return Inpainting(_png(image) if had_alpha else None, _png(white), None, note=BLANK_MASK_NOTE)
        region = expand_crop_region(region, width, height, soft.width, soft.height)
        x1, y1, x2, y2 = region
        overlay = Overlay(_overlay_image(image, soft), (x1, y1, x2 - x1, y2 - y1))
        passed_mask = resize_image(2, soft.crop(region), width, height).convert("L")
        passed_image = resize_image(2, image.crop(region), width, height)
        extra.update({"Inpaint area": "Only masked", "Masked area padding": padding})
    else:
        passed_mask = resize_image(0, soft, width, height)
        doubled = np.clip(np.asarray(passed_mask).astype(np.float32) * 2, 0, 255).astype(np.uint8)
        passed_image = resize_image(0, image, width, height)
        overlay = Overlay(_overlay_image(passed_image, Image.fromarray(doubled)))
        if fill_mode == 1:
            # Nothing else changes them: the pipeline resizes both to the size as A1111 does
            # (Lanczos), so they go on as they came where they can.
            return Inpainting(
                _png(image) if had_alpha else None, _png(soft) if mask_changed else None, overlay, extra
            )
    if fill_mode != 1:
        passed_image = fill(passed_image, passed_mask)
        if fill_mode == 0:
            extra["Masked content"] = "fill"
    return Inpainting(_png(passed_image), _png(passed_mask), overlay, extra)


def overlaid(png: bytes, overlay: Overlay) -> bytes:
    """A result PNG under ``overlay`` (``apply_overlay``), as a PNG with the same text chunks (its
    infotext). Raises OSError (Pillow's) for bytes that are no image."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    with Image.open(io.BytesIO(png)) as opened:
        chunks = {k: v for k, v in opened.info.items() if isinstance(k, str) and isinstance(v, str)}
        image = opened.convert("RGB")
    info = PngInfo()
    for key, value in chunks.items():
        info.add_text(key, value)
    return _png(apply_overlay(image, overlay), info)
