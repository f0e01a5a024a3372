"""The native adapter for Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``).

``pipe(...)`` runs its whole denoise loop in one call. This adapter rebuilds
that loop from the pipeline's components, one transformer evaluation per
``step`` call: the joint-attention transformer on the text embeddings and
pooled projections, classifier-free guidance, ``scheduler.step``, with the
pipeline's own timestep calculation (``calculate_shift`` for schedulers with
dynamic shifting) and noise (``randn_tensor`` from a CPU generator). A
request therefore gives bit for bit the latents of ``pipe(...,
generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")``
(one torch thread).

Each intermediate frame is the flow-matching estimate of the clean latent,
``x0 = x_t - sigma_t * v`` (the transformer predicts the velocity ``v``), so
previews show the picture forming instead of noise; the last frame is the
final latent. Frames are ``[16, h, w]`` latents in the transformer's space
(``(vae latent - shift_factor) * scaling_factor``), the space the ``sd3``
preview decoder reads; :meth:`SD3Diffusers.decode` runs the real VAE.

Every request owns its scheduler (``from_config`` of the pipeline's) and its
generator (see :mod:`.native` for why). The loop is :mod:`.native`'s; what
SD3 shares with Flux is :mod:`.flow`'s; this module holds the rest. Not
rebuilt: skip-layer guidance, IP-Adapter, custom sigmas and
``joint_attention_kwargs`` (use callback mode for those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...errors import ParamsError
from .base import PromptEmbeddings
from .flow import FlowDiffusers
from .loop import MAX_SIDE, cat_rows, signature_params
from .native import NativeState, TextConditioning

__all__ = ["SD3Diffusers"]


class SD3Diffusers(FlowDiffusers[TextConditioning]):
    """A diffusers Stable Diffusion 3 / 3.5 pipeline, one denoise step per engine step.

    The options are :class:`~.native.NativeDiffusers`'. Without
    ``encode_prompt`` the pipeline's own (CLIP-L, CLIP-G and, if present,
    T5) is used; ``scheduler`` must take the pipeline's timesteps (``mu``
    where it shifts dynamically).
    """

    #: The :mod:`omni_stream.preview` decoder for 16-channel latents (None for others).
    preview_decoder: str | None = "sd3"
    default_guidance = 7.0
    label = "SD3"
    cache_methods = ("none", "fbcache", "taylorseer")
    text_tokens = 77 + 256  # CLIP's 77 and T5's max_sequence_length, joined
    cache_why_not = "SD3 has no teacache: TeaCache's rescaling polynomial was fitted for Flux only"
    # StableDiffusion3Pipeline leaves the first step's index to be looked up.
    starts_at_first_timestep = False

    @staticmethod
    def fits(pipe: Any) -> bool:
        """``StableDiffusion3Pipeline``, or a non-pipeline object holding an SD3 transformer.

        Other diffusers pipelines built on the SD3 transformer (img2img,
        inpainting, ControlNet, PAG) have loops of their own that a
        text-to-image loop would silently replace; they are left to callback
        mode.
        """
        try:
            from diffusers import (
                DiffusionPipeline,
                SD3Transformer2DModel,
                StableDiffusion3Pipeline,
            )
        except ImportError:
            return False
        if isinstance(pipe, StableDiffusion3Pipeline):
            return True
        if isinstance(pipe, DiffusionPipeline):
            return False
        return isinstance(getattr(pipe, "transformer", None), SD3Transformer2DModel)

    # -- construction -------------------------------------------------------------

    def _import_helpers(self) -> None:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        self._calculate_shift = calculate_shift
        self._retrieve_timesteps = retrieve_timesteps

    def _checked_denoiser(self, pipe: Any) -> Any:
        from diffusers import SD3Transformer2DModel

        transformer = getattr(pipe, "transformer", None)
        if not isinstance(transformer, SD3Transformer2DModel):
            raise ParamsError(
                f"{type(pipe).__name__} has no SD3Transformer2DModel (its transformer is "
                f"{type(transformer).__name__}); SD3Diffusers drives StableDiffusion3Pipeline",
                field="pipe",
            )
        config = transformer.config
        if config.in_channels != config.out_channels:
            raise ParamsError(
                f"SD3 transformer has {config.in_channels} input and {config.out_channels} output "
                "channels; only text-to-image transformers (equal counts) are supported",
                field="pipe",
            )
        return transformer

    def _configure(self, template: Any) -> None:
        dynamic = bool(template.config.get("use_dynamic_shifting", None))
        if dynamic and "mu" not in signature_params(template.set_timesteps):
            raise ParamsError(
                f"{type(template).__name__} uses dynamic shifting but its set_timesteps takes no mu",
                field="scheduler",
            )
        config = self._transformer.config
        self._channels = int(config.in_channels)
        self._patch = int(config.patch_size)
        # StableDiffusion3Pipeline.check_inputs: sides are whole patches of latents.
        self._multiple = self._vae_scale * self._patch
        # The pipeline's default size: the transformer's sample size in latents.
        side = int(config.sample_size) * self._vae_scale
        self._default_size = (side, side)
        pos_max = getattr(config, "pos_embed_max_size", None)
        if pos_max:
            # The positional embedding is cropped from a pos_max x pos_max grid
            # of patches; a larger latent raises inside the transformer.
            self._max_side = min(MAX_SIDE, int(pos_max) * self._multiple)
        self.preview_decoder = "sd3" if self._channels == 16 else None

    # -- the loop's SD3 steps ---------------------------------------------------------

    def _set_timesteps(
        self, scheduler: Any, steps: int, device: torch.device | None, height: int, width: int
    ) -> None:
        # StableDiffusion3Pipeline.__call__, step 5.
        kwargs: dict[str, Any] = {}
        # The pipeline asks the scheduler it holds (a request's sampler may be another class).
        if scheduler.config.get("use_dynamic_shifting", None):
            seq = (height // self._vae_scale // self._patch) * (width // self._vae_scale // self._patch)
            kwargs["mu"] = self._shift(seq, 1.16, scheduler.config)
        self._retrieve_timesteps(scheduler, steps, device, sigmas=None, **kwargs)

    def _pipeline_encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        # "" -> None is what pipe(prompt=...) without a negative prompt does
        # (it encodes "" then).
        out = self._pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=guided,
            negative_prompt=negative_prompt or None,
        )
        return PromptEmbeddings(*out)

    def _conditioning(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype, guided: bool
    ) -> TextConditioning:
        embeds, pooled = self._text(params, device, dtype, guided)
        return TextConditioning(embeds=embeds, pooled=pooled)

    def _denoise(
        self, group: Sequence[NativeState[TextConditioning]], timesteps: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        inputs = [s.model_input() for s in group]
        out: torch.Tensor = self._transformer(
            hidden_states=cat_rows(inputs),
            timestep=cat_rows([t.expand(x.shape[0]) for t, x in zip(timesteps, inputs, strict=True)]),
            encoder_hidden_states=cat_rows([s.conditioning.embeds for s in group]),
            pooled_projections=cat_rows([s.conditioning.pooled for s in group]),
            joint_attention_kwargs=None,
            return_dict=False,
        )[0]
        return out
