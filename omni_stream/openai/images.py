"""OpenAI's Images API as our requests, and our results as its answers (pure).

``POST /v1/images/generations`` and ``/v1/images/edits`` take OpenAI's
fields; :func:`parse_images_request` checks them (a JSON body, or the
multipart form the SDK sends for edits, whose values all arrive as
strings) and :meth:`ImagesRequest.to_generate` makes the ``generate`` our
core admits, like any other door's:

======================  =====================================================
OpenAI                  ours
======================  =====================================================
``prompt``              ``params.prompt``
``n``                   ``params.num_images`` (1: left out)
``size`` ``"WxH"``      ``params.width`` and ``params.height`` (``"auto"``: the
                        model's default)
``quality``             ``params.steps``: ``low`` a quarter of the model's
                        default steps, ``medium`` / ``standard`` half,
                        ``high`` / ``hd`` all, ``auto`` the default; a
                        ``steps`` the request gives wins
``output_format``       ``output.format`` (png, jpeg, webp) and the partial
                        images' format
``output_compression``  ``output.quality`` (jpeg and webp)
``response_format``     ``b64_json`` (default), or ``url``: our output route
``model``               the served model (``generate``'s ``model``)
``stream`` +            partial images from the previews: the request previews
``partial_images``      every ``steps // (partial_images + 1)`` steps, and the
                        first ``partial_images`` of them go out
``user``,               accepted, not used
``moderation``,
``safety_identifier``
anything else           one of the model's own params (``seed``, ``steps``,
                        ``sampler``, ``negative_prompt``, ...), checked by it
======================  =====================================================

Refused (400, ``param`` naming it): ``background: "transparent"`` (the
models make opaque pictures), and the fields of OpenAI's own models that
have no meaning here (``style``, ``svg``, ``complexity``, ``frame_count``,
``frame_duration_ms``, ``markup``, ``input_fidelity``).
"""

from __future__ import annotations

import base64
import io
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..model import StepModel
from ..models.inputs import open_image
from ..protocol import Generate
from .errors import OpenAIError

__all__ = [
    "MAX_PARTIAL_IMAGES",
    "ImagesRequest",
    "completed_event",
    "images_response",
    "mask_to_paint",
    "parse_images_request",
    "partial_event",
]

#: OpenAI allows 0-3 partial images; we allow up to this many (each is a
#: full-size image in the stream, rendered from a preview).
MAX_PARTIAL_IMAGES: Final = 10
#: ``quality`` -> the share of the model's default steps.
QUALITY_STEPS: Final[Mapping[str, float | None]] = {
    "auto": None,
    "low": 0.25,
    "medium": 0.5,
    "standard": 0.5,
    "high": 1.0,
    "hd": 1.0,
}
OUTPUT_FORMATS: Final = ("png", "jpeg", "webp")
#: A ``preview.every`` no request reaches: no intermediate previews at all.
NO_PREVIEWS: Final = 1 << 30

#: OpenAI fields this door reads itself (the rest are the model's params).
_OURS: Final = frozenset(
    {
        "prompt",
        "n",
        "size",
        "quality",
        "output_format",
        "output_compression",
        "response_format",
        "model",
        "stream",
        "partial_images",
        "background",
        "user",
        "moderation",
        "safety_identifier",
    }
)
#: OpenAI fields for its own models that mean nothing for ours: refused when set.
_UNSUPPORTED: Final = frozenset(
    {
        "style",
        "svg",
        "complexity",
        "frame_count",
        "frame_duration_ms",
        "markup",
        "input_fidelity",
    }
)
_SIZE: Final = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")


def _bad(param: str, message: str, *, code: str = "invalid_field") -> OpenAIError:
    return OpenAIError(400, message, code, param=param)


