"""Model names for the command line and the server: built-ins, diffusers pipelines, single-file
checkpoints (``PATH.safetensors[?config=DIR]``) and ``module:attr``."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping

from ..errors import ParamsError
from ..model import StepModel

__all__ = ["BUILTIN_MODELS", "load_model", "single_file_spec"]

logger = logging.getLogger("omni_stream.models")


def _mixture() -> StepModel:
    from .mixture import Mixture

    return Mixture()


def _synthetic() -> StepModel:
    from .synthetic import Synthetic

    return Synthetic()


#: Built-in model names and their factories; the first is the default.
BUILTIN_MODELS: dict[str, Callable[[], StepModel]] = {
    "mixture": _mixture,
    "synthetic": _synthetic,
}


def load_model(spec: str, *, model_configs: Mapping[str, str] | None = None) -> StepModel:
    """Return the model named by ``spec``: a built-in name, ``diffusers:ID|PATH``, a single-file
    checkpoint (``PATH.safetensors``, ``diffusers:`` before it optional, ``?config=DIR`` after
    it) or ``module:attr``.

    ``attr`` may be a StepModel instance, a StepModel subclass or a factory
    called with no arguments. ``diffusers:MODEL_ID`` loads a pipeline with
    the diffusers extra. A single file takes its config from ``?config=DIR``,
    else from ``model_configs`` (``{model type: DIR}``, ``""`` for any;
    models/diffusers/single_file.py). Raises ParamsError naming ``spec`` when it
    cannot be loaded. Logs one INFO line saying what was loaded, unless it is a
    built-in (a diffusers pipeline: which mode, native or callback, it runs in).
    """
    model = _load(spec, model_configs)
    if spec not in BUILTIN_MODELS:  # a built-in is what its name says
        logger.info("model %s: %s", spec, model.describe())
    return model


def single_file_spec(spec: str) -> tuple[str, str | None] | None:
    """``(path, config folder or None)`` when ``spec`` names a checkpoint file
    (``[diffusers:]PATH.safetensors[?config=DIR]``, or a pickle's suffix, refused when it
    loads), else None. Raises ParamsError for an option after ``?`` other than ``config``."""
    from .diffusers.single_file import is_single_file

    text = spec[len("diffusers:") :] if spec.startswith("diffusers:") else spec
    path, sep, query = text.partition("?")
    if not is_single_file(path):
        return None
    if not sep:
        return path, None
    key, eq, value = query.partition("=")
    if key != "config" or not eq or not value:
        raise ParamsError(
            f"model {spec!r}: after '?' a checkpoint file takes config=DIR (a diffusers folder "
            f"of its architecture), got {query!r}",
            field="model",
        )
    return path, value


def _load_single_file(
    spec: str, path: str, config: str | None, configs: Mapping[str, str] | None
) -> StepModel:
    from .diffusers.single_file import pickle_refusal

    refusal = pickle_refusal(path)
    if refusal is not None:
        raise ParamsError(f"model {spec!r}: {refusal}", field="model")
    try:
        from .diffusers import Diffusers

        return Diffusers.from_single_file(path, config=config if config is not None else configs)
    except ImportError as exc:
        raise ParamsError(f"model {spec!r}: {exc}", field="model") from exc
    except (OSError, ValueError) as exc:
        raise ParamsError(f"model {spec!r} could not be loaded: {exc}", field="model") from exc


def _load(spec: str, configs: Mapping[str, str] | None) -> StepModel:
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]()
    single = single_file_spec(spec)
    if single is not None:
        return _load_single_file(spec, *single, configs)
    if spec.startswith("diffusers:"):
        from .diffusers import Diffusers

        model_id = spec[len("diffusers:") :]
        try:
            model = Diffusers.from_pretrained(model_id)
        except ImportError as exc:
            raise ParamsError(f"model {spec!r}: {exc}", field="model") from exc
        except (OSError, ValueError) as exc:
            raise ParamsError(f"model {spec!r} could not be loaded: {exc}", field="model") from exc
        return model
    if ":" not in spec:
        raise ParamsError(
            f"unknown model {spec!r}; built-in: {', '.join(BUILTIN_MODELS)}, or give module:attr",
            field="model",
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ParamsError(f"model {spec!r}: cannot import {module_name!r}: {exc}", field="model") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ParamsError(
            f"model {spec!r}: {module_name!r} has no attribute {attr!r}", field="model"
        ) from None
    if isinstance(obj, StepModel):
        return obj
    if callable(obj):
        model = obj()
        if isinstance(model, StepModel):
            return model
        raise ParamsError(
            f"model {spec!r}: calling it gave {type(model).__name__}, not a StepModel", field="model"
        )
    raise ParamsError(f"model {spec!r} is a {type(obj).__name__}, not a StepModel", field="model")
