"""``Diffusers(pipe)``: picks the adapter that streams a pipeline, and what they share.

Two ways to stream a diffusers pipeline:

native
    The adapter rebuilds the pipeline's denoise loop from its components, one
    iteration per engine ``step``: requests batch across each other and give
    bit for bit the latents of ``pipe(...)`` (one torch thread). The loop is
    :mod:`.native`'s; the adapters hold what their pipelines do their own
    way: UNet pipelines (SD 1.x/2.x, SDXL: :mod:`.unet`), SD3/SD3.5
    (:mod:`.sd3`) and Flux (:mod:`.flux`), the last two on :mod:`.flow`.
callback
    Any other ``DiffusionPipeline`` whose ``__call__`` takes
    ``callback_on_step_end`` (:mod:`.callback`): ``pipe(...)`` itself runs on
    the producer thread, one request at a time, and each step's latents are
    emitted from the callback.

``Diffusers(pipe, mode="auto")`` returns the native adapter where one exists
and the callback adapter otherwise; ``mode="native"`` or ``"callback"``
insists. Every adapter is a subclass of :class:`Diffusers`, so
``isinstance(model, Diffusers)`` holds and ``model.mode`` says which.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ParamsError
from ...model import StepModel
from ...params import MAX_IMAGES, images_param, positive_int
from .file_hashes import model_hash
from .loras import LoraBank

if TYPE_CHECKING:
    from .single_file import ConfigSource

__all__ = ["Diffusers", "PromptEmbeddings", "EncodePrompt", "MODES", "INSTALL_HINT", "adapter_for"]

INSTALL_HINT = 'the diffusers adapter needs the diffusers extra: pip install "omni-stream[diffusers]"'

#: The values of ``Diffusers(..., mode=)``.
MODES = ("auto", "native", "callback")

# (module, class) of the native adapters, tried in order; each class has a
# ``fits(pipe) -> bool`` static method that decides without importing more
# than diffusers itself.
_NATIVE = (
    ("unet", "UNetDiffusers"),
    ("sd3", "SD3Diffusers"),
    ("flux", "FluxDiffusers"),
)


@dataclass(frozen=True, slots=True)
class PromptEmbeddings:
    """One prompt's text conditioning, the way the denoiser consumes it.

    ``prompt_embeds`` is ``[1, seq, dim]`` (the leading 1 may be left out);
    ``negative_prompt_embeds`` has the same shape and is needed whenever a
    request uses classifier-free guidance (``guidance_scale > 1``). SDXL,
    SD3 and Flux also take the pooled embeddings, ``[1, dim]`` (or ``[dim]``).
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None


#: ``encode_prompt(prompt, negative_prompt) -> PromptEmbeddings``; runs on the producer thread.
EncodePrompt = Callable[[str, str], PromptEmbeddings]


def _adapter_class(module: str, name: str) -> type[Diffusers]:
    adapter: type[Diffusers] = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return adapter


def takes_step_callback(pipe: Any) -> bool:
    """Whether ``pipe.__call__`` accepts ``callback_on_step_end`` (callback mode needs it)."""
    if not callable(pipe):
        return False
    try:
        return "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        return False


def adapter_for(pipe: Any, mode: str = "auto") -> type[Diffusers]:
    """The adapter class that streams ``pipe`` in ``mode``; raises ParamsError when none does."""
    if mode not in MODES:
        raise ParamsError(f"mode must be one of {', '.join(MODES)}, got {mode!r}", field="mode")
    kind = type(pipe).__name__
    if mode in ("auto", "native"):
        for module, name in _NATIVE:
            cls = _adapter_class(module, name)
            if cls.fits(pipe):
                return cls
        if mode == "native":
            raise ParamsError(
                f"{kind} has no native adapter; native mode drives UNet pipelines (SD 1.x/2.x, "
                "SDXL), StableDiffusion3Pipeline and FluxPipeline; use mode='callback' "
                "for other pipelines",
                field="mode",
            )
    if takes_step_callback(pipe):
        return _adapter_class("callback", "CallbackDiffusers")
    raise ParamsError(
        f"{kind} cannot be streamed: it has no native adapter and its __call__ takes no "
        "callback_on_step_end (callback mode needs it)",
        field="pipe",
    )


#: The most images one request may ask for by default (``num_images``).
DEFAULT_MAX_IMAGES = 4


def checked_max_images(max_images: Any) -> int:
    """``max_images``, checked: 1 to :data:`~omni_stream.params.MAX_IMAGES` (ParamsError)."""
    positive_int(max_images, "max_images")
    if max_images > MAX_IMAGES:
        raise ParamsError(f"max_images must be at most {MAX_IMAGES}, got {max_images}", field="max_images")
    return int(max_images)