@dataclass(frozen=True, slots=True)
class ImagesRequest:
    """One checked ``/v1/images/generations`` (or ``edits``) request."""

    prompt: str
    n: int = 1
    size: tuple[int, int] | None = None  # (width, height); None: the model's default
    quality: str = "auto"
    output_format: str = "png"
    output_compression: int | None = None
    response_format: str = "b64_json"
    model: str | None = None
    stream: bool = False
    partial_images: int = 0
    #: The model's own params given beside OpenAI's (``extra_body``, or a form's other fields).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size_text(self) -> str:
        return "auto" if self.size is None else f"{self.size[0]}x{self.size[1]}"

    def to_generate(
        self, model: StepModel, *, served_name: str | None, detach: bool, route: str | None = None
    ) -> Generate:
        """The ``generate`` this request is on ``model``; OpenAIError (400) naming an OpenAI field
        the model cannot honour (``n`` above 1 for a model of one image a request, ``size`` for
        one without sides). ``route``: the served name it runs on when the door chose another
        than the request's ``model`` (an edit's ``NAME.edit``)."""
        declared = {p.name: p for p in model.params}
        params: dict[str, Any] = dict(self.extra)
        params["prompt"] = self.prompt
        if self.n > 1:
            if "num_images" not in declared:
                raise _bad(
                    "n",
                    f"model {served_name or model.name} makes one image a request; n must be 1",
                    code="unsupported",
                )
            params["num_images"] = self.n
        if self.size is not None:
            width, height = self.size
            if "width" in declared and "height" in declared:
                params["width"], params["height"] = width, height
            elif "size" in declared and width == height:
                params["size"] = width
            else:
                raise _bad(
                    "size",
                    f"model {served_name or model.name} cannot make {self.size_text} images "
                    "(its params have no width and height); use size 'auto'",
                    code="unsupported",
                )
        share = QUALITY_STEPS[self.quality]
        steps = declared.get("steps")
        given = "steps" in self.extra
        if share is not None and steps is not None and not given and isinstance(steps.default, int):
            params["steps"] = max(1, round(steps.default * share))
        quality = self.output_compression if self.output_format in ("jpeg", "webp") else None
        output = {"format": self.output_format, "quality": quality}
        preview: dict[str, Any] = {"every": NO_PREVIEWS}
        if self.stream and self.partial_images:
            total = params.get("steps", steps.default if steps is not None else None)
            every = max(1, int(total) // (self.partial_images + 1)) if isinstance(total, int) else 1
            # Full size, in the result's format: a partial image is the picture so far.
            preview = {"every": every, "format": self.output_format, "max_size": None, "quality": quality}
        return Generate(
            id=f"img_{uuid.uuid4().hex}",
            params=params,
            preview=preview,
            detach=detach,
            output=output,
            # The served model it runs on: the one asked for, or the one the door chose in its place
            # (NAME.edit for an edit of NAME: server/openai_api.py).
            model=route if route is not None else self.model,
        )


def _number(form: bool, value: Any, param: str, *, low: int, high: int) -> int:
    """An int field; a form's string is read as one (``"2"``), checked the same."""
    if form and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _bad(param, f"{param} must be an integer, got {value[:40]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(param, f"{param} must be an integer from {low} to {high}, got {type(value).__name__}")
    if not low <= value <= high:
        raise _bad(param, f"{param} must be from {low} to {high}, got {value}")
    return value


def _choice(value: Any, param: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        shown = repr(value)[:40]
        raise _bad(param, f"{param} must be one of {', '.join(choices)}, got {shown}")
    return value


def _flag(form: bool, value: Any, param: str) -> bool:
    if form and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise _bad(param, f"{param} must be true or false, got {repr(value)[:40]}")
    return value


def form_value(value: Any, field: str) -> Any:
    """A form field (``field``) for the model's params: JSON where it reads as JSON (``30``,
    ``0.5``, ``true``, ``[...]``), else the string itself (a prompt; ``NaN``, which is no JSON).

    Read by the JSON reader a body is read by (``protocol.decode_json`` is
    ``json.loads``), with its bound: a value nested deeper than it goes is
    refused as such a body is, 400 ``bad_json`` naming the field. Its
    RecursionError escaped this door as a 500 and a traceback (issue #39,
    attack 10: 50,000 ``[`` in one field). Raises OpenAIError.
    """
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value, parse_constant=_no_constant)
    except RecursionError:
        raise OpenAIError(
            400, f"form field {field!r} is not valid JSON: nested too deeply", "bad_json", param=field
        ) from None
    except ValueError:  # no JSON at all: the text itself
        return value


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON (a body that holds them is refused): such a field is text.
    raise ValueError(name)


def parse_images_request(
    obj: Mapping[str, Any], *, form: bool = False, max_images: int = 64
) -> ImagesRequest:
    """Check an Images API body (``form``: a multipart form's fields, all strings).

    Raises OpenAIError (400) naming the field: a missing or non-string
    ``prompt``, ``n`` outside 1 to ``max_images``, a ``size`` that is not
    ``WxH`` or ``auto``, an unknown ``quality``, ``output_format`` or
    ``response_format``, ``output_compression`` outside 0-100,
    ``partial_images`` outside 0 to MAX_PARTIAL_IMAGES, a transparent
    background, a field of OpenAI's own models.
    """
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "prompt is required: a non-empty string")
    for name in sorted(_UNSUPPORTED & set(obj)):
        if obj[name] is not None:
            raise _bad(
                name,
                f"{name} is a parameter of OpenAI's own models; these models do not take it",
                code="unsupported",
            )
    n = _number(form, obj.get("n", 1), "n", low=1, high=max_images) if obj.get("n") is not None else 1
    size: tuple[int, int] | None = None
    raw_size = obj.get("size")
    if raw_size is not None and raw_size != "auto":
        match = _SIZE.fullmatch(raw_size) if isinstance(raw_size, str) else None
        if match is None:
            raise _bad("size", f"size must be 'WxH' (e.g. '1024x1024') or 'auto', got {repr(raw_size)[:40]}")
        size = (int(match.group(1)), int(match.group(2)))
    quality = _choice(obj.get("quality") or "auto", "quality", tuple(QUALITY_STEPS))
    output_format = _choice(obj.get("output_format") or "png", "output_format", OUTPUT_FORMATS)
    compression = None
    if obj.get("output_compression") is not None:
        compression = _number(form, obj["output_compression"], "output_compression", low=0, high=100)
        # OpenAI's compression is 0-100 as well; our encoders' quality is 1-100.
        compression = max(1, compression)
    formats = ("b64_json", "url")
    response_format = _choice(obj.get("response_format") or "b64_json", "response_format", formats)
    background = obj.get("background")
    if background is not None and _choice(background, "background", ("auto", "opaque", "transparent")) == (
        "transparent"
    ):
        raise _bad(
            "background",
            "the models make opaque pictures: background 'transparent' is not supported",
            code="unsupported",
        )
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"model must be a string, got {type(model).__name__}")
    stream = _flag(form, obj["stream"], "stream") if obj.get("stream") is not None else False
    partials = 0
    if obj.get("partial_images") is not None:
        partials = _number(form, obj["partial_images"], "partial_images", low=0, high=MAX_PARTIAL_IMAGES)
    extra = {k: (form_value(v, k) if form else v) for k, v in obj.items() if k not in _OURS | _UNSUPPORTED}
    return ImagesRequest(
        prompt=prompt,
        n=n,
        size=size,
        quality=quality,
        output_format=output_format,
        output_compression=compression,
        response_format=response_format,
        model=model if model else None,
        stream=stream,
        partial_images=partials,
        extra=extra,
    )


