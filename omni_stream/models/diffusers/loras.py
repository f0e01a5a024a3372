"""LoRAs per request: loaded once, named by requests with a scale, switched between steps.

A server loads its LoRAs when it starts (``serve --lora NAME=PATH``,
``--lora-dir DIR``): each through diffusers' ``load_lora_weights(path,
adapter_name=NAME)``, which wraps the denoiser's (and text encoders')
layers with peft adapters. A request names the ones it wants::

    {"params": {"prompt": "a harbour", "loras": [{"name": "ink", "scale": 0.8}]}}

:func:`check_loras` turns that into a :data:`LoraSet` (sorted by name, so two
requests asking for the same set in another order batch together), and
:class:`LoraBank` puts a set on the pipeline before a request's prompt is
encoded and before each of its denoiser calls: ``set_adapters(names,
weights)``, or ``disable_lora()`` for none. A layer whose adapters are
disabled computes exactly its base layer, and one at scale 0 adds exactly
zero, so a request without LoRAs gives what the pipeline gives without
them, bit for bit. Switching costs one ``set_adapters`` call (it walks the
wrapped layers); the bank skips it when the set is the one already on.

A prompt may name them too, in AUTOMATIC1111's syntax: ``<lora:ink:0.8>``
(the weight 1 when left out) is ``{"name": "ink", "scale": 0.8}``.
:func:`check_request_loras` takes the tags out of the prompt (each with the
whitespace before it; the rest stripped) and merges them with the ``loras``
param; a LoRA named twice, in either place, is refused. A1111's
``<lora:NAME:TE:UNET>`` is taken when its two weights are equal (one scale
here applies to the text encoders and the denoiser alike) and refused
otherwise, as are its named weights (``te=``, ``unet=``, ``dyn=``). Tags in
the negative prompt are left as text, as A1111 leaves them.

The bank is used on the producer thread only (where the model's ``start``
and ``step`` run); ``check_loras`` runs on the event loop.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from ...errors import ParamsError
from ...params import finite_number
from .file_hashes import lora_hash

__all__ = [
    "LORA_FILE_SUFFIXES",
    "MAX_LORAS",
    "MAX_SCALE",
    "LoraBank",
    "LoraSet",
    "check_loras",
    "check_request_loras",
    "lora_dir",
    "lora_name_problem",
    "prompt_loras",
    "split_loras",
]

#: A request's LoRAs: ``((name, scale), ...)`` sorted by name; ``()`` for none.
LoraSet = tuple[tuple[str, float], ...]

#: LoRAs one request may name at once.
MAX_LORAS: Final = 8
#: The largest scale (and the most negative): beyond a few the picture is
#: noise, and a typo such as 80 for 0.8 should be told, not run.
MAX_SCALE: Final = 4.0
#: The files ``--lora-dir`` loads (each named by its file's stem).
LORA_FILE_SUFFIXES: Final = (".safetensors",)
#: A1111's prompt tag for a LoRA, with the whitespace before it (taken out with it).
LORA_TAG: Final = re.compile(r"\s*<lora:([^>]*)>")
# Characters a LoRA's name cannot hold: they end its prompt tag (<lora:NAME:WEIGHT>) or
# its entry in the PNG's "Lora hashes: name: hash, ..." early.
_NAME_STOPS: Final = frozenset(":,<>\n")


def lora_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a LoRA (a sentence), or None when it can."""
    if not isinstance(name, str) or not name.strip():
        return f"a LoRA needs a name, got {name!r}"
    stops = sorted(_NAME_STOPS & set(name))
    if stops:
        return (
            f"a LoRA's name cannot hold {' '.join(repr(c) for c in stops)} (it goes in a prompt's "
            f"<lora:NAME:WEIGHT> and the PNG's Lora hashes), got {name!r}"
        )
    return None


