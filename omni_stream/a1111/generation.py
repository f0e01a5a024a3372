"""AUTOMATIC1111's ``txt2img`` and ``img2img`` bodies as our params (pure).

:func:`parse_generation` checks a body's A1111 fields; :func:`model_params`
maps them onto the params a served model declares. The door
(``server/a1111_api.py``) submits one request for each image, one after the
other: ``n_iter`` iterations of ``batch_size`` images, as A1111 runs its
batches, each image of its own seed, as A1111's are:

=========================  ==========================================================
A1111                      ours
=========================  ==========================================================
``prompt``                 ``prompt``
``negative_prompt``        ``negative_prompt``
``steps``                  ``steps``
``cfg_scale``              ``guidance_scale`` (``guidance`` for a model that calls it so,
                           as the infotext's ``CFG scale`` does)
``width``, ``height``      ``width``, ``height`` (``size`` for a model of one side;
                           the init image's size for an img2img model without them)
``seed``                   ``seed``: -1 draws one; image *j* of iteration *i* runs with
                           the first image's seed + *i* x ``batch_size`` + *j*, as A1111's
                           ``all_seeds``
``sampler_name``           ``sampler`` (``sampler_index`` when it is absent), read by
``scheduler``              ``samplers.canonical``: ``"DPM++ 2M"`` + ``"Karras"`` is
                           ``dpmpp_2m_karras``
``batch_size``             that many requests of one image an iteration, 1 to
                           :data:`MAX_BATCH_SIZE`
``n_iter``                 that many iterations, 1 to :data:`MAX_N_ITER`
``override_settings``      ``sd_model_checkpoint``: the model of this request
``init_images`` (one)      ``image``
``mask``                   ``mask_image`` (white repaints, as A1111's), blurred by
``mask_blur``              ``mask_blur_x`` and ``mask_blur_y`` (``mask_blur`` sets both;
                           each 4 by default, as A1111's; ``a1111/masks.py``)
``inpaint_full_res``       "Only masked": the mask's region, grown by
                           ``inpaint_full_res_padding``, is what the request repaints
                           (``a1111/inpaint_area.py``); A1111's API default, true
``inpainting_fill``        0 (A1111's API default): the masked pixels filled before the
                           request; 1: as they are
``denoising_strength``     ``strength`` (img2img; txt2img's is the hires fix's)
``send_images``            false: the answer carries no images
=========================  ==========================================================

What A1111 does and we do not is refused, 422 naming the field, unless the
value is the one that asks for nothing: ``enable_hr``, ``restore_faces``,
``tiling`` (true), ``styles`` (a name), ``subseed_strength`` (not 0),
``seed_resize_from_*``, ``script_name``, ``alwayson_scripts``,
``save_images``, ``refiner_checkpoint``, ``resize_mode`` (not 0: just
resize), ``inpainting_mask_invert``, ``initial_noise_multiplier`` (not 1),
k-diffusion's ``eta`` (not null, 0 or 1: what clients send by default),
``s_churn``, ``s_tmin``, ``s_tmax`` (not 0) and ``s_noise`` (not 1).
Accepted and not applied, each said in docs/a1111.md:
``inpainting_fill`` 2 and 3's latent step (their pixel fill is done),
``image_cfg_scale`` (instruct-pix2pix's), the hires fix's fields while
``enable_hr`` is false. Other fields are ignored,
as A1111's own schema ignores fields it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import MessageError, ParamsError
from ..models.diffusers import samplers
from ..params import MAX_IMAGES, SEED_MAX, Param, finite_number
from .masks import DEFAULT_MASK_BLUR, MAX_MASK_BLUR

__all__ = ["FIELDS", "MAX_BATCH_SIZE", "MAX_N_ITER", "Generation", "model_params", "parse_generation"]

#: The most iterations (``n_iter``) one call runs: A1111's UI's own bound.
MAX_N_ITER: Final = 100
#: The most images an iteration makes (``batch_size``): as many as one request may ask for.
MAX_BATCH_SIZE: Final = MAX_IMAGES
#: A1111's ``cfg_scale`` when a request names none: accepted for a model without guidance.
DEFAULT_CFG: Final = 7.0
#: A1111's img2img ``denoising_strength`` when a request names none.
DEFAULT_STRENGTH: Final = 0.75
#: A1111's API's ``inpaint_full_res``, ``inpaint_full_res_padding`` and ``inpainting_fill`` when
#: a request names none (``StableDiffusionProcessingImg2Img``'s defaults; its UI's differ: 32, 1).
DEFAULT_FULL_RES: Final = True
DEFAULT_PADDING: Final = 0
DEFAULT_FILL: Final = 0
#: ``inpainting_fill``: 0 fill, 1 original, 2 latent noise, 3 latent nothing.
MAX_FILL: Final = 3

#: Our param -> the A1111 field a client sent it as (for the core's errors, which name ours).
FIELDS: Final[Mapping[str, str]] = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "steps": "steps",
    "guidance_scale": "cfg_scale",
    "guidance": "cfg_scale",
    "seed": "seed",
    "sampler": "sampler_name",
    "width": "width",
    "height": "height",
    "size": "width",
    "image": "init_images",
    "mask_image": "mask",
    "strength": "denoising_strength",
    "model": "override_settings.sd_model_checkpoint",
}

#: Fields accepted only at values that ask for nothing (A1111's defaults and what clients
#: send by default); any other value is refused, naming the field.
_NEUTRAL: Final[Mapping[str, tuple[Any, ...]]] = {
    "enable_hr": (None, False),
    "restore_faces": (None, False),
    "tiling": (None, False),
    "subseed_strength": (None, 0),
    "seed_resize_from_h": (None, 0, -1),
    "seed_resize_from_w": (None, 0, -1),
    "script_name": (None, ""),
    "save_images": (None, False),
    "refiner_checkpoint": (None, "", "None"),
    "eta": (None, 0, 1),
    "s_churn": (None, 0),
    "s_tmin": (None, 0),
    "s_tmax": (None, 0),
    "s_noise": (None, 1),
}
_IMG2IMG_NEUTRAL: Final[Mapping[str, tuple[Any, ...]]] = {
    "resize_mode": (None, 0),
    "inpainting_mask_invert": (None, 0, False),
    "initial_noise_multiplier": (None, 1),
}
#: Why each is refused, for the message.
_WHY: Final[Mapping[str, str]] = {
    "enable_hr": "the hires fix is not run here",
    "restore_faces": "faces are not restored here",
    "tiling": "tiling is not supported",
    "subseed_strength": "variation seeds are not supported",
    "seed_resize_from_h": "seeds are not resized",
    "seed_resize_from_w": "seeds are not resized",
    "script_name": "scripts are not run here",
    "save_images": "the server saves nothing; the images come back in the answer",
    "refiner_checkpoint": "no refiner is run",
    "eta": "k-diffusion's eta is not a knob of diffusers' samplers",
    "s_churn": "k-diffusion's s_churn is not a knob of diffusers' samplers",
    "s_tmin": "k-diffusion's s_tmin is not a knob of diffusers' samplers",
    "s_tmax": "k-diffusion's s_tmax is not a knob of diffusers' samplers",
    "s_noise": "k-diffusion's s_noise is not a knob of diffusers' samplers",
    "resize_mode": "only resize_mode 0 (just resize) is done",
    "inpainting_mask_invert": "masks are not inverted: send white where to repaint",
    "initial_noise_multiplier": "the initial noise is not scaled",
}


def _bad(field: str, message: str, *, code: str = "bad_params") -> MessageError:
    return MessageError(code, f"{field}: {message}", field=field)


@dataclass(frozen=True, slots=True)
class Generation:
    """One checked A1111 ``txt2img`` / ``img2img`` body (``kind``), before a model is chosen."""

    kind: str
    prompt: str = ""
    negative_prompt: str = ""
    steps: int | None = None
    cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    #: -1: draw one (the first image's, reported back).
    seed: int = -1
    sampler: str | None = None
    scheduler: str | None = None
    batch_size: int = 1
    n_iter: int = 1
    #: ``override_settings.sd_model_checkpoint``: this request's model; None: the caller's.
    model: str | None = None
    #: The other ``override_settings``: accepted where they leave the options as they are.
    overrides: dict[str, Any] = field(default_factory=dict)
    send_images: bool = True
    #: img2img: its init image and mask, base64 (a ``data:`` URL's prefix taken off).
    init_image: str | None = None
    mask: str | None = None
    #: The mask's blur across and down (A1111's ``mask_blur_x``, ``mask_blur_y``).
    mask_blur_x: int = DEFAULT_MASK_BLUR
    mask_blur_y: int = DEFAULT_MASK_BLUR
    #: "Only masked" (A1111's ``inpaint_full_res``) and its ``inpaint_full_res_padding``.
    inpaint_full_res: bool = DEFAULT_FULL_RES
    inpaint_full_res_padding: int = DEFAULT_PADDING
    #: A1111's ``inpainting_fill``: what the masked pixels start from (0 fill, 1 original, ...).
    inpainting_fill: int = DEFAULT_FILL
    denoising_strength: float | None = None
    #: The body's fields, echoed as the answer's ``parameters`` (the images left out).
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def image_count(self) -> int:
        """The images the call makes: ``n_iter`` x ``batch_size``."""
        return self.n_iter * self.batch_size

    def seed_of(self, image: int, first: int) -> int:
        """The seed image ``image`` of the call runs with (image *j* of iteration *i* is
        *i* x ``batch_size`` + *j*), the first having run with ``first``: A1111's ``all_seeds``."""
        return first + image