# -- answers ----------------------------------------------------------------------


def images_response(request: ImagesRequest, images: Sequence[bytes | str], *, created: int) -> dict[str, Any]:
    """The ``ImagesResponse`` body: each image's bytes (``b64_json``) or URL (``url``), in order."""
    key = "b64_json" if request.response_format == "b64_json" else "url"
    data = [
        {key: base64.b64encode(image).decode("ascii") if isinstance(image, bytes) else image}
        for image in images
    ]
    return {
        "created": created,
        "data": data,
        "background": "opaque",
        "output_format": request.output_format,
        "size": request.size_text,
        "quality": None if request.quality == "auto" else request.quality,
    }


def partial_event(
    kind: str,
    request: ImagesRequest,
    image: bytes,
    *,
    index: int,
    image_index: int,
    created_at: int,
    cached: bool = False,
) -> dict[str, Any]:
    """``{kind}.partial_image`` (``kind``: ``image_generation`` or ``image_edit``);
    ``image_index`` (ours) says which of ``n`` images it is, ``cached`` (ours, present only when
    true) that its step reused the request's step cache."""
    event = _event(f"{kind}.partial_image", request, image, image_index=image_index, created_at=created_at)
    event["partial_image_index"] = index
    if cached:
        event["cached"] = True
    return event


def completed_event(
    kind: str, request: ImagesRequest, image: bytes, *, image_index: int, created_at: int
) -> dict[str, Any]:
    """``{kind}.completed``: one image of the result (one such event per image)."""
    return _event(f"{kind}.completed", request, image, image_index=image_index, created_at=created_at)


def _event(
    type: str, request: ImagesRequest, image: bytes, *, image_index: int, created_at: int
) -> dict[str, Any]:
    return {
        "type": type,
        "b64_json": base64.b64encode(image).decode("ascii"),
        "image_index": image_index,
        "size": request.size_text,
        "output_format": request.output_format,
        "quality": request.quality,
        "background": "opaque",
        "created_at": created_at,
    }


def mask_to_paint(data: bytes, field: str = "mask") -> bytes:
    """An OpenAI mask (transparent where to paint) as diffusers' ``mask_image`` (white where to
    paint): a PNG of the same size. For a worker thread, on bytes the core checked from their
    header (``core.inputs.check_encoded``). Raises ParamsError (``field``) for bytes that do not
    decode."""
    picture = open_image(data, field=field)
    if "A" not in picture.getbands():  # a palette's transparency, a premultiplied alpha
        picture = picture.convert("RGBA")
    painted = picture.getchannel("A").point(lambda a: 255 if a == 0 else 0).convert("RGB")
    out = io.BytesIO()
    painted.save(out, "PNG")
    return out.getvalue()
