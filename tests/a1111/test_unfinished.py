"""The picture of an image /interrupt stopped, from its latest preview (a1111/unfinished.py)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from omni_stream.a1111.unfinished import unfinished_png
from omni_stream.preview.infotext import parse_infotext


def test_a_preview_becomes_a_png_of_the_images_size_with_its_infotext() -> None:
    preview = io.BytesIO()
    Image.new("RGB", (2, 3), (200, 10, 10)).save(preview, "PNG")
    params = {"model": "sd", "prompt": "a red cat", "steps": 900, "seed": 7, "sampler": "ddim"}
    made = Image.open(io.BytesIO(unfinished_png(preview.getvalue(), (16, 24), params)))
    assert (made.format, made.size, made.mode) == ("PNG", (16, 24), "RGB")
    assert (np.asarray(made) == (200, 10, 10)).all()  # one colour, scaled up: the same colour
    fields = parse_infotext(made.info["parameters"])
    assert (fields["Prompt"], fields["Seed"], fields["Size-1"], fields["Size-2"]) == ("a red cat", "7", "16", "24")
    same = Image.open(io.BytesIO(unfinished_png(preview.getvalue(), (2, 3), params)))
    assert same.size == (2, 3) and (np.asarray(same) == (200, 10, 10)).all()
