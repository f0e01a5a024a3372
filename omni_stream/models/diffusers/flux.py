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
preview decoder and the engine's tools expect of a latent. Each intermediate
frame is the flow-matching estimate ``x0 = x_t - sigma_t * v``; the last is
the final latent. :meth:`FluxDiffusers.decode` runs the real VAE.

Every request owns its scheduler and generator (see :mod:`.unet` for why).
Not rebuilt: true CFG with a negative prompt (``true_cfg_scale``),
IP-Adapter, custom sigmas, ``joint_attention_kwargs`` and the transformer's
cache hooks (their per-run state cannot be shared by interleaved requests);
use callback mode for those.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ParamsError
from ...params import Param, square_size
from .base import INSTALL_HINT as _INSTALL_HINT, Diffusers, EncodePrompt, PromptEmbeddings
from .loop import (
    cat_rows,
    check_batch_size,
    check_mode,
    check_multiple,
    check_pipeline_encoder,
    checked_embeddings,
    flow_x0,
    same_device,
    scheduler_template,
    shifted_vae_decode,
    signature_params,
    size_param,
    step_atomically,
    text_conditioning,
    timestep_count,
    vae_scale_factor,
    with_defaults,
)
from .sd3 import MAX_PROMPT_CHARS, MAX_SIDE

__all__ = ["FluxDiffusers"]


@dataclass
class _State:
    params: Mapping[str, Any]
    total: int
    scheduler: Any  # this request's own; never shared
    generator: torch.Generator  # this request's own; drew the noise, feeds stochastic sampling
    latents: torch.Tensor | None  # packed [1, seq, 4 * C]
    embeds: torch.Tensor | None  # T5 [1, text_seq, dim]
    pooled: torch.Tensor | None  # CLIP [1, dim]
    text_ids: torch.Tensor | None  # [text_seq, 3]
    image_ids: torch.Tensor | None  # [seq, 3]
    guidance: torch.Tensor | None  # [1] float32, for guidance-distilled transformers
    size: tuple[int, int]  # (height, width) in pixels: what unpacking needs
    step_kwargs: dict[str, Any]
    done: int = 0  # steps completed


