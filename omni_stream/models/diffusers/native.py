"""The native denoise loop, once: what every native adapter does the same way.

``pipe(...)`` runs its whole denoise loop in one call, so the engine cannot
drive it. A native adapter rebuilds that loop from the pipeline's
components, one denoiser evaluation per engine ``step``. The loop has the
same shape for every pipeline, and :class:`NativeDiffusers` holds it:

- the params (prompt, steps, guidance, seed, size) and their checks;
- a request's own scheduler (``from_config`` of the pipeline's) and CPU
  generator, its noise, its :class:`NativeState`;
- one ``step`` over several requests: denoiser calls grouped by shape, each
  row at its own timestep, guidance, ``scheduler.step``, the frame, all
  undone if anything raises (:func:`.loop.step_atomically`);
- ``close``, ``load``, ``batch_key`` and the VAE decodes.

Why each request owns its scheduler: a diffusers pipeline is not safe to
share between concurrent requests (diffusers #1606, Qwen-Image #236),
because its scheduler keeps per-run state (timesteps, step index, earlier
model outputs of multistep solvers). Every request gets its own scheduler,
its own latents and its own CPU generator; the denoiser, VAE and text
encoders are only ever read.

Snapshot and restore (``StepModel.snapshot``): a request's state is its
latents, its generator's state, its conditioning tensors (kept, not encoded
again: exact, and no text encoder runs on restore) and what its scheduler
changed since ``set_timesteps`` (:mod:`.scheduler_state`). Restore builds a
fresh scheduler the way ``start`` does and sets those back, so the steps
after it are the uninterrupted request's, bit for bit. Requests on a
scheduler whose noise lies outside the generator
(:data:`.samplers.UNCAPTURED_NOISE`) are declined.

An adapter (:mod:`.unet`, :mod:`.sd3`, :mod:`.flux`) keeps only what its
pipeline does differently, in the hooks marked "the adapter's" below: how
its denoiser and scheduler are checked, how prompts are encoded, how the
noise becomes latents, how the denoiser is called and guidance applied,
which frame a step shows, how latents are decoded.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch

from ...checkpoint import Checkpoint, plain_params
from ...errors import CheckpointError, ParamsError
from ...params import Param, images_param, seed_param, square_size
from . import samplers, scheduler_state
from .base import (
    DEFAULT_MAX_IMAGES,
    INSTALL_HINT,
    Diffusers,
    EncodePrompt,
    PromptEmbeddings,
    checked_max_images,
)
from .loop import (
    MAX_PROMPT_CHARS,
    MAX_SIDE,
    check_batch_size,
    check_mode,
    check_multiple,
    check_pipeline_encoder,
    checked_embeddings,
    same_device,
    scheduler_template,
    signature_params,
    size_param,
    step_atomically,
    timestep_count,
    vae_scale_factor,
    with_defaults,
)
from .loras import LoraBank, LoraSet, check_request_loras, split_loras
from .step_cache import CacheState, StepCache, cache_param, rebuilt, state_for

__all__ = ["DEFAULT_MAX_BATCH", "NativeDiffusers", "NativeState", "TextConditioning"]

#: Requests one denoiser call may carry by default: batching across requests
#: is on for the native loops (each request's rows at its own timestep).
DEFAULT_MAX_BATCH = 8


@dataclass(kw_only=True)
class TextConditioning:
    """A request's text conditioning, rows ready for the denoiser; adapters add their own."""

    embeds: torch.Tensor  # [rows, seq, dim]; rows = 2 (negative, positive) with guidance, else 1
    pooled: torch.Tensor | None = None  # [rows, dim] where the pipeline takes pooled embeddings

    #: The fields with one row per denoiser row (the others are shared by the call).
    per_row: ClassVar[tuple[str, ...]] = ("embeds", "pooled")

    def repeat(self, images: int) -> None:
        """Each row once per image, in place: ``[neg, pos]`` becomes ``[neg] * n + [pos] * n``,
        the layout ``encode_prompt(num_images_per_prompt=n)`` and the pipeline's guidance give."""
        if images == 1:
            return
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.per_row and isinstance(value, torch.Tensor):
                setattr(self, f.name, value.repeat_interleave(images, dim=0))


CondT = TypeVar("CondT", bound=TextConditioning)


