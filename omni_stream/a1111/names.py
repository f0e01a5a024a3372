"""Sampler and schedule names as AUTOMATIC1111 lists them, from ours and back (pure).

``models/diffusers/samplers.py`` reads every spelling a client sends
(``canonical``: A1111's ``"DPM++ 2M"`` with ``scheduler: "Karras"``, its
older ``"DPM++ 2M Karras"``, ComfyUI's ``dpmpp_2m``); this module goes the
other way, for what the A1111 door says: ``/samplers`` (each name a model
offers, with every other spelling of it as ``aliases``), ``/schedulers``,
and the ``Sampler`` / ``Schedule type`` of an ``info`` or a parsed infotext.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from ..models.diffusers import samplers

__all__ = ["DEFAULT_SCHEDULE", "display", "sampler_list", "scheduler_list"]

#: A1111's ``scheduler`` when a request names none: the sampler's own noise levels.
DEFAULT_SCHEDULE: Final = "automatic"

#: A1111's labels for the schedules ``samplers.SCHEDULES`` takes.
_LABELS: Final = {
    "karras": "Karras",
    "normal": "Normal",
    "simple": "Simple",
    "automatic": "Automatic",
    "uniform": "Uniform",
    "sgm_uniform": "SGM Uniform",
}


def display(ours: str) -> tuple[str, str]:
    """``(A1111's sampler name, its schedule label)`` for our sampler ``ours``: ``dpmpp_2m_karras``
    is ``("DPM++ 2M", "Karras")``, ``euler_a`` ``("Euler a", "Automatic")``; a name A1111 has no
    spelling for (``default``: the pipeline's own) is itself, ``Automatic``."""
    karras = ours.endswith("_karras")
    base = ours[: -len("_karras")] if karras else ours
    schedule = _LABELS["karras" if karras else DEFAULT_SCHEDULE]
    for spelling in samplers.spellings([base])[base]:
        if spelling.lower() in samplers.A1111_NAMES:
            return spelling, schedule
    return base, schedule


def sampler_list(choices: Sequence[str]) -> list[dict[str, Any]]:
    """``GET /sdapi/v1/samplers`` for a model offering ``choices`` (our names): one entry per
    name A1111 spells (``"DPM++ 2M"``, ``"DPM++ 2M Karras"``: both are taken), each with every
    other ``sampler_name`` that ``canonical`` takes for it as ``aliases`` (ours, ComfyUI's) and,
    for a Karras twin, A1111's ``options`` (``scheduler: karras``: ComfyUI's pair too)."""
    out = []
    for ours in choices:
        # ComfyUI's pair ("dpmpp_2m + karras") is two fields, not a name: its options say it.
        others = [s for s in samplers.spellings([ours]).get(ours, []) if " + " not in s]
        named = [s for s in others if _is_a1111(s)]
        name = named[0] if named else ours
        aliases = [s for s in (ours, *others) if s != name]
        options = {"scheduler": "karras"} if ours.endswith("_karras") else {}
        out.append({"name": name, "aliases": aliases, "options": options})
    return out


def _is_a1111(spelling: str) -> bool:
    lower = spelling.lower()
    if lower.endswith(" karras"):
        lower = lower[: -len(" karras")]
    return lower in samplers.A1111_NAMES


def scheduler_list() -> list[dict[str, Any]]:
    """``GET /sdapi/v1/schedulers``: the schedules a request's ``scheduler`` may name, in A1111's
    shape (``karras`` picks a sampler's Karras twin, the others its own noise levels)."""
    return [
        {
            "name": name,
            "label": _LABELS.get(name, name),
            "aliases": None,
            "default_rho": -1,
            "need_inner_model": False,
        }
        for name in samplers.SCHEDULES
    ]
