"""Samplers by the names users know, mapped to diffusers schedulers (pure lookups, no loop).

AUTOMATIC1111 and ComfyUI name a sampler (``euler_a``, ``dpmpp_2m_karras``);
diffusers names a scheduler class and its options. :data:`NOISE` is the
table for models that predict noise (or v): SD 1.x/2.x, SDXL;
:data:`FLOW` the one for flow-matching models (SD3, Flux). A model offers
the entries of its table that this diffusers has and that run its loop
(:func:`offered`), plus ``default``: the scheduler the pipeline came with,
as configured.

A request's scheduler is ``Class.from_config(pipe.scheduler.config,
**options)``, the way the diffusers documentation switches schedulers, so a
request with sampler X equals ``pipe(...)`` after ``pipe.scheduler =
Class.from_config(pipe.scheduler.config, **options)``. The options set
every choice a sampler's name makes (Karras sigmas on or off, the solver's
algorithm), so nothing the pipeline's own config says about them leaks
into another sampler.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ...errors import ParamsError

__all__ = [
    "A1111_NAMES",
    "COMFY_NAMES",
    "DEFAULT",
    "SCHEDULES",
    "EXTRAS",
    "FLOW",
    "NOISE",
    "UNCAPTURED_NOISE",
    "Sampler",
    "build",
    "canonical",
    "check_installed",
    "missing_packages",
    "offered",
    "sampler_names",
    "spellings",
    "with_canonical",
]

#: The pipeline's own scheduler, as it was loaded (its class and config unchanged).
DEFAULT: Final = "default"


@dataclass(frozen=True, slots=True)
class Sampler:
    """One name: the diffusers scheduler class and the options that make it that sampler."""

    name: str
    scheduler: str
    options: dict[str, Any] = field(default_factory=dict)
    #: Python packages it needs beyond diffusers (LMS computes its coefficients with scipy).
    needs: tuple[str, ...] = ()


def _karras(
    name: str, scheduler: str, options: dict[str, Any] | None = None, needs: tuple[str, ...] = ()
) -> tuple[Sampler, Sampler]:
    """A sampler and its ``_karras`` twin (Karras et al.'s noise levels)."""
    options = options or {}
    return (
        Sampler(name, scheduler, {**options, "use_karras_sigmas": False}, needs),
        Sampler(f"{name}_karras", scheduler, {**options, "use_karras_sigmas": True}, needs),
    )


_DPMPP: dict[str, Any] = {"algorithm_type": "dpmsolver++", "solver_order": 2}
_DPMPP_SDE: dict[str, Any] = {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}

#: Noise- and v-prediction models (UNet pipelines), A1111's names first.
NOISE: Final[tuple[Sampler, ...]] = (
    *_karras("euler", "EulerDiscreteScheduler"),
    Sampler("euler_a", "EulerAncestralDiscreteScheduler"),
    *_karras("heun", "HeunDiscreteScheduler"),
    *_karras("dpm_2", "KDPM2DiscreteScheduler"),
    *_karras("dpm_2_a", "KDPM2AncestralDiscreteScheduler"),
    *_karras("lms", "LMSDiscreteScheduler", needs=("scipy",)),  # its coefficients: scipy.integrate
    *_karras("dpmpp_2m", "DPMSolverMultistepScheduler", _DPMPP),
    *_karras("dpmpp_2m_sde", "DPMSolverMultistepScheduler", _DPMPP_SDE),
    *_karras("dpmpp_sde", "DPMSolverSDEScheduler", needs=("torchsde",)),  # torchsde's Brownian tree
    Sampler("ddim", "DDIMScheduler"),
    Sampler("ddpm", "DDPMScheduler"),
    Sampler("pndm", "PNDMScheduler"),
    *_karras("unipc", "UniPCMultistepScheduler"),
    *_karras("deis", "DEISMultistepScheduler"),
    Sampler("lcm", "LCMScheduler"),
    Sampler("tcd", "TCDScheduler"),
)

#: Flow-matching models (SD3, Flux).
FLOW: Final[tuple[Sampler, ...]] = (
    *_karras("euler", "FlowMatchEulerDiscreteScheduler"),
    Sampler("heun", "FlowMatchHeunDiscreteScheduler"),
    Sampler("lcm", "FlowMatchLCMScheduler"),
)


#: Every name of ours, in either table (what :func:`canonical` passes through as it is).
_OURS: Final = frozenset(s.name for s in (*NOISE, *FLOW))

#: Scheduler classes whose noise does not come from the request's generator,
#: so a snapshot cannot capture it and a request on them is never
#: checkpointed. DPMSolverSDEScheduler (dpmpp_sde) builds a torchsde Brownian
#: tree on its first step, seeded from the global RNG when its config has no
#: seed, and keeps it; its answers depend on the tree's cached queries.
UNCAPTURED_NOISE: Final = frozenset({"DPMSolverSDEScheduler"})

#: The extra of pyproject.toml that installs a package a sampler needs; a
#: package no extra declares (torchsde: dpmpp_sde alone needs it) is
#: installed by its own name. tests/test_extras.py checks this against
#: pyproject.toml, so the error below never names an extra that lacks it.
EXTRAS: Final = {"scipy": "diffusers"}


#: AUTOMATIC1111's display names (and Forge's), lower-cased, for ours. A trailing " Karras"
#: (A1111 before 1.6: "DPM++ 2M Karras") or a ``scheduler`` of ``karras`` (1.6 and after, and
#: ComfyUI) picks the ``_karras`` twin.
A1111_NAMES: Final[Mapping[str, str]] = {
    "euler": "euler",
    "euler a": "euler_a",
    "heun": "heun",
    "dpm2": "dpm_2",
    "dpm2 a": "dpm_2_a",
    "lms": "lms",
    "dpm++ 2m": "dpmpp_2m",
    "dpm++ 2m sde": "dpmpp_2m_sde",
    "dpm++ sde": "dpmpp_sde",
    "ddim": "ddim",
    "ddpm": "ddpm",
    "plms": "pndm",
    "unipc": "unipc",
    "deis": "deis",
    "lcm": "lcm",
    "tcd": "tcd",
}

#: ComfyUI's ``sampler_name`` values for ours (its ``scheduler`` is a separate field).
COMFY_NAMES: Final[Mapping[str, str]] = {
    "euler": "euler",
    "euler_ancestral": "euler_a",
    "heun": "heun",
    "dpm_2": "dpm_2",
    "dpm_2_ancestral": "dpm_2_a",
    "lms": "lms",
    "dpmpp_2m": "dpmpp_2m",
    "dpmpp_2m_sde": "dpmpp_2m_sde",
    "dpmpp_sde": "dpmpp_sde",
    "ddim": "ddim",
    "ddpm": "ddpm",
    "uni_pc": "unipc",
    "deis": "deis",
    "lcm": "lcm",
    "tcd": "tcd",
}

#: Schedules (A1111 1.6's ``scheduler``, ComfyUI's ``scheduler``) and what they make of a sampler:
#: Karras noise levels, or the sampler's own. Others (exponential, beta, ...) are refused by name.
SCHEDULES: Final[Mapping[str, bool]] = {
    "karras": True,
    "normal": False,
    "simple": False,
    "automatic": False,
    "uniform": False,
    "sgm_uniform": False,
}


def canonical(name: Any, schedule: Any = None) -> Any:
    """Our name for ``name`` as AUTOMATIC1111 ("Euler a", "DPM++ 2M Karras") or ComfyUI
    ("euler_ancestral", "uni_pc") spell it, with ``schedule`` ("karras", "normal", ...) applied;
    ``name`` itself when it is ours or unknown (the param's choices then answer it).

    Raises ParamsError (field ``scheduler``) for a schedule that is not in :data:`SCHEDULES`,
    or ``karras`` on a sampler without a Karras twin.
    """
    if not isinstance(name, str):
        return name
    text = name.strip()
    lower = text.lower()
    karras = False
    if lower.endswith(" karras"):
        lower, karras = lower[: -len(" karras")].rstrip(), True
    ours = A1111_NAMES.get(lower) or COMFY_NAMES.get(lower) or (lower if lower in _OURS else None)
    if ours is None:
        return name
    if ours.endswith("_karras"):
        ours, karras = ours[: -len("_karras")], True
    if schedule is not None:
        key = str(schedule).strip().lower()
        if key not in SCHEDULES:
            raise ParamsError(
                f"scheduler {str(schedule)[:40]!r} is not one of {', '.join(SCHEDULES)}", field="scheduler"
            )
        karras = karras or SCHEDULES[key]
    if not karras:
        return ours
    if f"{ours}_karras" not in _OURS:
        raise ParamsError(f"sampler {name!r} has no Karras schedule", field="scheduler")
    return f"{ours}_karras"


def with_canonical(params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``params`` with its ``sampler`` spelled as ours (:func:`canonical`), the rest untouched."""
    if not isinstance(params, Mapping) or "sampler" not in params:
        return params
    ours = canonical(params["sampler"])
    return params if ours == params["sampler"] else {**params, "sampler": ours}


def spellings(names: Sequence[str]) -> dict[str, list[str]]:
    """For each of our sampler ``names``, the other spellings :func:`canonical` takes for it
    (A1111's display names, ComfyUI's ``sampler_name`` with ``scheduler: karras`` where it
    applies): what ``/samplers`` lists."""
    out: dict[str, list[str]] = {}
    for name in names:
        base, karras = (name[: -len("_karras")], True) if name.endswith("_karras") else (name, False)
        found: list[str] = []
        for display, ours in A1111_NAMES.items():
            if ours == base:
                found.append(_title(display) + (" Karras" if karras else ""))
        for comfy, ours in COMFY_NAMES.items():
            if ours == base:
                found.append(f"{comfy} + karras" if karras else comfy)
        out[name] = [f for f in dict.fromkeys(found) if f != name]
    return out


def _title(display: str) -> str:
    # A1111's own capitalisation ("Euler a", "DPM++ 2M SDE", "UniPC", "PLMS").
    special = {
        "unipc": "UniPC",
        "plms": "PLMS",
        "ddim": "DDIM",
        "ddpm": "DDPM",
        "lms": "LMS",
        "lcm": "LCM",
        "tcd": "TCD",
        "deis": "DEIS",
    }
    if display in special:
        return special[display]
    words = display.split(" ")
    return " ".join(
        w.upper() if w.startswith(("dpm", "2m", "sde")) else w.capitalize() if i == 0 else w
        for i, w in enumerate(words)
    )


def sampler_names(table: Sequence[Sampler]) -> tuple[str, ...]:
    return tuple(s.name for s in table)


def missing_packages(sampler: Sampler) -> tuple[str, ...]:
    """The packages ``sampler`` needs that this Python cannot import."""
    lacking = []
    for package in sampler.needs:
        try:
            importlib.import_module(package)
        except ImportError:
            lacking.append(package)
    return tuple(lacking)


def scheduler_class(sampler: Sampler) -> Any:
    """The diffusers class of ``sampler``, or None where this diffusers or a package it needs lacks it."""
    import diffusers

    if missing_packages(sampler):
        return None
    cls = getattr(diffusers, sampler.scheduler, None)
    return cls if isinstance(cls, type) else None


def check_installed(params: Mapping[str, Any] | None, table: Sequence[Sampler], *, model: str) -> None:
    """Refuse a request whose ``sampler`` is an entry of ``table`` left unoffered for want of a package.

    Without this the request got the ``choices`` error, a list of names
    that leaves out the one asked for and never says why. Raises
    ParamsError (field ``sampler``) naming the sampler, the missing
    packages and the command that installs them; returns for anything else
    (an offered sampler, an unknown name: the param check answers those).
    """
    name = params.get("sampler") if isinstance(params, Mapping) else None
    entry = next((s for s in table if s.name == name), None)
    lacking = missing_packages(entry) if entry is not None else ()
    if not lacking:
        return
    extras = sorted({EXTRAS[p] for p in lacking if p in EXTRAS})
    alone = [p for p in lacking if p not in EXTRAS]
    commands = [f'pip install "omni-stream[{",".join(extras)}]"'] if extras else []
    if alone:
        commands.append(f"pip install {' '.join(alone)}")
    raise ParamsError(
        f"{model} param 'sampler': {name!r} needs {' and '.join(lacking)}, which "
        f"{'is' if len(lacking) == 1 else 'are'} not installed here; {' and '.join(commands)} installs "
        f"{'it' if len(lacking) == 1 else 'them'}",
        field="sampler",
    )


# Built schedulers, never set: a request gets a deep copy. Some classes
# compute tables in __init__ (KDPM2: ~130 ms on a CPU), which each request
# would otherwise pay on the producer; a copy of an unused one is the same
# object a fresh from_config makes (set_timesteps then sets it up as a
# pipeline's __call__ does). Bounded: a few models' samplers.
_PROTOTYPES: OrderedDict[tuple[str, str], Any] = OrderedDict()
_PROTOTYPES_MAX = 128
_lock = threading.Lock()  # the event loop (step counts) and the producer (start) both build


def build(sampler: Sampler, config: Any) -> Any:
    """A fresh scheduler for ``sampler`` from a pipeline scheduler's ``config``.

    Options the class does not take are left out (``use_karras_sigmas=False``
    asks nothing of a class without Karras sigmas); one it needs and lacks
    is a bug in the table. Raises LookupError where the class is missing.
    """
    # The class and options too: the two tables reuse names (euler, heun, lcm).
    key = (
        f"{sampler.scheduler}:{json.dumps(sampler.options, sort_keys=True)}",
        json.dumps(dict(config), sort_keys=True, default=repr),
    )
    with _lock:
        prototype = _PROTOTYPES.get(key)
        if prototype is not None:
            _PROTOTYPES.move_to_end(key)
    if prototype is None:
        cls = scheduler_class(sampler)
        if cls is None:
            raise LookupError(f"sampler {sampler.name!r} needs {sampler.scheduler}, which is not available")
        takes = inspect.signature(cls.__init__).parameters
        options = {k: v for k, v in sampler.options.items() if k in takes or v is not False}
        prototype = cls.from_config(config, **options)
        with _lock:
            _PROTOTYPES[key] = prototype
            while len(_PROTOTYPES) > _PROTOTYPES_MAX:
                _PROTOTYPES.popitem(last=False)
    return copy.deepcopy(prototype)


def offered(table: Sequence[Sampler], works: Callable[[Sampler], bool]) -> tuple[Sampler, ...]:
    """The entries of ``table`` this diffusers has and ``works`` accepts (a dry run of the model's loop)."""
    return tuple(s for s in table if scheduler_class(s) is not None and works(s))
