"""What SD3 and Flux share: flow-matching transformers on CLIP and T5 text.

:class:`FlowDiffusers` is the native loop (:mod:`.native`) for pipelines
whose transformer predicts a velocity ``v`` on text embeddings and a pooled
CLIP embedding, with a flow-matching scheduler whose shift ``mu`` the
pipeline derives from the image size (``calculate_shift``). What the two
pipelines share lives here:

- the text conditioning: ``joint_attention_dim`` embeddings and
  ``pooled_projection_dim`` pooled ones, from the pipeline's CLIP (and T5)
  encoders or an ``encode_prompt`` callable;
- each intermediate frame, the flow-matching estimate of the clean latent
  ``x0 = x_t - sigma_t * v`` (:func:`flow_x0`), so previews show the
  picture forming; the last frame is the final latent;
- the decode: ``vae.decode(x / scaling_factor + shift_factor)``
  (:func:`shifted_vae_decode`), frames being in the transformer's space.

:mod:`.sd3` and :mod:`.flux` keep the rest: their transformer's call, their
timesteps, Flux's packed latents.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import samplers, step_cache
from .base import vae_image
from .loop import text_conditioning, vae_latents
from .native import CondT, NativeDiffusers, NativeState

__all__ = ["FlowDiffusers", "flow_x0", "shifted_vae_decode"]


class FlowDiffusers(NativeDiffusers[CondT]):
    """A flow-matching transformer pipeline (SD3, Flux), one transformer evaluation per engine step."""

    default_steps = 28
    encoder_parts = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    needs_pooled = True
    #: The name errors give this pipeline ("SD3", "Flux").
    label = "flow-matching"
    sampler_table = samplers.FLOW
    cache_methods: tuple[str, ...] = step_cache.METHODS
    cache_why_not = ""

    #: The text tokens a request's transformer sees (the pipeline's padded prompt length).
    text_tokens: int = 512

    # Bound by the adapter's _import_helpers, from its own pipeline module.
    _calculate_shift: Callable[..., float]
    _retrieve_timesteps: Callable[..., Any]

    @property
    def _transformer(self) -> Any:
        return self._denoiser

    def _shift(self, image_seq_len: int, max_shift: float, config: Any) -> float:
        """The pipeline's ``mu`` for ``image_seq_len`` latent tokens (``max_shift``: its default), from
        ``config``: the scheduler being set's (another sampler's class may keep fewer keys)."""
        return self._calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )

    def _text(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype, guided: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeds, pooled)`` on ``device``; ParamsError when they do not fit the transformer."""
        emb = self._encode(params, device, guided)
        config = self._transformer.config
        embeds, pooled = text_conditioning(
            emb,
            guided,
            width=config.joint_attention_dim,
            width_name="the transformer's joint_attention_dim",
            family=self.label,
            pooled=True,
            pooled_width=config.pooled_projection_dim,
        )
        assert pooled is not None
        return embeds.to(device=device, dtype=dtype), pooled.to(device=device, dtype=dtype)

    # -- the memory a request's step cache holds (model.ModelMemory) ------------------------

    def request_memory_bytes(self, params: Mapping[str, Any]) -> int:
        """Bytes a request of these checked params adds on the device beyond its frames: its step
        cache's state (step_cache.state_bytes; TaylorSeer's is gigabytes at Flux.1's size), so
        the server's memory bound counts it. 0 without a cache."""
        cache = params.get("cache")
        if not isinstance(cache, Mapping) or cache.get("method", "none") == "none":
            return 0
        default_h, default_w = self._default_size
        height, width = int(params.get("height", default_h)), int(params.get("width", default_w))
        latent_h, latent_w = self._latent_size(height, width)
        config = self._transformer.config
        shape = step_cache.CacheShape(
            rows=int(params.get("num_images", 1)) * (2 if self._guided(params) else 1),
            image_tokens=(latent_h // 2) * (latent_w // 2),  # 2x2 patches (SD3), packed (Flux)
            text_tokens=self.text_tokens,
            width=int(config.num_attention_heads) * int(config.attention_head_dim),
            double_blocks=len(getattr(self._transformer, "transformer_blocks", ())),
            single_blocks=len(getattr(self._transformer, "single_transformer_blocks", ())),
            value_bytes=self._transformer.dtype.itemsize,
        )
        return step_cache.state_bytes(cache, shape)

    def cache_bytes(self) -> int:
        """Nothing outlives its request here (model.ModelMemory)."""
        return 0

    def trim_cache(self, keep_bytes: int = 0) -> int:
        return 0

    def _x0(
        self, s: NativeState[CondT], output: Any, latents: torch.Tensor, pred: torch.Tensor
    ) -> torch.Tensor | None:
        return flow_x0(s.scheduler, latents, pred)

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return shifted_vae_decode(self._pipe, latents)


def flow_x0(scheduler: Any, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor | None:
    """The clean-latent estimate of the step just taken, ``x_t - sigma_t * v``, or None.

    Only for flow-matching Euler schedulers, where that step's sigma is
    ``sigmas[step_index - 1]`` once ``step`` has advanced the index (the x0
    its stochastic sampling computes too).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or scheduler.config.invert_sigmas:
        return None
    index = scheduler.step_index
    if index is None or index < 1:
        return None
    sigma: torch.Tensor = scheduler.sigmas[index - 1]
    x0 = sample.float() - sigma.to(sample.device) * velocity.float()
    return x0.to(sample.dtype)


def shifted_vae_decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """SD3/Flux VAE decode of ``[C, h, w]`` latents: ``vae.decode(x / scaling + shift)`` as ``vae_image``.

    Raises ParamsError without a VAE or for latents of the wrong shape.
    """
    vae, latents = vae_latents(pipe, latents)
    param = next(vae.parameters())
    shift = vae.config.shift_factor or 0.0
    with torch.no_grad():
        # The pipelines' order: rescale in the latents' dtype, then hand the
        # VAE its own device and dtype.
        x = latents[None].to(param.device) / vae.config.scaling_factor + shift
        image = vae.decode(x.to(param.dtype), return_dict=False)[0]
    return vae_image(image)
