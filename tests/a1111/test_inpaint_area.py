"""A masked img2img as A1111 runs it around its sampler: "Only masked", the fill, the overlay
(a1111/inpaint_area.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from omni_stream.a1111.inpaint_area import (
    BLANK_MASK_NOTE,
    Inpainting,
    crop_region,
    expand_crop_region,
    inpainting,
    overlaid,
)
from omni_stream.a1111.masks import blurred
from omni_stream.errors import MessageError


def png(image: Image.Image, text: dict[str, str] | None = None) -> bytes:
    info = PngInfo()
    for key, value in (text or {}).items():
        info.add_text(key, value)
    out = io.BytesIO()
    image.save(out, "PNG", pnginfo=info)
    return out.getvalue()


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def box_mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    """White (repaint) in ``box`` (x1, y1, x2, y2), black elsewhere."""
    pixels = np.zeros((height, width), dtype=np.uint8)
    x1, y1, x2, y2 = box
    pixels[y1:y2, x1:x2] = 255
    return Image.fromarray(pixels)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def prepare(init: Image.Image, mask: Image.Image, **fields: object) -> Inpainting:
    args: dict[str, object] = dict(size=None, blur_x=0, blur_y=0, full_res=False, padding=0, fill_mode=1)
    return inpainting(png(init), png(mask), **{**args, **fields})  # type: ignore[arg-type]


def test_the_crop_region_is_a1111s_grown_to_the_aspect_ratio() -> None:
    # Worked through A1111's get_crop_region_v2 and expand_crop_region by hand.
    wide = box_mask(64, 64, (10, 40, 20, 45))
    assert crop_region(wide) == (10, 40, 20, 45)  # no padding: the box itself
    assert crop_region(wide, 4) == (6, 36, 24, 49)  # 18 x 13
    assert expand_crop_region((6, 36, 24, 49), 32, 32, 64, 64) == (6, 34, 24, 52)  # 13 -> 18 down: 2 up, 3 down
    # At the bottom and right edges: the padding stops there; grown across to 2:1, it is shifted left.
    corner = box_mask(64, 48, (50, 30, 60, 48))
    assert crop_region(corner, 8) == (42, 22, 64, 48)  # 22 x 26
    assert expand_crop_region((42, 22, 64, 48), 64, 32, 64, 48) == (12, 22, 64, 48)  # 52 x 26
    # At the left edge: grown 18 across, 9 each side, then shifted right by the 9 it left the image.
    edge = box_mask(40, 40, (0, 10, 4, 30))
    assert crop_region(edge, 2) == (0, 8, 6, 32)
    assert expand_crop_region((0, 8, 6, 32), 16, 16, 40, 40) == (0, 8, 24, 32)
    assert crop_region(Image.new("L", (8, 8)), 32) is None  # blank


def test_only_masked_repaints_the_region_and_pastes_the_result_back_there() -> None:
    init = picture(64, 48)
    mask = box_mask(64, 48, (50, 30, 60, 48))
    area = prepare(init, mask, size=(64, 32), full_res=True, padding=8)
    assert area.overlay is not None and area.overlay.paste_to == (12, 22, 52, 26)  # x, y, w, h of (12, 22, 64, 48)
    assert area.extra == {"Inpaint area": "Only masked", "Masked area padding": 8} and area.note is None
    # The region (52 x 26, 2:1 as 64 x 32) cropped and resized to the request's size: what it repaints.
    assert area.image is not None and area.mask is not None
    cropped = init.crop((12, 22, 64, 48)).resize((64, 32), Image.Resampling.LANCZOS)
    assert (pixels(area.image) == np.asarray(cropped)).all()
    cropped_mask = mask.crop((12, 22, 64, 48)).resize((64, 32), Image.Resampling.LANCZOS)
    assert (np.asarray(Image.open(io.BytesIO(area.mask))) == np.asarray(cropped_mask)).all()
    # A result (a flat magenta, with its infotext) lands in the region, under the mask only.
    result = png(Image.new("RGB", (64, 32), (255, 0, 255)), {"parameters": "a cat\nSteps: 2", "omni_stream": "{}"})
    back = overlaid(result, area.overlay)
    out, sent = pixels(back), np.asarray(init)
    assert out.shape == (48, 64, 3)  # the init image's size: the picture, not the crop
    inside = np.asarray(mask) > 0
    assert (out[~inside] == sent[~inside]).all()  # byte for byte, the region's unmasked pixels too
    assert (out[inside] == (255, 0, 255)).all()
    assert Image.open(io.BytesIO(back)).text == {"parameters": "a cat\nSteps: 2", "omni_stream": "{}"}


def test_pixels_outside_the_mask_come_back_as_they_were_sent() -> None:
    init = picture(48, 48, seed=1)
    hard = box_mask(48, 48, (28, 4, 44, 20))
    area = prepare(init, hard, size=(48, 48), blur_x=4, blur_y=4)  # the whole picture, blurred as A1111's
    assert area.image is None and area.mask is not None and area.extra == {}  # fill 1: the image as it came
    soft = blurred(np.asarray(hard), 4, 4)
    assert (np.asarray(Image.open(io.BytesIO(area.mask))) == soft).all()
    assert area.overlay is not None and area.overlay.paste_to is None
    result = picture(48, 48, seed=2)  # what the VAE gave back: every pixel another
    back = pixels(overlaid(png(result, {"parameters": "x"}), area.overlay))
    untouched = soft == 0
    assert untouched.sum() > 1000 and (back[untouched] == np.asarray(init)[untouched]).all()
    # Where the mask, doubled (A1111's mask_for_overlay), is white, the result shows through.
    repainted = soft >= 128
    assert repainted.any() and (back[repainted] == np.asarray(result)[repainted]).all()


def test_fill_changes_only_the_masked_pixels_of_the_init_image() -> None:
    init = picture(32, 24, seed=3)
    mask = box_mask(32, 24, (8, 6, 20, 14))
    area = prepare(init, mask, fill_mode=0)
    assert area.image is not None and area.extra == {"Masked content": "fill"}
    changed = (pixels(area.image) != np.asarray(init)).any(axis=2)
    inside = np.asarray(mask) > 0
    assert not changed[~inside].any()  # outside the mask: the very pixels sent
    assert changed[inside].mean() > 0.9  # inside: blurred colours of the pixels around
    # 2 and 3 (latent noise, latent nothing) fill the pixels as A1111 does before its latent step.
    noise = prepare(init, mask, fill_mode=2)
    assert noise.image == area.image and noise.extra == {}


def test_a_blank_mask_only_masked_is_a_plain_img2img_as_a1111s() -> None:
    init = picture(16, 16)
    area = prepare(init, Image.new("L", (16, 16)), full_res=True, padding=32, size=(16, 16))
    assert (area.overlay, area.extra, area.note) == (None, {}, BLANK_MASK_NOTE)
    assert area.image is None and area.mask is not None  # the image as it came, all of it repainted
    assert (np.asarray(Image.open(io.BytesIO(area.mask))) == 255).all()


def test_bytes_that_are_no_image_are_refused_naming_the_field() -> None:
    for init, mask, field in ((b"\x89PNG\r\n\x1a\n" + b"\0" * 40, png(Image.new("L", (8, 8))), "init_images"),
                              (png(picture(8, 8)), b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "mask")):
        with pytest.raises(MessageError) as info:
            inpainting(init, mask, size=None, blur_x=0, blur_y=0, full_res=False, padding=0, fill_mode=1)
        assert info.value.field == field
