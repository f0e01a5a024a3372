"""Sampler names as AUTOMATIC1111 and ComfyUI spell them, read as ours (``samplers.canonical``)
and listed back (``samplers.spellings``): pure lookups, no diffusers needed."""

from __future__ import annotations

import pytest

from omni_stream.errors import ParamsError
from omni_stream.models.diffusers import samplers
from omni_stream.models.diffusers.samplers import canonical, spellings

OURS = sorted({s.name for s in (*samplers.NOISE, *samplers.FLOW)})


@pytest.mark.parametrize(
    ("name", "schedule", "ours"),
    [
        ("Euler a", None, "euler_a"),
        ("euler A", None, "euler_a"),  # any case
        ("  DPM++ 2M  ", None, "dpmpp_2m"),
        ("DPM++ 2M Karras", None, "dpmpp_2m_karras"),  # A1111 before 1.6
        ("DPM++ 2M", "Karras", "dpmpp_2m_karras"),  # A1111 1.6 and later
        ("DPM++ 2M", "automatic", "dpmpp_2m"),
        ("dpmpp_2m", "karras", "dpmpp_2m_karras"),  # ComfyUI's pair
        ("euler_ancestral", "normal", "euler_a"),
        ("uni_pc", "sgm_uniform", "unipc"),
        ("PLMS", None, "pndm"),
        ("dpmpp_2m_karras", None, "dpmpp_2m_karras"),  # ours, as it is
        ("dpmpp_2m_karras", "karras", "dpmpp_2m_karras"),
    ],
)
def test_each_spelling_is_read_as_our_sampler(name: str, schedule: str | None, ours: str) -> None:
    assert canonical(name, schedule) == ours


def test_an_unknown_name_or_a_non_string_is_left_for_the_params_check_to_answer() -> None:
    assert canonical("Restart") == "Restart"
    assert canonical("default", "karras") == "default"  # not a sampler of the tables: untouched
    assert canonical(None) is None and canonical(3) == 3


def test_a_schedule_we_do_not_have_or_karras_without_a_twin_names_the_scheduler_field() -> None:
    with pytest.raises(ParamsError) as unknown:
        canonical("Euler", "exponential")
    assert unknown.value.field == "scheduler" and "karras" in unknown.value.message
    with pytest.raises(ParamsError) as no_twin:
        canonical("Euler a", "karras")
    assert no_twin.value.field == "scheduler" and "Euler a" in no_twin.value.message


def test_spellings_lists_every_other_name_canonical_takes_for_each_of_ours() -> None:
    listed = spellings(OURS)
    assert listed["euler_a"] == ["Euler a", "euler_ancestral"]
    assert listed["dpmpp_2m_karras"] == ["DPM++ 2M Karras", "dpmpp_2m + karras"]
    assert listed["unipc"] == ["UniPC", "uni_pc"]
    assert listed["dpmpp_2m"] == ["DPM++ 2M"]  # ComfyUI's spelling is ours: not repeated
    for ours, others in listed.items():
        assert ours not in others
        for other in others:
            name, _, schedule = other.partition(" + ")
            assert canonical(name, schedule or None) == ours, other
