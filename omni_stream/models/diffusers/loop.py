"""The plain functions the native loops are built from: checks, state snapshots, batching.

:mod:`.native` (the loop itself) and the adapters on it, :mod:`.unet`,
:mod:`.flow`, :mod:`.sd3` and :mod:`.flux`, call these; none of them holds
a request or a pipeline, so each can be read and tested alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ParamsError
from ...params import Param, positive_int
from .base import PromptEmbeddings

#: The longest prompt (and negative prompt) a native loop takes, in characters.
MAX_PROMPT_CHARS = 10_000
#: The largest image side a native loop takes, in pixels (a pipeline may take less).
MAX_SIDE = 8192


@dataclass(slots=True)
class Saved:
    """What a failed ``step`` must put back: the scheduler's attributes, the generator, the
    step cache (step_cache.py: its fields are replaced, never changed in place)."""

    state: Any  # an adapter's per-request state: .scheduler, .generator, .cache
    attrs: dict[str, Any]
    rng: torch.Tensor
    cache: Any = None

    @classmethod
    def take(cls, state: Any) -> Saved:
        # scheduler.step rebinds attributes (step index, last sample) and
        # shifts lists in place (model_outputs, derivatives, ets); one level
        # of copying undoes both without copying the tensors.
        attrs = {k: (list(v) if type(v) is list else v) for k, v in vars(state.scheduler).items()}
        cache = getattr(state, "cache", None)
        return cls(state, attrs, state.generator.get_state(), None if cache is None else dict(vars(cache)))

    def restore(self) -> None:
        attrs = vars(self.state.scheduler)
        attrs.clear()
        attrs.update(self.attrs)
        self.state.generator.set_state(self.rng)
        if self.cache is not None:
            vars(self.state.cache).update(self.cache)


def check_mode(mode: str) -> None:
    if mode not in ("auto", "native"):
        raise ParamsError(
            f"a native adapter takes mode 'auto' or 'native', got {mode!r}",
            field="mode",
        )


def check_batch_size(max_batch_size: Any) -> None:
    positive_int(max_batch_size, "max_batch_size")


def scheduler_template(pipe: Any, scheduler: Any | None) -> Any:
    template = scheduler if scheduler is not None else getattr(pipe, "scheduler", None)
    if template is None or not all(hasattr(template, a) for a in ("step", "config", "set_timesteps")):
        raise ParamsError(
            f"{type(pipe).__name__} has no scheduler; pass scheduler=",
            field="scheduler",
        )
    return template


def vae_scale_factor(pipe: Any) -> int:
    """The pipelines' ``vae_scale_factor``: 2 ** (VAE blocks - 1), 8 without a VAE."""
    vae = getattr(pipe, "vae", None)
    return 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 8


def check_pipeline_encoder(pipe: Any, needs: Sequence[str], pooled: bool) -> None:
    """Raise ParamsError unless ``pipe`` can encode prompts itself (``needs`` names its parts).

    ``pooled`` says whether the replacement the error asks for must return
    pooled embeddings too.
    """
    missing = [n for n in needs if getattr(pipe, n, None) is None]
    if missing or not callable(getattr(pipe, "encode_prompt", None)):
        raise ParamsError(
            f"{type(pipe).__name__} has no {' / '.join(missing) or 'encode_prompt'}; pass "
            "encode_prompt=, a callable (prompt, negative_prompt) -> PromptEmbeddings"
            + (" with pooled_prompt_embeds" if pooled else ""),
            field="encode_prompt",
        )


def checked_embeddings(emb: Any) -> PromptEmbeddings:
    """``emb`` if it is PromptEmbeddings; raises ParamsError otherwise."""
    if not isinstance(emb, PromptEmbeddings):
        raise ParamsError(
            f"encode_prompt must return PromptEmbeddings, got {type(emb).__name__}",
            field="encode_prompt",
        )
    return emb


