"""AUTOMATIC1111's infotext: the ``parameters`` text a PNG carries, written and read back.

A1111 writes how a picture was made as three parts, and every tool of that
world (its own PNG Info tab and ``/sdapi/v1/png-info``, civitai, ComfyUI's
readers) reads them::

    a harbour at dawn <lora:ink:0.8>
    Negative prompt: blurry
    Steps: 20, Sampler: euler_a, CFG scale: 7.5, Seed: 42, Size: 512x512, Model hash: 6ce0161689,
    Model: sd, eta: 0.0, Lora hashes: "ink: 1f3a6c0b2d4e"

- the prompt, with each LoRA the request used as A1111's ``<lora:NAME:WEIGHT>``
  tag after it (the diffusers models read those tags back as ``loras``);
- ``Negative prompt:`` and the negative prompt, when there is one;
- one line (two above, for the page) of ``Key: value`` pairs, a value holding ``,``, ``:`` or a line
  break written as a JSON string (A1111's ``quote``). A1111's own keys
  (``Steps``, ``Sampler``, ``CFG scale``, ``Seed``, ``Size``, ``Model hash``,
  ``Model``, ``Denoising strength``, ``Lora hashes``) are used where a param
  has one; every other plain param (a number, a string, a bool) follows
  under its own name, so that the text says all that made the picture.

The hashes are A1111's: ``Model hash`` the first 10 hex digits of the
checkpoint file's sha256, ``Lora hashes`` each LoRA's first 12 of the sha256
of its tensors (kohya's "addnet" hash, civitai's AutoV3). They come in
``params["hashes"]`` (``{"model": ..., "loras": {name: ...}}``; the diffusers
models' ``weight_hashes(params)`` gives it), which is not a model param.

:func:`parse_infotext` reads such a text the way A1111's
``parse_generation_parameters`` does, to A1111's keys (``Prompt``,
``Negative prompt``, ``Steps``, ``Size-1``, ...), values as strings;
:func:`params_from_infotext` turns it into our params, which reproduce the
picture (prompt tags included: ``<lora:ink:0.8>`` is ``loras``). Pure: no
I/O, no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "A1111_KEYS",
    "lora_tags",
    "parameters_text",
    "params_from_infotext",
    "parse_infotext",
]

#: A1111's key for each of our params (the first param present wins), in the order A1111 writes them.
A1111_KEYS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("Steps", ("steps", "num_inference_steps")),
    ("Sampler", ("sampler", "scheduler")),
    ("CFG scale", ("guidance_scale", "cfg_scale", "cfg", "guidance")),
    ("Seed", ("seed",)),
)

# Params the text says elsewhere (the prompt lines, Size, Model, the hashes, A1111's keys), or
# that are not about the picture (output: what kind of file it was sent as). A param A1111's
# key names by another name (a model's `guidance` as CFG scale) is written under its own too,
# which is how params_from_infotext gives it back by that name.
_NOT_EXTRA: Final = frozenset(
    {"prompt", "negative_prompt", "negative", "height", "width", "model", "model_name", "loras", "hashes"}
    | {"output", "strength"}
    | {keys[0] for _, keys in A1111_KEYS}
)

# A1111's (modules/infotext_utils.py): a key, then a quoted value or one up to the next comma.
_PARAM: Final = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
_IMAGE_SIZE: Final = re.compile(r"^(\d+)x(\d+)$")
# Our own params' names (A1111's keys have capitals or spaces).
_OUR_NAME: Final = re.compile(r"[a-z][a-z0-9_]*")


def _first(params: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = params.get(key)
        if value is not None and value != "":
            return value
    return None


def _quote(text: str) -> str:
    """A1111's ``quote``: a value that would end the pair early is written as a JSON string."""
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _unquote(text: str) -> str:
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


def _number(value: float) -> str:
    """A scale as the shortest text that reads back as the same float (1.0 as ``1``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _lora_entries(value: Any) -> list[tuple[str, float]]:
    """A request's ``loras``, checked (``(("ink", 0.8),)``) or as sent (``[{"name", "scale"}]``)."""
    out: list[tuple[str, float]] = []
    if not isinstance(value, (list, tuple)):
        return out
    for entry in value:
        if isinstance(entry, Mapping):
            name, scale = entry.get("name"), entry.get("scale", 1.0)
        elif isinstance(entry, (list, tuple)) and len(entry) == 2:
            name, scale = entry
        else:
            continue
        if isinstance(name, str) and isinstance(scale, (int, float)) and math.isfinite(scale):
            out.append((name, float(scale)))
    return out


def lora_tags(loras: Any) -> str:
    """A request's ``loras`` as A1111's prompt tags: ``<lora:ink:0.8> <lora:pastel:1>``."""
    return " ".join(f"<lora:{name}:{_number(scale)}>" for name, scale in _lora_entries(loras))


