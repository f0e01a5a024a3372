"""A PNG's infotext read back for /png-info (a1111/infotext.py)."""

from __future__ import annotations

import io
import json

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from omni_stream.a1111.infotext import a1111_fields, png_text, request_of

TEXT = (
    "a harbour, at dawn <lora:ink:0.8>\nNegative prompt: blurry\n"
    'Steps: 20, Sampler: dpmpp_2m_karras, CFG scale: 7.5, Seed: 42, Size: 512x768, Model: sd, '
    'num_images: 2, Lora hashes: "ink: 1f3a6c0b2d4e"'
)


def test_an_infotext_reads_as_a1111s_png_info_with_the_sampler_in_a1111s_name() -> None:
    fields = a1111_fields(TEXT)
    assert fields["Prompt"] == "a harbour, at dawn <lora:ink:0.8>" and fields["Negative prompt"] == "blurry"
    assert (fields["Steps"], fields["Size-1"], fields["Size-2"], fields["Model"]) == ("20", "512", "768", "sd")
    assert (fields["Sampler"], fields["Schedule type"]) == ("DPM++ 2M", "Karras")
    assert fields["Lora hashes"] == "ink: 1f3a6c0b2d4e"
    assert a1111_fields("Steps: 4, Sampler: Euler a, Seed: 1")["Schedule type"] == "Automatic"
    assert a1111_fields("Steps: 4, Sampler: default, Seed: 1")["Sampler"] == "default"  # not A1111's


def test_the_request_of_an_infotext_is_the_txt2img_body_that_makes_it_again() -> None:
    assert request_of(a1111_fields(TEXT)) == {
        "prompt": "a harbour, at dawn <lora:ink:0.8>", "negative_prompt": "blurry", "steps": 20, "cfg_scale": 7.5,
        "seed": 42, "width": 512, "height": 768, "sampler_name": "DPM++ 2M", "scheduler": "karras",
        "override_settings": {"sd_model_checkpoint": "sd"}, "batch_size": 2,
    }
    # The batch from the omni_stream JSON where the text does not say it; a bad number is left out.
    fields = a1111_fields("a cat\nSteps: x, Seed: 3, Size: 16x16")
    made = request_of(fields, {"omni_stream": json.dumps({"num_images": 3})})
    assert made == {"prompt": "a cat", "negative_prompt": "", "seed": 3, "width": 16, "height": 16, "batch_size": 3}


def test_a_pngs_text_is_read_without_its_pixels_and_other_bytes_have_none() -> None:
    info = PngInfo()
    info.add_text("parameters", TEXT)
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG", pnginfo=info)
    assert png_text(buf.getvalue()) == {"parameters": TEXT}
    jpeg = io.BytesIO()
    Image.new("RGB", (4, 4)).save(jpeg, "JPEG")
    assert png_text(jpeg.getvalue()) == {} and png_text(b"not an image") == {}
