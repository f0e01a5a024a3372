"""The native adapter for Flux.1 (``FluxPipeline``: dev, schnell and their fine-tunes).

``pipe(...)`` runs its whole denoise loop in one call. This adapter rebuilds
that loop from the pipeline's components, one transformer evaluation per
``step`` call, with diffusers' own pieces: ``randn_tensor`` noise from a CPU
generator, packed into ``[seq, 64]`` tokens by ``FluxPipeline._pack_latents``,
``_prepare_latent_image_ids`` positions, the pipeline's sigmas and
``calculate_shift`` mu for ``retrieve_timesteps``, the guidance embedding of
guidance-distilled models (``transformer.config.guidance_embeds``, Flux.1
dev), the T5 embeddings with zero text ids and the pooled CLIP embedding. A
request therefore gives bit for bit the latents of ``pipe(...,
generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")``
(one torch thread).

Frames are *unpacked* latents ``[16, h, w]`` in the transformer's space
(``(vae latent - shift_factor) * scaling_factor``), the shape the ``flux``
preview decoder and the engine's tools expect of a latent (and what
:meth:`FluxDiffusers.decode_latents` takes). Each intermediate frame is the
flow-matching estimate ``x0 = x_t - sigma_t * v``; the last is the final
latent. :meth:`FluxDiffusers.decode` runs the real VAE.

Every request owns its scheduler and generator (see :mod:`.native` for
why). The loop is :mod:`.native`'s; what Flux shares with SD3 is
:mod:`.flow`'s; this module holds the rest. Not rebuilt: true CFG with a
negative prompt (``true_cfg_scale``), IP-Adapter, custom sigmas,
``joint_attention_kwargs`` and diffusers' cache hooks (their per-run state
cannot be shared by interleaved requests: the ``cache`` param is First-Block
Cache, TeaCache and TaylorSeer per request, :mod:`.step_cache`); use callback
mode for those.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ...errors import ParamsError
from ...params import Param
from .base import PromptEmbeddings
from .flow import FlowDiffusers
from .loop import cat_rows, signature_params
from .native import NativeState, TextConditioning

__all__ = ["FluxDiffusers"]


@dataclass(kw_only=True)
class _FluxConditioning(TextConditioning):
    # embeds: T5 [1, text_seq, dim]; pooled: CLIP [1, dim]
    text_ids: torch.Tensor  # [text_seq, 3]
    image_ids: torch.Tensor  # [seq, 3]
    guidance: torch.Tensor | None  # [1] float32, for guidance-distilled transformers

    per_row: ClassVar[tuple[str, ...]] = ("embeds", "pooled", "guidance")


_State = NativeState[_FluxConditioning]


class FluxDiffusers(FlowDiffusers[_FluxConditioning]):
    """A diffusers Flux.1 pipeline, one denoise step per engine step.

    The options are :class:`~.native.NativeDiffusers`'. ``encode_prompt``
    returns T5 ``prompt_embeds`` and the pooled CLIP
    ``pooled_prompt_embeds`` (its ``negative_prompt`` argument is always
    ""); ``defaults`` such as ``{"steps": 4}`` suit schnell; ``scheduler``
    must take the pipeline's sigmas and mu.
    """

    #: The :mod:`omni_stream.preview` decoder for 16-channel latents (None for others).
    preview_decoder: str | None = "flux"
    takes_negative_prompt = False
    label = "Flux"
    conditioning_type = _FluxConditioning

    @staticmethod
    def fits(pipe: Any) -> bool:
        """``FluxPipeline``, or a non-pipeline object holding a Flux transformer.

        Other diffusers pipelines on the Flux transformer (img2img, fill,
        Kontext, ControlNet) have loops of their own; they are left to
        callback mode.
        """
        try:
            from diffusers import (
                DiffusionPipeline,
                FluxPipeline,
                FluxTransformer2DModel,
            )
        except ImportError:
            return False
        if isinstance(pipe, FluxPipeline):
            return True
        if isinstance(pipe, DiffusionPipeline):
            return False
        return isinstance(getattr(pipe, "transformer", None), FluxTransformer2DModel)

    # -- construction -------------------------------------------------------------

    def _import_helpers(self) -> None:
        from diffusers import FluxPipeline
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        self._calculate_shift = calculate_shift
        self._retrieve_timesteps = retrieve_timesteps
        self._flux = FluxPipeline

    def _checked_denoiser(self, pipe: Any) -> Any:
        from diffusers import FluxTransformer2DModel

        transformer = getattr(pipe, "transformer", None)
        if not isinstance(transformer, FluxTransformer2DModel):
            raise ParamsError(
                f"{type(pipe).__name__} has no FluxTransformer2DModel (its transformer is "
                f"{type(transformer).__name__}); FluxDiffusers drives FluxPipeline",
                field="pipe",
            )
        config = transformer.config
        if config.in_channels % 4 or transformer.out_channels != config.in_channels:
            # Fill/Canny/Depth transformers take extra packed channels (image,
            # mask) that a text-to-image loop has no values for.
            raise ParamsError(
                f"Flux transformer has {config.in_channels} input and {transformer.out_channels} "
                "output channels; only text-to-image transformers (equal counts, 2x2 packed "
                "latents) are supported",
                field="pipe",
            )
        return transformer

    def _configure(self, template: Any) -> None:
        # FluxPipeline.__call__ passes its own sigmas unless the scheduler
        # makes flow sigmas itself, and always passes mu.
        own_sigmas = not getattr(template.config, "use_flow_sigmas", False)
        takes = signature_params(template.set_timesteps)
        needed = {"mu"} | ({"sigmas"} if own_sigmas else set())
        if not needed <= takes:
            raise ParamsError(
                f"{type(template).__name__}.set_timesteps takes no {' / '.join(sorted(needed - takes))}; "
                "FluxPipeline's timesteps need a flow-matching scheduler",
                field="scheduler",
            )
        config = self._transformer.config
        self._channels = int(config.in_channels) // 4
        self._guidance_embeds = bool(config.guidance_embeds)
        # Latents are packed in 2x2 patches: sides are whole patches.
        self._multiple = self._vae_scale * 2
        side = int(getattr(self._pipe, "default_sample_size", 128)) * self._vae_scale
        self._default_size = (side, side)
        self.preview_decoder = "flux" if self._channels == 16 else None

    def _guidance_params(self) -> list[Param]:
        guidance_help = (
            "distilled guidance, fed to the transformer's guidance embedding"
            if self._guidance_embeds
            else "unused: this transformer has no guidance embedding"
        )
        return [Param("guidance_scale", "float", 3.5, guidance_help, minimum=0.0, maximum=100.0)]

    # -- the loop's Flux steps --------------------------------------------------------

    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        # FluxPipeline.prepare_latents: whole 2x2 patches of latents.
        return (2 * (height // self._multiple), 2 * (width // self._multiple))

    def _set_timesteps(
        self, scheduler: Any, steps: int, device: torch.device | None, height: int, width: int
    ) -> None:
        # FluxPipeline.__call__, step 5 (then set_begin_index(0), as the loop does).
        # The pipeline asks the scheduler it holds (a request's sampler may be another class).
        own_sigmas = not getattr(scheduler.config, "use_flow_sigmas", False)
        sigmas = np.linspace(1.0, 1 / steps, steps) if own_sigmas else None
        h, w = self._latent_size(height, width)
        mu = self._shift((h // 2) * (w // 2), 1.15, scheduler.config)
        self._retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)

    def _guided(self, params: Mapping[str, Any]) -> bool:
        # Distilled guidance goes in as an embedding: one row per request.
        return False

    def _pipeline_encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        embeds, pooled, _ = self._pipe.encode_prompt(
            prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=1
        )
        return PromptEmbeddings(embeds, pooled_prompt_embeds=pooled)

    def _conditioning(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype, guided: bool
    ) -> _FluxConditioning:
        embeds, pooled = self._text(params, device, dtype, guided)
        # FluxPipeline.encode_prompt: every text token sits at position zero.
        text_ids = torch.zeros(embeds.shape[1], 3).to(device=device, dtype=dtype)
        h, w = self._latent_size(int(params["height"]), int(params["width"]))
        image_ids = self._flux._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
        guidance = None
        if self._guidance_embeds:
            guidance = torch.full([1], float(params["guidance_scale"]), device=device, dtype=torch.float32)
        return _FluxConditioning(
            embeds=embeds, pooled=pooled, text_ids=text_ids, image_ids=image_ids, guidance=guidance
        )

    def _initial_latents(self, noise: torch.Tensor, scheduler: Any, height: int, width: int) -> torch.Tensor:
        images, channels, h, w = noise.shape
        packed: torch.Tensor = self._flux._pack_latents(noise, images, channels, h, w)
        return packed

    def _group_key(self, s: _State) -> Hashable:
        # The position ids are shared by the whole batch: one text length and
        # one image size a call.
        return (tuple(s.conditioning.embeds.shape[1:]), s.params["height"], s.params["width"])

    def _denoise(self, group: Sequence[_State], timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        inputs = [s.model_input() for s in group]
        steps = [t.expand(x.shape[0]).to(x.dtype) / 1000 for t, x in zip(timesteps, inputs, strict=True)]
        conds = [s.conditioning for s in group]
        out: torch.Tensor = self._transformer(
            hidden_states=cat_rows(inputs),
            timestep=cat_rows(steps),
            guidance=cat_rows([c.guidance for c in conds]) if self._guidance_embeds else None,
            pooled_projections=cat_rows([c.pooled for c in conds]),
            encoder_hidden_states=cat_rows([c.embeds for c in conds]),
            txt_ids=conds[0].text_ids,
            img_ids=conds[0].image_ids,
            joint_attention_kwargs={},
            return_dict=False,
        )[0]
        return out

    def _frame(self, s: _State, latents: torch.Tensor) -> torch.Tensor:
        # A fresh tensor (the permute makes reshape copy): safe to hand out.
        height, width = int(s.params["height"]), int(s.params["width"])
        unpacked: torch.Tensor = self._flux._unpack_latents(latents, height, width, self._vae_scale)
        return unpacked[0] if s.images == 1 else unpacked
