"""The model a ``--model SPEC`` names, built with the command's options (its LoRAs, the configs
of single-file checkpoints).

:class:`ModelLoader` is a value, not a closure: ``serve --ray`` pickles it
to every replica, which builds its model with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import OmniStreamError, ParamsError
from ..model import StepModel
from .console import UsageError, describe_error

logger = logging.getLogger("omni_stream.models")

__all__ = ["ModelLoader", "build_model", "check_model_configs", "named_spec"]


def build_model(
    spec: str,
    preview_vae: str | None = None,
    loras: Mapping[str, str] | None = None,
    *,
    no_batch: bool = False,
    max_images: int | None = None,
    model_configs: Mapping[str, str] | None = None,
    cache: Mapping[str, object] | None = None,
) -> StepModel:
    """The model named by ``spec``, built now (:class:`ModelLoader`'s arguments)."""
    return ModelLoader.of(
        spec,
        preview_vae,
        loras,
        no_batch=no_batch,
        max_images=max_images,
        model_configs=model_configs,
        cache=cache,
    )()


@dataclass(frozen=True, slots=True)
class ModelLoader:
    """How to build the model named by ``spec``, with the command line's options: a value.

    ``serve --ray`` sends it to every replica, which calls it to build its
    model: Ray pickles it there, so it holds only its fields (a closure over
    the parsed arguments took their logging handler's lock along and failed
    to pickle). Make it with :meth:`of`, where the command runs: the
    environment's preview autoencoder is the command's, not a replica's.
    """

    spec: str
    #: The tiny preview autoencoder, and the option or variable that named it.
    preview_vae: str | None = None
    preview_vae_from: str = "--preview-vae"
    loras: tuple[tuple[str, str], ...] = ()
    no_batch: bool = False
    max_images: int | None = None
    #: Whether a model that takes no LoRAs is an error (LoRAs bound to it, or the only model)
    #: rather than passed over (LoRAs given for every model, one of several).
    loras_required: bool = True
    #: Single-file checkpoints' config folders by diffusers' model type ("" for any).
    model_configs: tuple[tuple[str, str], ...] = ()
    #: The default of the ``cache`` param (``serve --cache``), as (key, value) pairs.
    cache: tuple[tuple[str, object], ...] | None = None
    #: Whether a model that cannot cache is an error (the only model) rather than passed over.
    cache_required: bool = True

    @classmethod
    def of(
        cls,
        spec: str,
        preview_vae: str | None = None,
        loras: Mapping[str, str] | None = None,
        *,
        no_batch: bool = False,
        max_images: int | None = None,
        loras_required: bool = True,
        model_configs: Mapping[str, str] | None = None,
        cache: Mapping[str, object] | None = None,
        cache_required: bool = True,
    ) -> ModelLoader:
        """``spec`` with the LoRAs (``{name: path}``; ``loras_required``: a model that takes
        none is an error, else they are passed over), ``no_batch`` (one request per model call:
        a diffusers pipeline's results then equal ``pipe()``'s bit for bit whatever else runs),
        ``max_images`` (the most images a request may ask for, ``num_images``), the config
        folders of single-file checkpoints and the preview autoencoder, else
        ``$OMNI_STREAM_PREVIEW_VAE``'s."""
        from ..config import PREVIEW_VAE_ENV, preview_vae as env_preview_vae

        vae, vae_from = (
            (preview_vae, "--preview-vae") if preview_vae else (env_preview_vae(), PREVIEW_VAE_ENV)
        )
        return cls(
            spec,
            vae,
            vae_from,
            loras=tuple((loras or {}).items()),
            no_batch=no_batch,
            max_images=max_images,
            loras_required=loras_required,
            model_configs=tuple((model_configs or {}).items()),
            cache=None if cache is None else tuple(cache.items()),
            cache_required=cache_required,
        )

    def __call__(self) -> StepModel:
        """A new model; raises ParamsError for a spec that does not load, UsageError for an
        option the model does not take."""
        from ..models.registry import load_model

        spec = self.spec
        try:
            model = load_model(spec, model_configs=dict(self.model_configs))
        except OmniStreamError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's factory may raise anything
            raise ParamsError(
                f"model {spec!r} failed to load: {type(exc).__name__}: {exc}", field="model"
            ) from exc
        if self.preview_vae:
            flag, vae = self.preview_vae_from, self.preview_vae
            use = getattr(model, "use_preview_vae", None)
            if use is None:
                raise UsageError(
                    f"{flag}: model {spec!r} has no latents for a tiny autoencoder to decode; "
                    "it works with diffusers:... models"
                )
            try:
                use(vae)
            except (ImportError, ValueError, OSError) as exc:
                raise UsageError(f"{flag} {vae!r}: {describe_error(exc)}") from exc
        if self.loras:
            load = getattr(model, "load_loras", None)
            names = ", ".join(name for name, _ in self.loras)
            if load is None and self.loras_required:
                raise UsageError(
                    f"--lora: model {spec!r} takes no LoRAs ({names}); they work with diffusers models"
                )
            if load is None:
                logger.info("model %s takes no LoRAs: %s not loaded into it", spec, names)
            else:
                try:
                    load(dict(self.loras))
                except (ImportError, ValueError, OSError) as exc:
                    raise UsageError(f"--lora: model {spec!r}: {describe_error(exc)}") from exc
        if self.cache is not None:
            self._default_cache(model, dict(self.cache))
        if self.no_batch:
            model.max_batch_size = 1  # the engine reads it when it starts
        if self.max_images is not None:
            limit = getattr(model, "set_max_images", None)
            if limit is None:
                raise UsageError(
                    f"--max-images: model {spec!r} makes one image a request; "
                    "mixture and diffusers:... image models make several"
                )
            try:
                limit(self.max_images)
            except ParamsError as exc:
                raise UsageError(f"--max-images: {exc}") from None
        return model

    def _default_cache(self, model: StepModel, value: dict[str, object]) -> None:
        """``--cache``: the default of ``model``'s ``cache`` param; UsageError where it cannot
        take it (passed over, logged, on one of several models that did not ask for it)."""
        params = tuple(getattr(model, "params", ()))
        found = next((p for p in params if p.name == "cache"), None)
        try:
            if found is None:
                raise ParamsError(f"model {self.spec!r} has no cache param", field="cache")
            default = found.with_default(value, model=self.spec)
        except ParamsError as exc:
            if self.cache_required or value.get("method") == "none":
                raise UsageError(f"--cache: {exc}") from None
            logger.info("--cache passed over for model %s: %s", self.spec, exc)
            return
        model.params = tuple(default if p.name == "cache" else p for p in params)


def check_model_configs(given: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``--model-config [TYPE=]DIR`` as ``{model type or "": DIR}``; UsageError for a type given
    twice or a DIR that is not a diffusers folder (no model_index.json)."""
    out: dict[str, str] = {}
    for model_type, folder in given:
        option = f"--model-config {model_type + '=' if model_type else ''}{folder}"
        if model_type in out:
            which = f"for {model_type!r}" if model_type else "without a type"
            raise UsageError(f"{option}: a config folder is given twice {which}")
        if not (Path(folder) / "model_index.json").is_file():
            raise UsageError(
                f"{option}: not a diffusers pipeline's folder (it has no model_index.json); "
                "save_pretrained writes one, and `hf download REPO` of a diffusers repo brings one"
            )
        out[model_type] = folder
    return out


def named_spec(text: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` as (NAME, SPEC); a plain SPEC as (None, SPEC). A spec may hold ``=``
    itself (a path): only a left part that is a model name (no ``:`` or ``/``) names it."""
    from ..ids import MODEL_NAME

    name, sep, spec = text.partition("=")
    if sep and MODEL_NAME.fullmatch(name):
        return name, spec
    return None, text
