"""OpenAI's video jobs (``/v1/videos``) as our detached requests, and back (pure).

A video job is a detached request (docs/http.md): it runs whether or not
anyone watches, its result is kept ``retention_s`` after it ends, and only
its principal sees it. The fields:

==================  ===========================================================
OpenAI              ours
==================  ===========================================================
``prompt``          ``params.prompt``
``seconds``         ``params.num_frames``: ``round(seconds * fps) + 1`` at the
                    model's frame rate (its ``fps``, else 16): the ``4k + 1``
                    frame counts Wan and LTX take; at least 2 frames, at most
                    the model's ``num_frames`` maximum
``size`` ``WxH``    ``params.width`` and ``params.height``
``model``           the served model
``input_reference`` ``params.image`` (an image-to-video model's first frame)
``webhook``         ours: ``{"url", "events"}``, a signed delivery when the job
                    ends (docs/webhooks.md; JSON text in a form)
anything else       one of the model's own params (``steps``, ``seed``, ...)
==================  ===========================================================

``status`` is ``queued`` (not started, or its model loading),
``in_progress``, ``paused`` (ours: ``POST /v1/generations/{id}/pause``),
``completed`` or ``failed`` (an error, or cancelled);
``progress`` is the share of its denoise steps done, 0-100.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import ParamsError
from ..model import StepModel
from ..params import Param
from ..protocol import Generate
from .errors import OpenAIError
from .images import form_value

__all__ = ["DEFAULT_FPS", "VideoRequest", "frames_of", "list_page", "parse_video_request", "video_object"]

#: The frame rate of a model that does not say (its ``fps`` attribute): Wan's.
DEFAULT_FPS: Final = 16
#: The longest clip a request may ask for, in seconds.
MAX_SECONDS: Final = 120.0
_SIZE: Final = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
_OURS: Final = frozenset({"prompt", "seconds", "size", "model", "input_reference", "webhook"})


def _bad(param: str, message: str, code: str = "invalid_field") -> OpenAIError:
    return OpenAIError(400, message, code, param=param)


@dataclass(frozen=True, slots=True)
class VideoRequest:
    """One checked ``POST /v1/videos``."""

    prompt: str
    seconds: float | None = None
    size: tuple[int, int] | None = None
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``{"url", "events"?}``: a signed delivery when the job ends (docs/webhooks.md).
    webhook: dict[str, Any] | None = None

    def to_generate(self, model: StepModel, *, served_name: str) -> Generate:
        """The detached ``generate`` of this job on ``model``; OpenAIError (400) for a field the
        model cannot honour (``seconds`` without ``num_frames``, ``size`` without sides, a
        ``seconds`` beside a ``num_frames``)."""
        by_name = {p.name: p for p in model.params}
        declared = set(by_name)
        params = dict(self.extra)
        if "prompt" not in declared:
            raise _bad(
                "prompt",
                f"model {served_name} takes no prompt (its text conditioning is fixed)",
                "unsupported",
            )
        params["prompt"] = self.prompt
        if self.seconds is not None:
            if "num_frames" not in declared:
                raise _bad(
                    "seconds",
                    f"model {served_name} makes no videos of a set length (no num_frames)",
                    "unsupported",
                )
            if "num_frames" in self.extra:
                raise _bad("seconds", "give seconds or num_frames, not both")
            params["num_frames"] = frames_of(self.seconds, model, by_name["num_frames"], served_name)
        if self.size is not None:
            if not {"width", "height"} <= declared:
                raise _bad("size", f"model {served_name} has no width and height params", "unsupported")
            params["width"], params["height"] = self.size
        try:
            return Generate.build(
                f"video_{uuid.uuid4().hex}",
                params,
                # No intermediate previews: nobody watches a job's steps.
                {"every": 1 << 30},
                detach=True,
                model=self.model,
                webhook=self.webhook,
            )
        except ParamsError as exc:  # the webhook's shape, a model name, values JSON cannot carry
            raise _bad(exc.field or "webhook", exc.message) from None


def frames_of(seconds: float, model: StepModel, param: Param, served_name: str) -> int:
    """``seconds`` as ``model``'s frame count (``round(seconds * fps) + 1``); OpenAIError (400,
    ``seconds``) with the range the model makes when that is under two frames (``seconds=1e-9``
    made a one-frame video that then failed ``step_failed``: issue #39) or over its ``num_frames``."""
    fps = getattr(model, "fps", None) or DEFAULT_FPS
    frames = round(seconds * fps) + 1
    most = int(param.maximum) if param.maximum is not None else None
    longest = MAX_SECONDS if most is None else min(MAX_SECONDS, (most - 1) / fps)
    if frames < 2 or (most is not None and frames > most):
        raise _bad(
            "seconds",
            f"seconds must be from {1 / fps:g} to {longest:g} for model {served_name} (a video of 2 to "
            f"{most if most is not None else round(MAX_SECONDS * fps) + 1} frames at its {fps:g} frames a "
            f"second); got {seconds:g}",
        )
    return frames


def parse_video_request(obj: Mapping[str, Any], *, form: bool = False) -> VideoRequest:
    """Check a ``POST /v1/videos`` body (``form``: a multipart form's fields, strings).

    Raises OpenAIError (400) naming the field: a missing ``prompt``, ``seconds``
    not a positive number up to MAX_SECONDS, ``size`` not ``WxH``.
    """
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "prompt is required: a non-empty string")
    seconds: float | None = None
    raw = obj.get("seconds")
    if raw is not None:
        try:
            seconds = float(raw) if isinstance(raw, str) else raw
        except ValueError:
            seconds = None
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS)
        ):
            raise _bad(
                "seconds", f"seconds must be a number above 0, at most {MAX_SECONDS:g}; got {repr(raw)[:40]}"
            )
        seconds = float(seconds)
    size = None
    if obj.get("size") is not None:
        match = _SIZE.fullmatch(obj["size"]) if isinstance(obj["size"], str) else None
        if match is None:
            raise _bad("size", f"size must be 'WxH' (e.g. '1280x720'), got {repr(obj['size'])[:40]}")
        size = (int(match.group(1)), int(match.group(2)))
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"model must be a string, got {type(model).__name__}")
    webhook = obj.get("webhook")
    if form and isinstance(webhook, str):
        webhook = form_value(webhook, "webhook")  # a form carries the object as JSON text
    if webhook is not None and not isinstance(webhook, dict):
        raise _bad("webhook", 'webhook must be an object: {"url": ..., "events": [...]}')
    extra = {k: (form_value(v, k) if form else v) for k, v in obj.items() if k not in _OURS}
    return VideoRequest(
        prompt=prompt, seconds=seconds, size=size, model=model or None, extra=extra, webhook=webhook
    )


