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
generator: a pipeline's scheduler keeps per-run state and is not safe to
share (see :mod:`.unet`). Not rebuilt: skip-layer guidance, IP-Adapter,
custom sigmas and ``joint_attention_kwargs`` (use callback mode for those).

The small flow-matching helpers at the bottom are shared with :mod:`.flux`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

__all__ = ["SD3Diffusers"]
MAX_PROMPT_CHARS = 10_000
MAX_SIDE = 8192


@dataclass
class _State:
    params: Mapping[str, Any]
    total: int
    scheduler: Any  # this request's own; never shared
    generator: torch.Generator  # this request's own; drew the noise, feeds stochastic sampling
    latents: torch.Tensor | None  # [1, C, h, w]
    embeds: torch.Tensor | None  # [rows, seq, dim]; rows = 2 (negative, positive) with guidance
    pooled: torch.Tensor | None  # [rows, dim]
    guided: bool
    step_kwargs: dict[str, Any]
    done: int = 0  # steps completed

    @property
    def rows(self) -> int:
        return 2 if self.guided else 1


class SD3Diffusers(Diffusers):
    """A diffusers Stable Diffusion 3 / 3.5 pipeline, one denoise step per engine step."""

    name = "diffusers"
    mode = "native"
    #: The :mod:`omni_stream.preview` decoder for 16-channel latents (None for others).
    preview_decoder: str | None = "sd3"

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
        """Wrap ``pipe``, a loaded ``StableDiffusion3Pipeline`` (or an object with its components).

        ``encode_prompt`` turns a prompt into :class:`PromptEmbeddings` (with
        pooled embeddings); when omitted the pipeline's own ``encode_prompt``
        (CLIP-L, CLIP-G and, if present, T5) is used. ``scheduler`` replaces
        the pipeline's (only its class and config are read). ``defaults``
        overrides param defaults. ``max_batch_size`` above 1 lets the engine
        run several requests in one transformer call.

        Raises ImportError without diffusers; ParamsError for a pipeline
        without an SD3 transformer, a scheduler that cannot take the
        pipeline's timesteps, a missing prompt encoder, or bad ``defaults``.
        """
        try:
            # diffusers' own helpers, so the loop does what the pipeline does.
            from diffusers import SD3Transformer2DModel
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
                calculate_shift,
                retrieve_timesteps,
            )
            from diffusers.utils.torch_utils import randn_tensor
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        self._calculate_shift = calculate_shift
        self._retrieve_timesteps = retrieve_timesteps
        self._randn_tensor = randn_tensor
        check_mode(mode)
        check_batch_size(max_batch_size)
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
        template = scheduler_template(pipe, scheduler)
        self._pipe = pipe
        self._transformer = transformer
        self._scheduler_cls = type(template)
        self._scheduler_config = template.config
        self._dynamic = bool(template.config.get("use_dynamic_shifting", None))
        if self._dynamic and "mu" not in signature_params(template.set_timesteps):
            raise ParamsError(
                f"{type(template).__name__} uses dynamic shifting but its set_timesteps takes no mu",
                field="scheduler",
            )
        self._step_params = signature_params(template.step)
        self._channels = int(config.in_channels)
        self._patch = int(config.patch_size)
        self._vae_scale = vae_scale_factor(pipe)
        # StableDiffusion3Pipeline.check_inputs: sides are whole patches of latents.
        self._multiple = self._vae_scale * self._patch
        if encode_prompt is not None and not callable(encode_prompt):
            raise ParamsError(
                f"encode_prompt must be callable, got {type(encode_prompt).__name__}",
                field="encode_prompt",
            )
        if encode_prompt is None:
            check_pipeline_encoder(pipe, ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"))
        self._encode_prompt = encode_prompt
        self.preview_decoder: str | None = "sd3" if self._channels == 16 else None
        self.max_batch_size = max_batch_size
        self.name = name or "diffusers"
        self.params = self._declare(defaults)
        self._timestep_counts: dict[int, int] = {}

    # -- declarations and checks (event loop) --------------------------------

    def _declare(self, defaults: Mapping[str, Any] | None) -> tuple[Param, ...]:
        # The pipeline's default size: the transformer's sample size in latents.
        side = int(self._transformer.config.sample_size) * self._vae_scale
        largest = MAX_SIDE
        pos_max = getattr(self._transformer.config, "pos_embed_max_size", None)
        if pos_max:
            # The positional embedding is cropped from a pos_max x pos_max grid
            # of patches; a larger latent raises inside the transformer.
            largest = min(largest, int(pos_max) * self._multiple)
        params = [
            Param("prompt", "str", "", "text prompt", max_len=MAX_PROMPT_CHARS),
            Param("negative_prompt", "str", "", "what to steer away from (with guidance)",
                  max_len=MAX_PROMPT_CHARS),
            Param("steps", "int", 28, "denoise steps (num_inference_steps)", minimum=1, maximum=1000),
            Param("guidance_scale", "float", 7.0, "classifier-free guidance; 1 or less turns it off",
                  minimum=0.0, maximum=100.0),
            Param("seed", "int", 0, "seed of the request's CPU generator", minimum=0, maximum=2**63 - 1),
            Param("height", "int", side, f"image height in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=largest),
            Param("width", "int", side, f"image width in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=largest),
            size_param(self._multiple, largest),
        ]
        return with_defaults(params, defaults, self.name)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params with defaults filled in; raises ParamsError naming the field."""
        out = super().validate(params)
        square_size(out, params, model=self.name)
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
            side = self._transformer.config.sample_size * self._vae_scale
            count = timestep_count(lambda n: self._scheduler(n, None, side, side), steps, self.name)
            self._timestep_counts[steps] = count
        return count

    def _scheduler(self, steps: int, device: torch.device | None, height: int, width: int) -> Any:
        """A fresh scheduler set as a request's loop starts it (the step count checks run it too)."""
        scheduler = self._scheduler_cls.from_config(self._scheduler_config)
        self._timesteps(scheduler, steps, device, height, width)
        return scheduler

    def _timesteps(
        self, scheduler: Any, steps: int, device: torch.device | None, height: int, width: int
    ) -> None:
        # StableDiffusion3Pipeline.__call__, step 5.
        kwargs: dict[str, Any] = {}
        if self._dynamic:
            config = self._scheduler_config
            seq = (height // self._vae_scale // self._patch) * (width // self._vae_scale // self._patch)
            kwargs["mu"] = self._calculate_shift(
                seq,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        self._retrieve_timesteps(scheduler, steps, device, sigmas=None, **kwargs)

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """``(height, width)`` when batching is on (``max_batch_size > 1``), else None.

        Batched requests share transformer calls, each row at its own
        timestep and guidance scale; a batched call may round differently
        from a solo one, so results match solo runs closely, not bit for bit.
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
        """Encode the prompt, make this request's scheduler, generator and noise.

        Raises ParamsError when the prompt embeddings do not fit the transformer.
        """
        with torch.no_grad():
            guided = float(params["guidance_scale"]) > 1.0
            dtype = self._transformer.dtype
            height, width = int(params["height"]), int(params["width"])
            embeds, pooled = self._conditioning(params, device, dtype, guided)
            # The pipeline's order: noise, then timesteps.
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            shape = (1, self._channels, height // self._vae_scale, width // self._vae_scale)
            latents = self._randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            scheduler = self._scheduler(int(params["steps"]), device, height, width)
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
            guided=guided,
            step_kwargs=step_kwargs,
        )

    def step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        """Run one denoise step for each state; one frame ``[C, h, w]`` each.

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
            if s.guided:
                uncond, text = pred.chunk(2)
                pred = uncond + float(s.params["guidance_scale"]) * (text - uncond)
            prev = s.scheduler.step(pred, t, latents, **s.step_kwargs, return_dict=False)[0]
            x0 = None
            if s.done + 1 < s.total:
                x0 = flow_x0(s.scheduler, latents, pred)
            frame = prev if x0 is None else x0
            results.append((prev, frame[0]))
        frames = []
        for s, (prev, frame) in zip(states, results, strict=True):
            s.latents = prev
            s.done += 1
            frames.append(frame)
        return frames

    def _predict(self, states: Sequence[_State], timesteps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # One transformer call per group of states whose text and latents have
        # one shape; each row carries its own timestep.
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, s in enumerate(states):
            assert s.embeds is not None and s.latents is not None
            groups.setdefault((tuple(s.embeds.shape[1:]), tuple(s.latents.shape[1:])), []).append(i)
        preds: list[torch.Tensor | None] = [None] * len(states)
        for members in groups.values():
            inputs, steps = [], []
            for i in members:
                s, t = states[i], timesteps[i]
                assert s.latents is not None
                x = torch.cat([s.latents] * 2) if s.guided else s.latents
                inputs.append(x)
                steps.append(t.expand(x.shape[0]))
            group = [states[i] for i in members]
            out = self._transformer(
                hidden_states=cat_rows(inputs),
                timestep=cat_rows(steps),
                encoder_hidden_states=cat_rows([s.embeds for s in group]),
                pooled_projections=cat_rows([s.pooled for s in group]),
                joint_attention_kwargs=None,
                return_dict=False,
            )[0]
            offset = 0
            for i in members:
                rows = states[i].rows
                preds[i] = out[offset : offset + rows]
                offset += rows
        assert all(p is not None for p in preds)
        return preds  # type: ignore[return-value]

    def close(self, state: _State) -> None:
        """Drop the request's tensors; a later ``step`` on it raises."""
        state.latents = state.embeds = state.pooled = None
        state.scheduler = None
        state.step_kwargs = {}

    # -- prompts ----------------------------------------------------------------

    def _encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        if self._encode_prompt is not None:
            return checked_embeddings(self._encode_prompt(prompt, negative_prompt))
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self._encode(params["prompt"], params["negative_prompt"], device, guided)
        config = self._transformer.config
        embeds, pooled = text_conditioning(
            emb, guided, config.joint_attention_dim, config.pooled_projection_dim, "SD3"
        )
        return embeds.to(device=device, dtype=dtype), pooled.to(device=device, dtype=dtype)

    # -- decoding ---------------------------------------------------------------

    def decode(self, state: _State, frame: torch.Tensor) -> torch.Tensor:
        """The request's image ``[3, H, W]`` in [-1, 1]: the final latent through the VAE.

        The engine calls this for ``output: "image"``; raises ParamsError
        without a VAE.
        """
        return shifted_vae_decode(self._pipe, frame)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one frame's latents with the VAE: float32 RGB ``[3, H, W]`` in ``[-1, 1]``, on the CPU.

        For latents a request returned with ``output: "latent"``; call it
        once the engine is done (it runs the full VAE on this thread).
        Raises ParamsError without a VAE or for latents of the wrong shape.
        """
        return shifted_vae_decode(self._pipe, latents).cpu()


# -- shared with .flux ------------------------------------------------------------
