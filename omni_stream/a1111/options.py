"""AUTOMATIC1111's ``/options`` per principal, and its checkpoint names (pure).

A1111 has one model loaded for everyone: ``POST /sdapi/v1/options
{"sd_model_checkpoint": ...}`` switches it for every client. Here it is the
caller's own choice (its principal's: its token's tenant, else its
address), kept by :class:`ModelChoices` and used by its later requests
that name no ``override_settings.sd_model_checkpoint``; another
principal's requests are not touched, and no model is loaded or unloaded
for it (a server of several models holds them all; ``--max-loaded``
decides what is on the device). The book is bounded: past
``max_principals`` the choice least recently used is forgotten (that
principal's requests go back to the server's first model).

The other options are read-only here: a client may post them back as
``GET /options`` gave them (a client that saves and restores the options
does), and any other value is refused naming the option.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..errors import MessageError

__all__ = [
    "MAX_PRINCIPALS",
    "PREVIEW_EVERY",
    "PREVIEW_FORMAT",
    "ModelChoices",
    "checked_options",
    "options_payload",
    "resolve_model",
]

#: Principals whose model choice is kept at once.
MAX_PRINCIPALS: Final = 4096
#: A1111's ``show_progress_every_n_steps`` (its default): a live preview every that many steps.
PREVIEW_EVERY: Final = 10
#: A1111's ``live_previews_image_format`` (its default): the live preview, and the picture of an
#: image stopped half-way (a1111/unfinished.py), lossless.
PREVIEW_FORMAT: Final = "png"
#: The model option.
CHECKPOINT: Final = "sd_model_checkpoint"
#: Checkpoint file suffixes a client may put after a model's name (A1111's titles carry them).
_SUFFIXES: Final = (".safetensors", ".ckpt", ".pt", ".bin")


class ModelChoices:
    """Each principal's model (its key -> a served model's name), least recently used forgotten."""

    def __init__(self, max_principals: int = MAX_PRINCIPALS) -> None:
        self._max = max_principals
        self._chosen: OrderedDict[str, str] = OrderedDict()

    def get(self, principal: str) -> str | None:
        """The model ``principal`` chose, None when it chose none (or it was forgotten)."""
        name = self._chosen.get(principal)
        if name is not None:
            self._chosen.move_to_end(principal)
        return name

    def choose(self, principal: str, model: str) -> None:
        self._chosen[principal] = model
        self._chosen.move_to_end(principal)
        while len(self._chosen) > self._max:
            self._chosen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._chosen)


def resolve_model(title: str, models: Sequence[str], *, field: str = CHECKPOINT) -> str:
    """The served model a checkpoint ``title`` names: its name, as ``/sd-models`` lists it, or
    A1111's forms of it (any case, a file suffix, a ``" [hash]"`` after it).

    Raises MessageError ``not_found`` (404) naming ``field`` and the models.
    """
    wanted = title.strip()
    if wanted in models:
        return wanted
    base = wanted.rsplit(" [", 1)[0] if wanted.endswith("]") else wanted
    for suffix in _SUFFIXES:
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
    for name in models:
        if name.lower() == base.lower():
            return name
    raise MessageError(
        "not_found",
        f"{field}: model {title[:80]!r} is not served here; /sdapi/v1/sd-models lists {', '.join(models)}",
        field=field,
    )


def options_payload(model: str) -> dict[str, Any]:
    """``GET /sdapi/v1/options`` for a caller whose requests run on ``model``."""
    return {
        CHECKPOINT: model,
        "sd_checkpoint_hash": None,
        "show_progress_every_n_steps": PREVIEW_EVERY,
        "live_previews_enable": True,
        "live_previews_image_format": PREVIEW_FORMAT,
        "samples_format": "png",
    }


def checked_options(
    posted: Mapping[str, Any], *, current: str, models: Sequence[str], prefix: str = ""
) -> str | None:
    """The model ``posted`` options choose (None: they choose none), every other option checked
    to be what :func:`options_payload` says for ``current``. ``prefix``: where the options sit
    (``override_settings.``), for the errors.

    Raises MessageError naming the option: ``not_found`` for an unknown model, ``unsupported``
    for an option set to another value than the server's.
    """
    chosen = None
    now = options_payload(current)
    for key, value in posted.items():
        field = f"{prefix}{key}"
        if key == CHECKPOINT:
            if not isinstance(value, str):
                raise MessageError("bad_params", f"{field}: must be a model's title", field=field)
            chosen = resolve_model(value, models, field=field)
        elif key not in now or now[key] != value:
            shown = f"it is {now[key]!r}" if key in now else "it is not an option here"
            raise MessageError(
                "unsupported",
                f"{field}: only {CHECKPOINT} can be set here ({shown}); got {value!r:.60}",
                field=field,
            )
    return chosen
