"""``Diffusers(pipe)``: picks the adapter that streams a pipeline, and what they share.

Two ways to stream a diffusers pipeline:

native
    The adapter rebuilds the pipeline's denoise loop from its components, one
    iteration per engine ``step``: requests batch across each other and give
    bit for bit the latents of ``pipe(...)`` (one torch thread). UNet
    pipelines (SD 1.x/2.x, SDXL: :mod:`.unet`), SD3/SD3.5 (:mod:`.sd3`) and
    Flux (:mod:`.flux`).
callback
    Any other ``DiffusionPipeline`` whose ``__call__`` takes
    ``callback_on_step_end`` (:mod:`.callback`): ``pipe(...)`` itself runs on
    the producer thread, one request at a time, and each step's latents are
    emitted from the callback.

``Diffusers(pipe, mode="auto")`` returns the native adapter where one exists
and the callback adapter otherwise; ``mode="native"`` or ``"callback"``
insists. Every adapter is a subclass of :class:`Diffusers`, so
``isinstance(model, Diffusers)`` holds and ``model.mode`` says which.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...model import StepModel

__all__ = ["Diffusers", "PromptEmbeddings", "EncodePrompt", "MODES", "INSTALL_HINT", "adapter_for"]

INSTALL_HINT = 'the diffusers adapter needs the diffusers extra: pip install "omni-stream[diffusers]"'

#: The values of ``Diffusers(..., mode=)``.
MODES = ("auto", "native", "callback")

# (module, class) of the native adapters, tried in order; each class has a
# ``fits(pipe) -> bool`` static method that decides without importing more
# than diffusers itself.
_NATIVE = (
    ("unet", "UNetDiffusers"),
    ("sd3", "SD3Diffusers"),
    ("flux", "FluxDiffusers"),
)


@dataclass(frozen=True, slots=True)
class PromptEmbeddings:
    """One prompt's text conditioning, the way the denoiser consumes it.

    ``prompt_embeds`` is ``[1, seq, dim]`` (the leading 1 may be left out);
    ``negative_prompt_embeds`` has the same shape and is needed whenever a
    request uses classifier-free guidance (``guidance_scale > 1``). SDXL,
    SD3 and Flux also take the pooled embeddings, ``[1, dim]`` (or ``[dim]``).
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None


#: ``encode_prompt(prompt, negative_prompt) -> PromptEmbeddings``; runs on the producer thread.
EncodePrompt = Callable[[str, str], PromptEmbeddings]


def _adapter_class(module: str, name: str) -> type[Diffusers]:
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def takes_step_callback(pipe: Any) -> bool:
    """Whether ``pipe.__call__`` accepts ``callback_on_step_end`` (callback mode needs it)."""
    call = getattr(pipe, "__call__", None)
    if call is None:
        return False
    try:
        return "callback_on_step_end" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


def adapter_for(pipe: Any, mode: str = "auto") -> type[Diffusers]:
    """The adapter class that streams ``pipe`` in ``mode``; raises ValueError when none does."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    kind = type(pipe).__name__
    if mode in ("auto", "native"):
        for module, name in _NATIVE:
            cls = _adapter_class(module, name)
            if cls.fits(pipe):
                return cls
        if mode == "native":
            raise ValueError(
                f"{kind} has no native adapter; native mode drives UNet pipelines (SD 1.x/2.x, "
                "SDXL), StableDiffusion3Pipeline and FluxPipeline; use mode='callback' "
                "for other pipelines"
            )
    if takes_step_callback(pipe):
        return _adapter_class("callback", "CallbackDiffusers")
    raise ValueError(
        f"{kind} cannot be streamed: it has no native adapter and its __call__ takes no "
        "callback_on_step_end (callback mode needs it)"
    )


class Diffusers(StepModel):
    """A diffusers pipeline, streamed step by step (``Diffusers(pipe, mode="auto")``).

    Calling ``Diffusers(pipe, **options)`` returns the adapter subclass that
    fits ``pipe`` (see the module docstring); the options are that adapter's.
    """

    name = "diffusers"
    #: "native" or "callback": how this adapter streams its pipeline.
    mode: str = "native"

    def __new__(cls, pipe: Any = None, *args: Any, mode: str = "auto", **kwargs: Any) -> Diffusers:
        if cls is Diffusers:
            try:
                import diffusers  # noqa: F401
            except ImportError as exc:
                raise ImportError(INSTALL_HINT) from exc
            cls = adapter_for(pipe, mode)
        return super().__new__(cls)

    @staticmethod
    def fits(pipe: Any) -> bool:
        """Whether this adapter drives ``pipe`` natively (each native adapter answers)."""
        return False

    @classmethod
    def from_pretrained(
        cls,
        model_id: str,
        *,
        torch_dtype: torch.dtype | None = None,
        mode: str = "auto",
        **pipeline_kwargs: Any,
    ) -> Diffusers:
        """Load ``model_id`` (a hub id or a folder) with ``DiffusionPipeline.from_pretrained`` and wrap it.

        Raises ImportError without diffusers, and whatever diffusers raises
        for a model it cannot load; ValueError as :class:`Diffusers` does.
        """
        try:
            from diffusers import DiffusionPipeline
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        if torch_dtype is not None:
            pipeline_kwargs["torch_dtype"] = torch_dtype
        pipe = DiffusionPipeline.from_pretrained(model_id, **pipeline_kwargs)
        if cls is Diffusers:
            return Diffusers(pipe, mode=mode)
        return cls(pipe)

    def describe(self) -> str:
        return f"{type(self._pipe).__name__ if hasattr(self, '_pipe') else 'diffusers'} ({self.mode} mode)"


def vae_image(image: torch.Tensor) -> torch.Tensor:
    """A VAE's decoded batch of one, as the engine's decoded output: ``[3, H, W]`` float32 in [-1, 1].

    ``pipe(..., output_type="pt")`` returns ``(image / 2 + 0.5).clamp(0, 1)``
    of the same tensor; this is that image mapped back to [-1, 1], the range
    every RGB frame in omni_stream uses. It stays on the device: the copier
    moves it like any frame.
    """
    if image.dim() == 4:
        image = image[0]
    return image.float().clamp(-1.0, 1.0)
