"""Sampler and schedule names as A1111 lists them (a1111/names.py)."""

from __future__ import annotations

from omni_stream.a1111.names import display, sampler_list, scheduler_list
from omni_stream.models.diffusers.samplers import SCHEDULES, canonical


def test_our_sampler_is_said_in_a1111s_name_with_its_schedule() -> None:
    assert display("dpmpp_2m_karras") == ("DPM++ 2M", "Karras")
    assert display("euler_a") == ("Euler a", "Automatic")
    assert display("pndm") == ("PLMS", "Automatic")
    assert display("default") == ("default", "Automatic")  # the pipeline's own: no A1111 name


def test_samplers_lists_each_a1111_name_with_every_other_spelling_that_picks_it() -> None:
    listed = {entry["name"]: entry for entry in sampler_list(["default", "euler_a", "dpmpp_2m", "dpmpp_2m_karras"])}
    assert listed["Euler a"] == {"name": "Euler a", "aliases": ["euler_a", "euler_ancestral"], "options": {}}
    assert listed["DPM++ 2M Karras"] == {
        "name": "DPM++ 2M Karras", "aliases": ["dpmpp_2m_karras"], "options": {"scheduler": "karras"}}
    assert listed["default"]["aliases"] == []
    for entry in listed.values():
        wanted = canonical(entry["name"])
        assert all(canonical(alias) == wanted for alias in entry["aliases"]), entry


def test_schedulers_lists_the_schedules_a_request_may_name_in_a1111s_shape() -> None:
    listed = scheduler_list()
    assert [s["name"] for s in listed] == list(SCHEDULES)
    assert listed[0] == {"name": "karras", "label": "Karras", "aliases": None, "default_rho": -1,
                         "need_inner_model": False}
