"""Callback mode: stream any diffusers pipeline whose ``__call__`` takes ``callback_on_step_end``.

The pipeline's own ``__call__`` runs each request, on the engine's producer
thread, one request at a time (``runs_whole_requests``); its step callback
hands each step's latents to the engine through ``emit``. When a request is
cancelled, times out or the engine stops, ``emit`` raises
:class:`~omni_stream.model.RequestStopped` inside the callback, which unwinds
``pipe(...)`` right there: no further step runs. This fits every pipeline
with that callback (img2img, ControlNet, Qwen-Image, Wan/LTX/CogVideoX video,
pipelines with LoRAs loaded, ...) without rebuilding its loop, at the cost of
batching: requests never share a denoiser call.

Params: declared from ``pipe.__call__``'s signature, for the arguments it
takes (``prompt``, ``negative_prompt``, ``steps`` for
``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``, ``seed``
for a CPU generator, ``height``/``width`` and ``size`` for both,
``num_frames``, ``strength``, the input images ``image``, ``mask_image`` and
``control_image``, ``sampler`` for its scheduler, ``loras``), with the pipeline's own defaults
where its signature gives literals. Sizes are not checked against the
pipeline's multiples: its own ``check_inputs`` raises (failing the request)
or rounds, as it does for ``pipe(...)``. Each input image is a PNG/JPEG data URL or file path (a PIL
image from Python), decoded by ``validate`` (see :mod:`.inputs`).

Frames: each step's frame is the ``latents`` tensor the callback sees after
that step (the noisy latent, not an x0 estimate: callbacks get no more),
batch dimension dropped and cloned: ``[C, h, w]`` for image pipelines,
``[C, T, h, w]`` for video ones. Packed latents (``[seq, ch]``: Flux,
Qwen-Image, LTX) are unpacked with the pipeline's own static
``_unpack_latents`` when the sizes it needs are known (``height``/``width``
params, or the pipeline's ``default_sample_size``); otherwise they stay
packed. Qwen-Image's ``[C, 1, h, w]`` loses its singleton frame axis. The
final frame is the request's output: with ``output: "latent"`` the last
step's latents (shaped like the others), with ``output: "image"`` the
pipeline's decoded ``output_type="pt"`` result mapped to ``[-1, 1]``:
``[3, H, W]`` for images, ``[T, 3, H, W]`` for videos.

The step count: ``total_steps`` is how many times the callback will fire,
``len(scheduler.timesteps)`` after ``set_timesteps(steps)`` on a throwaway
copy of the pipeline's scheduler (usually ``steps``), and for pipelines that
take ``strength`` (img2img) the timesteps the pipeline's own
``get_timesteps`` keeps, run against that throwaway scheduler (diffusers'
rule: ``min(int(steps * strength), steps)`` steps for SD). A pipeline that
fires its callback a different number of times (a custom timestep schedule
passed through ``call_kwargs``) fails its request with an error saying so.

Sharing: a pipeline is not safe to share between concurrent calls (its
scheduler keeps per-call state: ``set_timesteps``, step index); callback
mode runs one request at a time on one thread, so each call owns it while
it runs. Don't call the same pipeline elsewhere while the engine runs it.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ParamsError
from ...model import Emit
from ...params import Param, images_param, positive_int, seed_param, square_size
from ..inputs import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, load_image
from . import samplers
from .base import DEFAULT_MAX_IMAGES, Diffusers, checked_max_images, takes_step_callback
from .loop import same_device, signature_params, timestep_count, with_defaults
from .loras import LoraBank, LoraSet, check_request_loras, split_loras

__all__ = ["CallbackDiffusers"]

logger = logging.getLogger("omni_stream.models.diffusers")

_MAX_PROMPT_CHARS = 10_000
_MAX_SIDE = 8192
_MAX_FRAMES = 2048
_DEFAULT_STEPS = 50

# Arguments this adapter sets itself on every call; call_kwargs may not.
_RESERVED = frozenset(
    {
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "output_type",
        "return_dict",
        # One request is one output, drawn from its own seeded generator.
        "generator",
        "num_images_per_prompt",
        "num_videos_per_prompt",
    }
)

#: The input images a pipeline's ``__call__`` may take, and what each is.
_IMAGE_ARGS: dict[str, str] = {
    "image": "input image (img2img, inpaint; a ControlNet pipeline's control image)",
    "mask_image": "inpaint mask, white where to paint",
    "control_image": "ControlNet conditioning image (img2img and inpaint ControlNet pipelines)",
}

# Pipelines that cannot run without an input image although their signature
# defaults ``image`` to None (the ones taking ``strength`` are caught too).
_NEEDS_IMAGE = re.compile(
    r"Img2Img|ImageToImage|Image2Image|ImageToVideo|Image2Video|Inpaint|ControlNet|Edit"
)


@dataclass
class _State:
    kwargs: dict[str, Any]  # for pipe(...); the callback and output_type are added by run()
    total: int
    output: str  # "image" or "latent"
    unpack: Callable[[torch.Tensor], torch.Tensor] | None  # packed [1, seq, ch] -> [1, C, (T,) h, w]
    sampler: str = samplers.DEFAULT
    loras: LoraSet = ()
    images: int = 1  # num_images_per_prompt


class CallbackDiffusers(Diffusers):
    """A diffusers pipeline run whole per request, streamed from its step callback."""

    name = "diffusers"
    mode = "callback"
    runs_whole_requests = True
    max_batch_size = 1

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        """Never: the request's state lives inside ``pipe(...)``'s own loop, out of reach between steps.

        Its requests are not paused, and after a crash restart from step 0.
        """
        return False

    def __init__(
        self,
        pipe: Any,
        *,
        mode: str = "callback",
        defaults: Mapping[str, Any] | None = None,
        name: str | None = None,
        call_kwargs: Mapping[str, Any] | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_image_bytes: int = MAX_IMAGE_BYTES,
        image_paths: bool = True,
        max_images: int = DEFAULT_MAX_IMAGES,
    ) -> None:
        """Wrap ``pipe``, any pipeline whose ``__call__`` takes ``callback_on_step_end``.

        ``defaults`` overrides param defaults (``{"steps": 30}``).
        ``call_kwargs`` are fixed arguments of every call (``prompt_embeds``,
        ``max_sequence_length``, ...); an argument fixed there is no longer a
        request param (``prompt_embeds`` replaces ``prompt``,
        ``negative_prompt_embeds`` ``negative_prompt``). ``max_image_pixels``
        and ``max_image_bytes`` bound the ``image`` param; ``image_paths=False``
        accepts data URLs only (see :mod:`.inputs`). ``max_images`` bounds
        ``num_images`` (the pipeline's ``num_images_per_prompt``), declared
        for image pipelines that take it.

        Raises ParamsError for a pipeline without ``callback_on_step_end`` or
        ``output_type``, ``call_kwargs`` that the pipeline does not take or
        that this adapter sets itself, bad bounds or bad ``defaults``.
        """
        if mode not in ("auto", "callback"):  # "auto": Diffusers(pipe) picked this adapter
            raise ParamsError(
                f"CallbackDiffusers runs in mode 'callback', got {mode!r}",
                field="mode",
            )
        kind = type(pipe).__name__
        if not takes_step_callback(pipe):
            raise ParamsError(
                f"{kind}.__call__ takes no callback_on_step_end; callback mode needs it",
                field="pipe",
            )
        signature = inspect.signature(pipe.__call__).parameters
        named = {
            k
            for k, p in signature.items()
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        }
        if "output_type" not in named:
            raise ParamsError(
                f"{kind}.__call__ takes no output_type; callback mode needs it",
                field="pipe",
            )
        tensor_inputs = getattr(pipe, "_callback_tensor_inputs", None)
        if tensor_inputs is not None and "latents" not in tensor_inputs:
            raise ParamsError(f"{kind} does not pass 'latents' to its step callback", field="pipe")
        fixed = dict(call_kwargs or {})
        if bad := sorted(set(fixed) & _RESERVED):
            raise ParamsError(
                f"call_kwargs may not set {bad}: the callback adapter sets them per request",
                field="call_kwargs",
            )
        if unknown := sorted(set(fixed) - named):
            raise ParamsError(
                f"call_kwargs: {kind}.__call__ takes no {unknown}",
                field="call_kwargs",
            )
        bounds = {"max_image_pixels": max_image_pixels, "max_image_bytes": max_image_bytes}
        for bound, value in bounds.items():
            positive_int(value, bound)

        self._max_images = checked_max_images(max_images)
        self._pipe = pipe
        self._signature = signature
        self._fixed = fixed
        self._max_image_pixels = max_image_pixels
        self._max_image_bytes = max_image_bytes
        self._image_paths = bool(image_paths)
        self._template = getattr(pipe, "scheduler", None)
        self._sampler_table: tuple[samplers.Sampler, ...] = ()
        self._samplers = self._offer_samplers()
        #: (the scheduler run() put on the pipeline for a request's sampler, the pipeline's own).
        self._lent: tuple[Any, Any] | None = None
        self._swap = threading.Lock()
        self._loras = LoraBank(pipe)
        self._video = "num_frames" in named
        #: Whether the output is a video ``[T, 3, H, W]`` (the server picks output formats by it):
        #: the video pipelines are the ones taking ``num_frames``.
        self.produces_video = self._video
        self.name = name or "diffusers"
        # (param name, pipeline argument) for each declared param; start() maps them.
        self._args: dict[str, str] = {}
        self.params = self._declare(defaults)
        declared = {p.name for p in self.params}
        #: The input-image params it declares (``image``, ``mask_image``,
        #: ``control_image``): core/inputs.py checks their headers, validate decodes them.
        self.image_params = tuple(n for n in _IMAGE_ARGS if n in declared)
        # Which of them a request must give: the pipeline cannot run without them
        # although its signature may default them to None.
        self._required_images = {
            name
            for name in self.image_params
            if signature[name].default is inspect.Parameter.empty
            or (name == "image" and ("strength" in named or bool(_NEEDS_IMAGE.search(kind))))
            # Flux's Fill and Control pipelines take them too (defaulting them to None).
            or (name == "mask_image" and ("Inpaint" in kind or "Fill" in kind))
            or (name == "control_image" and "Control" in kind)
        }
        self._unpack_kind = _unpack_kind(pipe)
        self.preview_decoder: str | None = _preview_decoder(pipe)
        self._counts: dict[tuple[int, float | None, str], int] = {}

    @property
    def sampler_names(self) -> tuple[str, ...]:
        """The names ``sampler`` takes (empty for a pipeline without a scheduler)."""
        return (samplers.DEFAULT, *self._samplers) if self._samplers is not None else ()

    def _offer_samplers(self) -> dict[str, samplers.Sampler] | None:
        """The table entries that can stand in for the pipeline's scheduler; None without one.

        The pipeline's ``__call__`` runs the loop, so only what it hands its
        scheduler can be checked: a flow-matching pipeline (Flux, SD3,
        Qwen-Image, Wan) passes ``sigmas`` and ``mu`` where its scheduler takes
        them, so a sampler must take those too; each is also set up and
        stepped through a few steps.
        """
        template = self._template
        if template is None or not all(hasattr(template, a) for a in ("set_timesteps", "config", "step")):
            return None
        config = template.config
        flow = (
            type(template).__name__.startswith("FlowMatch")
            or config.get("prediction_type", None) == "flow_prediction"
            or bool(config.get("use_flow_sigmas", False))
        )
        needed = signature_params(template.set_timesteps) & {"sigmas", "mu"} if flow else frozenset()

        def works(sampler: samplers.Sampler) -> bool:
            try:
                if not needed <= signature_params(samplers.build(sampler, config).set_timesteps):
                    return False
                timestep_count(lambda n: self._throwaway_scheduler(n, sampler), 4, self.name)
            except Exception:  # noqa: BLE001 - whatever the class raises, it is not offered
                return False
            return True

        table = samplers.FLOW if flow else samplers.NOISE
        self._sampler_table = table  # validate's refusal of a sampler whose package is missing
        return {s.name: s for s in samplers.offered(table, works)}

    # -- declarations and checks (event loop) --------------------------------

    def _literal(self, arg: str, kinds: tuple[type, ...]) -> Any:
        """The pipeline's default for ``arg`` when it is a literal of ``kinds``, else None."""
        default = self._signature[arg].default
        if isinstance(default, bool) or not isinstance(default, kinds):
            return None
        if float in kinds and isinstance(default, (int, float)):
            return float(default)
        return default

    def _declare(self, defaults: Mapping[str, Any] | None) -> tuple[Param, ...]:
        def takes(arg: str) -> bool:
            return arg in self._signature and arg not in self._fixed

        params: list[Param] = []

        def add(param: Param, arg: str) -> None:
            params.append(param)
            self._args[param.name] = arg

        if takes("prompt") and "prompt_embeds" not in self._fixed:
            add(Param("prompt", "str", "", "text prompt", max_len=_MAX_PROMPT_CHARS), "prompt")
        if takes("negative_prompt") and "negative_prompt_embeds" not in self._fixed:
            add(
                Param(
                    "negative_prompt",
                    "str",
                    "",
                    "what to steer away from (with guidance)",
                    max_len=_MAX_PROMPT_CHARS,
                ),
                "negative_prompt",
            )
        if takes("num_inference_steps"):
            steps = self._literal("num_inference_steps", (int,)) or _DEFAULT_STEPS
            add(
                Param("steps", "int", steps, "denoise steps (num_inference_steps)", minimum=1, maximum=1000),
                "num_inference_steps",
            )
        if takes("guidance_scale"):
            add(
                Param(
                    "guidance_scale",
                    "float",
                    self._literal("guidance_scale", (int, float)),
                    "classifier-free guidance scale",
                    minimum=0.0,
                    maximum=100.0,
                ),
                "guidance_scale",
            )
        if takes("true_cfg_scale"):
            # Qwen-Image's classifier-free guidance (on with a negative prompt);
            # its guidance_scale is for guidance-distilled checkpoints.
            add(
                Param(
                    "true_cfg_scale",
                    "float",
                    self._literal("true_cfg_scale", (int, float)),
                    "true classifier-free guidance scale (with a negative prompt)",
                    minimum=0.0,
                    maximum=100.0,
                ),
                "true_cfg_scale",
            )
        if "generator" in self._signature:
            add(seed_param("seed of the request's CPU generator"), "generator")
        if "num_images_per_prompt" in self._signature and not self._video:
            add(images_param(self._max_images), "num_images_per_prompt")
        if self._samplers is not None and "scheduler" not in self._fixed:
            # Not a pipeline argument: run() puts the request's scheduler on the pipeline.
            add(
                Param(
                    "sampler",
                    "str",
                    samplers.DEFAULT,
                    f"the scheduler: default is the pipeline's own ({type(self._template).__name__}); "
                    "the others by their AUTOMATIC1111 / ComfyUI names",
                    choices=self.sampler_names,
                ),
                "",
            )
        sides = [s for s in ("height", "width") if takes(s)]
        for side in sides:
            add(
                Param(
                    side,
                    "int",
                    self._literal(side, (int,)),
                    f"{side} in pixels",
                    minimum=8,
                    maximum=_MAX_SIDE,
                ),
                side,
            )
        if len(sides) == 2:
            add(
                Param(
                    "size",
                    "int",
                    None,
                    "height and width in pixels, both at once",
                    minimum=8,
                    maximum=_MAX_SIDE,
                ),
                "",
            )
        if takes("num_frames"):
            add(
                Param(
                    "num_frames",
                    "int",
                    self._literal("num_frames", (int,)),
                    "video frames",
                    minimum=1,
                    maximum=_MAX_FRAMES,
                ),
                "num_frames",
            )
        if takes("strength"):
            add(
                Param(
                    "strength",
                    "float",
                    self._literal("strength", (int, float)),
                    "how far from the input image: 1 starts from pure noise",
                    minimum=0.0,
                    maximum=1.0,
                ),
                "strength",
            )
        where = "a data:image/png;base64 or data:image/jpeg;base64 URL" + (
            ", or a PNG/JPEG file path" if self._image_paths else ""
        )
        for name, what in _IMAGE_ARGS.items():
            if takes(name):
                add(Param(name, "str", None, f"{what}: {where}"), name)
        return with_defaults(params, defaults, self.name)

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params with defaults filled in, each input image decoded to an RGB PIL image.

        Raises ParamsError naming the field: a bad value, ``size`` given with
        a different ``height``/``width``, a missing or bad input image, bad
        ``loras``, or steps (and strength) that leave no step to run.
        """
        images: dict[str, Any] = {}
        if self.image_params and isinstance(params, Mapping):
            # Param kinds have no image: take them out, check them here.
            params = dict(params)
            images = {name: params.pop(name, None) for name in self.image_params}
        params, loras = split_loras(samplers.with_canonical(params))
        if "sampler" in self._args:
            samplers.check_installed(params, self._sampler_table, model=self.name)
        out = super().validate(params)
        # A1111's <lora:NAME:WEIGHT> in the prompt is a `loras` entry (every door gets it here).
        prompt, out["loras"] = check_request_loras(out.get("prompt"), loras, self.lora_names, model=self.name)
        if "prompt" in out:
            out["prompt"] = prompt
        if "size" in self._args:
            square_size(out, params, model=self.name)
        for name in self.image_params:
            image = images.get(name)
            if image is None:
                image = out[name]  # a default from defaults=
            if image is None and name in self._required_images:
                raise ParamsError(
                    f"{self.name} param {name!r} is required: {type(self._pipe).__name__} needs "
                    f"its {_IMAGE_ARGS[name]} (a data:image/png;base64 URL"
                    + (" or a file path)" if self._image_paths else ")"),
                    field=name,
                )
            out[name] = (
                None
                if image is None
                else load_image(
                    image,
                    field=name,
                    max_pixels=self._max_image_pixels,
                    max_bytes=self._max_image_bytes,
                    allow_paths=self._image_paths,
                )
            )
        self.total_steps(out)
        return out

    def _value(self, params: Mapping[str, Any], name: str, arg: str) -> Any:
        """A request's value for pipeline argument ``arg``: its param, or the fixed call kwarg."""
        if name in self._args:
            return params.get(name)
        return self._fixed.get(arg)

    def total_steps(self, params: Mapping[str, Any]) -> int:
        """How many times the step callback fires (see the module docstring).

        Raises ParamsError (``steps`` or ``strength``) when the scheduler
        rejects the step count or no step is left to run.
        """
        steps = self._value(params, "steps", "num_inference_steps")
        steps = _DEFAULT_STEPS if steps is None else int(steps)
        strength = self._value(params, "strength", "strength")
        strength = None if strength is None else float(strength)
        # The pipeline's scheduler as it is now: a user may swap it (say, to
        # Heun, which fires the callback twice a step) after wrapping. Not
        # while run() has a request's sampler on it: that one is the running
        # request's, and the pipeline's own is what run() puts back.
        with self._swap:
            template, lent = getattr(self._pipe, "scheduler", None), self._lent
        if lent is not None and template is lent[0]:
            template = lent[1]
        if template is not self._template:
            self._template = template
            self._counts.clear()
        sampler = str(params.get("sampler") or samplers.DEFAULT)
        key = (steps, strength, sampler)
        count = self._counts.get(key)
        if count is None:
            count = self._count(steps, strength, sampler)
            if len(self._counts) > 4096:  # strengths are floats: keep the cache bounded
                self._counts.clear()
            self._counts[key] = count
        return count

    def _count(self, steps: int, strength: float | None, sampler: str = samplers.DEFAULT) -> int:
        entry = self._sampler(sampler)
        scheduler = self._throwaway_scheduler(steps, entry)
        count = steps
        if scheduler is not None:
            # Also runs a throwaway through every step: a count set_timesteps
            # takes may still fail inside the pipeline's loop (loop.timestep_count).
            count = timestep_count(lambda n: self._throwaway_scheduler(n, entry), steps, self.name)
        if strength is not None:
            count = self._strength_count(scheduler, steps, strength)
            if count < 1:
                raise ParamsError(
                    f"{self.name}: strength {strength:g} with {steps} steps leaves no denoise step "
                    "(the pipeline runs min(int(steps * strength), steps)); raise either",
                    field="strength",
                )
        if count < 1:
            raise ParamsError(
                f"{self.name} param 'steps': no timesteps for {steps} steps",
                field="steps",
            )
        return count

    def _sampler(self, name: str) -> samplers.Sampler | None:
        """The table entry of sampler ``name``; None for ``default`` (the pipeline's own)."""
        if name == samplers.DEFAULT or not self._samplers:
            return None
        return self._samplers[name]

    def _throwaway_scheduler(self, steps: int, sampler: samplers.Sampler | None = None) -> Any | None:
        # A copy of the pipeline's scheduler (or of the request's sampler's),
        # on the CPU: the pipeline's own is the running request's, mutated by
        # its call on the producer thread.
        template = self._template
        if template is None or not hasattr(template, "set_timesteps") or not hasattr(template, "config"):
            return None
        if sampler is not None:
            scheduler = samplers.build(sampler, template.config)
        else:
            scheduler = type(template).from_config(template.config)
        kwargs: dict[str, Any] = {}
        if (
            getattr(scheduler.config, "use_dynamic_shifting", False)
            and "mu" in inspect.signature(scheduler.set_timesteps).parameters
        ):
            kwargs["mu"] = 1.0  # the pipeline computes mu from the image size; the count ignores it
        try:
            scheduler.set_timesteps(steps, **kwargs)
        except ValueError as exc:
            raise ParamsError(f"{self.name} param 'steps': {exc}", field="steps") from None
        return scheduler

    def _strength_count(self, scheduler: Any, steps: int, strength: float) -> int:
        """Timesteps an img2img pipeline keeps for ``strength``: its own ``get_timesteps`` rule."""
        get = inspect.getattr_static(type(self._pipe), "get_timesteps", None)
        if scheduler is not None and inspect.isfunction(get):
            names = list(inspect.signature(get).parameters)[1:]
            if names[:2] == ["num_inference_steps", "strength"] and set(names[2:]) <= {
                "device",
                "denoising_start",
            }:
                # Run the pipeline's rule against the throwaway scheduler: SD
                # truncates steps * strength, Flux rounds t_start instead.
                proxy = types.SimpleNamespace(scheduler=scheduler, denoising_start=None)
                extra = {"device": "cpu"} if "device" in names else {}
                try:
                    timesteps, _ = get(proxy, steps, strength, **extra)
                    return len(timesteps)
                except (AttributeError, TypeError):
                    logger.debug(
                        "%s.get_timesteps needs more than a scheduler; using SD's rule",
                        type(self._pipe).__name__,
                    )
        # diffusers' StableDiffusionImg2ImgPipeline.get_timesteps.
        init = min(int(steps * strength), steps)
        t_start = max(steps - init, 0)
        if scheduler is None:
            return steps - t_start
        return len(scheduler.timesteps[t_start * scheduler.order :])

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """None: the pipeline runs one request per call, never batched."""
        return None

    # -- producer thread -------------------------------------------------------

    def load(self, device: torch.device) -> None:
        """Move the pipeline to ``device`` unless it computes there already or is offloaded."""
        pipe = self._pipe
        current = getattr(pipe, "device", None)
        if not isinstance(current, torch.device) or not hasattr(pipe, "to") or _offloaded(pipe):
            return  # accelerate's hooks move offloaded modules themselves
        if not same_device(current, device):
            pipe.to(device)

    def start(self, params: Mapping[str, Any], device: torch.device) -> _State:
        """The arguments of this request's ``pipe(...)`` call (nothing runs yet)."""
        kwargs = dict(self._fixed)
        for name, arg in self._args.items():
            value = params.get(name)
            if value is None or not arg:
                continue
            if name == "seed":
                value = torch.Generator(device="cpu").manual_seed(int(value))
            elif name == "negative_prompt" and value == "":
                # As if not given: Qwen-Image turns true CFG on for any negative prompt.
                continue
            kwargs[arg] = value
        output = params.get("output", "image")
        return _State(
            kwargs=kwargs,
            total=self.total_steps(params),
            output=output,
            unpack=self._unpacker(kwargs),
            sampler=str(params.get("sampler") or samplers.DEFAULT),
            loras=tuple(params.get("loras", ())),
            images=int(params.get("num_images", 1)),
        )

    def step(self, states: Sequence[Any]) -> Sequence[torch.Tensor]:
        """Never called: the engine calls :meth:`run`. Raises RuntimeError."""
        raise RuntimeError("CallbackDiffusers runs whole requests: the engine calls run(), not step()")

    def run(self, state: _State, emit: Emit) -> None:
        """Call the pipeline once, emitting each step's latents and then the output.

        ``RequestStopped`` from ``emit`` propagates out of the pipeline's loop.
        Raises RuntimeError when the callback fires more or fewer times than
        ``total_steps`` said, or the output is not an image or video tensor;
        whatever the pipeline raises.
        """
        pipe = self._pipe
        fired = 0
        last: torch.Tensor | None = None

        def on_step_end(_pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            nonlocal fired, last
            fired += 1
            if fired > state.total:
                raise RuntimeError(
                    f"{type(pipe).__name__} ran more than the {state.total} steps total_steps "
                    "predicted; see CallbackDiffusers' step-count rule"
                )
            if fired < state.total:
                emit(self._frame(state, tensors["latents"]))
            elif state.output == "latent":
                # The last step's latents are the output, emitted once the call returns.
                last = self._frame(state, tensors["latents"])
            return tensors

        self._loras.activate(state.loras)
        entry = self._sampler(state.sampler)
        own = getattr(pipe, "scheduler", None)
        if entry is not None and own is not None:
            # This request's scheduler on the pipeline for its call; the
            # pipeline's own back after it (one call at a time: it is ours).
            lent = samplers.build(entry, own.config)
            with self._swap:  # total_steps, on the event loop meanwhile, reads both
                self._lent = (lent, own)
                pipe.scheduler = lent
        try:
            with torch.no_grad():
                out = pipe(
                    **state.kwargs,
                    callback_on_step_end=on_step_end,
                    callback_on_step_end_tensor_inputs=["latents"],
                    output_type="latent" if state.output == "latent" else "pt",
                    return_dict=True,
                )
        except BaseException:
            _reset_after_abort(pipe)
            raise
        finally:
            if entry is not None and own is not None:
                with self._swap:
                    pipe.scheduler = own
                    self._lent = None
        if fired != state.total:
            raise RuntimeError(
                f"{type(pipe).__name__} ran {fired} steps, total_steps predicted {state.total}"
            )
        if last is not None:
            emit(last)
        else:
            emit(self._decoded(out, state.images), decoded=True)

    def close(self, state: _State) -> None:
        """Drop the request's arguments (its image, its generator)."""
        state.kwargs = {}
        state.unpack = None

    # -- frames -------------------------------------------------------------------

    def _frame(self, state: _State, latents: torch.Tensor) -> torch.Tensor:
        if state.unpack is not None and latents.dim() == 3:
            try:
                latents = state.unpack(latents)
            except (RuntimeError, ValueError) as exc:
                # Sizes guessed wrong: keep this request's frames packed, all of them.
                logger.warning(
                    "cannot unpack %s latents %s (%s); streaming them packed",
                    type(self._pipe).__name__,
                    tuple(latents.shape),
                    exc,
                )
                state.unpack = None
        # One image: [C, h, w]; several (num_images): all of them, [n, C, h, w].
        frame = latents[0] if state.images == 1 else latents
        if not self._video and frame.dim() == 4 + (state.images > 1) and frame.shape[-3] == 1:
            frame = frame.squeeze(-3)  # Qwen-Image: an image is a one-frame video latent
        # A fresh tensor: the copier reads it while the pipeline goes on, and
        # schedulers may update their latents in place.
        return frame.clone()

    def _unpacker(self, kwargs: Mapping[str, Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How to unpack this request's packed latents, or None to stream them as they are."""
        pipe, kind = self._pipe, self._unpack_kind
        if kind is None:
            return None
        unpack = type(pipe)._unpack_latents
        height, width = kwargs.get("height"), kwargs.get("width")
        if kind == "image":
            if height is None and width is None and "image" not in kwargs:
                # Flux and Qwen-Image fall back to their default sample size.
                side = getattr(pipe, "default_sample_size", None)
                factor = getattr(pipe, "vae_scale_factor", None)
                if isinstance(side, int) and isinstance(factor, int):
                    height = width = side * factor
            factor = getattr(pipe, "vae_scale_factor", None)
            if height is None or width is None or not isinstance(factor, int):
                return None
            return lambda x: unpack(x, height, width, factor)
        # LTX: sizes in latent units, patch sizes from the pipeline.
        frames = kwargs.get("num_frames", self._literal("num_frames", (int,)) if self._video else None)
        attrs = [
            getattr(pipe, a, None)
            for a in (
                "vae_temporal_compression_ratio",
                "vae_spatial_compression_ratio",
                "transformer_spatial_patch_size",
                "transformer_temporal_patch_size",
            )
        ]
        if height is None or width is None or frames is None or not all(isinstance(a, int) for a in attrs):
            return None
        temporal, spatial, patch, patch_t = attrs
        sizes = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        return lambda x: unpack(x, *sizes, patch, patch_t)

    def _decoded(self, out: Any, images: int = 1) -> torch.Tensor:
        """The pipeline's ``output_type="pt"`` result as a frame: floats in [-1, 1] (all
        ``images`` of them, stacked, for several)."""
        video = hasattr(out, "frames")
        result = out.frames if video else getattr(out, "images", None)
        if isinstance(result, (list, tuple)) and result and isinstance(result[0], torch.Tensor):
            result = torch.stack(list(result))
        elif result is not None and not isinstance(result, torch.Tensor):
            try:
                import numpy as np

                if isinstance(result, np.ndarray):
                    result = torch.from_numpy(result)
            except ImportError:  # pragma: no cover - numpy comes with torch
                pass
        if not isinstance(result, torch.Tensor):
            raise RuntimeError(
                f"{type(self._pipe).__name__} returned {type(result).__name__} for output_type='pt', "
                "not a tensor"
            )
        want = 5 if video else 4  # [B, T, C, H, W] / [B, C, H, W]
        if result.dim() != want or result.shape[0] != images or result.shape[-3] not in (1, 3, 4):
            raise RuntimeError(
                f"{type(self._pipe).__name__} returned {'frames' if video else 'images'} shaped "
                f"{tuple(result.shape)}; expected [{images}, {'T, ' if video else ''}C, H, W]"
            )
        # pt output is (x / 2 + 0.5).clamp(0, 1) of the VAE's image: map it back.
        return (result[0] if images == 1 else result).float() * 2.0 - 1.0


def _unpack_kind(pipe: Any) -> str | None:
    """Which ``_unpack_latents`` signature the pipeline has: "image", "video" or None."""
    fn = inspect.getattr_static(type(pipe), "_unpack_latents", None)
    if not isinstance(fn, staticmethod):
        return None
    names = list(inspect.signature(fn.__func__).parameters)
    if names == ["latents", "height", "width", "vae_scale_factor"]:
        return "image"  # Flux, Qwen-Image, Chroma: pixel sizes
    if names == ["latents", "num_frames", "height", "width", "patch_size", "patch_size_t"]:
        return "video"  # LTX: latent sizes and patch sizes
    return None


def _preview_decoder(pipe: Any) -> str | None:
    """The preview decoder that fits the pipeline's latent frames, where it is plain."""
    kind = type(pipe).__name__
    unet = getattr(pipe, "unet", None)
    vae = getattr(pipe, "vae", None)
    channels = getattr(getattr(vae, "config", None), "latent_channels", None)
    if unet is not None and channels == 4:
        return "sdxl" if getattr(unet.config, "addition_embed_type", None) == "text_time" else "sd15"
    if kind.startswith("StableDiffusion3"):
        return "sd3"
    if kind.startswith("Flux") and not kind.startswith("Flux2"):
        return "flux"
    return None


def _offloaded(pipe: Any) -> bool:
    if getattr(pipe, "_all_hooks", None):
        return True
    components = getattr(pipe, "components", None) or {}
    return any(hasattr(m, "_hf_hook") for m in components.values() if isinstance(m, torch.nn.Module))


def _reset_after_abort(pipe: Any) -> None:
    """Undo what a ``pipe(...)`` stopped mid-loop leaves behind.

    Each call resets ``_interrupt`` and its timestep itself, but the end of
    ``__call__`` also resets stateful denoiser hooks (caches) and re-arms CPU
    offload (``maybe_free_model_hooks``); a stopped call never got there.
    """
    for attr, value in (("_interrupt", False), ("_current_timestep", None)):
        if hasattr(pipe, attr):
            setattr(pipe, attr, value)
    free = getattr(pipe, "maybe_free_model_hooks", None)
    if callable(free):
        try:
            free()
        except Exception as exc:  # the abort's own error matters more
            logger.warning("maybe_free_model_hooks after a stopped call raised %r", exc)
