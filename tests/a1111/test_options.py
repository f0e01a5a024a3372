"""A1111's /options per principal, and its checkpoint names (a1111/options.py)."""

from __future__ import annotations

import pytest

from omni_stream.a1111.options import ModelChoices, checked_options, options_payload, resolve_model
from omni_stream.errors import MessageError

MODELS = ["sd15", "SDXL-base"]


def test_a_checkpoint_is_named_by_its_title_or_a1111s_forms_of_it() -> None:
    assert resolve_model("sd15", MODELS) == "sd15"
    assert resolve_model("sdxl-base.safetensors [31e35c80fc]", MODELS) == "SDXL-base"
    assert resolve_model("SD15.ckpt", MODELS) == "sd15"
    with pytest.raises(MessageError) as info:
        resolve_model("sd3", MODELS, field="override_settings.sd_model_checkpoint")
    assert (info.value.code, info.value.field) == ("not_found", "override_settings.sd_model_checkpoint")
    assert "sd15, SDXL-base" in info.value.message


def test_only_the_model_is_set_and_the_other_options_may_be_posted_back_as_they_are() -> None:
    now = options_payload("sd15")
    assert checked_options({**now, "sd_model_checkpoint": "SDXL-base"}, current="sd15", models=MODELS) == "SDXL-base"
    assert checked_options({}, current="sd15", models=MODELS) is None
    for posted in ({"samples_format": "jpg"}, {"CLIP_stop_at_last_layers": 2}):
        with pytest.raises(MessageError) as info:
            checked_options(posted, current="sd15", models=MODELS, prefix="override_settings.")
        assert info.value.code == "unsupported"
        assert info.value.field == "override_settings." + next(iter(posted))


def test_each_principal_keeps_its_own_choice_and_the_least_recently_used_is_forgotten() -> None:
    choices = ModelChoices(max_principals=2)
    choices.choose("token:a", "sdxl")
    choices.choose("token:b", "sd15")
    assert choices.get("token:a") == "sdxl"  # a is used again: b is now the oldest
    choices.choose("token:c", "sd15")
    assert (choices.get("token:b"), choices.get("token:a"), len(choices)) == (None, "sdxl", 2)
