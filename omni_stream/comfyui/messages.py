"""ComfyUI's websocket messages, from our typed ones: :class:`Translator` (pure).

A ComfyUI client (``/ws?clientId=...``) hears, for each prompt it posted
with that ``client_id``, what ComfyUI's own server sends::

    status                 {"status": {"exec_info": {"queue_remaining": N}}, "sid"?}
    execution_start        {"prompt_id", "timestamp"}
    execution_cached       {"nodes": [...], "prompt_id", "timestamp"}
    executing              {"node", "display_node", "prompt_id"}   (node null: the prompt is over)
    progress               {"value", "max", "prompt_id", "node"}
    executed               {"node", "display_node", "output": {"images": [...]}, "prompt_id"}
    execution_success      {"prompt_id", "timestamp"}
    execution_error        {"prompt_id", "node_id", "node_type", "exception_message", ...}
    execution_interrupted  {"prompt_id", "node_id", "node_type", "executed", "timestamp"}

and a binary frame for each step's preview: a 4-byte big-endian event type
(1, ``PREVIEW_IMAGE``), a 4-byte image type (1 JPEG, 2 PNG), the image's
bytes (ComfyUI's ``server.py``, ``send_image``). The last step's is the
result itself (a PNG): our last frame is the result, with no preview of
its own before it. The core's outbox holds our
message objects, so a client that reads slowly gets the latest progress and
preview (latest wins, as on our own websocket); this turns each one, as the
writer takes it, into those frames. ``status`` reports the queue of the
connection's own principal (its prompts not yet ended), so a client that
waits for ``queue_remaining: 0`` (comfy-api-simplified does) is not held by
other people's work.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .. import protocol
from .plan import Plan

if TYPE_CHECKING:
    from ..core.outbox import Outgoing

__all__ = ["IMAGE_TYPES", "PREVIEW_IMAGE", "Translator", "message", "preview_frame", "status"]

#: ComfyUI's ``BinaryEventTypes.PREVIEW_IMAGE``.
PREVIEW_IMAGE: Final = 1
#: The image type after it: what ComfyUI's ``send_image`` writes for each format.
IMAGE_TYPES: Final = {"jpeg": 1, "png": 2}

Frame = str | bytes


def preview_frame(image: bytes | memoryview, fmt: str) -> bytes | None:
    """A preview as ComfyUI's binary frame; None for a format it has no type for."""
    kind = IMAGE_TYPES.get(fmt)
    if kind is None:
        return None
    return struct.pack(">II", PREVIEW_IMAGE, kind) + bytes(image)


def message(kind: str, data: dict[str, Any]) -> str:
    """``{"type": kind, "data": data}`` as a text frame."""
    return json.dumps({"type": kind, "data": data}, separators=(",", ":"))


def status(queue_remaining: int, sid: str | None = None) -> str:
    """``status``: the queue; ``sid`` (the client's id) only in the first, on connecting."""
    data: dict[str, Any] = {"status": {"exec_info": {"queue_remaining": queue_remaining}}}
    if sid is not None:
        data["sid"] = sid
    return message("status", data)


class Translator:
    """One connection's frames for the messages of the prompts it watches.

    ``lookup``: a prompt's :class:`Plan` by id (None once forgotten: the
    messages then name no node); ``remaining``: the principal's prompts not
    yet ended, for ``status``; ``clock``: seconds since the epoch.
    """

    def __init__(
        self,
        lookup: Callable[[str], Plan | None],
        remaining: Callable[[], int],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lookup = lookup
        self._remaining = remaining
        self._clock = clock
        self._started: set[str] = set()
        #: Each running prompt's results so far (their formats): ``executed`` lists them.
        self._results: dict[str, list[str]] = {}

    def frames(self, item: Outgoing) -> list[Frame]:
        """The frames ``item`` becomes (none for what ComfyUI does not send)."""
        if isinstance(item, protocol.Preview):
            header = item.header
            if header.final:
                # A result (executed names its file) is also the last step's preview: the
                # request's last frame is its result, which no intermediate preview precedes.
                self._results.setdefault(header.id, []).append(header.format)
            frame = preview_frame(item.image, header.format)
            return [] if frame is None else [frame]
        if isinstance(item, protocol.Accepted):
            return [status(self._remaining())]
        if isinstance(item, protocol.Progress):
            plan = self._lookup(item.id)
            data = {"value": item.step, "max": item.total, "prompt_id": item.id, "node": _sampler(plan)}
            return [*self._start(item.id, plan), message("progress", data)]
        if isinstance(item, protocol.Done):
            return self._done(item.id)
        if isinstance(item, protocol.Cancelled):
            return self._ended(item.id, "execution_interrupted", {})
        if isinstance(item, protocol.ErrorMessage) and item.id is not None:
            extra = {
                "exception_message": item.message,
                "exception_type": f"omni_stream.{item.code}",
                "traceback": [],
                "current_inputs": {},
                "current_outputs": {},
            }
            return self._ended(item.id, "execution_error", extra)
        return []  # queued, loading, paused, resumed, restarted: nothing of ComfyUI's

    def _now(self) -> int:
        return int(self._clock() * 1000)

    def _start(self, prompt_id: str, plan: Plan | None) -> list[Frame]:
        if prompt_id in self._started:
            return []
        self._started.add(prompt_id)
        stamp = {"prompt_id": prompt_id, "timestamp": self._now()}
        cached = [] if plan is None else list(plan.cached)
        return [
            message("execution_start", stamp),
            message("execution_cached", {"nodes": cached, **stamp}),
            _executing(prompt_id, _sampler(plan)),
        ]

    def _done(self, prompt_id: str) -> list[Frame]:
        plan = self._lookup(prompt_id)
        frames = self._start(prompt_id, plan)
        formats = self._results.pop(prompt_id, [])
        if plan is not None:
            frames += [_executing(prompt_id, node) for node in plan.decoders]
            for output in plan.outputs:
                images = [
                    {"filename": output.filename(prompt_id, i, fmt), "subfolder": "", "type": output.kind}
                    for i, fmt in enumerate(formats)
                ]
                frames.append(_executing(prompt_id, output.node_id))
                data = {
                    "node": output.node_id,
                    "display_node": output.node_id,
                    "output": {"images": images},
                    "prompt_id": prompt_id,
                }
                frames.append(message("executed", data))
        frames.append(message("execution_success", {"prompt_id": prompt_id, "timestamp": self._now()}))
        return [*frames, *self._over(prompt_id)]

    def _ended(self, prompt_id: str, kind: str, extra: dict[str, Any]) -> list[Frame]:
        plan = self._lookup(prompt_id)
        frames = self._start(prompt_id, plan)
        self._results.pop(prompt_id, None)
        data = {
            "prompt_id": prompt_id,
            "node_id": _sampler(plan),
            "node_type": None if plan is None else plan.sampler.class_type,
            "executed": [] if plan is None else list(plan.cached),
            "timestamp": self._now(),
            **extra,
        }
        return [*frames, message(kind, data), *self._over(prompt_id)]

    def _over(self, prompt_id: str) -> list[Frame]:
        # ComfyUI's order: the queue's status as the prompt leaves it, then executing null.
        self._started.discard(prompt_id)
        return [status(self._remaining()), _executing(prompt_id, None)]


def _sampler(plan: Plan | None) -> str | None:
    return None if plan is None else plan.sampler.id


def _executing(prompt_id: str, node: str | None) -> str:
    return message("executing", {"node": node, "display_node": node, "prompt_id": prompt_id})