class FluxDiffusers(Diffusers):
    """A diffusers Flux.1 pipeline, one denoise step per engine step."""

    name = "diffusers"
    mode = "native"
    #: The :mod:`omni_stream.preview` decoder for 16-channel latents (None for others).
    preview_decoder: str | None = "flux"

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

    def __init__(
        self,
        pipe: Any,
        *,
        mode: str = "native",
        encode_prompt: EncodePrompt | None = None,
        scheduler: Any | None = None,
        defaults: Mapping[str, Any] | None = None,
        max_batch_size: int = 1,
        name: str | None = None,
    ) -> None:
        """Wrap ``pipe``, a loaded ``FluxPipeline`` (or an object with its components).

        ``encode_prompt`` turns a prompt into :class:`PromptEmbeddings`: T5
        ``prompt_embeds`` and the pooled CLIP ``pooled_prompt_embeds`` (its
        ``negative_prompt`` argument is always ""); when omitted the
        pipeline's own ``encode_prompt`` is used. ``scheduler`` replaces the
        pipeline's (only its class and config are read). ``defaults``
        overrides param defaults, e.g. ``{"steps": 4}`` for schnell.
        ``max_batch_size`` above 1 lets the engine run several requests in
        one transformer call.

        Raises ImportError without diffusers; ParamsError for a pipeline
        without a Flux transformer, a scheduler that cannot take the
        pipeline's sigmas and mu, a missing prompt encoder, or bad
        ``defaults``.
        """
        try:
            # diffusers' own helpers, so the loop does what the pipeline does.
            from diffusers import FluxPipeline, FluxTransformer2DModel
            from diffusers.pipelines.flux.pipeline_flux import (
                calculate_shift,
                retrieve_timesteps,
            )
            from diffusers.utils.torch_utils import randn_tensor
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        self._calculate_shift = calculate_shift
        self._retrieve_timesteps = retrieve_timesteps
        self._randn_tensor = randn_tensor
        self._flux = FluxPipeline
        check_mode(mode)
        check_batch_size(max_batch_size)
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
        template = scheduler_template(pipe, scheduler)
        self._pipe = pipe
        self._transformer = transformer
        self._scheduler_cls = type(template)
        self._scheduler_config = template.config
        # FluxPipeline.__call__ passes its own sigmas unless the scheduler
        # makes flow sigmas itself, and always passes mu.
        self._own_sigmas = not getattr(template.config, "use_flow_sigmas", False)
        takes = signature_params(template.set_timesteps)
        needed = {"mu"} | ({"sigmas"} if self._own_sigmas else set())
        if not needed <= takes:
            raise ParamsError(
                f"{type(template).__name__}.set_timesteps takes no {' / '.join(sorted(needed - takes))}; "
                "FluxPipeline's timesteps need a flow-matching scheduler",
                field="scheduler",
            )
        self._step_params = signature_params(template.step)
        self._channels = int(config.in_channels) // 4
        self._guidance_embeds = bool(config.guidance_embeds)
        self._vae_scale = vae_scale_factor(pipe)
        # Latents are packed in 2x2 patches: sides are whole patches.
        self._multiple = self._vae_scale * 2
        self._default_side = int(getattr(pipe, "default_sample_size", 128)) * self._vae_scale
        if encode_prompt is not None and not callable(encode_prompt):
            raise ParamsError(
                f"encode_prompt must be callable, got {type(encode_prompt).__name__}",
                field="encode_prompt",
            )
        if encode_prompt is None:
            check_pipeline_encoder(pipe, ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"))
        self._encode_prompt = encode_prompt
        self.preview_decoder: str | None = "flux" if self._channels == 16 else None
        self.max_batch_size = max_batch_size
        self.name = name or "diffusers"
        self.params = self._declare(defaults)
        self._timestep_counts: dict[int, int] = {}

    # -- declarations and checks (event loop) --------------------------------

    def _declare(self, defaults: Mapping[str, Any] | None) -> tuple[Param, ...]:
        guidance_help = (
            "distilled guidance, fed to the transformer's guidance embedding"
            if self._guidance_embeds
            else "unused: this transformer has no guidance embedding"
        )
        params = [
            Param("prompt", "str", "", "text prompt", max_len=MAX_PROMPT_CHARS),
            Param("steps", "int", 28, "denoise steps (num_inference_steps)", minimum=1, maximum=1000),
            Param("guidance_scale", "float", 3.5, guidance_help, minimum=0.0, maximum=100.0),
            Param("seed", "int", 0, "seed of the request's CPU generator", minimum=0, maximum=2**63 - 1),
            Param("height", "int", self._default_side,
                  f"image height in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=MAX_SIDE),
            Param("width", "int", self._default_side,
                  f"image width in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=MAX_SIDE),
            size_param(self._multiple, MAX_SIDE),
        ]
        return with_defaults(params, defaults, self.name)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params with defaults filled in; raises ParamsError naming the field."""
        out = super().validate(params)
        square_size(out, params, model=self.name)
        # FluxPipeline only warns and rounds down; a request gets the size it asked for.
        check_multiple(out, self._multiple, self.name)
        self._timestep_count(out["steps"])
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        """One frame per transformer evaluation: ``len(scheduler.timesteps)``; ParamsError if rejected."""
        return self._timestep_count(int(params["steps"]))

    def _timestep_count(self, steps: int) -> int:
        count = self._timestep_counts.get(steps)
        if count is None:
            # A throwaway CPU scheduler, cached per step count; mu (for the
            # default size) moves the sigmas, never their number.
            side = self._default_side
            count = timestep_count(lambda n: self._scheduler(n, None, side, side), steps, self.name)
            self._timestep_counts[steps] = count
        return count

    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        # FluxPipeline.prepare_latents: whole 2x2 patches of latents.
        return (2 * (height // self._multiple), 2 * (width // self._multiple))

    def _scheduler(self, steps: int, device: torch.device | None, height: int, width: int) -> Any:
        """A fresh scheduler set as a request's loop starts it (the step count checks run it too)."""
        scheduler = self._scheduler_cls.from_config(self._scheduler_config)
        self._timesteps(scheduler, steps, device, height, width)
        # Set by the pipeline before its loop, so the first step needs no
        # lookup of the timestep's index.
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return scheduler

    def _timesteps(
        self, scheduler: Any, steps: int, device: torch.device | None, height: int, width: int
    ) -> None:
        # FluxPipeline.__call__, step 5.
        sigmas = np.linspace(1.0, 1 / steps, steps) if self._own_sigmas else None
        h, w = self._latent_size(height, width)
        config = self._scheduler_config
        mu = self._calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        self._retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """``(height, width)`` when batching is on (``max_batch_size > 1``), else None.

        Batched requests share transformer calls (one set of image and text
        position ids), each row at its own timestep and guidance; a batched
        call may round differently from a solo one, so results match solo
        runs closely, not bit for bit.
        """
        if self.max_batch_size == 1:
            return None
        return (params["height"], params["width"])

    # -- producer thread -------------------------------------------------------

    def load(self, device: torch.device) -> None:
        """Move the pipeline's modules to ``device`` unless the transformer is there already."""
        if not same_device(next(self._transformer.parameters()).device, device):
            self._pipe.to(device)

    def start(self, params: Mapping[str, Any], device: torch.device) -> _State:
        """Encode the prompt, make this request's scheduler, generator, noise and position ids.

        Raises ParamsError when the prompt embeddings do not fit the transformer.
        """
        with torch.no_grad():
            dtype = self._transformer.dtype
            height, width = int(params["height"]), int(params["width"])
            embeds, pooled, text_ids = self._conditioning(params, device, dtype)
            # The pipeline's order: noise, then timesteps.
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            h, w = self._latent_size(height, width)
            noise = self._randn_tensor(
                (1, self._channels, h, w), generator=generator, device=device, dtype=dtype
            )
            latents = self._flux._pack_latents(noise, 1, self._channels, h, w)
            image_ids = self._flux._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
            scheduler = self._scheduler(int(params["steps"]), device, height, width)
            guidance = None
            if self._guidance_embeds:
                guidance = torch.full(
                    [1], float(params["guidance_scale"]), device=device, dtype=torch.float32
                )
        step_kwargs: dict[str, Any] = {}
        if "generator" in self._step_params:
            # Only stochastic sampling draws here; the pipeline would use the
            # global RNG, a request its own generator.
            step_kwargs["generator"] = generator
        return _State(
            params=params,
            total=len(scheduler.timesteps),
            scheduler=scheduler,
            generator=generator,
            latents=latents,
            embeds=embeds,
            pooled=pooled,
            text_ids=text_ids,
            image_ids=image_ids,
            guidance=guidance,
            size=(height, width),
            step_kwargs=step_kwargs,
        )

    def step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        """Run one denoise step for each state; one unpacked frame ``[C, h, w]`` each.

        Raises RuntimeError for a closed or finished state. If anything
        raises, every state (scheduler and generator too) is left as it was.
        """
        return step_atomically(states, self.name, self._step)

    def _step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        timesteps = [s.scheduler.timesteps[s.done] for s in states]
        preds = self._predict(states, timesteps)
        # Nothing below writes to a state until every scheduler has stepped:
        # a raise leaves only scheduler/generator changes, which step() undoes.
        results = []
        for s, t, pred in zip(states, timesteps, preds, strict=True):
            latents = s.latents
            assert latents is not None
            prev = s.scheduler.step(pred, t, latents, **s.step_kwargs, return_dict=False)[0]
            x0 = None
            if s.done + 1 < s.total:
                x0 = flow_x0(s.scheduler, latents, pred)
            frame = self._unpack(prev if x0 is None else x0, s)
            results.append((prev, frame))
        frames = []
        for s, (prev, frame) in zip(states, results, strict=True):
            s.latents = prev
            s.done += 1
            frames.append(frame)
        return frames

    def _unpack(self, packed: torch.Tensor, s: _State) -> torch.Tensor:
        # A fresh tensor (the permute makes reshape copy): safe to hand out.
        height, width = s.size
        latents: torch.Tensor = self._flux._unpack_latents(packed, height, width, self._vae_scale)[0]
        return latents

    def _predict(self, states: Sequence[_State], timesteps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # One transformer call per group of states with one text length and
        # one latent size: the position ids are shared by the whole batch.
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, s in enumerate(states):
            assert s.embeds is not None
            groups.setdefault((tuple(s.embeds.shape[1:]), s.size), []).append(i)
        preds: list[torch.Tensor | None] = [None] * len(states)
        for members in groups.values():
            group = [states[i] for i in members]
            steps = []
            for i in members:
                latents = states[i].latents
                assert latents is not None
                steps.append(timesteps[i].expand(latents.shape[0]).to(latents.dtype) / 1000)
            first = group[0]
            out = self._transformer(
                hidden_states=cat_rows([s.latents for s in group]),
                timestep=cat_rows(steps),
                guidance=cat_rows([s.guidance for s in group]) if self._guidance_embeds else None,
                pooled_projections=cat_rows([s.pooled for s in group]),
                encoder_hidden_states=cat_rows([s.embeds for s in group]),
                txt_ids=first.text_ids,
                img_ids=first.image_ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0]
            for row, i in enumerate(members):
                preds[i] = out[row : row + 1]
        assert all(p is not None for p in preds)
        return preds  # type: ignore[return-value]

    def close(self, state: _State) -> None:
        """Drop the request's tensors; a later ``step`` on it raises."""
        state.latents = state.embeds = state.pooled = None
        state.text_ids = state.image_ids = state.guidance = None
        state.scheduler = None
        state.step_kwargs = {}

    # -- prompts ----------------------------------------------------------------

    def _conditioning(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._encode_prompt is not None:
            emb = checked_embeddings(self._encode_prompt(params["prompt"], ""))
        else:
            embeds, pooled, _ = self._pipe.encode_prompt(
                prompt=params["prompt"], prompt_2=None, device=device, num_images_per_prompt=1
            )
            emb = PromptEmbeddings(embeds, pooled_prompt_embeds=pooled)
        config = self._transformer.config
        embeds, pooled = text_conditioning(
            emb, False, config.joint_attention_dim, config.pooled_projection_dim, "Flux"
        )
        embeds = embeds.to(device=device, dtype=dtype)
        # FluxPipeline.encode_prompt: every text token sits at position zero.
        text_ids = torch.zeros(embeds.shape[1], 3).to(device=device, dtype=dtype)
        return embeds, pooled.to(device=device, dtype=dtype), text_ids

    # -- decoding ---------------------------------------------------------------

    def decode(self, state: _State, frame: torch.Tensor) -> torch.Tensor:
        """The request's image ``[3, H, W]`` in [-1, 1]: the final (unpacked) latent through the VAE.

        The engine calls this for ``output: "image"``; raises ParamsError
        without a VAE.
        """
        return shifted_vae_decode(self._pipe, frame)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one frame's unpacked latents ``[16, h, w]`` with the VAE: float32 RGB ``[3, H, W]``, CPU.

        For latents a request returned with ``output: "latent"`` (packed
        ``[seq, 64]`` latents: unpack them first, see
        ``omni_stream.preview.unpack_flux``); call it once the engine is done.
        Raises ParamsError without a VAE or for latents of the wrong shape.
        """
        return shifted_vae_decode(self._pipe, latents).cpu()