def video_object(
    *,
    video_id: str,
    status: str,
    progress: int,
    created_at: int,
    completed_at: int | None,
    expires_at: int | None,
    model: str,
    prompt: str,
    seconds: str,
    size: str,
    error: Mapping[str, Any] | None = None,
    restarted: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's ``Video`` object, and ``restarted`` (ours: ``{"from_step", "reason"}`` when the job
    was run again after its server or replica was lost, else null; OpenAI's clients ignore it)."""
    return {
        "id": video_id,
        "object": "video",
        "status": status,
        "progress": progress,
        "created_at": created_at,
        "completed_at": completed_at,
        "expires_at": expires_at,
        "model": model,
        "prompt": prompt,
        "seconds": seconds,
        "size": size,
        "remixed_from_video_id": None,
        "error": None if error is None else {"code": error.get("code"), "message": error.get("message")},
        "restarted": None if restarted is None else dict(restarted),
    }


def list_page(
    videos: Sequence[Mapping[str, Any]], *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of ``GET /v1/videos``: ``videos`` by ``created_at`` (``order`` asc or desc),
    those after the id ``after``, at most ``limit``. Raises OpenAIError for an ``after`` not
    among them, a bad ``order`` or ``limit``."""
    if order not in ("asc", "desc"):
        raise _bad("order", f"order must be asc or desc, got {order[:20]!r}")
    if not 1 <= limit <= 100:
        raise _bad("limit", f"limit must be from 1 to 100, got {limit}")
    ordered = sorted(videos, key=lambda v: (v["created_at"], v["id"]), reverse=order == "desc")
    start = 0
    if after is not None:
        ids = [v["id"] for v in ordered]
        if after not in ids:
            raise OpenAIError(404, f"no video {after[:80]!r} to list after", "not_found", param="after")
        start = ids.index(after) + 1
    page = list(ordered[start : start + limit])
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }
