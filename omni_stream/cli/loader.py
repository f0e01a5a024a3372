"""The model a ``--model SPEC`` names, built with the command's options; the LoRAs it names.

:class:`ModelLoader` is a value, not a closure: ``serve --ray`` pickles it
to every replica, which builds its model with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import OmniStreamError, ParamsError
from ..model import StepModel
from .console import UsageError, describe_error

__all__ = ["ModelLoader", "build_model", "lora_paths", "named_spec"]


def build_model(
    spec: str,
    preview_vae: str | None = None,
    loras: Mapping[str, str] | None = None,
    *,
    no_batch: bool = False,
    max_images: int | None = None,
) -> StepModel:
    """The model named by ``spec``, built now (:class:`ModelLoader`'s arguments)."""
    return ModelLoader.of(spec, preview_vae, loras, no_batch=no_batch, max_images=max_images)()


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

    @classmethod
    def of(
        cls,
        spec: str,
        preview_vae: str | None = None,
        loras: Mapping[str, str] | None = None,
        *,
        no_batch: bool = False,
        max_images: int | None = None,
    ) -> ModelLoader:
        """``spec`` with the LoRAs (``{name: path}``), ``no_batch`` (one request per model call:
        a diffusers pipeline's results then equal ``pipe()``'s bit for bit whatever else runs),
        ``max_images`` (the most images a request may ask for, ``num_images``) and the preview
        autoencoder, else ``$OMNI_STREAM_PREVIEW_VAE``'s."""
        from ..config import PREVIEW_VAE_ENV, preview_vae as env_preview_vae

        pairs = tuple((loras or {}).items())
        if preview_vae:
            return cls(spec, preview_vae, "--preview-vae", pairs, no_batch, max_images)
        return cls(spec, env_preview_vae(), PREVIEW_VAE_ENV, pairs, no_batch, max_images)

    def __call__(self) -> StepModel:
        """A new model; raises ParamsError for a spec that does not load, UsageError for an
        option the model does not take."""
        from ..models.registry import load_model

        spec = self.spec
        try:
            model = load_model(spec)
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
            if load is None:
                raise UsageError(
                    f"--lora: model {spec!r} takes no LoRAs; they work with diffusers:... models"
                )
            try:
                load(dict(self.loras))
            except (ImportError, ValueError, OSError) as exc:
                raise UsageError(f"--lora: {describe_error(exc)}") from exc
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


def lora_paths(args: argparse.Namespace) -> dict[str, str]:
    """``{name: path}`` from --lora NAME=PATH and --lora-dir DIR; UsageError for a clash or a bad folder."""
    from ..models.diffusers.loras import lora_dir

    sources: list[tuple[str, dict[str, str]]] = []
    for folder in args.lora_dir or ():
        try:
            sources.append((f"--lora-dir {folder}", lora_dir(folder)))
        except ValueError as exc:
            raise UsageError(f"--lora-dir: {exc}") from None
    sources += [(f"--lora {name}=...", {name: path}) for name, path in args.lora or ()]
    found: dict[str, str] = {}
    for source, loras in sources:
        for name, path in loras.items():
            if name in found:
                raise UsageError(f"{source}: a LoRA named {name!r} is given twice")
            found[name] = path
    return found


def named_spec(text: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` as (NAME, SPEC); a plain SPEC as (None, SPEC). A spec may hold ``=``
    itself (a path): only a left part that is a model name (no ``:`` or ``/``) names it."""
    from ..ids import MODEL_NAME

    name, sep, spec = text.partition("=")
    if sep and MODEL_NAME.fullmatch(name):
        return name, spec
    return None, text
