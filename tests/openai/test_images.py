"""OpenAI's Images API as our requests (omni_stream/openai/images.py): the parts issue #39 changed."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from omni_stream.openai import images as oi
from omni_stream.openai.errors import OpenAIError


def test_form_fields_are_json_where_they_read_as_json_and_refused_nested_too_deeply() -> None:
    assert oi.form_value("30", "steps") == 30 and oi.form_value("[1, 2]", "loras") == [1, 2]
    # Text that is no JSON is the text itself, NaN included (a JSON body holding it is refused).
    assert oi.form_value("[cinematic] a fox", "negative_prompt") == "[cinematic] a fox"
    assert oi.form_value("NaN", "negative_prompt") == "NaN"
    # 50,000 nested '[' were a RecursionError out of the door: a 500 (issue #39, attack 10).
    with pytest.raises(OpenAIError) as info:
        oi.form_value("[" * 50_000, "steps")
    assert (info.value.status, info.value.code, info.value.param) == (400, "bad_json", "steps")
    assert "nested too deeply" in info.value.message
    with pytest.raises(OpenAIError):
        oi.parse_images_request({"prompt": "x", "seed": "[" * 50_000}, form=True)


def test_an_openai_mask_becomes_white_where_it_is_transparent() -> None:
    mask = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    mask.putpixel((0, 0), (0, 0, 0, 0))
    palette = Image.new("P", (4, 2), 1)
    palette.putpixel((3, 1), 0)
    for picture, where in ((mask, (0, 0)), (palette, (3, 1))):
        buf = io.BytesIO()
        picture.save(buf, "PNG", **({"transparency": 0} if picture.mode == "P" else {}))
        painted = Image.open(io.BytesIO(oi.mask_to_paint(buf.getvalue())))
        assert painted.mode == "RGB" and painted.size == (4, 2)
        white = [(x, y) for y in range(2) for x in range(4) if painted.getpixel((x, y)) == (255, 255, 255)]
        assert white == [where]
