"""The LoRAs a command names: for every model that takes LoRAs, or bound to one model.

``--lora NAME=PATH`` and ``--lora-dir DIR`` apply to every served model that
takes LoRAs (the diffusers ones); a model that takes none is passed over,
unless it is the only model, where a LoRA with nowhere to go is a mistake
worth saying. ``--lora MODEL:NAME=PATH`` and ``--lora-dir MODEL=DIR`` bind
LoRAs to one model: a model that is not served, or that takes no LoRAs, is
then an error at start. A name given twice for one model is an error.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field

from .console import UsageError

__all__ = ["LoraOptions", "lora_options"]


@dataclass(frozen=True, slots=True)
class LoraOptions:
    """The command's LoRAs: ``shared`` for every model, ``bound`` per model name (``{name: path}``)."""

    shared: dict[str, str] = field(default_factory=dict)
    bound: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The option that named each (model or "", LoRA name), for messages.
    sources: dict[tuple[str, str], str] = field(default_factory=dict)

    def for_model(self, model: str) -> dict[str, str]:
        """``{name: path}`` of the LoRAs model ``model`` loads: the shared ones and its own."""
        return {**self.shared, **self.bound.get(model, {})}

    def check_models(self, served: Iterable[str]) -> None:
        """UsageError naming a LoRA bound to a model that is not served."""
        names = [name for name in served if name]
        for model, loras in self.bound.items():
            if model in names:
                continue
            source = self.sources[(model, next(iter(loras)))]
            listed = ", ".join(names) if names else "none is named: give --model NAME=SPEC"
            raise UsageError(f"{source}: no model is named {model!r}; served: {listed}")


def lora_options(args: argparse.Namespace) -> LoraOptions:
    """The LoRAs of ``--lora [MODEL:]NAME=PATH`` and ``--lora-dir [MODEL=]DIR``; UsageError for a
    folder without LoRAs or a name given twice for one model."""
    from ..models.diffusers.loras import lora_dir

    given: list[tuple[str, str, dict[str, str]]] = []  # (model or "", option, {name: path})
    for model, folder in args.lora_dir or ():
        option = f"--lora-dir {model + '=' if model else ''}{folder}"
        try:
            given.append((model or "", option, lora_dir(folder)))
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
    for model, name, path in args.lora or ():
        given.append((model or "", f"--lora {model + ':' if model else ''}{name}=...", {name: path}))
    out = LoraOptions()
    for model, option, loras in given:
        target = out.shared if not model else out.bound.setdefault(model, {})
        for name, path in loras.items():
            if name in target or (model and name in out.shared):
                where = f" for model {model!r}" if model else ""
                raise UsageError(f"{option}: a LoRA named {name!r} is given twice{where}")
            target[name] = path
            out.sources[(model, name)] = option
    # A shared name that clashes with a bound one given before it.
    for model, loras in out.bound.items():
        for name in loras:
            if name in out.shared:
                raise UsageError(
                    f"{out.sources[('', name)]}: a LoRA named {name!r} is given twice for model {model!r}"
                )
    return out
