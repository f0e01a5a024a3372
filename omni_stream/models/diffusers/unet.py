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
:meth:`Diffusers.decode` runs the real VAE.

Why each request owns its scheduler: a diffusers pipeline is not safe to
share between concurrent requests (diffusers #1606, Qwen-Image #236),
because its scheduler keeps per-run state (timesteps, step index, earlier
model outputs of multistep solvers). Every request gets its own scheduler
(``from_config`` of the pipeline's), its own latents and its own CPU
generator; the UNet, VAE and text encoders are only ever read.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...errors import ParamsError
from ...params import Param, positive_int, square_size
from .base import INSTALL_HINT as _INSTALL_HINT, Diffusers, EncodePrompt, PromptEmbeddings, vae_image
from .loop import (
    batch_of_one,
    cat_rows,
    check_multiple,
    same_device,
    signature_params,
    size_param,
    step_atomically,
    timestep_count,
)

__all__ = ["UNetDiffusers"]
_MAX_PROMPT_CHARS = 10_000
_MAX_SIDE = 8192


@dataclass
class _State:
    params: Mapping[str, Any]
    total: int
    scheduler: Any  # this request's own scheduler; never shared
    generator: torch.Generator  # this request's own; drew the noise, feeds ancestral samplers
    latents: torch.Tensor | None  # [1, C, h, w]
    embeds: torch.Tensor  # [rows, seq, dim]; rows = 2 (negative, positive) with guidance, else 1
    text_embeds: torch.Tensor | None  # SDXL pooled embeddings [rows, dim]
    time_ids: torch.Tensor | None  # SDXL micro-conditioning [rows, 6]
    timestep_cond: torch.Tensor | None  # guidance embedding of guidance-distilled UNets [rows, dim]
    guided: bool
    step_kwargs: dict[str, Any]
    done: int = 0  # steps completed

    @property
    def rows(self) -> int:
        return 2 if self.guided else 1


class UNetDiffusers(Diffusers):
    """A diffusers Stable Diffusion / SDXL pipeline, one denoise step per engine step."""

    name = "diffusers"
    mode = "native"

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
        """Wrap ``pipe``, a loaded ``StableDiffusionPipeline``-style pipeline.

        ``encode_prompt`` turns a prompt into :class:`PromptEmbeddings`; when
        omitted the pipeline's own ``encode_prompt`` (tokenizer and text
        encoder) is used. ``scheduler`` replaces the pipeline's scheduler
        (only its class and config are read). ``defaults`` overrides param
        defaults, e.g. ``{"steps": 4, "guidance_scale": 0.0}`` for a turbo
        model. ``max_batch_size`` above 1 lets the engine run several
        requests in one UNet call (see :meth:`batch_key`).

        Raises ImportError without diffusers; ParamsError for a pipeline this
        adapter cannot drive, a missing prompt encoder, or bad ``defaults``.
        """
        try:
            # diffusers' own helpers, so the loop does what the pipelines do.
            from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
                rescale_noise_cfg,
            )
            from diffusers.utils.torch_utils import randn_tensor
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        self._rescale_noise_cfg = rescale_noise_cfg
        self._randn_tensor = randn_tensor
        positive_int(max_batch_size, "max_batch_size")
        unet = getattr(pipe, "unet", None)
        if unet is None:
            kind = "a transformer" if getattr(pipe, "transformer", None) is not None else "no"
            raise ParamsError(
                f"{type(pipe).__name__} has {kind} denoiser and no UNet; the diffusers adapter "
                "supports UNet2DConditionModel pipelines (Stable Diffusion 1.x/2.x, SDXL)",
                field="pipe",
            )
        template = scheduler if scheduler is not None else getattr(pipe, "scheduler", None)
        if template is None or not hasattr(template, "step") or not hasattr(template, "config"):
            raise ParamsError(
                f"{type(pipe).__name__} has no scheduler; pass scheduler=",
                field="scheduler",
            )
        config = unet.config
        addition = getattr(config, "addition_embed_type", None)
        if addition is None:
            self.family = "sd"
        elif addition == "text_time":
            self.family = "sdxl"
        else:
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

        self._pipe = pipe
        self._unet = unet
        self._scheduler_cls = type(template)
        self._scheduler_config = template.config
        self._step_params = signature_params(template.step)
        self._keeps_x0 = _keeps_x0(template)
        self._time_cond_dim: int | None = getattr(config, "time_cond_proj_dim", None)
        self._channels = int(config.in_channels)
        self._cross_dim = config.cross_attention_dim
        vae = getattr(pipe, "vae", None)
        self._vae_scale = (
            2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 8
        )
        # diffusers' pipelines ask for multiples of 8 (check_inputs); a VAE
        # that downsamples more needs its own factor.
        self._multiple = max(8, self._vae_scale)
        if encode_prompt is not None and not callable(encode_prompt):
            raise ParamsError(
                f"encode_prompt must be callable, got {type(encode_prompt).__name__}",
                field="encode_prompt",
            )
        if encode_prompt is None:
            self._check_pipeline_encoder()
        self._encode_prompt = encode_prompt
        self.preview_decoder: str | None = (
            "sdxl" if self.family == "sdxl" else "sd15" if self._channels == 4 else None
        )
        self.max_batch_size = max_batch_size
        self.name = name or "diffusers"
        self.params = self._declare(defaults)
        self._timestep_counts: dict[int, int] = {}

    # -- declarations and checks (event loop) --------------------------------

    def _declare(self, defaults: Mapping[str, Any] | None) -> tuple[Param, ...]:
        sample = self._unet.config.sample_size
        side_h, side_w = (sample, sample) if isinstance(sample, int) else tuple(sample)
        params = [
            Param("prompt", "str", "", "text prompt", max_len=_MAX_PROMPT_CHARS),
            Param("negative_prompt", "str", "", "what to steer away from (with guidance)",
                  max_len=_MAX_PROMPT_CHARS),
            Param("steps", "int", 50, "denoise steps (num_inference_steps)", minimum=1, maximum=1000),
            Param("guidance_scale", "float", 5.0 if self.family == "sdxl" else 7.5,
                  "classifier-free guidance; 1 or less turns it off", minimum=0.0, maximum=100.0),
            Param("guidance_rescale", "float", 0.0, "rescale guided noise (arXiv 2305.08891)",
                  minimum=0.0, maximum=1.0),
            Param("seed", "int", 0, "seed of the request's CPU generator", minimum=0, maximum=2**63 - 1),
            Param("height", "int", side_h * self._vae_scale,
                  f"image height in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=_MAX_SIDE),
            Param("width", "int", side_w * self._vae_scale,
                  f"image width in pixels, a multiple of {self._multiple}",
                  minimum=self._multiple, maximum=_MAX_SIDE),
            size_param(self._multiple, _MAX_SIDE),
        ]
        if "eta" in self._step_params:
            params.append(Param("eta", "float", 0.0, "DDIM eta: 0 is deterministic, 1 is DDPM-like",
                                minimum=0.0, maximum=1.0))
        if defaults:
            by_name = {p.name: i for i, p in enumerate(params)}
            unknown = sorted(set(defaults) - set(by_name))
            if unknown:
                raise ParamsError(
                    f"defaults: unknown param(s) {unknown}; known: {sorted(by_name)}",
                    field="defaults",
                )
            for key, value in defaults.items():
                spec = params[by_name[key]]
                try:
                    checked = spec.check(value, model=self.name)
                except ParamsError as exc:
                    raise ParamsError(f"defaults: {exc}", field="defaults") from None
                params[by_name[key]] = replace(spec, default=checked)
        return tuple(params)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params with defaults filled in; raises ParamsError naming the field."""
        out = super().validate(params)
        square_size(out, params, model=self.name)
        check_multiple(out, self._multiple, self.name)
        self._timestep_count(out["steps"])
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        """One frame per UNet evaluation: ``len(scheduler.timesteps)`` for ``steps``.

        That is ``steps`` for most schedulers, but not all (PNDM: steps + 1;
        Heun and DPM2: 2 * steps - 1). Raises ParamsError when the scheduler
        rejects ``steps``.
        """
        return self._timestep_count(int(params["steps"]))

    def _timestep_count(self, steps: int) -> int:
        count = self._timestep_counts.get(steps)
        if count is None:
            # A throwaway scheduler on the CPU: tiny numpy/torch math, cached per
            # step count, so the event loop pays it once per distinct value.
            count = timestep_count(self._scheduler, steps, self.name)
            self._timestep_counts[steps] = count
        return count

    def _scheduler(self, steps: int, device: torch.device | None = None) -> Any:
        """A fresh scheduler set as a request's loop starts it (the step count checks run it too)."""
        scheduler = self._scheduler_cls.from_config(self._scheduler_config)
        scheduler.set_timesteps(steps, device=device)
        if hasattr(scheduler, "set_begin_index"):
            # Text-to-image always starts at the first timestep; without this
            # the index is looked up by value, which is wrong for repeated
            # timesteps.
            scheduler.set_begin_index(0)
        return scheduler

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """``(height, width)`` when batching is on (``max_batch_size > 1``), else None.

        Batched requests share UNet calls, each row at its own timestep and
        guidance scale. A batched UNet call can round differently from a solo
        one (kernels are chosen per batch size), so batched results match
        solo ones closely, not bit for bit; hence batching is opt-in.
        """
        if self.max_batch_size == 1:
            return None
        return (params["height"], params["width"])

    # -- producer thread -------------------------------------------------------

    def load(self, device: torch.device) -> None:
        """Move the pipeline's modules to ``device`` unless the UNet is there already."""
        current = next(self._unet.parameters()).device
        if not same_device(current, device):
            self._pipe.to(device)

    def start(self, params: Mapping[str, Any], device: torch.device) -> _State:
        """Encode the prompt, make this request's scheduler, generator and noise.

        Raises ParamsError when ``encode_prompt`` returns embeddings that do
        not fit the UNet.
        """
        with torch.no_grad():
            guidance = float(params["guidance_scale"])
            guided = guidance > 1.0 and self._time_cond_dim is None
            dtype = self._unet.dtype
            height, width = int(params["height"]), int(params["width"])
            embeds, text_embeds, time_ids = self._conditioning(params, device, dtype, guided)
            timestep_cond = None
            if self._time_cond_dim is not None:
                scale = torch.tensor(guidance - 1).repeat(1)
                timestep_cond = _guidance_embedding(scale, self._time_cond_dim).to(
                    device=device, dtype=dtype
                )

            # The order below is the pipelines' (timesteps, then noise) so the
            # generator is drawn from exactly as pipe(generator=...) draws it.
            scheduler = self._scheduler(int(params["steps"]), device)
            total = len(scheduler.timesteps)
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            shape = (1, self._channels, height // self._vae_scale, width // self._vae_scale)
            latents = self._randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            latents = latents * scheduler.init_noise_sigma

        step_kwargs: dict[str, Any] = {}
        if "eta" in self._step_params:
            step_kwargs["eta"] = float(params.get("eta", 0.0))
        if "generator" in self._step_params:
            step_kwargs["generator"] = generator
        return _State(
            params=params,
            total=total,
            scheduler=scheduler,
            generator=generator,
            latents=latents,
            embeds=embeds,
            text_embeds=text_embeds,
            time_ids=time_ids,
            timestep_cond=timestep_cond,
            guided=guided,
            step_kwargs=step_kwargs,
        )

    def step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        """Run one denoise step for each state; one frame ``[C, h, w]`` each.

        If anything raises, every state (its scheduler and generator too) is
        left as it was, so the engine can retry each request alone.
        """
        return step_atomically(states, self.name, self._step)

    def _step(self, states: Sequence[_State]) -> list[torch.Tensor]:
        timesteps = [s.scheduler.timesteps[s.done] for s in states]
        noise_preds = self._predict_noise(states, timesteps)
        # Nothing below writes to a state until every scheduler has stepped:
        # a raise leaves only scheduler/generator changes, which step() undoes.
        results = []
        for s, t, noise_pred in zip(states, timesteps, noise_preds, strict=True):
            latents = s.latents
            assert latents is not None
            if s.guided:
                uncond, text = noise_pred.chunk(2)
                noise_pred = uncond + float(s.params["guidance_scale"]) * (text - uncond)
                rescale = float(s.params["guidance_rescale"])
                if rescale > 0.0:
                    noise_pred = self._rescale_noise_cfg(noise_pred, text, guidance_rescale=rescale)
            output = s.scheduler.step(noise_pred, t, latents, **s.step_kwargs, return_dict=True)
            prev = output.prev_sample
            preview = None if s.done + 1 == s.total else self._x0_prediction(s, output, prev)
            frame = prev if preview is None else preview.to(dtype=prev.dtype)
            results.append((prev, frame[0]))
        frames = []
        for s, (prev, frame) in zip(states, results, strict=True):
            s.latents = prev
            s.done += 1
            frames.append(frame)
        return frames

    def _x0_prediction(self, s: _State, output: Any, prev: torch.Tensor) -> torch.Tensor | None:
        """The clean-sample estimate this step exposes, or None."""
        for attr in ("pred_original_sample", "denoised"):  # most schedulers; LCM and TCD
            value = getattr(output, attr, None)
            if isinstance(value, torch.Tensor):
                return value
        if self._keeps_x0:
            outputs = getattr(s.scheduler, "model_outputs", None)
            if outputs and isinstance(outputs[-1], torch.Tensor) and outputs[-1].shape == prev.shape:
                return outputs[-1]
        return None

    def _predict_noise(
        self, states: Sequence[_State], timesteps: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        # One UNet call per group of states whose text embeddings have one
        # shape (always one group with the pipeline's own encoder). Each row
        # carries its own timestep, so requests at different steps share a call.
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(tuple(s.embeds.shape[1:]), []).append(i)
        preds: list[torch.Tensor | None] = [None] * len(states)
        for members in groups.values():
            inputs, steps = [], []
            for i in members:
                s, t = states[i], timesteps[i]
                assert s.latents is not None
                x = torch.cat([s.latents] * 2) if s.guided else s.latents
                inputs.append(s.scheduler.scale_model_input(x, t))
                steps.append(t.reshape(1).expand(s.rows))
            group = [states[i] for i in members]
            added = None
            if self.family == "sdxl":
                added = {
                    "text_embeds": cat_rows([s.text_embeds for s in group]),
                    "time_ids": cat_rows([s.time_ids for s in group]),
                }
            timestep_cond = None
            if self._time_cond_dim is not None:
                timestep_cond = cat_rows([s.timestep_cond for s in group])
            sample = cat_rows(inputs)
            out = self._unet(
                sample,
                # A 1-D timestep tensor is not moved to the sample's device by
                # the UNet (a 0-d one is); some schedulers keep theirs elsewhere.
                cat_rows(steps).to(sample.device),
                encoder_hidden_states=cat_rows([s.embeds for s in group]),
                timestep_cond=timestep_cond,
                added_cond_kwargs=added,
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
        state.latents = None
        state.scheduler = None
        state.text_embeds = state.time_ids = state.timestep_cond = None
        state.step_kwargs = {}

    # -- prompts ----------------------------------------------------------------

    def _check_pipeline_encoder(self) -> None:
        pipe = self._pipe
        needs = ("tokenizer_2", "text_encoder_2") if self.family == "sdxl" else ("tokenizer", "text_encoder")
        missing = [n for n in needs if getattr(pipe, n, None) is None]
        if missing or not callable(getattr(pipe, "encode_prompt", None)):
            raise ParamsError(
                f"{type(pipe).__name__} has no {' / '.join(missing) or 'encode_prompt'}; pass "
                "encode_prompt=, a callable (prompt, negative_prompt) -> PromptEmbeddings",
                field="encode_prompt",
            )

    def _encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        if self._encode_prompt is not None:
            emb = self._encode_prompt(prompt, negative_prompt)
            if not isinstance(emb, PromptEmbeddings):
                raise ParamsError(
                    f"encode_prompt must return PromptEmbeddings, got {type(emb).__name__}",
                    field="encode_prompt",
                )
            return emb
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
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        emb = self._encode(params["prompt"], params["negative_prompt"], device, guided)
        positive = batch_of_one(emb.prompt_embeds, "prompt_embeds", 3)
        if positive.shape[-1] != self._cross_dim:
            raise ParamsError(
                f"prompt_embeds has width {positive.shape[-1]}, the UNet's cross_attention_dim "
                f"is {self._cross_dim}",
                field="prompt_embeds",
            )
        rows = [positive]
        if guided:
            if emb.negative_prompt_embeds is None:
                raise ParamsError(
                    "encode_prompt returned no negative_prompt_embeds, which guidance_scale > 1 needs",
                    field="negative_prompt_embeds",
                )
            negative = batch_of_one(emb.negative_prompt_embeds, "negative_prompt_embeds", 3)
            if negative.shape != positive.shape:
                raise ParamsError(
                    f"negative_prompt_embeds {tuple(negative.shape)} and prompt_embeds "
                    f"{tuple(positive.shape)} must have the same shape",
                    field="negative_prompt_embeds",
                )
            rows = [negative, positive]
        embeds = torch.cat(rows).to(device=device, dtype=dtype)
        if self.family != "sdxl":
            return embeds, None, None

        if emb.pooled_prompt_embeds is None:
            raise ParamsError(
                "SDXL needs pooled_prompt_embeds; encode_prompt returned none",
                field="pooled_prompt_embeds",
            )
        pooled = [batch_of_one(emb.pooled_prompt_embeds, "pooled_prompt_embeds", 2)]
        if guided:
            if emb.negative_pooled_prompt_embeds is None:
                raise ParamsError(
                    "SDXL with guidance_scale > 1 needs negative_pooled_prompt_embeds; "
                    "encode_prompt returned none",
                    field="negative_pooled_prompt_embeds",
                )
            pooled.insert(0, batch_of_one(
                emb.negative_pooled_prompt_embeds, "negative_pooled_prompt_embeds", 2
            ))
        text_embeds = torch.cat(pooled).to(device=device, dtype=dtype)
        height, width = int(params["height"]), int(params["width"])
        # SDXL micro-conditioning: original size, crop top-left, target size;
        # the pipeline's defaults for text-to-image.
        ids = [height, width, 0, 0, height, width]
        expected = self._unet.add_embedding.linear_1.in_features
        given = self._unet.config.addition_time_embed_dim * len(ids) + text_embeds.shape[-1]
        if given != expected:
            raise ParamsError(
                f"pooled_prompt_embeds width {text_embeds.shape[-1]} does not fit the UNet: its "
                f"added embedding takes {expected} values, this gives {given}",
                field="pooled_prompt_embeds",
            )
        time_ids = torch.tensor([ids] * len(pooled), dtype=dtype).to(device)
        return embeds, text_embeds, time_ids

    # -- decoding ---------------------------------------------------------------

    def decode(self, state: _State, frame: torch.Tensor) -> torch.Tensor:
        """The request's image: the final latent through the VAE, on the producer's device.

        The engine calls this for ``output: "image"`` (see ``StepModel.decode``).
        """
        return self._vae_decode(frame)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one frame's latents with the VAE: float32 RGB ``[3, H, W]`` in ``[-1, 1]``, on the CPU.

        For latents a request returned with ``output: "latent"``. Runs the
        full VAE on the calling thread: call it once the engine is done, not
        beside a running engine on a small CPU box, where its torch threads
        would fight the producer's. Raises ParamsError without a VAE or for
        latents of the wrong shape.
        """
        return self._vae_decode(latents).cpu()

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = getattr(self._pipe, "vae", None)
        if vae is None:
            raise ParamsError(
                f"{type(self._pipe).__name__} has no VAE to decode with",
                field="pipe",
            )
        if latents.dim() == 4 and latents.shape[0] == 1:
            latents = latents[0]
        if latents.dim() != 3 or latents.shape[0] != vae.config.latent_channels:
            raise ParamsError(
                f"decode needs latents [{vae.config.latent_channels}, h, w], got {tuple(latents.shape)}",
                field="latents",
            )
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
            return self._vae_run(vae, latents)
        finally:
            if upcast:
                vae.to(dtype=torch.float16)

    def _vae_run(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
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


def _keeps_x0(scheduler: Any) -> bool:
    """Whether ``scheduler`` keeps its step's x0 as its newest model output.

    DPM-Solver++ and UniPC (predict_x0) convert the model output to x0 and
    keep it for their multistep update, but their step output omits it.
    """
    from diffusers import (
        DPMSolverMultistepScheduler,
        DPMSolverSinglestepScheduler,
        UniPCMultistepScheduler,
    )

    config: Any = scheduler.config
    if isinstance(scheduler, (DPMSolverMultistepScheduler, DPMSolverSinglestepScheduler)):
        return config.algorithm_type in ("dpmsolver++", "sde-dpmsolver++")
    if isinstance(scheduler, UniPCMultistepScheduler):
        return bool(config.predict_x0)
    return False


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