@dataclass(kw_only=True)
class NativeState(Generic[CondT]):
    """One request in a native loop; ``latents`` and ``cond`` are None once it is closed."""

    params: Mapping[str, Any]
    total: int  # frames the request gives: len(scheduler.timesteps)
    scheduler: Any  # this request's own; never shared
    generator: torch.Generator  # this request's own; drew the noise, feeds stochastic sampling
    latents: torch.Tensor | None  # [images, ...] in the denoiser's layout
    cond: CondT | None
    guided: bool  # classifier-free guidance: two rows (negative, positive) per image
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    done: int = 0  # steps completed
    images: int = 1  # num_images: rows of latents
    #: Its step cache (params' ``cache``: step_cache.py), None without one.
    cache: CacheState | None = None

    @property
    def rows(self) -> int:
        return self.images * (2 if self.guided else 1)

    @property
    def conditioning(self) -> CondT:
        if self.cond is None:
            raise RuntimeError("a closed request has no conditioning")
        return self.cond

    def model_input(self) -> torch.Tensor:
        """The latents once per row: twice (negative, positive) with guidance."""
        if self.latents is None:
            raise RuntimeError("a closed request has no latents")
        return torch.cat([self.latents] * 2) if self.guided else self.latents


class NativeDiffusers(Diffusers, Generic[CondT]):
    """A diffusers pipeline whose denoise loop is rebuilt here, one denoiser evaluation per engine step.

    ``NativeDiffusers(pipe, *, mode="native", encode_prompt=None,
    scheduler=None, defaults=None, max_batch_size=None, batch=True,
    max_images=4, name=None)``: ``mode`` is "auto" or "native" (what :class:`Diffusers`
    passes on); ``encode_prompt`` turns a prompt into
    :class:`PromptEmbeddings` (the pipeline's own encoder when omitted);
    ``scheduler`` replaces the pipeline's (only its class and config are
    read); ``defaults`` overrides param defaults. Batching is on: the
    engine runs up to ``max_batch_size`` (default
    :data:`DEFAULT_MAX_BATCH`) requests in one denoiser call (see
    :meth:`batch_key`); ``batch=False`` (or ``max_batch_size=1``) runs each
    alone, for results equal to ``pipe()``'s bit for bit whatever runs beside.
    ``max_images`` bounds ``num_images``: the images one request makes from
    its prompt, as ``pipe(num_images_per_prompt=n)`` does.
    """

    name = "diffusers"
    mode = "native"

    # -- what an adapter declares ------------------------------------------------

    #: ``steps``' default: the pipeline's ``num_inference_steps``.
    default_steps: int = 50
    #: ``guidance_scale``'s default: the pipeline's.
    default_guidance: float = 7.5
    #: Whether the pipeline takes a negative prompt.
    takes_negative_prompt: bool = True
    #: Whether a request's scheduler starts at index 0 (``set_begin_index``)
    #: rather than looking its first timestep up by value.
    starts_at_first_timestep: bool = True
    #: The pipeline's components its own ``encode_prompt`` needs.
    encoder_parts: tuple[str, ...] = ("tokenizer", "text_encoder")
    #: Whether the denoiser takes pooled text embeddings.
    needs_pooled: bool = False
    #: The samplers a request may name (those of them this diffusers has and
    #: that run this loop are offered; samplers.py).
    sampler_table: tuple[samplers.Sampler, ...] = samplers.NOISE
    #: The adapter's conditioning class (``restore`` rebuilds one from a checkpoint's tensors).
    conditioning_type: type[TextConditioning] = TextConditioning
    #: The step-caching methods its denoiser can use (step_cache.py), and why not more.
    cache_methods: tuple[str, ...] = ("none",)
    cache_why_not: str = "a UNet has no transformer blocks whose work a step could reuse"

    def __init__(
        self,
        pipe: Any,
        *,
        mode: str = "native",
        encode_prompt: EncodePrompt | None = None,
        scheduler: Any | None = None,
        defaults: Mapping[str, Any] | None = None,
        max_batch_size: int | None = None,
        batch: bool = True,
        max_images: int = DEFAULT_MAX_IMAGES,
        name: str | None = None,
    ) -> None:
        """Wrap ``pipe``; the options are the class docstring's.

        Raises ImportError without diffusers; ParamsError for a pipeline this
        adapter cannot drive, a scheduler that cannot run its loop, a missing
        prompt encoder, or bad ``defaults``.
        """
        try:
            # diffusers' own helpers, so the loop does what the pipeline does.
            from diffusers.utils.torch_utils import randn_tensor

            self._import_helpers()
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        self._randn_tensor = randn_tensor
        check_mode(mode)
        if max_batch_size is None:
            max_batch_size = DEFAULT_MAX_BATCH if batch else 1
        elif not batch and max_batch_size != 1:
            raise ParamsError(
                f"batch=False runs one request per call; max_batch_size={max_batch_size!r} asks for more",
                field="max_batch_size",
            )
        check_batch_size(max_batch_size)
        self._max_images = checked_max_images(max_images)
        self._pipe = pipe
        self._denoiser = self._checked_denoiser(pipe)
        template = scheduler_template(pipe, scheduler)
        self._scheduler_cls = type(template)
        self._scheduler_config = template.config
        self._step_params = signature_params(template.step)
        self._vae_scale = vae_scale_factor(pipe)
        # Set by _configure: the latent channels, the multiple sides must be,
        # the largest side, the pipeline's default (height, width).
        self._channels = 0
        self._multiple = 8
        self._max_side = MAX_SIDE
        self._default_size = (0, 0)
        self._configure(template)
        self._samplers = {s.name: s for s in samplers.offered(self.sampler_table, self._runs_loop)}
        self._loras = LoraBank(pipe)
        if encode_prompt is not None and not callable(encode_prompt):
            raise ParamsError(
                f"encode_prompt must be callable, got {type(encode_prompt).__name__}",
                field="encode_prompt",
            )
        if encode_prompt is None:
            check_pipeline_encoder(pipe, self.encoder_parts, self.needs_pooled)
        self._encode_prompt = encode_prompt
        self.max_batch_size = max_batch_size
        self.name = name or "diffusers"
        self.params = with_defaults(self._declare(), defaults, self.name)
        self._timestep_counts: dict[tuple[str, int], int] = {}
        # The denoiser's blocks, wrapped for step caching once a request asks for it.
        self._step_cache: StepCache | None = None
        #: Steps of requests that cache, computed in full and reused (/metrics reads them).
        self.step_cache_totals = {"computed": 0, "cached": 0}

    @property
    def sampler_names(self) -> tuple[str, ...]:
        """The names ``sampler`` takes: ``default`` (the pipeline's own scheduler), then the offered ones."""
        return (samplers.DEFAULT, *self._samplers)

    def _runs_loop(self, sampler: samplers.Sampler) -> bool:
        """Whether ``sampler``'s scheduler takes this loop's timesteps and steps through them."""
        height, width = self._default_size
        try:
            # A dry run of a few steps (timestep_count steps through them all).
            timestep_count(
                lambda n: self._scheduler(n, None, height, width, sampler.name, offer=sampler), 4, self.name
            )
        except Exception:  # noqa: BLE001 - whatever the class raises, it is not offered
            return False
        return True

    # -- declarations and checks (event loop) --------------------------------

    def _declare(self) -> list[Param]:
        multiple, largest = self._multiple, self._max_side
        height, width = self._default_size
        params = [Param("prompt", "str", "", "text prompt", max_len=MAX_PROMPT_CHARS)]
        if self.takes_negative_prompt:
            params.append(
                Param(
                    "negative_prompt",
                    "str",
                    "",
                    "what to steer away from (with guidance)",
                    max_len=MAX_PROMPT_CHARS,
                )
            )
        return [
            *params,
            Param(
                "steps",
                "int",
                self.default_steps,
                "denoise steps (num_inference_steps)",
                minimum=1,
                maximum=1000,
            ),
            *self._guidance_params(),
            seed_param("seed of the request's CPU generator"),
            images_param(self._max_images),
            Param(
                "height",
                "int",
                height,
                f"image height in pixels, a multiple of {multiple}",
                minimum=multiple,
                maximum=largest,
            ),
            Param(
                "width",
                "int",
                width,
                f"image width in pixels, a multiple of {multiple}",
                minimum=multiple,
                maximum=largest,
            ),
            size_param(multiple, largest),
            Param(
                "sampler",
                "str",
                samplers.DEFAULT,
                f"the scheduler: default is the pipeline's own ({self._scheduler_cls.__name__}); "
                "the others by their AUTOMATIC1111 / ComfyUI names",
                choices=self.sampler_names,
            ),
            *self._sampler_params(),
            cache_param(self.cache_methods, self.cache_why_not),
        ]

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params with defaults filled in; raises ParamsError naming the field."""
        params, loras = split_loras(samplers.with_canonical(params))
        samplers.check_installed(params, self.sampler_table, model=self.name)
        out = super().validate(params)
        # A1111's <lora:NAME:WEIGHT> in the prompt is a `loras` entry (every door gets it here).
        out["prompt"], out["loras"] = check_request_loras(
            out["prompt"], loras, self.lora_names, model=self.name
        )
        square_size(out, params, model=self.name)
        # Some pipelines only warn and round down; a request gets the size it asked for.
        check_multiple(out, self._multiple, self.name)
        self._timestep_count(out["steps"], out["sampler"])
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        """One frame per denoiser evaluation: ``len(scheduler.timesteps)`` for ``steps``.

        That is ``steps`` for most schedulers, but not all (PNDM: steps + 1;
        Heun and DPM2: 2 * steps - 1). Raises ParamsError when the scheduler
        rejects ``steps``.
        """
        return self._timestep_count(int(params["steps"]), params.get("sampler", samplers.DEFAULT))

    def _timestep_count(self, steps: int, sampler: str) -> int:
        count = self._timestep_counts.get((sampler, steps))
        if count is None:
            # A throwaway scheduler on the CPU, cached per sampler and step
            # count, so the event loop pays it once per distinct pair; the size
            # (mu, where the pipeline shifts by it) moves the timesteps, never
            # their number.
            height, width = self._default_size
            count = timestep_count(
                lambda n: self._scheduler(n, None, height, width, sampler), steps, self.name
            )
            self._timestep_counts[(sampler, steps)] = count
        return count

    def _scheduler(
        self,
        steps: int,
        device: torch.device | None,
        height: int,
        width: int,
        sampler: str = samplers.DEFAULT,
        *,
        offer: samplers.Sampler | None = None,
    ) -> Any:
        """A fresh scheduler for ``sampler`` set as a request's loop starts it (the step count checks
        run it too). ``offer``: a table entry not offered yet (its trial run)."""
        if sampler == samplers.DEFAULT:
            scheduler = self._scheduler_cls.from_config(self._scheduler_config)
        else:
            scheduler = samplers.build(offer or self._samplers[sampler], self._scheduler_config)
        self._set_timesteps(scheduler, steps, device, height, width)
        if self.starts_at_first_timestep and hasattr(scheduler, "set_begin_index"):
            # Text-to-image always starts at the first timestep; without this
            # the index is looked up by value, which is wrong for repeated
            # timesteps.
            scheduler.set_begin_index(0)
        return scheduler

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """``(height, width, sampler)`` when batching is on (``max_batch_size > 1``), else None.

        Batched requests share denoiser calls, each row at its own timestep
        and guidance. A batched call can round differently from a solo one
        (kernels are chosen per batch size), so a request batched with
        others matches its solo run closely, not bit for bit (alone it is
        bit for bit); ``batch=False`` gives up the sharing for exactness.
        """
        if self.max_batch_size == 1:
            return None
        # Requests on different samplers, or with other LoRAs, are never
        # batched together: one batch, one kind of step, one set of weights.
        return (
            params["height"],
            params["width"],
            params.get("sampler", samplers.DEFAULT),
            params.get("loras", ()),
        )

    # -- producer thread -------------------------------------------------------

    def load(self, device: torch.device) -> None:
        """Move the pipeline's modules to ``device`` unless the denoiser is there already."""
        if not same_device(next(self._denoiser.parameters()).device, device):
            self._pipe.to(device)

    def start(self, params: Mapping[str, Any], device: torch.device) -> NativeState[CondT]:
        """Encode the prompt, make this request's scheduler, generator and noise.

        Raises ParamsError when the prompt embeddings do not fit the denoiser.
        """
        height, width = int(params["height"]), int(params["width"])
        with torch.no_grad():
            dtype = self._denoiser.dtype
            guided = self._guided(params)
            images = int(params.get("num_images", 1))
            # A LoRA may adapt the text encoders too: its weights are on before the prompt is encoded.
            self._loras.activate(_loras_of(params))
            cond = self._conditioning(params, device, dtype, guided)
            cond.repeat(images)
            # Only the noise draws from the generator, so the order of the two
            # lines below changes nothing (SD draws after set_timesteps, SD3
            # and Flux before).
            scheduler = self._scheduler(
                int(params["steps"]), device, height, width, params.get("sampler", samplers.DEFAULT)
            )
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            # All the images' noise in one draw, as num_images_per_prompt does.
            shape = (images, self._channels, *self._latent_size(height, width))
            noise = self._randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            latents = self._initial_latents(noise, scheduler, height, width)
        total = len(scheduler.timesteps)
        return NativeState(
            params=params,
            total=total,
            scheduler=scheduler,
            generator=generator,
            latents=latents,
            cond=cond,
            guided=guided,
            step_kwargs=self._step_kwargs(params, generator, signature_params(scheduler.step)),
            images=images,
            cache=state_for(params, total),
        )

    def _step_kwargs(
        self, params: Mapping[str, Any], generator: torch.Generator, takes: frozenset[str]
    ) -> dict[str, Any]:
        """What ``scheduler.step`` gets besides the model output (``takes``: its parameters)."""
        kwargs: dict[str, Any] = {}
        if "generator" in takes:
            # Only stochastic sampling draws here; the pipeline would use the
            # global RNG, a request its own generator.
            kwargs["generator"] = generator
        return kwargs

    def step(self, states: Sequence[NativeState[CondT]]) -> list[torch.Tensor]:
        """Run one denoise step for each state; one frame ``[C, h, w]`` each (``[n, C, h, w]``
        for a request of ``n`` images).

        Raises RuntimeError for a closed or finished state. If anything
        raises, every state (its scheduler and generator too) is left as it
        was, so the engine can retry each request alone.
        """
        return step_atomically(states, self.name, self._step)

    def _step(self, states: Sequence[NativeState[CondT]]) -> list[torch.Tensor]:
        timesteps = [s.scheduler.timesteps[s.done] for s in states]
        preds = self._predict(states, timesteps)
        # Nothing below writes to a state until every scheduler has stepped:
        # a raise leaves only scheduler/generator changes, which step() undoes.
        results = []
        for s, t, pred in zip(states, timesteps, preds, strict=True):
            latents = s.latents
            assert latents is not None
            pred = self._guide(s, pred)
            output = s.scheduler.step(pred, t, latents, **s.step_kwargs, return_dict=True)
            prev = output.prev_sample
            # Intermediate frames show the clean-sample estimate, so previews
            # show the picture forming (diffusers #3579); the last, the result.
            x0 = None if s.done + 1 == s.total else self._x0(s, output, latents, pred)
            results.append((prev, self._frame(s, prev if x0 is None else x0)))
        frames = []
        for s, (prev, frame) in zip(states, results, strict=True):
            s.latents = prev
            s.done += 1
            frames.append(frame)
            if s.cache is not None:  # counted once the step stands (a failed one is undone)
                self.step_cache_totals["cached" if s.cache.last_cached else "computed"] += 1
        return frames

    def _predict(
        self, states: Sequence[NativeState[CondT]], timesteps: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        # One denoiser call per group of states whose inputs have one shape
        # (always one group with the pipeline's own encoder and a batch key).
        # Each row carries its own timestep, so requests at different steps
        # share a call.
        groups: dict[tuple[LoraSet, Hashable], list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault((_loras_of(s.params), self._group_key(s)), []).append(i)
        preds: list[torch.Tensor | None] = [None] * len(states)
        for (loras, _), members in groups.items():
            self._loras.activate(loras)  # one set_adapters, only when it changes
            group = [states[i] for i in members]
            with self._caching(group):
                out = self._denoise(group, [timesteps[i] for i in members])
            offset = 0
            for i in members:
                rows = states[i].rows
                preds[i] = out[offset : offset + rows]
                offset += rows
        assert all(p is not None for p in preds)
        return preds  # type: ignore[return-value]

    def step_reused(self, states: Sequence[NativeState[CondT]]) -> list[bool]:
        """Whether each of the last step's ``states`` reused its step cache (the engine marks its
        frame: ``StepTimings.cached``, ``progress``'s ``cached``)."""
        return [s.cache is not None and s.cache.last_cached for s in states]

    def _caching(self, group: Sequence[NativeState[CondT]]) -> contextlib.AbstractContextManager[object]:
        """The denoiser call's step caching: each request's rows and cache (step_cache.py);
        nothing when none of ``group`` caches."""
        if all(s.cache is None for s in group):
            return contextlib.nullcontext()
        if self._step_cache is None:
            self._step_cache = StepCache(self._denoiser)
        return self._step_cache.batch([(s.rows, s.cache) for s in group])

    def _group_key(self, s: NativeState[CondT]) -> Hashable:
        assert s.latents is not None
        return (tuple(s.conditioning.embeds.shape[1:]), tuple(s.latents.shape[1:]))

    def _guide(self, s: NativeState[CondT], pred: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance of a guided request's two rows; ``pred`` as it is otherwise."""
        if not s.guided:
            return pred
        uncond, text = pred.chunk(2)
        return uncond + float(s.params["guidance_scale"]) * (text - uncond)

    def _frame(self, s: NativeState[CondT], latents: torch.Tensor) -> torch.Tensor:
        """The frame a step hands out for ``latents`` ``[n, C, h, w]``: ``[C, h, w]`` for one
        image, all ``n`` for several (Frame.image_count)."""
        return latents[0] if s.images == 1 else latents

    def close(self, state: NativeState[CondT]) -> None:
        """Drop the request's tensors; a later ``step`` on it raises."""
        state.latents = None
        state.cond = None
        state.scheduler = None
        state.step_kwargs = {}

    # -- snapshot and restore (omni_stream.model) --------------------------------

    def repeatable(self, params: Mapping[str, Any]) -> bool:
        """Whether a request of these checked params gives the same result every time (a server
        may answer its exact repeat with that result: core/repeats.py): unless its sampler draws
        noise outside its generator, or its ``cache`` says ``results: false``."""
        cache = params.get("cache")
        wants = not isinstance(cache, Mapping) or cache.get("results", True) is not False
        return wants and self.can_snapshot(params)

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        """True unless the request's scheduler keeps noise outside its generator (UNCAPTURED_NOISE)."""
        name = self._scheduler_class_name(params.get("sampler", samplers.DEFAULT))
        return name not in samplers.UNCAPTURED_NOISE

    def _scheduler_class_name(self, sampler: str) -> str:
        if sampler == samplers.DEFAULT:
            return self._scheduler_cls.__name__
        entry = self._samplers.get(sampler)
        return entry.scheduler if entry is not None else sampler

    def snapshot(self, state: NativeState[CondT]) -> Checkpoint:
        """The request's latents, generator, conditioning and scheduler state (producer thread).

        ``state`` is not changed. Raises CheckpointError for a closed
        request, a scheduler in :data:`.samplers.UNCAPTURED_NOISE`, or a
        scheduler attribute a checkpoint cannot hold.
        """
        if state.latents is None or state.cond is None or state.scheduler is None:
            raise CheckpointError(f"{self.name}: a closed request has no state to snapshot")
        if not self.can_snapshot(state.params):
            raise CheckpointError(
                f"{self.name}: {type(state.scheduler).__name__} draws noise outside the request's "
                "generator, which a snapshot cannot capture; this request cannot be checkpointed"
            )
        with torch.no_grad():
            fresh = self._reference_scheduler(state.params, state.latents.device)
            values, tensors = scheduler_state.capture(state.scheduler, fresh, "scheduler")
            # Copies: the request goes on stepping (and on the CPU .cpu() would alias it).
            tensors["latents"] = state.latents.detach().to("cpu", copy=True)
            tensors["generator"] = state.generator.get_state()
            cond: dict[str, bool] = {}
            for f in fields(state.cond):
                value = getattr(state.cond, f.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"cond.{f.name}"] = value.detach().to("cpu", copy=True)
                elif value is not None:
                    raise CheckpointError(f"{self.name}: conditioning field {f.name!r} is not a tensor")
                cond[f.name] = value is not None
            cache = None
            if state.cache is not None:
                cache = state.cache.counts()
                tensors.update({f"cache.{k}": v for k, v in state.cache.tensors().items()})
        return Checkpoint(
            model=self.snapshot_kind,
            format=self.snapshot_format,
            step=state.done,
            total=state.total,
            params=plain_params(state.params),
            tensors=tensors,
            values={
                "scheduler": values,
                "cond": cond,
                "guided": state.guided,
                "images": state.images,
                "cache": cache,
            },
        )

    def restore(self, checkpoint: Checkpoint, device: torch.device) -> NativeState[CondT]:
        """The request ``checkpoint`` holds, on ``device``, ready for its next step (producer thread).

        Raises CheckpointError for a checkpoint of another model or format,
        with params this model refuses now (a LoRA not loaded), or whose
        tensors do not fit (another dtype, another layout).
        """
        params = self.restored_params(checkpoint)
        tensors, values = checkpoint.tensors, checkpoint.values
        images = int(params.get("num_images", 1))
        guided = self._guided(params)
        dtype = self._denoiser.dtype
        try:
            latents = tensors["latents"]
            rng = tensors["generator"]
            cond_fields: Mapping[str, bool] = values["cond"]
            saved = (bool(values["guided"]), int(values["images"]))
            with torch.no_grad():
                scheduler = self._fresh_scheduler(params, device)
                scheduler_state.apply(scheduler, values["scheduler"], tensors, device)
                cond_values: dict[str, Any] = {
                    name: tensors[f"cond.{name}"].to(device, copy=True) if present else None
                    for name, present in cond_fields.items()
                }
                cond = self.conditioning_type(**cond_values)
                # Its step cache as it was (a checkpoint without one: the request's, fresh).
                saved_cache = values.get("cache")
                cache = (
                    state_for(params, len(scheduler.timesteps))
                    if saved_cache is None
                    else rebuilt(
                        saved_cache,
                        {k.removeprefix("cache."): v for k, v in tensors.items() if k.startswith("cache.")},
                        device,
                    )
                )
            generator = torch.Generator(device="cpu")
            generator.set_state(rng)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - a well-formed file of the wrong content
            raise CheckpointError(
                f"{self.name}: the checkpoint's state cannot be rebuilt: {exc!r:.200}"
            ) from exc
        fits = (
            saved == (guided, images)
            and latents.shape[0] == images
            and latents.dtype == dtype
            and cond.embeds.dtype == dtype
        )
        if not fits:
            raise CheckpointError(
                f"{self.name}: the checkpoint's state (latents {tuple(latents.shape)} {latents.dtype}, "
                f"guided {saved[0]}) does not fit this model ({images} images, {dtype}, guided {guided})"
            )
        total = len(scheduler.timesteps)
        if total != checkpoint.total:
            raise CheckpointError(
                f"{self.name}: the checkpoint has {checkpoint.total} steps, its scheduler {total}"
            )
        return NativeState(
            params=params,
            total=total,
            scheduler=scheduler,
            generator=generator,
            latents=latents.to(device, copy=True),
            cond=cast(CondT, cond),
            guided=guided,
            step_kwargs=self._step_kwargs(params, generator, signature_params(scheduler.step)),
            done=checkpoint.step,
            images=images,
            cache=cache,
        )

    def _reference_scheduler(self, params: Mapping[str, Any], device: torch.device) -> Any:
        """A fresh scheduler for ``params``, kept (it is only read: what a snapshot compares
        against): building one costs milliseconds, a snapshot is taken every few steps."""
        key = (
            int(params["steps"]),
            int(params["height"]),
            int(params["width"]),
            params.get("sampler", samplers.DEFAULT),
            str(device),
        )
        cache: dict[Any, Any] = self.__dict__.setdefault("_reference_schedulers", {})
        fresh = cache.get(key)
        if fresh is None:
            if len(cache) >= 16:  # a handful of (steps, size, sampler) at a time in practice
                cache.pop(next(iter(cache)))
            fresh = cache[key] = self._fresh_scheduler(params, device)
        return fresh

    def _fresh_scheduler(self, params: Mapping[str, Any], device: torch.device) -> Any:
        """The scheduler ``start`` makes for ``params``: the base a snapshot's state is a difference to."""
        return self._scheduler(
            int(params["steps"]),
            device,
            int(params["height"]),
            int(params["width"]),
            params.get("sampler", samplers.DEFAULT),
        )

    def _params_from_checkpoint(self, params: Mapping[str, Any]) -> dict[str, Any]:
        # Checked loras are ((name, scale), ...), written down as [[name, scale], ...];
        # validate takes the request's form.
        out = dict(params)
        loras = out.get("loras")
        if isinstance(loras, list):
            try:
                out["loras"] = [{"name": name, "scale": scale} for name, scale in loras]
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"{self.name}: the checkpoint's loras are malformed: {loras!r:.100}"
                ) from exc
        return out

    # -- prompts ----------------------------------------------------------------

    def _encode(self, params: Mapping[str, Any], device: torch.device, guided: bool) -> PromptEmbeddings:
        prompt, negative_prompt = params["prompt"], params.get("negative_prompt", "")
        if self._encode_prompt is not None:
            return checked_embeddings(self._encode_prompt(prompt, negative_prompt))
        return self._pipeline_encode(prompt, negative_prompt, device, guided)

    # -- decoding ---------------------------------------------------------------

    def decode(self, state: NativeState[CondT], frame: torch.Tensor) -> torch.Tensor:
        """The request's image ``[3, H, W]`` in [-1, 1]: the final latent through the VAE
        (``[n, 3, H, W]`` for ``n`` images, each decoded on its own).

        Runs on the producer's device; the engine calls this for ``output:
        "image"`` (see ``StepModel.decode``). Raises ParamsError without a VAE.
        """
        if state.images == 1:
            return self._vae_decode(frame)
        return torch.stack([self._vae_decode(latents) for latents in frame])

    def decode_preview(self, state: Any, frame: torch.Tensor) -> torch.Tensor | None:
        """The tiny autoencoder's preview (:meth:`Diffusers.decode_preview`), per image for several."""
        if getattr(state, "images", 1) == 1:
            return super().decode_preview(state, frame)
        decoded = []
        for latents in frame:
            image = super().decode_preview(state, latents)
            if image is None:
                return None  # no tiny autoencoder: the linear decoders preview the grid
            decoded.append(image)
        return torch.stack(decoded)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one frame's latents with the VAE: float32 RGB ``[3, H, W]`` in ``[-1, 1]``, on the CPU.

        For the frames a request returned with ``output: "latent"``. Runs the
        full VAE on the calling thread: call it once the engine is done, not
        beside a running engine on a small CPU box, where its torch threads
        would fight the producer's. Raises ParamsError without a VAE or for
        latents of the wrong shape.
        """
        return self._vae_decode(latents).cpu()

    # -- the adapter's: what its pipeline does its own way ------------------------

    def _import_helpers(self) -> None:
        """Bind the pipeline module's own helpers; raises ImportError without them."""

    @abc.abstractmethod
    def _checked_denoiser(self, pipe: Any) -> Any:
        """``pipe``'s denoiser; raises ParamsError when it is not one this loop can drive."""

    @abc.abstractmethod
    def _configure(self, template: Any) -> None:
        """Read what the loop needs from the denoiser and ``template`` (the scheduler); ParamsError."""

    def _guidance_params(self) -> list[Param]:
        """The params that set guidance: classifier-free guidance's scale, unless the pipeline differs."""
        return [
            Param(
                "guidance_scale",
                "float",
                self.default_guidance,
                "classifier-free guidance; 1 or less turns it off",
                minimum=0.0,
                maximum=100.0,
            )
        ]

    def _sampler_params(self) -> list[Param]:
        """Params the scheduler takes (``eta``), declared last."""
        return []

    def _set_timesteps(
        self, scheduler: Any, steps: int, device: torch.device | None, height: int, width: int
    ) -> None:
        """Set ``scheduler``'s timesteps for ``steps`` the way the pipeline's ``__call__`` does."""
        scheduler.set_timesteps(steps, device=device)

    def _guided(self, params: Mapping[str, Any]) -> bool:
        """Whether the request runs classifier-free guidance (two rows per denoiser call)."""
        return float(params["guidance_scale"]) > 1.0

    @abc.abstractmethod
    def _pipeline_encode(
        self, prompt: str, negative_prompt: str, device: torch.device, guided: bool
    ) -> PromptEmbeddings:
        """The pipeline's own ``encode_prompt``, as :class:`PromptEmbeddings`."""

    @abc.abstractmethod
    def _conditioning(
        self, params: Mapping[str, Any], device: torch.device, dtype: torch.dtype, guided: bool
    ) -> CondT:
        """The request's conditioning on ``device``; ParamsError when it does not fit the denoiser."""

    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        """The noise's ``(h, w)`` for an image of ``height`` x ``width`` pixels."""
        return (height // self._vae_scale, width // self._vae_scale)

    def _initial_latents(self, noise: torch.Tensor, scheduler: Any, height: int, width: int) -> torch.Tensor:
        """The first latents from the noise ``[1, C, h, w]``, in the denoiser's layout."""
        return noise

    @abc.abstractmethod
    def _denoise(
        self, group: Sequence[NativeState[CondT]], timesteps: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """One denoiser call on ``group``'s rows, in order; its prediction, ``rows`` rows a state."""

    def _x0(
        self, s: NativeState[CondT], output: Any, latents: torch.Tensor, pred: torch.Tensor
    ) -> torch.Tensor | None:
        """The clean-sample estimate of the step ``output`` just took from ``latents``, or None."""
        return None

    @abc.abstractmethod
    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents`` ``[C, h, w]`` through the pipeline's VAE: ``[3, H, W]`` in [-1, 1]; ParamsError."""


def _loras_of(params: Mapping[str, Any]) -> LoraSet:
    loras: LoraSet = params.get("loras", ())
    return loras