class Diffusers(StepModel):
    """A diffusers pipeline, streamed step by step (``Diffusers(pipe, mode="auto")``).

    Calling ``Diffusers(pipe, **options)`` returns the adapter subclass that
    fits ``pipe`` (see the module docstring); the options are that adapter's.
    """

    name = "diffusers"
    #: "native" or "callback": how this adapter streams its pipeline.
    mode: str = "native"
    #: The LoRAs loaded into the pipeline; each adapter makes its own in __init__.
    _loras: LoraBank

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRAs a request may name in ``loras`` (loaded with :meth:`load_loras`)."""
        return self._loras.names

    def load_loras(self, loras: Mapping[str, Any]) -> None:
        """Load ``{name: path}`` LoRAs into the pipeline (diffusers' ``load_lora_weights``,
        through peft), before the engine starts: on the caller's thread. Raises ValueError
        naming the LoRA that fails, ImportError without peft."""
        self._loras.load(loras)

    def set_max_images(self, max_images: int) -> None:
        """Let a request ask for up to ``max_images`` images (``num_images``), before the engine
        starts. Raises ParamsError for a bad count or a model that makes one image a request."""
        max_images = checked_max_images(max_images)
        for i, param in enumerate(self.params):
            if param.name == "num_images":
                if param.default > max_images:
                    raise ParamsError(
                        f"max_images {max_images} is below num_images' default {param.default}",
                        field="max_images",
                    )
                # The default (a model's defaults= may set it) stays.
                new = dataclasses.replace(images_param(max_images), default=param.default)
                self.params = (*self.params[:i], new, *self.params[i + 1 :])
                self._max_images = max_images
                return
        raise ParamsError(f"{self.name} makes one image a request (it has no num_images)", field="max_images")

    def __new__(cls, pipe: Any = None, *args: Any, mode: str = "auto", **kwargs: Any) -> Diffusers:
        if cls is Diffusers:
            try:
                import diffusers  # noqa: F401
            except ImportError as exc:
                raise ImportError(INSTALL_HINT) from exc
            cls = adapter_for(pipe, mode)
        return super().__new__(cls)

    @staticmethod
    def fits(pipe: Any) -> bool:
        """Whether this adapter drives ``pipe`` natively (each native adapter answers)."""
        return False

    @classmethod
    def from_pretrained(
        cls,
        model_id: str,
        *,
        torch_dtype: torch.dtype | None = None,
        mode: str = "auto",
        **pipeline_kwargs: Any,
    ) -> Diffusers:
        """Load ``model_id`` (a hub id or a folder) with ``DiffusionPipeline.from_pretrained`` and wrap it.

        Raises ImportError without diffusers, and whatever diffusers raises
        for a model it cannot load; ParamsError as :class:`Diffusers` does.
        """
        try:
            from diffusers import DiffusionPipeline
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        if torch_dtype is not None:
            pipeline_kwargs["torch_dtype"] = torch_dtype
        pipe = DiffusionPipeline.from_pretrained(model_id, **pipeline_kwargs)
        # A served pipeline would draw one tqdm bar per request on stderr.
        pipe.set_progress_bar_config(disable=True)
        if cls is Diffusers:
            # What Diffusers(pipe, mode=mode) does: the adapter that fits.
            return adapter_for(pipe, mode)(pipe, mode=mode)
        return cls(pipe)

    @classmethod
    def from_single_file(
        cls,
        path: str | os.PathLike[str],
        *,
        config: ConfigSource | None = None,
        torch_dtype: torch.dtype | None = None,
        mode: str = "auto",
        **pipeline_kwargs: Any,
    ) -> Diffusers:
        """Load a single-file checkpoint (``.safetensors``: SD 1.x/2.x, SDXL, SD3, Flux) and wrap it.

        ``config`` is the diffusers folder of its architecture that ``from_single_file``
        takes the pipeline's config from, or such folders by diffusers' model type
        (:mod:`.single_file`). Sets :attr:`model_hash` (reading the file once more).
        Raises ValueError naming the file (an architecture not streamed, a pickle, no
        config offline: saying what to give), ImportError without diffusers, ParamsError
        as :class:`Diffusers` does.
        """
        try:
            import diffusers  # noqa: F401
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        from .single_file import load_pipeline

        pipe = load_pipeline(path, config=config, torch_dtype=torch_dtype, **pipeline_kwargs)
        pipe.set_progress_bar_config(disable=True)
        model = adapter_for(pipe, mode)(pipe, mode=mode) if cls is Diffusers else cls(pipe)
        # What A1111 writes as "Model hash", and so what a PNG's reader looks the file up by.
        model.model_hash = model_hash(path)
        return model

    #: The checkpoint file's hash as A1111 writes ``Model hash`` (from_single_file sets it).
    model_hash: str | None = None

    def weight_hashes(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The weights behind a request with these checked params, as a PNG's infotext names
        them (omni_stream.preview.infotext): ``{"model": hash, "loras": {name: hash}}``, each
        only where known, the LoRAs only those the request uses."""
        out: dict[str, Any] = {}
        if self.model_hash is not None:
            out["model"] = self.model_hash
        known = self._loras.hashes
        # Checked loras are ((name, scale), ...); as sent, [{"name", "scale"}, ...].
        names = [e.get("name") if isinstance(e, Mapping) else e[0] for e in params.get("loras") or ()]
        used = {name: known[name] for name in names if name in known}
        if used:
            out["loras"] = used
        return out

    def unload(self) -> None:
        """Move the pipeline back to the CPU (``load`` moves it to the device again) and let the
        accelerator's allocator return what it held; nothing for a pipeline on the CPU."""
        pipe = getattr(self, "_pipe", None)
        device = getattr(pipe, "device", None)
        if pipe is None or getattr(device, "type", "cpu") == "cpu":
            return
        pipe.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def describe(self) -> str:
        pipe = getattr(self, "_pipe", None)
        kind = type(pipe).__name__ if pipe is not None else "diffusers pipeline"
        return f"{kind}, {self.mode} mode"

    # -- previews by a tiny autoencoder ------------------------------------------

    #: The tiny autoencoder that decodes previews, or None (see ``use_preview_vae``).
    preview_vae: Any = None

    def use_preview_vae(self, vae: Any) -> None:
        """Decode previewed steps with ``vae``: an ``AutoencoderTiny``, or a path / model id of one.

        TAESD-family weights fit their pipelines: taesd (SD 1.x/2.x),
        taesdxl (SDXL), taesd3 (SD3), taef1 (Flux). The decode runs on the
        producer's device, only on the steps a reader previews (see
        ``Engine.stream(preview_every=)``), and its time is in
        ``Frame.timings.decode_s``. Raises ParamsError for a VAE whose latent
        channels do not fit this pipeline's latents, ImportError without
        diffusers, and what ``from_pretrained`` raises for a path it cannot load.
        """
        if isinstance(vae, str):
            try:
                from diffusers import AutoencoderTiny
            except ImportError as exc:
                raise ImportError(INSTALL_HINT) from exc
            vae = AutoencoderTiny.from_pretrained(vae)
        config = getattr(vae, "config", None)
        if config is None or not callable(getattr(vae, "decode", None)):
            raise ParamsError(
                f"preview VAE must be an AutoencoderTiny, got {type(vae).__name__}",
                field="vae",
            )
        want = self.latent_channels
        if want is not None and int(config.latent_channels) != want:
            raise ParamsError(
                f"preview VAE has {config.latent_channels} latent channels; this pipeline's latents "
                f"have {want} (taesd/taesdxl: 4, taesd3/taef1: 16)",
                field="vae",
            )
        vae.eval()
        self.preview_vae = vae

    #: Channels of this pipeline's latent frames ([C, h, w]); None when unknown.
    @property
    def latent_channels(self) -> int | None:
        vae = getattr(getattr(self, "_pipe", None), "vae", None)
        channels = getattr(getattr(vae, "config", None), "latent_channels", None)
        return int(channels) if channels is not None else None

    def decode_preview(self, state: Any, frame: torch.Tensor) -> torch.Tensor | None:
        """A previewed step through the tiny autoencoder: ``[3, H, W]`` in [-1, 1], or None without one.

        Only image latents ``[C, h, w]`` are decoded; other frames (video
        latents) are left to the linear preview decoders.
        """
        vae = self.preview_vae
        if vae is None or frame.dim() != 3:
            return None
        param = next(vae.parameters())
        if param.device != frame.device:
            # First use on the producer's device: move it here, on the
            # producer thread, like every other module of the model.
            vae.to(frame.device)
            param = next(vae.parameters())
        x = frame[None].to(dtype=param.dtype)
        # The pipelines' own rule with the tiny VAE's constants: taesd and
        # taesdxl take the denoiser's latents as they are (scale 1, shift 0);
        # taesd3 and taef1 the VAE's scale and shift.
        x = x / float(vae.config.scaling_factor) + float(getattr(vae.config, "shift_factor", 0.0) or 0.0)
        with torch.no_grad():
            image = vae.decode(x, return_dict=False)[0]
        return vae_image(image)


def vae_image(image: torch.Tensor) -> torch.Tensor:
    """A VAE's decoded batch of one, as the engine's decoded output: ``[3, H, W]`` float32 in [-1, 1].

    ``pipe(..., output_type="pt")`` returns ``(image / 2 + 0.5).clamp(0, 1)``
    of the same tensor; this is that image mapped back to [-1, 1], the range
    every RGB frame in omni_stream uses. It stays on the device: the copier
    moves it like any frame.
    """
    if image.dim() == 4:
        image = image[0]
    return image.float().clamp(-1.0, 1.0)