def parse_generation(body: Mapping[str, Any], *, kind: str) -> Generation:
    """Check an A1111 ``txt2img`` (``kind``) or ``img2img`` body's fields (see the module docstring).

    Raises MessageError (422 ``bad_params``, ``unsupported``) naming the field.
    """
    neutral = {**_NEUTRAL, **(_IMG2IMG_NEUTRAL if kind == "img2img" else {})}
    for name, allowed in neutral.items():
        value = body.get(name)
        if not _one_of(value, allowed):
            raise _bad(name, f"{_WHY[name]}; got {value!r:.60}", code="unsupported")
    styles = body.get("styles")
    if styles:
        raise _bad("styles", f"no prompt styles are kept here; got {styles!r:.60}", code="unsupported")
    scripts = body.get("alwayson_scripts")
    if scripts:
        first = next(iter(scripts)) if isinstance(scripts, Mapping) else ""
        raise _bad(
            f"alwayson_scripts.{first}" if first else "alwayson_scripts",
            "scripts are not run here",
            code="unsupported",
        )
    overrides = _mapping(body, "override_settings")
    model = overrides.pop("sd_model_checkpoint", None)
    if model is not None and not isinstance(model, str):
        raise _bad("override_settings.sd_model_checkpoint", f"must be a model's title, got {model!r:.60}")
    sampler = _text(body, "sampler_name") or _text(body, "sampler_index")
    init_image = mask = None
    strength = None
    blur = (DEFAULT_MASK_BLUR, DEFAULT_MASK_BLUR)
    full_res, padding, fill = DEFAULT_FULL_RES, DEFAULT_PADDING, DEFAULT_FILL
    if kind == "img2img":
        images = body.get("init_images")
        if not isinstance(images, Sequence) or isinstance(images, str) or not images:
            raise _bad("init_images", "img2img needs its image: a list of one base64 image")
        if len(images) > 1:
            raise _bad("init_images", f"one init image a request, got {len(images)}", code="unsupported")
        init_image = _base64(images[0], "init_images")
        if body.get("mask") is not None:
            mask = _base64(body["mask"], "mask")
            blur = _mask_blur(body)
        full_res = _full_res(body)
        sent_padding = _integer(body, "inpaint_full_res_padding", low=0)
        padding = DEFAULT_PADDING if sent_padding is None else sent_padding
        sent_fill = _integer(body, "inpainting_fill", low=0, high=MAX_FILL)
        fill = DEFAULT_FILL if sent_fill is None else sent_fill
        strength = _number(body, "denoising_strength")
    echo = {k: v for k, v in body.items() if k not in ("init_images", "mask")}
    if kind == "img2img" and body.get("include_init_images") is True:
        echo.update(init_images=body.get("init_images"), mask=body.get("mask"))
    gen = Generation(
        kind=kind,
        prompt=_text(body, "prompt") or "",
        negative_prompt=_text(body, "negative_prompt") or "",
        steps=_integer(body, "steps", low=1),
        cfg_scale=_number(body, "cfg_scale"),
        width=_integer(body, "width", low=1),
        height=_integer(body, "height", low=1),
        seed=_seed(body.get("seed")),
        sampler=sampler,
        scheduler=_text(body, "scheduler"),
        batch_size=_integer(body, "batch_size", low=1, high=MAX_BATCH_SIZE) or 1,
        n_iter=_integer(body, "n_iter", low=1, high=MAX_N_ITER) or 1,
        model=model or None,
        overrides=overrides,
        send_images=_flag(body, "send_images", default=True),
        init_image=init_image,
        mask=mask,
        mask_blur_x=blur[0],
        mask_blur_y=blur[1],
        inpaint_full_res=full_res,
        inpaint_full_res_padding=padding,
        inpainting_fill=fill,
        denoising_strength=strength,
        echo=echo,
    )
    if gen.seed != -1 and gen.seed_of(gen.image_count - 1, gen.seed) > SEED_MAX:
        # Refused now, not at the image whose seed goes over, after the ones before it ran.
        raise _bad("seed", f"image k of the call runs with seed + k, at most {SEED_MAX}; got {gen.seed}")
    return gen


