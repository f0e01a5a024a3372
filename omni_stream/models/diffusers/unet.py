"""The native adapter for UNet pipelines: Stable Diffusion 1.x/2.x and SDXL.

``pipe(...)`` runs its whole denoise loop in one call, so the engine cannot
drive it. This adapter rebuilds the loop of ``StableDiffusionPipeline`` and
``StableDiffusionXLPipeline`` from the pipeline's components, one iteration
per ``step`` call: ``scale_model_input``, the UNet, classifier-free
guidance (and ``guidance_rescale``), ``scheduler.step``, exactly as
diffusers does it, so a request gives bit for bit the latents of
``pipe(..., generator=torch.Generator("cpu").manual_seed(seed),
output_type="latent")``. Cancelling needs nothing more: the engine stops
calling ``step`` and calls ``close``.

Each frame is the scheduler's x0 prediction (``pred_original_sample``, or
``denoised``, or the x0 a DPM-Solver++ / UniPC solver keeps), so previews
show the picture forming rather than noise (diffusers #3579); where the
scheduler exposes none it is the noisy latent. The last frame is always the
final latent. Frames are ``[C, h, w]`` latents in the UNet's space (the VAE
latent times ``scaling_factor``) and dtype; ``preview_decoder`` names the
latent-to-RGB decoder in :mod:`omni_stream.preview` that fits them, and
:meth:`UNetDiffusers.decode` runs the real VAE.

Every request owns its scheduler (``from_config`` of the pipeline's), its
latents and its CPU generator (see :mod:`.native` for why). The loop is
:mod:`.native`'s; this module holds what the UNet pipelines do their own
way: SDXL's pooled embeddings and micro-conditioning, the guidance
embedding of guidance-distilled UNets (LCM), ``eta``, the x0 of each
scheduler, the SDXL VAE's float32 decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import ParamsError
from ...params import Param
from . import samplers
from .base import PromptEmbeddings, vae_image
from .loop import cat_rows, signature_params, text_conditioning, vae_latents
from .native import NativeDiffusers, NativeState, TextConditioning

__all__ = ["UNetDiffusers"]


@dataclass(kw_only=True)
class _UNetConditioning(TextConditioning):
    # pooled: SDXL's pooled embeddings (the UNet's text_embeds) [rows, dim]
    time_ids: torch.Tensor | None = None  # SDXL micro-conditioning [rows, 6]
    timestep_cond: torch.Tensor | None = None  # guidance embedding of guidance-distilled UNets [1, dim]

    per_row: ClassVar[tuple[str, ...]] = ("embeds", "pooled", "time_ids", "timestep_cond")


_State = NativeState[_UNetConditioning]


class UNetDiffusers(NativeDiffusers[_UNetConditioning]):
    """A diffusers Stable Diffusion / SDXL pipeline, one denoise step per engine step.

    The options are :class:`~.native.NativeDiffusers`'. Without
    ``encode_prompt`` the pipeline's own (tokenizer and text encoder) is
    used; ``defaults`` such as ``{"steps": 4, "guidance_scale": 0.0}`` suit
    a turbo model.
    """

    #: "sd" (1.x/2.x) or "sdxl", from the UNet's ``addition_embed_type``.
    family = "sd"
    conditioning_type = _UNetConditioning

    @property
    def snapshot_kind(self) -> str:
        # An SD checkpoint lacks what an SDXL UNet needs (pooled, time ids): the family is part of the kind.
        return f"{type(self).__name__}/{self.family}"

    @staticmethod
    def fits(pipe: Any) -> bool:
        """The text-to-image UNet pipelines (SD 1.x/2.x, SDXL), or a non-pipeline object with a UNet.

        img2img, inpainting, ControlNet and the other UNet pipelines have
        loops of their own (an input image, a mask, a control net) that a
        text-to-image loop would silently drop; they go to callback mode.
        """
        try:
            from diffusers import (
                DiffusionPipeline,
                StableDiffusionPipeline,
                StableDiffusionXLPipeline,
            )
        except ImportError:
            return False
        if type(pipe) in (StableDiffusionPipeline, StableDiffusionXLPipeline):
            return True
        if isinstance(pipe, DiffusionPipeline):
            return False
        return getattr(pipe, "unet", None) is not None

    @property
    def _unet(self) -> Any:
        return self._denoiser

    # -- construction -------------------------------------------------------------

    #: The samplers whose step takes ``eta`` (set with the params, at construction).
    _eta_takers: tuple[str, ...] = ()

    def _import_helpers(self) -> None:
        from diffusers import (
            DPMSolverMultistepScheduler,
            DPMSolverSinglestepScheduler,
            UniPCMultistepScheduler,
        )
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

        self._rescale_noise_cfg = rescale_noise_cfg
        # For _keeps_x0, asked on the per-step path: imported once, here.
        self._dpm_solvers = (DPMSolverMultistepScheduler, DPMSolverSinglestepScheduler)
        self._unipc = UniPCMultistepScheduler

    def _checked_denoiser(self, pipe: Any) -> Any:
        unet = getattr(pipe, "unet", None)
        if unet is None:
            kind = "a transformer" if getattr(pipe, "transformer", None) is not None else "no"
            raise ParamsError(
                f"{type(pipe).__name__} has {kind} denoiser and no UNet; the diffusers adapter "
                "supports UNet2DConditionModel pipelines (Stable Diffusion 1.x/2.x, SDXL)",
                field="pipe",
            )
        config = unet.config
        addition = getattr(config, "addition_embed_type", None)
        if addition not in (None, "text_time"):
            raise ParamsError(
                f"UNet addition_embed_type {addition!r} is not supported; the diffusers adapter "
                "drives Stable Diffusion 1.x/2.x (none) and SDXL ('text_time') UNets",
                field="pipe",
            )
        if config.in_channels != config.out_channels:
            # Inpainting and upscaling UNets take extra channels (mask, image)
            # that a text-to-image loop has no values for.
            raise ParamsError(
                f"UNet has {config.in_channels} input and {config.out_channels} output channels; "
                "only text-to-image UNets (equal counts) are supported",
                field="pipe",
            )
        return unet

    def _configure(self, template: Any) -> None:
        config = self._unet.config
        sdxl = getattr(config, "addition_embed_type", None) == "text_time"
        self.family = "sdxl" if sdxl else "sd"
        self.default_guidance = 5.0 if sdxl else 7.5
        self.needs_pooled = sdxl
        self.encoder_parts = ("tokenizer_2", "text_encoder_2") if sdxl else ("tokenizer", "text_encoder")
        self._time_cond_dim: int | None = getattr(config, "time_cond_proj_dim", None)
        self._channels = int(config.in_channels)
        # diffusers' pipelines ask for multiples of 8 (check_inputs); a VAE
        # that downsamples more needs its own factor.
        self._multiple = max(8, self._vae_scale)
        sample = config.sample_size
        side_h, side_w = (sample, sample) if isinstance(sample, int) else tuple(sample)
        self._default_size = (side_h * self._vae_scale, side_w * self._vae_scale)
        self.preview_decoder = "sdxl" if sdxl else "sd15" if self._channels == 4 else None

    def _guidance_params(self) -> list[Param]:
        return [
            *super()._guidance_params(),
            Param(
                "guidance_rescale",
                "float",
                0.0,
                "rescale guided noise (arXiv 2305.08891)",
                minimum=0.0,
                maximum=1.0,
            ),
        ]

    def _sampler_params(self) -> list[Param]:
        # Once, at construction (validate reads it for every request that gives eta).
        self._eta_takers = takers = self._eta_samplers()
        if not takers:
            return []
        return [
            Param(
                "eta",
                "float",
                0.0,
                f"DDIM eta: 0 is deterministic, 1 is DDPM-like (sampler {' or '.join(takers)})",
                minimum=0.0,
                maximum=1.0,
            )
        ]

    def _eta_samplers(self) -> tuple[str, ...]:
        """The samplers whose step takes ``eta`` (DDIM's; ``default`` where the pipeline's does)."""
        takers = [samplers.DEFAULT] if "eta" in self._step_params else []
        for sampler in self._samplers.values():
            cls = samplers.scheduler_class(sampler)
            if cls is not None and "eta" in signature_params(cls.step):
                takers.append(sampler.name)
        return tuple(takers)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params; ``eta`` other than 0 only with a sampler that takes it (ParamsError)."""
        out = super().validate(params)
        if out.get("eta") and out["sampler"] not in self._eta_takers:
            raise ParamsError(
                f"{self.name} param 'eta' applies to sampler {' or '.join(self._eta_takers)}, "
                f"not {out['sampler']!r}; leave it out or 0",
                field="eta",
            )
        return out

    # -- the loop's UNet steps --------------------------------------------------------

    def _guided(self, params: Mapping[str, Any]) -> bool:
        # A guidance-distilled UNet takes the scale as an embedding instead.
        return super()._guided(params) and self._time_cond_dim is None

    def _step_kwargs(
        self, params: Mapping[str, Any], generator: torch.Generator, takes: frozenset[str]
    ) -> dict[str, Any]:
        kwargs = super()._step_kwargs(params, generator, takes)
        if "eta" in takes:
            kwargs["eta"] = float(params.get("eta", 0.0))
        return kwargs

    def _initial_latents(self, noise: torch.Tensor, scheduler: Any, height: int, width: int) -> torch.Tensor:
        latents: torch.Tensor = noise * scheduler.init_noise_sigma
        return latents

    def _pipeline_encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        # "" -> None matches pipe(prompt=...) without a negative prompt: SD
        # encodes "" either way; SDXL then uses zeros (force_zeros_for_empty_prompt).
        out = self._pipe.encode_prompt(
            prompt=prompt,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=guided,
            negative_prompt=negative_prompt or None,
        )
        return PromptEmbeddings(*out)

    def _conditioning(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype, guided: bool
    ) -> _UNetConditioning:
        emb = self._encode(params, device, guided)
        embeds, pooled = text_conditioning(
            emb,
            guided,
            width=self._unet.config.cross_attention_dim,
            width_name="the UNet's cross_attention_dim",
            family=self.family.upper(),
            pooled=self.needs_pooled,
        )
        cond = _UNetConditioning(embeds=embeds.to(device=device, dtype=dtype))
        if pooled is not None:
            cond.pooled = pooled.to(device=device, dtype=dtype)
            cond.time_ids = self._time_ids(params, cond.pooled).to(device)
        if self._time_cond_dim is not None:
            scale = torch.tensor(float(params["guidance_scale"]) - 1).repeat(1)
            cond.timestep_cond = _guidance_embedding(scale, self._time_cond_dim).to(
                device=device, dtype=dtype
            )
        return cond

    def _time_ids(self, params: Mapping[str, Any], pooled: torch.Tensor) -> torch.Tensor:
        """SDXL's micro-conditioning rows; ParamsError when ``pooled`` does not fit the UNet."""
        height, width = int(params["height"]), int(params["width"])
        # Original size, crop top-left, target size: the pipeline's defaults
        # for text-to-image.
        ids = [height, width, 0, 0, height, width]
        expected = self._unet.add_embedding.linear_1.in_features
        given = self._unet.config.addition_time_embed_dim * len(ids) + pooled.shape[-1]
        if given != expected:
            raise ParamsError(
                f"pooled_prompt_embeds width {pooled.shape[-1]} does not fit the UNet: its "
                f"added embedding takes {expected} values, this gives {given}",
                field="pooled_prompt_embeds",
            )
        return torch.tensor([ids] * pooled.shape[0], dtype=pooled.dtype)

    def _denoise(self, group: Sequence[_State], timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        pairs = list(zip(group, timesteps, strict=True))
        inputs = [s.scheduler.scale_model_input(s.model_input(), t) for s, t in pairs]
        steps = [t.reshape(1).expand(s.rows) for s, t in pairs]
        conds = [s.conditioning for s in group]
        added = None
        if self.family == "sdxl":
            added = {
                "text_embeds": cat_rows([c.pooled for c in conds]),
                "time_ids": cat_rows([c.time_ids for c in conds]),
            }
        timestep_cond = None
        if self._time_cond_dim is not None:
            timestep_cond = cat_rows([c.timestep_cond for c in conds])
        sample = cat_rows(inputs)
        out: torch.Tensor = self._unet(
            sample,
            # A 1-D timestep tensor is not moved to the sample's device by
            # the UNet (a 0-d one is); some schedulers keep theirs elsewhere.
            cat_rows(steps).to(sample.device),
            encoder_hidden_states=cat_rows([c.embeds for c in conds]),
            timestep_cond=timestep_cond,
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
        return out

    def _guide(self, s: _State, pred: torch.Tensor) -> torch.Tensor:
        guided = super()._guide(s, pred)
        rescale = float(s.params["guidance_rescale"])
        if s.guided and rescale > 0.0:
            text = pred.chunk(2)[1]
            guided = self._rescale_noise_cfg(guided, text, guidance_rescale=rescale)
        return guided

    def _x0(self, s: _State, output: Any, latents: torch.Tensor, pred: torch.Tensor) -> torch.Tensor | None:
        prev = output.prev_sample
        for attr in ("pred_original_sample", "denoised"):  # most schedulers; LCM and TCD
            value = getattr(output, attr, None)
            if isinstance(value, torch.Tensor):
                return value.to(dtype=prev.dtype)
        if self._keeps_x0(s.scheduler):
            outputs = getattr(s.scheduler, "model_outputs", None)
            if outputs and isinstance(outputs[-1], torch.Tensor) and outputs[-1].shape == prev.shape:
                return outputs[-1].to(dtype=prev.dtype)
        return None

    def _keeps_x0(self, scheduler: Any) -> bool:
        """Whether ``scheduler`` (a request's own: samplers differ) keeps its step's x0 as its
        newest model output. DPM-Solver++ and UniPC (predict_x0) convert the model output to x0
        and keep it for their multistep update, but their step output omits it."""
        config: Any = scheduler.config
        if isinstance(scheduler, self._dpm_solvers):
            return config.algorithm_type in ("dpmsolver++", "sde-dpmsolver++")
        if isinstance(scheduler, self._unipc):
            return bool(config.predict_x0)
        return False

    # -- decoding ---------------------------------------------------------------

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae, latents = vae_latents(self._pipe, latents)
        # The SDXL pipeline's rule: its stock VAE overflows in float16 (a
        # black or NaN image), so it decodes in float32 and casts back after.
        upcast = (
            self.family == "sdxl"
            and vae.dtype == torch.float16
            and bool(getattr(vae.config, "force_upcast", False))
        )
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            return _vae_run(vae, latents)
        finally:
            if upcast:
                vae.to(dtype=torch.float16)


def _vae_run(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    param = next(vae.parameters())
    x = latents[None].to(device=param.device, dtype=param.dtype)
    mean = getattr(vae.config, "latents_mean", None)
    std = getattr(vae.config, "latents_std", None)
    with torch.no_grad():
        if mean is not None and std is not None:
            # The SDXL pipeline's rule for VAEs that normalise their latents.
            shape = (1, len(mean), 1, 1)
            mean_t = torch.tensor(mean).view(shape).to(x.device, x.dtype)
            std_t = torch.tensor(std).view(shape).to(x.device, x.dtype)
            x = x * std_t / vae.config.scaling_factor + mean_t
        else:
            x = x / vae.config.scaling_factor
        image = vae.decode(x, return_dict=False)[0]
    return vae_image(image)


def _guidance_embedding(w: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # diffusers' get_guidance_scale_embedding (guidance-distilled UNets such as
    # LCM take the guidance scale as a sinusoidal embedding), same operations.
    w = w * 1000.0
    half = dim // 2
    emb = torch.log(torch.tensor(10000.0)) / (half - 1)
    emb = torch.exp(torch.arange(half, dtype=dtype) * -emb)
    emb = w.to(dtype)[:, None] * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb
