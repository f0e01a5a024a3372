"""Checks before a generate reaches the engine: preview settings and params."""

from __future__ import annotations

import pytest

import omni_stream as om

from omni_stream.models import Synthetic
from omni_stream.preview import PreviewSpec
from omni_stream.server.admission import (
    OutputSpec,
    output_spec,
    cap_preview,
    check_params,
    default_decoder,
    preview_spec,
)
from omni_stream.server.limits import ServerLimits
from omni_stream.server.protocol import MessageError

LIMITS = ServerLimits(max_steps=50, max_image_size=256)


def spec(wire: dict | None) -> PreviewSpec:
    return preview_spec(
        wire, default=PreviewSpec(), decoder="rgb", limits=LIMITS, request_id="r"
    )


def test_preview_defaults_and_caps() -> None:
    assert spec(None) == PreviewSpec()
    assert spec({"format": "png"}).max_size == 256  # 512 by default, capped
    assert spec({"max_size": None}).max_size == 256
    assert spec({"max_size": 64}).max_size == 64
    assert cap_preview(PreviewSpec(max_size=100), LIMITS).max_size == 100


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"format": "bmp"}, "preview.format"),
        ({"every": 0}, "preview.every"),
        ({"quality": 101}, "preview.quality"),
        ({"format": "png", "quality": 50}, "preview.quality"),
        ({"max_size": 0}, "preview.max_size"),
        ({"decoder": "builtins:eval"}, "preview.decoder"),
        ({"size": 3}, "preview.size"),
    ],
)
def test_bad_preview_names_the_option(wire: dict, field: str) -> None:
    with pytest.raises(MessageError) as info:
        spec(wire)
    assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", field, "r")


def test_params_are_checked_by_the_model_then_the_limits() -> None:
    model = Synthetic()
    assert check_params(model, {"steps": 50}, LIMITS, request_id="r") == 50
    with pytest.raises(MessageError) as info:
        check_params(model, {"steps": "ten"}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field, info.value.request_id) == ("bad_params", "steps", "r")
    with pytest.raises(MessageError) as info:
        check_params(model, {"steps": 51}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field, info.value.request_id) == ("limit_exceeded", "steps", "r")


def test_default_decoder_follows_the_model() -> None:
    model = Synthetic()
    assert default_decoder(model) == "auto"  # by the frame's shape
    model.preview_decoder = "sd15"  # type: ignore[attr-defined]
    assert default_decoder(model) == "sd15"


def test_output_settings_are_checked_and_defaulted() -> None:
    assert output_spec(None, video=False, request_id="r") == OutputSpec("png")
    assert output_spec({"format": "jpeg", "quality": 90}, video=False, request_id="r") == OutputSpec("jpeg", 90)
    assert output_spec({"format": "gif"}, video=True, request_id="r") == OutputSpec("gif")
    cases = [
        ({"format": "mp4"}, False, "output.format"),
        ({"format": "png"}, True, "output.format"),
        ({"format": "png", "quality": 50}, False, "output.quality"),
        ({"format": "jpeg", "quality": 0}, False, "output.quality"),
        ({"size": 3}, False, "output.size"),
    ]
    for wire, video, field in cases:
        with pytest.raises(MessageError) as info:
            output_spec(wire, video=video, request_id="r")
        assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", field, "r")


def test_over_the_wire_an_image_param_must_be_a_data_url() -> None:
    class TakesImage(Synthetic):
        params = (*Synthetic.params, om.Param("image", "str", ""))

    opened: list[str] = []

    class Reading(TakesImage):
        def validate(self, params):
            opened.append(params.get("image"))  # a real model would read the file here
            return super().validate(params)

    with pytest.raises(MessageError) as info:
        check_params(Reading(), {"image": "/etc/passwd"}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field) == ("bad_params", "image")
    assert "data: URL" in info.value.message
    assert opened == [], "the path must be refused before the model reads it"


def test_an_input_image_larger_than_max_image_size_is_refused() -> None:
    from PIL import Image

    class Decodes(Synthetic):
        params = (*Synthetic.params, om.Param("image", "str", ""))

        def validate(self, params):
            params = dict(params)
            side = int(params.pop("image")[len("data:"):])
            return {**super().validate(params), "image": Image.new("RGB", (side, 8))}

    limits = ServerLimits(max_image_size=64)
    assert check_params(Decodes(), {"image": "data:64"}, limits, request_id="r") == 20
    with pytest.raises(MessageError) as info:
        check_params(Decodes(), {"image": "data:65"}, limits, request_id="r")
    assert (info.value.code, info.value.field) == ("limit_exceeded", "image")
    assert "65x8" in info.value.message