def model_params(
    gen: Generation, declared: Sequence[Param], *, model: str, image_size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """``gen``'s fields as the params of ``model`` (its ``declared`` params), without the seed and
    the images (the door adds those). ``image_size``: the init image's (width, height).

    Raises MessageError (422) naming the A1111 field a model cannot take: a
    ``negative_prompt`` or ``cfg_scale`` it has no param for, ``width``/``height`` it cannot
    make, an init image or mask for a text-to-image model, a sampler for a model of one
    scheduler, a ``scheduler`` that is not a schedule.
    """
    names = {p.name for p in declared}
    out: dict[str, Any] = {}

    def refuse(field: str, message: str) -> MessageError:
        return _bad(field, f"model {model} {message}", code="unsupported")

    if gen.prompt or "prompt" in names:
        if "prompt" not in names:
            raise refuse("prompt", "takes no prompt")
        out["prompt"] = gen.prompt
    if gen.negative_prompt:
        if "negative_prompt" not in names:
            raise refuse("negative_prompt", "takes no negative prompt")
        out["negative_prompt"] = gen.negative_prompt
    if gen.steps is not None:
        if "steps" not in names:
            raise refuse("steps", "takes no step count")
        out["steps"] = gen.steps
    if gen.cfg_scale is not None:
        guidance = next((g for g in ("guidance_scale", "guidance") if g in names), None)
        if guidance is not None:
            out[guidance] = gen.cfg_scale
        elif gen.cfg_scale != DEFAULT_CFG:
            raise refuse("cfg_scale", f"has no guidance scale; leave cfg_scale at {DEFAULT_CFG:g}")
    out.update(_sampler(gen, names, model=model))
    out.update(_sides(gen, names, model=model, image_size=image_size))
    if gen.kind == "img2img":
        if "image" not in names:
            raise refuse(
                "init_images",
                "takes no init image: choose an img2img or inpaint model (sd_model_checkpoint)",
            )
        if gen.mask is not None and "mask_image" not in names:
            raise refuse("mask", "takes no mask: choose an inpaint model (sd_model_checkpoint)")
        if gen.denoising_strength is not None:
            if "strength" in names:
                out["strength"] = gen.denoising_strength
            elif gen.denoising_strength != DEFAULT_STRENGTH:
                raise refuse("denoising_strength", "takes no strength")
    return out


def _sampler(gen: Generation, names: set[str], *, model: str) -> dict[str, Any]:
    schedule = gen.scheduler
    if gen.sampler is None:
        if schedule is not None and schedule.strip().lower() not in (samplers.DEFAULT, "automatic"):
            raise _bad("scheduler", f"a schedule ({schedule!r:.40}) needs a sampler_name")
        return {}
    try:
        ours = samplers.canonical(gen.sampler, schedule)
    except ParamsError as exc:
        raise _bad(exc.field or "scheduler", exc.message) from None
    if "sampler" in names:
        return {"sampler": ours}
    if ours == samplers.DEFAULT:
        return {}
    raise _bad(
        "sampler_name",
        f"model {model} runs its pipeline's own scheduler only: leave sampler_name out",
        code="unsupported",
    )


def _sides(
    gen: Generation, names: set[str], *, model: str, image_size: tuple[int, int] | None
) -> dict[str, Any]:
    width, height = gen.width, gen.height
    if width is None and height is None:
        return {}
    if "width" in names and "height" in names:
        return {k: v for k, v in (("width", width), ("height", height)) if v is not None}
    if "size" in names and width == height:
        return {"size": width}
    if image_size is not None:
        if (width or image_size[0], height or image_size[1]) == image_size:
            return {}
        raise _bad(
            "width",
            f"model {model} makes images the size of the init image, {image_size[0]}x{image_size[1]}; "
            f"send width {image_size[0]} and height {image_size[1]}, or an image of {width}x{height}",
            code="unsupported",
        )
    what = "square images only" if "size" in names else "images of its own size"
    raise _bad("width", f"model {model} makes {what}; got {width}x{height}", code="unsupported")


# -- one field each ------------------------------------------------------------------


def _one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    # true is not 1 and false not 0 here: ``eta: true`` is no value A1111 takes.
    for choice in allowed:
        if choice is None or isinstance(choice, bool):
            if value is choice:
                return True
        elif not isinstance(value, bool) and value == choice:
            return True
    return False


def _text(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, f"must be a string, got {type(value).__name__}")
    return value


def _integer(body: Mapping[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JavaScript clients send 512.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r:.40}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise _bad(name, f"must be {bound}, got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite_number(value):
        raise _bad(name, f"must be a number, got {value!r:.40}")
    return float(value)


def _mask_blur(body: Mapping[str, Any]) -> tuple[int, int]:
    """``(mask_blur_x, mask_blur_y)``: each 4 unless sent; ``mask_blur``, sent, sets both (the
    setter of A1111's ``mask_blur`` property, which its API calls after the two)."""
    both = _integer(body, "mask_blur", low=0, high=MAX_MASK_BLUR)
    if both is not None:
        return both, both
    x = _integer(body, "mask_blur_x", low=0, high=MAX_MASK_BLUR)
    y = _integer(body, "mask_blur_y", low=0, high=MAX_MASK_BLUR)
    return (DEFAULT_MASK_BLUR if x is None else x, DEFAULT_MASK_BLUR if y is None else y)


def _full_res(body: Mapping[str, Any]) -> bool:
    """``inpaint_full_res``: true or false, or 1 or 0 (the index of A1111's UI's radio, which
    some clients send)."""
    value = body.get("inpaint_full_res")
    if value is None:
        return DEFAULT_FULL_RES
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise _bad("inpaint_full_res", f"must be true or false, got {value!r:.40}")


def _seed(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise _bad("seed", f"must be an integer, -1 for a random one; got {value!r:.40}")
    return value


def _flag(body: Mapping[str, Any], name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r:.40}")
    return value


def _mapping(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(name, f"must be an object, got {type(value).__name__}")
    return dict(value)


def _base64(value: Any, name: str) -> str:
    """A base64 image as A1111 takes it: bare, or a ``data:image/...;base64,`` URL."""
    if not isinstance(value, str) or not value:
        raise _bad(name, f"must be a base64 image, got {type(value).__name__}")
    if value.startswith("data:"):
        head, _, data = value.partition(",")
        if not head.endswith(";base64"):
            raise _bad(name, f"a data: URL must be base64, got {head[:40]!r}")
        return data
    if value.startswith(("http://", "https://")):
        raise _bad(name, "the server fetches no URLs: send the image itself, base64", code="unsupported")
    return value
