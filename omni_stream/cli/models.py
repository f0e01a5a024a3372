"""``omni-stream models``: the models and their params, listed (text or JSON)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..model import StepModel
from .console import PROG, UsageError, describe_error
from .loader import build_model, check_model_configs, named_spec

__all__ = ["cmd_models"]

_DIFFUSERS_LINE = (
    "diffusers:ID|PATH: a diffusers pipeline (a hub id or a saved folder; the diffusers extra): "
    "native step-wise loops for SD 1.x/2.x, SDXL, SD3 and Flux, callback mode for every other "
    f"pipeline; `{PROG} models diffusers:ID` lists its params and mode"
)


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _format_param(row: dict[str, Any]) -> str:
    parts = [f"  {row['name']:<10} {row['kind']:<6} default={json.dumps(row['default'])}"]
    lo, hi = row.get("minimum"), row.get("maximum")
    if lo is not None and hi is not None:
        parts.append(f"range={_number(lo)}..{_number(hi)}")
    elif lo is not None:
        parts.append(f"range>={_number(lo)}")
    elif hi is not None:
        parts.append(f"range<={_number(hi)}")
    if "choices" in row:
        parts.append(f"choices={','.join(row['choices'])}")
    if row.get("help"):
        parts.append(f"  {row['help']}")
    return " ".join(parts)


def _preview_default(model: StepModel) -> str:
    from ..preview import default_decoder

    return default_decoder(model)


def cmd_models(args: argparse.Namespace) -> int:
    from ..models.diffusers.single_file import is_single_file
    from ..models.registry import BUILTIN_MODELS
    from ..params import describe

    given = [named_spec(n) for n in args.names or list(BUILTIN_MODELS)]
    names = [spec for _, spec in given]
    unknown = [
        n
        for n in names
        if n not in BUILTIN_MODELS and ":" not in n and not is_single_file(n.partition("?")[0])
    ]
    if unknown:
        raise UsageError(
            f"unknown model(s) {', '.join(map(repr, unknown))}; "
            f"built-in: {', '.join(BUILTIN_MODELS)}, or diffusers:ID|PATH, PATH.safetensors, or module:attr"
        )
    configs = check_model_configs(args.model_config or ())
    default = next(iter(BUILTIN_MODELS))
    named = any(served is not None for served, _ in given)
    rows: list[dict[str, Any]] = []
    # Each model is made only when listed: a missing optional dependency of
    # one must not hide the others.
    for served, name in given:
        try:
            model = (
                BUILTIN_MODELS[name]() if name in BUILTIN_MODELS else build_model(name, model_configs=configs)
            )
        except Exception as exc:  # noqa: BLE001 - reported, and the listing goes on
            first = (served, name) == given[0] if named else name == default
            rows.append({"name": served or name, "default": first, "error": describe_error(exc)})
            continue
        rows.append(
            {
                # NAME=SPEC: the name a request's `model` takes on `serve --model NAME=SPEC`.
                "name": served or name,
                "spec": name,
                # With NAME=SPEC, as serve takes them: the first is the default.
                "default": (served, name) == given[0] if named else name == default,
                "description": model.describe(),
                "preview_decoder": _preview_default(model),
                "params": describe(model.params),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        mark = " (default)" if row["default"] else ""
        if "error" in row:
            print(f"{row['name']}{mark}: unavailable: {row['error']}")
            continue
        print(f"{row['name']}{mark}: {row['description']}")
        for param in row["params"]:
            print(_format_param(param))
    if not args.names:
        print(_DIFFUSERS_LINE)
    return 0