def check_loras(value: Any, known: Sequence[str], *, model: str) -> LoraSet:
    """A request's ``loras`` param as a :data:`LoraSet`; ParamsError naming the entry that is wrong.

    ``value``: a list of ``{"name": NAME, "scale": NUMBER}`` (``scale``
    defaults to 1), or None / ``[]`` for none. ``known``: the names loaded.
    """
    if value is None:
        return ()
    where = f"{model} param 'loras'"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ParamsError(
            f'{where} must be a list of {{"name", "scale"}} objects, got {value!r:.80}', field="loras"
        )
    if len(value) > MAX_LORAS:
        raise ParamsError(f"{where} names {len(value)} LoRAs; at most {MAX_LORAS}", field="loras")
    chosen: dict[str, float] = {}
    for i, entry in enumerate(value):
        field = f"loras[{i}]"
        if not isinstance(entry, Mapping):
            raise ParamsError(
                f"{where}: entry {i} must be an object with name and scale, got {entry!r:.80}", field=field
            )
        extra = sorted(str(k) for k in entry if k not in ("name", "scale"))
        if extra:
            raise ParamsError(
                f"{where}: entry {i} has unknown key(s) {extra}; it takes name and scale",
                field=f"{field}.{extra[0]}",
            )
        name = entry.get("name")
        if not isinstance(name, str) or name not in known:
            listed = ", ".join(sorted(known)) if known else "none are loaded (serve --lora NAME=PATH)"
            raise ParamsError(
                f"{where}: entry {i} names {name!r:.80}, which is not a loaded LoRA; known: {listed}",
                field=f"{field}.name",
            )
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not finite_number(scale):
            raise ParamsError(
                f"{where}: entry {i}'s scale must be a number, got {scale!r:.80}", field=f"{field}.scale"
            )
        if not -MAX_SCALE <= scale <= MAX_SCALE:
            raise ParamsError(
                f"{where}: entry {i}'s scale must be from {-MAX_SCALE:g} to {MAX_SCALE:g}, got {scale!r}",
                field=f"{field}.scale",
            )
        if name in chosen:
            raise ParamsError(f"{where}: {name!r} is named twice", field=f"{field}.name")
        chosen[name] = float(scale)
    return tuple(sorted(chosen.items()))


def _tag_scale(tag: str, weights: list[str], where: str) -> float:
    """A tag's one scale from A1111's positional weights (none: 1)."""
    if any("=" in w for w in weights):
        raise ParamsError(
            f"{where}: {tag} has named weights; write <lora:NAME> or <lora:NAME:WEIGHT>", field="prompt"
        )
    values: list[float] = []
    for text in weights:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ParamsError(f"{where}: {tag}'s weight {text.strip()!r} is not a number", field="prompt")
        values.append(value)
    if not values:
        return 1.0
    if len(values) > 2 or len(set(values)) > 1:
        raise ParamsError(
            f"{where}: {tag} gives the text encoders and the denoiser other weights; one scale "
            "applies to both here: write <lora:NAME:WEIGHT>",
            field="prompt",
        )
    return values[0]


def prompt_loras(prompt: str, *, model: str = "diffusers") -> tuple[str, list[tuple[str, float, str]]]:
    """``prompt`` without its ``<lora:...>`` tags, and each tag's ``(name, scale, tag)``.

    Each tag leaves with the whitespace before it, and a prompt that held any is
    stripped, so ``"a cat <lora:ink:0.8>"`` is ``"a cat"``. Raises ParamsError (field
    ``prompt``) for a tag without a name or with weights that are not one number.
    """
    where = f"{model} param 'prompt'"
    found: list[tuple[str, float, str]] = []
    for match in LORA_TAG.finditer(prompt):
        tag = match.group(0).strip()
        name, *weights = match.group(1).split(":")
        if not name.strip():
            raise ParamsError(f"{where}: {tag} names no LoRA; write <lora:NAME:WEIGHT>", field="prompt")
        found.append((name.strip(), _tag_scale(tag, weights, where), tag))
    if not found:
        return prompt, []
    return LORA_TAG.sub("", prompt).strip(), found


def check_request_loras(prompt: Any, value: Any, known: Sequence[str], *, model: str) -> tuple[Any, LoraSet]:
    """A request's prompt without its ``<lora:...>`` tags, and its LoRAs: the ``loras`` param
    (:func:`check_loras`) and the tags together. Raises ParamsError naming the field: a tag's
    unknown name or bad weight (``prompt``), a LoRA named twice, too many."""
    chosen = dict(check_loras(value, known, model=model))
    if not isinstance(prompt, str) or "<lora:" not in prompt:
        return prompt, tuple(sorted(chosen.items()))
    text, tags = prompt_loras(prompt, model=model)
    where = f"{model} param 'prompt'"
    for name, scale, tag in tags:
        if name not in known:
            listed = ", ".join(sorted(known)) if known else "none are loaded (serve --lora NAME=PATH)"
            raise ParamsError(
                f"{where}: {tag} names {name!r}, which is not a loaded LoRA; known: {listed}", field="prompt"
            )
        if not -MAX_SCALE <= scale <= MAX_SCALE:
            raise ParamsError(
                f"{where}: {tag}'s weight must be from {-MAX_SCALE:g} to {MAX_SCALE:g}", field="prompt"
            )
        if name in chosen:
            raise ParamsError(
                f"{where}: {tag} names {name!r}, which the request names already (in 'loras' or "
                "another tag); name each LoRA once",
                field="prompt",
            )
        chosen[name] = scale
    if len(chosen) > MAX_LORAS:
        raise ParamsError(
            f"{where} and 'loras' name {len(chosen)} LoRAs together; at most {MAX_LORAS}", field="prompt"
        )
    return text, tuple(sorted(chosen.items()))