def _plain(value: Any) -> str | None:
    """An extra param's value as text that reads back as itself, or None when it is not plain."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    if isinstance(value, str):
        return value
    return None


def parameters_text(params: Mapping[str, Any], *, width: int, height: int) -> str:
    """AUTOMATIC1111's ``parameters`` text for ``params`` (only what is present; see the module).

    ``Size`` is the image's; ``Model`` is ``params["model"]``; ``params["hashes"]`` gives
    ``Model hash`` and ``Lora hashes``. Raises nothing.
    """
    lines = []
    prompt = _first(params, ("prompt",))
    tags = lora_tags(params.get("loras"))
    if prompt is not None or tags:
        lines.append(" ".join(str(part) for part in (prompt, tags) if part))
    negative = _first(params, ("negative_prompt", "negative"))
    if negative is not None:
        lines.append(f"Negative prompt: {negative}")
    fields: list[tuple[str, str]] = [
        (name, str(value)) for name, keys in A1111_KEYS if (value := _first(params, keys)) is not None
    ]
    fields.append(("Size", f"{width}x{height}"))
    hashes = params.get("hashes")
    hashes = hashes if isinstance(hashes, Mapping) else {}
    if isinstance(hashes.get("model"), str):
        fields.append(("Model hash", hashes["model"]))
    model = _first(params, ("model", "model_name"))
    if model is not None:
        fields.append(("Model", str(model)))
    strength = params.get("strength")
    if isinstance(strength, (int, float)) and not isinstance(strength, bool):
        fields.append(("Denoising strength", str(strength)))
    for key, value in params.items():
        if key in _NOT_EXTRA or not _OUR_NAME.fullmatch(key):
            continue
        text = _plain(value)
        if text is not None:
            fields.append((key, text))
    known = hashes.get("loras")
    if isinstance(known, Mapping):
        used = [f"{name}: {known[name]}" for name, _ in _lora_entries(params.get("loras")) if name in known]
        if used:
            fields.append(("Lora hashes", ", ".join(used)))
    lines.append(", ".join(f"{key}: {_quote(value)}" for key, value in fields))
    return "\n".join(lines)


def parse_infotext(text: str) -> dict[str, str]:
    """A1111's ``parameters`` text as A1111's keys and string values, the way its
    ``parse_generation_parameters`` reads it.

    ``Prompt`` and ``Negative prompt`` (``""`` when absent), then each ``Key: value`` of
    the last line, quoted values unquoted; ``Size: 512x768`` gives ``Size-1`` (``"512"``)
    and ``Size-2`` (``"768"``). A last line of fewer than three pairs is part of the
    prompt (A1111's rule). Unlike A1111's, nothing is added that the text does not say
    (no ``Clip skip: 1``). Raises nothing.
    """
    *lines, last = text.strip().split("\n")
    if len(_PARAM.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt: list[str] = []
    negative: list[str] = []
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            line = line[len("Negative prompt:") :].strip()
            negative.append(line)
        elif negative:
            negative.append(line)
        else:
            prompt.append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in _PARAM.findall(last):
        value = _unquote(value.strip())
        size = _IMAGE_SIZE.match(value)
        if size is not None:
            out[f"{key}-1"], out[f"{key}-2"] = size.group(1), size.group(2)
        else:
            out[key] = value
    return out


def _read(text: str) -> Any:
    """An extra param's value: a JSON number, bool or null as itself, anything else as the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, (bool, int, float)) else text


def params_from_infotext(text: str) -> dict[str, Any]:
    """Our params from A1111's ``parameters`` text: what reproduces the picture it describes.

    ``prompt`` (its ``<lora:...>`` tags kept: the diffusers models read them as ``loras``),
    ``negative_prompt``, ``steps``, ``sampler`` (``Schedule type: Karras`` joined to it,
    A1111's way before 1.6, which the models read), ``guidance_scale``, ``seed``,
    ``width`` and ``height`` from ``Size`` (unless the text has our own ``size``),
    ``strength`` from ``Denoising strength``, and each extra param under its own name (a
    param A1111's key was written from, by another name, comes back by that name alone:
    mixture's ``guidance``, not ``guidance_scale``).
    The model is not a param: ``parse_infotext(text)["Model"]``. A value that is not the
    number its key needs is left out (the model's default applies). Raises nothing.
    """
    fields = parse_infotext(text)
    out: dict[str, Any] = {}
    if fields["Prompt"]:
        out["prompt"] = fields["Prompt"]
    if fields["Negative prompt"]:
        out["negative_prompt"] = fields["Negative prompt"]
    aliases = {key: keys[1:] for key, keys in A1111_KEYS}
    for key, name, kind in (
        ("Steps", "steps", int),
        ("CFG scale", "guidance_scale", float),
        ("Seed", "seed", int),
        ("Denoising strength", "strength", float),
    ):
        # Written from a param of another name: that name, among the extras, gives it back.
        if key in fields and not any(alias in fields for alias in aliases.get(key, ())):
            try:
                out[name] = kind(fields[key])
            except ValueError:
                continue
    if "Sampler" in fields and not any(alias in fields for alias in aliases["Sampler"]):
        sampler = fields["Sampler"]
        if fields.get("Schedule type", "").lower() == "karras" and not sampler.lower().endswith("karras"):
            sampler += " Karras"
        out["sampler"] = sampler
    for key, value in fields.items():
        if _OUR_NAME.fullmatch(key):
            out[key] = _read(value)
    if "size" not in out and "Size-1" in fields:
        out["width"], out["height"] = int(fields["Size-1"]), int(fields["Size-2"])
    return out