def text_conditioning(
    emb: PromptEmbeddings,
    guided: bool,
    *,
    width: int,
    width_name: str,
    family: str,
    pooled: bool,
    pooled_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(embeds [rows, seq, width], pooled [rows, dim] or None)``, the negative row first when guided.

    ``width_name`` names where ``width`` comes from (``"the UNet's
    cross_attention_dim"``), for the error; ``pooled`` says whether
    ``family`` needs pooled embeddings, ``pooled_width`` their width where
    it is checked here. Raises ParamsError for missing, misshapen or
    mismatched embeddings.
    """
    positive = batch_of_one(emb.prompt_embeds, "prompt_embeds", 3)
    if positive.shape[-1] != width:
        raise ParamsError(
            f"prompt_embeds has width {positive.shape[-1]}, {width_name} is {width}",
            field="prompt_embeds",
        )
    positive_pooled = None
    if pooled:
        if emb.pooled_prompt_embeds is None:
            raise ParamsError(
                f"{family} needs pooled_prompt_embeds; encode_prompt returned none",
                field="pooled_prompt_embeds",
            )
        positive_pooled = batch_of_one(emb.pooled_prompt_embeds, "pooled_prompt_embeds", 2)
        if pooled_width is not None and positive_pooled.shape[-1] != pooled_width:
            raise ParamsError(
                f"pooled_prompt_embeds has width {positive_pooled.shape[-1]}, the transformer's "
                f"pooled_projection_dim is {pooled_width}",
                field="pooled_prompt_embeds",
            )
    if not guided:
        return positive, positive_pooled
    negative = _negative(emb.negative_prompt_embeds, positive, "negative_prompt_embeds", family)
    # The pipelines' row order: negative, then positive.
    embeds = torch.cat([negative, positive])
    if positive_pooled is None:
        return embeds, None
    negative_pooled = _negative(
        emb.negative_pooled_prompt_embeds, positive_pooled, "negative_pooled_prompt_embeds", family
    )
    return embeds, torch.cat([negative_pooled, positive_pooled])


def _negative(value: Any, positive: torch.Tensor, field: str, family: str) -> torch.Tensor:
    if value is None:
        raise ParamsError(
            f"{family} with guidance_scale > 1 needs {field}; encode_prompt returned none",
            field=field,
        )
    negative = batch_of_one(value, field, positive.dim())
    if negative.shape != positive.shape:
        like = field.removeprefix("negative_")
        raise ParamsError(
            f"{field} {tuple(negative.shape)} and {like} {tuple(positive.shape)} must have the same shape",
            field=field,
        )
    return negative


def with_defaults(params: list[Param], defaults: Mapping[str, Any] | None, model: str) -> tuple[Param, ...]:
    """``params`` with ``defaults`` applied; raises ParamsError for unknown names or bad values."""
    if defaults:
        by_name = {p.name: i for i, p in enumerate(params)}
        unknown = sorted(set(defaults) - set(by_name))
        if unknown:
            raise ParamsError(
                f"defaults: unknown param(s) {unknown}; known: {sorted(by_name)}",
                field="defaults",
            )
        for key, value in defaults.items():
            try:
                params[by_name[key]] = params[by_name[key]].with_default(value, model=model)
            except ParamsError as exc:
                raise ParamsError(f"defaults: {exc}", field="defaults") from None
    return tuple(params)


def size_param(multiple: int, maximum: int) -> Param:
    """``size``: both sides at once, as every image model takes it (see ``params.square_size``)."""
    return Param(
        "size",
        "int",
        None,
        f"height and width in pixels, both at once, a multiple of {multiple}",
        minimum=multiple,
        maximum=maximum,
    )


def check_multiple(params: Mapping[str, Any], multiple: int, model: str) -> None:
    """Raise ParamsError naming ``height`` or ``width`` (``size`` where it set them) when not a multiple."""
    for side in ("height", "width"):
        if params[side] % multiple:
            name = "size" if params.get("size") == params[side] else side
            raise ParamsError(
                f"{model} param {name!r} must be a multiple of {multiple}, got {params[side]}",
                field=name,
            )


#: How far below a failing step count ``timestep_count`` looks for the bound.
_BOUND_SEARCH = 32


def timestep_count(make: Callable[[int], Any], steps: int, model: str) -> int:
    """``len(timesteps)`` of ``make(steps)``, a throwaway scheduler set for ``steps``.

    The scheduler is also run through every one of its steps on a one-value
    latent: a count its ``set_timesteps`` accepts may still index past its
    tables (DDIM, PNDM and DDPM with ``steps_offset=1`` and ``"leading"``
    spacing at ``steps == num_train_timesteps``; DPM-Solver++ with
    ``"leading"`` spacing there), which the request would otherwise hit as
    a raw IndexError at its first or last step. Raises ParamsError (field
    ``steps``) naming the scheduler and, where one is found, the largest
    count below that runs.
    """
    scheduler = _scheduled(make, steps, model)
    count = len(scheduler.timesteps)
    if count < 1:
        raise ParamsError(
            f"{model} param 'steps': {type(scheduler).__name__} gives no timesteps for {steps} steps",
            field="steps",
        )
    failure = _dry_run(scheduler)
    if failure is not None:
        name = type(scheduler).__name__
        trained = getattr(scheduler.config, "num_train_timesteps", None)
        what = f"{name} ({trained} training timesteps)" if trained else name
        bound = next((m for m in range(steps - 1, max(steps - _BOUND_SEARCH, 0), -1) if _runs(make, m)), None)
        limit = f"must be at most {bound} for {what}" if bound else f"cannot be run by {what}"
        raise ParamsError(
            f"{model} param 'steps' {limit}, got {steps} ({type(failure).__name__} at that count: {failure})",
            field="steps",
        )
    return count


def _scheduled(make: Callable[[int], Any], steps: int, model: str) -> Any:
    try:
        return make(steps)
    except ValueError as exc:
        raise ParamsError(f"{model} param 'steps': {exc}", field="steps") from None


def _runs(make: Callable[[int], Any], steps: int) -> bool:
    try:
        scheduler = make(steps)
    except ValueError:
        return False
    return len(scheduler.timesteps) > 0 and _dry_run(scheduler) is None


def _dry_run(scheduler: Any) -> Exception | None:
    """Step ``scheduler`` through all its timesteps on zeros; the exception it raised, or None.

    Only the indices matter here, not the values: a latent of one value
    costs about 0.1 ms a step. A private generator keeps ancestral
    schedulers off the global RNG.
    """
    sample = torch.zeros(1, 1, 1, 1)
    takes = signature_params(scheduler.step)
    kwargs: dict[str, Any] = {}
    if "generator" in takes:
        kwargs["generator"] = torch.Generator().manual_seed(0)
    try:
        for t in scheduler.timesteps:
            if hasattr(scheduler, "scale_model_input"):
                scheduler.scale_model_input(sample, t)
            out = scheduler.step(torch.zeros_like(sample), t, sample, **kwargs)
            sample = out[0] if isinstance(out, tuple) else out.prev_sample
    except Exception as exc:  # any scheduler's own failure: what the request would have hit
        return exc
    return None


def check_steppable(states: Sequence[Any], model: str) -> None:
    """Raise RuntimeError for a closed state or one past its last step."""
    for s in states:
        if s.latents is None:
            raise RuntimeError(f"{model}: step() on a closed request")
        if s.done >= s.total:
            raise RuntimeError(f"{model}: step() past the last of {s.total} steps")


def step_atomically(
    states: Sequence[Any], model: str, run: Callable[[Sequence[Any]], list[torch.Tensor]]
) -> list[torch.Tensor]:
    """``run(states)`` under no_grad, so that a raise leaves every state as it was.

    The model contract lets the engine retry each state of a failed batch
    alone; that is only sound if the failed call changed nothing. Raises
    RuntimeError for a closed or finished state, and what ``run`` raises.
    """
    check_steppable(states, model)
    saved = [Saved.take(s) for s in states]
    try:
        with torch.no_grad():
            return run(states)
    except BaseException:
        for snapshot in saved:
            snapshot.restore()
        raise


def vae_latents(pipe: Any, latents: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``(pipe.vae, latents as [C, h, w])`` for a decode; a leading batch of one is dropped.

    Raises ParamsError without a VAE or for latents of the wrong shape.
    """
    vae = getattr(pipe, "vae", None)
    if vae is None:
        raise ParamsError(f"{type(pipe).__name__} has no VAE to decode with", field="pipe")
    if latents.dim() == 4 and latents.shape[0] == 1:
        latents = latents[0]
    channels = vae.config.latent_channels
    if latents.dim() != 3 or latents.shape[0] != channels:
        raise ParamsError(
            f"decode needs latents [{channels}, h, w], got {tuple(latents.shape)}",
            field="latents",
        )
    return vae, latents


def batch_of_one(value: Any, field: str, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ParamsError(f"{field} must be a torch.Tensor, got {type(value).__name__}", field=field)
    t = value[None] if value.dim() == ndim - 1 else value
    if t.dim() != ndim or t.shape[0] != 1:
        want = "[1, seq, dim]" if ndim == 3 else "[1, dim]"
        raise ParamsError(f"{field} must be {want}, got {tuple(t.shape)}", field=field)
    if not t.is_floating_point():
        raise ParamsError(f"{field} must hold floats, got {t.dtype}", field=field)
    return t


def cat_rows(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    # One request's rows go to the UNet as they are, the way the pipeline
    # passes them; several are stacked along the batch dimension.
    rows = [t for t in tensors if t is not None]
    if len(rows) != len(tensors):
        raise RuntimeError("a batched request lacks a conditioning tensor its peers have")
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def signature_params(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True

    def index(d: torch.device) -> int:
        return d.index if d.index is not None else torch.cuda.current_device()

    return index(a) == index(b)