def split_loras(params: Any) -> tuple[Any, Any]:
    """``(params without "loras", the request's loras)``: a list of objects, which Param kinds do
    not have, is taken out for :func:`check_loras` before the params are validated."""
    if isinstance(params, Mapping) and "loras" in params:
        rest = dict(params)
        return rest, rest.pop("loras")
    return params, None


def lora_dir(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``{stem: path}`` of the LoRA files (``.safetensors``) and LoRA folders directly in ``folder``.

    A folder counts when it holds ``pytorch_lora_weights.safetensors`` (what
    diffusers' ``save_lora_weights`` writes). Raises ValueError for a folder
    that does not exist or holds none.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a folder")
    found: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix in LORA_FILE_SUFFIXES:
            found[entry.stem] = str(entry)
        elif entry.is_dir() and (entry / "pytorch_lora_weights.safetensors").is_file():
            found[entry.name] = str(entry)
    if not found:
        raise ValueError(
            f"{str(root)!r} holds no LoRA (.safetensors files, or folders that save_lora_weights wrote)"
        )
    return found


class LoraBank:
    """The LoRAs loaded into one pipeline, and which set is on it now (see the module docstring)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._names: list[str] = []
        self._hashes: dict[str, str] = {}
        self._active: LoraSet | None = None  # None: not known (set before first use)
        #: set_adapters / disable_lora calls made (a switch skipped when the set is on already).
        self.switches = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    @property
    def hashes(self) -> dict[str, str]:
        """``{name: hash}`` as A1111 writes ``Lora hashes`` (file_hashes.lora_hash), for the LoRAs
        loaded from a file it can hash."""
        return dict(self._hashes)

    def load(self, loras: Mapping[str, str | os.PathLike[str]]) -> None:
        """Load each ``{name: path}`` as an adapter of that name; ValueError naming the one that fails.

        Needs peft (diffusers loads LoRAs through it). A name loaded already
        is an error, not a replacement: requests in flight may be using it.
        """
        load = getattr(self._pipe, "load_lora_weights", None)
        if not callable(load):
            raise ValueError(f"{type(self._pipe).__name__} cannot load LoRAs (it has no load_lora_weights)")
        for name, path in loras.items():
            problem = lora_name_problem(name)
            if problem is not None:
                raise ValueError(problem)
            if name in self._names:
                raise ValueError(f"a LoRA named {name!r} is loaded already")
            try:
                load(str(path), adapter_name=name)
            except ImportError as exc:
                raise ImportError(f'LoRAs need peft: pip install "omni-stream[diffusers]" ({exc})') from exc
            except Exception as exc:  # noqa: BLE001 - diffusers and peft raise many kinds
                raise ValueError(
                    f"LoRA {name!r} from {str(path)!r} could not be loaded: {type(exc).__name__}: {exc}"
                ) from exc
            self._names.append(name)
            digest = lora_hash(path) if isinstance(path, (str, os.PathLike)) else None
            if digest is not None:
                self._hashes[name] = digest
        self._active = None  # loading enables the new adapter: set the next request's set afresh

    def activate(self, loras: LoraSet) -> None:
        """Put ``loras`` on the pipeline (none: every adapter off), unless it is on already."""
        if not self._names or loras == self._active:
            return
        # Not known until the switch is done: one that raises half way (adapters
        # enabled, weights not set) must not leave the next request thinking
        # its set is on.
        self._active = None
        if loras:
            self._pipe.enable_lora()
            names, weights = [name for name, _ in loras], [scale for _, scale in loras]
            self._pipe.set_adapters(names, adapter_weights=weights)
        else:
            self._pipe.disable_lora()
        self._active = loras
        self.switches += 1
