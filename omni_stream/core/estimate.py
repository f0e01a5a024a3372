"""What a running request holds in host memory, estimated from its params at admission (pure).

A running request holds host memory outside every outbox: its state in the
engine, each step's temporaries, frames on their way to its consumer,
previews and its result being rendered, its decoded input images, and what
the model builds for it (model.ModelMemory: the Mixture's image bank for a
new size). :func:`estimate_memory` estimates it from the params (the size
of one frame, times frames measured with the Synthetic model; the input
images at their decoded size; the model's own word);
:func:`reserve_memory` refuses a request whose estimate alone is over half
of ``max_memory_bytes`` (``limit_exceeded``) or that does not fit beside
what the server already holds (``busy``), and otherwise reserves it in the
server's :class:`~omni_stream.core.memory.MemoryBudget` until the request
ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from ..errors import MessageError, ServerBusyError
from ..model import StepModel, model_memory
from .inputs import image_params
from .limits import ServerLimits
from .load import RETRY_AFTER_MIN_S
from .memory import MemoryBudget, MemoryReservation

__all__ = [
    "MemoryEstimate",
    "check_memory",
    "estimate_memory",
    "frame_bytes",
    "largest_fitting",
    "host_engines",
    "reserve_memory",
    "state_on_host",
    "HOST_FRAMES_PER_REQUEST",
    "HOST_FRAMES_PER_BATCH",
    "HOST_BATCH_RETAINED_BYTES",
    "HOST_FRAMES_PER_LARGE_BATCH",
    "DEVICE_FRAMES_PER_REQUEST",
    "REQUEST_BASE_BYTES",
    "RESULT_COPIES",
    "LATENT_RATIO",
    "INPUT_BYTES_PER_PIXEL",
    "MAX_REQUEST_MEMORY_SHARE",
    "host_batch_cost",
]

#: Host memory per running request, in frames (one step's output), when the
#: engine computes on the host (the CPU device; ``sim`` too): its state and
#: the frames on their way out (the copy the engine hands over, the one in
#: the request's delivery slot, the one its consumer holds while it waits
#: for a preview thread, the preview or result being rendered).
HOST_FRAMES_PER_REQUEST: Final = 6
#: ... plus, for the largest batch the engine may step at once (up to its
#: max_batch_size requests of one batch key), the step's temporaries and
#: what the allocator keeps of them between steps (:func:`host_batch_cost`):
#: this many times the batch's frames up to HOST_BATCH_RETAINED_BYTES of
#: them (glibc keeps freed blocks under 32 MiB in its heaps: RSS runs 2-3x
#: the live tensors for small batches), HOST_FRAMES_PER_LARGE_BATCH times
#: the rest (larger temporaries are mapped and unmapped).
#: Measured, peak RSS over an idle server, Synthetic on the CPU, raw
#: previews, never-reading clients (benchmarks/exhaust.py; docs/
#: reliability.md): 15-27 frames a request for 1-8 requests of 0.5-2 MiB
#: frames; 10.6-10.9 for 4-8 of 12 MiB, 8.6 for 32 of 3 MiB, 6.8 for 100
#: of 0.75 MiB (JPEG previews). The estimate is at or above each of these
#: (a request alone has twice that, under the MAX_REQUEST_MEMORY_SHARE cap).
HOST_FRAMES_PER_BATCH: Final = 20
HOST_BATCH_RETAINED_BYTES: Final = 12 << 20
HOST_FRAMES_PER_LARGE_BATCH: Final = 5
#: Host memory per running request, in frames, when the engine computes on
#: an accelerator: its state and temporaries stay on the device; on the host
#: the pool buffer its copy lands in, the frame handed over (in the delivery
#: slot), an older one its consumer still holds, and the rendering. Counted,
#: not measured (no GPU run yet). For a diffusers pipeline the frame
#: estimated from ``size``/``width``/``height`` is the decoded result in
#: float32 (the per-step latents are smaller).
DEVICE_FRAMES_PER_REQUEST: Final = 4
#: When the frame estimate is a decoded result (read from ``size`` /
#: ``width`` / ``height`` / ``num_frames``, not a ``shape``) and the engine
#: computes on an accelerator, the per-step frames are latents and only the
#: final frame is the decoded result: the result counts RESULT_COPIES times
#: (its host copy, and its 8-bit conversion and encoder buffers while it is
#: encoded) and the DEVICE_FRAMES_PER_REQUEST per-step frames at the result
#: over LATENT_RATIO each. 12 is the densest latent of the image families
#: here (16 channels at 1/8 per side, SD3 and Flux: 16 / (3 x 64)); SD 1.5
#: is 1/48, and video VAEs also compress time 4x. Without this a standard
#: video (49 frames of 720 x 480: a 203 MB float32 result) counted as 4
#: decoded results (813 MB) and was refused at the default 1 GiB bound.
RESULT_COPIES: Final = 2
LATENT_RATIO: Final = 12
#: Host memory per running request whatever its frames: the engine's and the
#: server's objects for it, a model's small per-request tensors (measured:
#: 230 KiB a request for 144 requests of 16x16 Synthetic frames, most of it
#: its 128x128 work operand and the batched matmul's temporaries).
REQUEST_BASE_BYTES: Final = 256 << 10
#: One request may reserve at most this share of ``max_memory_bytes``: the
#: rest is room for the messages it and others queue (and a margin for a
#: request alone, whose temporaries the allocator keeps most of).
MAX_REQUEST_MEMORY_SHARE: Final = 0.5

#: Int params with these names are image sides in pixels (as limits.py).
_SIDES = ("size", "width", "height")
_FLOAT32 = 4
_ANY_BATCH = 1 << 30


def host_batch_cost(frames: int) -> int:
    """Host bytes held for a batch whose frames take ``frames`` bytes (see HOST_FRAMES_PER_BATCH)."""
    small = min(frames, HOST_BATCH_RETAINED_BYTES)
    return HOST_FRAMES_PER_BATCH * small + HOST_FRAMES_PER_LARGE_BATCH * (frames - small)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """A running request's expected host memory (see :func:`estimate_memory`).

    ``own`` bytes are its alone; ``shared`` bytes (its frame) count towards
    the batch ``group`` it steps in (None: it batches with nobody), of which
    the engine steps ``batch_size`` at most at once, costing
    ``batch_cost(sum of their shared bytes)``. ``frame_bytes``: one frame as
    estimated (0: unknown; the consumer learns it from the first frame,
    growing ``own`` and ``shared`` by ``own_per_byte`` / ``shared_per_byte``).
    ``field``: the param the estimate comes from, for error messages.
    """

    own: int
    shared: int = 0
    group: Hashable | None = None
    batch_size: int = 1
    batch_cost: Callable[[int], int] | None = None
    frame_bytes: int = 0
    own_per_byte: float = 0.0
    shared_per_byte: float = 0.0
    field: str = "params"
    #: Of ``own``: what the model says it builds for the request (model.ModelMemory).
    model_bytes: int = 0

    @property
    def alone(self) -> int:
        """What the request reserves alone in its batch."""
        return self.own + (self.batch_cost(self.shared) if self.batch_cost is not None else self.shared)


def _param_values(model: StepModel, params: Mapping[str, Any]) -> dict[str, Any]:
    # The request's params with the model's defaults filled in (params has
    # passed check_params already, so its values are valid).
    out = {spec.name: spec.default for spec in getattr(model, "params", ())}
    if isinstance(params, Mapping):
        out.update(params)
    return out


def frame_bytes(model: StepModel, params: Mapping[str, Any]) -> tuple[int, str] | None:
    """Bytes of one frame of a request, from its params, and the param that says so; None if unknown.

    A ``shape`` param is the frame's shape (values of the model's ``dtype``,
    float32 when it has none); else ``size`` / ``width`` / ``height`` give
    an RGB image in float32 (times ``num_frames`` for a video, times
    ``num_images`` for a request of several images), the size of a decoded
    result. The largest such reading wins.
    """
    values = _param_values(model, params)
    dtype = getattr(model, "dtype", None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else _FLOAT32
    best: tuple[int, str] | None = None

    def keep(n: int, name: str) -> None:
        nonlocal best
        if n > 0 and (best is None or n > best[0]):
            best = (n, name)

    for spec in getattr(model, "params", ()):
        value = values.get(spec.name)
        if spec.kind == "shape" and isinstance(value, (list, tuple)) and value:
            try:
                keep(math.prod(int(d) for d in value) * itemsize, spec.name)
            except (TypeError, ValueError):
                continue
    names = {spec.name for spec in getattr(model, "params", ()) if spec.kind == "int"}

    def side(name: str) -> int | None:
        v = values.get(name) if name in names else None
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    # A given size sets both sides (a different given side is refused by the
    # model), but the values here have the defaults filled in: a default
    # width must not hide a larger size, so each side is the larger reading.
    size = side("size") or 0
    width, height = max(side("width") or 0, size), max(side("height") or 0, size)
    # A video's frames and a request's images both stack whole pictures.
    frames = (side("num_frames") or 1) * (side("num_images") or 1)
    if width and height:
        field = (
            "size"
            if size and size >= max(side("width") or 0, side("height") or 0)
            else next((n for n in _SIDES if side(n)), "size")
        )
        keep(3 * width * height * frames * _FLOAT32, field)
    # An image-to-image model renders at its input image's size: an input
    # image is a side reading too (a 1024x1024 input counted as the model's
    # default side let a request cost 379 MiB against a 0.25 MiB estimate).
    for name, (w, h) in _input_sizes(model, values):
        keep(3 * w * h * frames * _FLOAT32, name)
    return best


def _input_sizes(model: StepModel, values: Mapping[str, Any]) -> list[tuple[str, tuple[int, int]]]:
    """(param, (width, height)) of each decoded input image in ``values``."""
    out = []
    for name in image_params(model):
        size = getattr(values.get(name), "size", None)
        if isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size):
            out.append((name, (int(size[0]), int(size[1]))))
    return out


#: Bytes an input image holds per pixel while its request runs: the decoded
#: RGB image (8-bit) and the float32 tensor a pipeline makes of it.
INPUT_BYTES_PER_PIXEL: Final = 3 + 3 * _FLOAT32


def _model_extra(model: StepModel, values: Mapping[str, Any]) -> int:
    """What the model says a request adds beyond its frames (model.ModelMemory), 0 if it says nothing."""
    memory = model_memory(model)
    if memory is None:
        return 0
    try:
        return max(0, int(memory.request_memory_bytes(values)))
    except Exception:  # noqa: BLE001 - a model's own estimate failing must not refuse the request
        return 0


def _on_cpu(engine: Any) -> list[bool | None]:
    """For each engine behind ``engine`` (an engine group's members, or itself):
    whether its device computes on the host CPU, None where it cannot tell."""
    device = getattr(engine, "device", None)
    if device is not None and hasattr(device, "computes_on_cpu"):
        return [bool(device.computes_on_cpu)]
    members = getattr(engine, "members", None)
    if members:
        return [v for m in members for v in _on_cpu(m)]
    return [None]


def host_engines(engine: Any) -> int:
    """How many engines behind ``engine`` compute on the host CPU (for ``max_active``'s default).

    1 for an engine on a CPU (or simulated) device; for an engine group,
    its members that are (all of them, or 0: a group mixing an accelerator
    in is treated as one); 0 for an accelerator, and for an engine whose
    device it cannot see (a Ray deployment: its replicas count for
    themselves).
    """
    on_cpu = _on_cpu(engine)
    return len(on_cpu) if all(on_cpu) else 0


def state_on_host(engine: Any) -> bool:
    """Whether ``engine`` computes in host memory (its requests' state and temporaries count).

    True for a CPU (or simulated) device; for an engine group, when any
    member's device is; True when it cannot tell.
    """
    return any(v is None or v for v in _on_cpu(engine))


def estimate_memory(
    model: StepModel, params: Mapping[str, Any], *, on_host: bool = True, batch_size: int = 1
) -> MemoryEstimate:
    """A running request's host memory, from its (checked) params.

    A model may say itself: a ``memory_bytes(params)`` method returning the
    bytes one request holds on the host (params with defaults filled in),
    or None to let the server estimate. Else :data:`REQUEST_BASE_BYTES` plus
    one frame (:func:`frame_bytes`) times :data:`HOST_FRAMES_PER_REQUEST`,
    and the frame shared with its batch (:func:`host_batch_cost`), when
    ``on_host``; else the frame times :data:`DEVICE_FRAMES_PER_REQUEST`, or, when the frame
    is a decoded result read from the sides, the result :data:`RESULT_COPIES` times and
    the per-step latents beside it (:data:`LATENT_RATIO`). Model weights and caches
    shared by all requests are not counted: they are there when the server
    is idle.
    """
    hook = getattr(model, "memory_bytes", None)
    if callable(hook):
        stated = hook(_param_values(model, params))
        if stated is not None:
            return MemoryEstimate(own=max(0, int(stated)))
    own_k = HOST_FRAMES_PER_REQUEST if on_host else DEVICE_FRAMES_PER_REQUEST
    shared_k = 1 if on_host else 0  # its frame, in the batch's (host_batch_cost)
    group: Hashable | None = None
    if shared_k:
        try:
            group = model.batch_key(_param_values(model, params))
        except Exception:  # noqa: BLE001 - a model's own rules; unknown: it batches alone
            group = None
        if group is not None:
            group = ("batch", group)
    found = frame_bytes(model, params)
    nbytes, field = found if found is not None else (0, "params")
    own_per_byte = float(own_k)
    if not on_host and (field in _SIDES or field in image_params(model)):
        own_per_byte = RESULT_COPIES + DEVICE_FRAMES_PER_REQUEST / LATENT_RATIO
    values = _param_values(model, params)
    inputs = sum(w * h * INPUT_BYTES_PER_PIXEL for _, (w, h) in _input_sizes(model, values))
    # Buffers the model builds for this request (a cache entry for a new
    # size): host memory only where the engine computes on the host.
    extra = _model_extra(model, values) if on_host else 0
    return MemoryEstimate(
        own=REQUEST_BASE_BYTES + int(own_per_byte * nbytes) + inputs + extra,
        shared=shared_k * nbytes,
        group=group,
        batch_size=max(1, batch_size) if group is not None else 1,
        batch_cost=host_batch_cost if on_host else None,
        frame_bytes=nbytes,
        own_per_byte=own_per_byte,
        shared_per_byte=float(shared_k),
        field=field,
        model_bytes=extra,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


#: The grain of a suggested size: a multiple every diffusion model takes (8 for SD's VAE, 16 for
#: Flux's and most video models' patches, 32 or 64 for some).
_SUGGEST_GRAIN = 64


def largest_fitting(
    model: StepModel, params: Mapping[str, Any], cap: int, *, on_host: bool, batch_size: int
) -> str | None:
    """The largest picture size, of the request's aspect ratio, whose estimate is within ``cap``:
    ``"WxH"`` (``"N"`` for a model with a square ``size``), in multiples of 64; None when the
    request's size is not what is over (another param is) or not even 64 px fits."""
    values = _param_values(model, params)
    ints = {spec.name for spec in getattr(model, "params", ()) if spec.kind == "int"}
    found = frame_bytes(model, params)
    if found is None or found[1] not in _SIDES:
        return None
    square = "size" in ints and not {"width", "height"} <= ints
    width = int(values.get("width") or values.get("size") or 0) if not square else int(values["size"])
    height = int(values.get("height") or values.get("size") or 0) if not square else width
    if width <= 0 or height <= 0:
        return None
    w = width - width % _SUGGEST_GRAIN
    while w >= _SUGGEST_GRAIN:
        h = max(_SUGGEST_GRAIN, (height * w // width) // _SUGGEST_GRAIN * _SUGGEST_GRAIN)
        trial = {**params, "size": w} if square else {**params, "width": w, "height": h}
        if not square and "size" in trial and "size" in ints:
            trial["size"] = max(w, h)
        if estimate_memory(model, trial, on_host=on_host, batch_size=batch_size).alone <= cap:
            return str(w) if square else f"{w}x{h}"
        w -= _SUGGEST_GRAIN
    return None


def check_memory(
    budget: MemoryBudget,
    model: StepModel,
    params: Mapping[str, Any],
    *,
    engine: Any = None,
    request_id: str,
    retry_after_s: Callable[[], float] | None = None,
) -> MemoryEstimate:
    """:func:`reserve_memory`'s checks without the reservation; the estimate.

    For a door that would do work for the request first (decode its input
    images: ``params`` may then hold anything with the image's ``size`` in
    their place): a request refused for memory costs no decode. Raises as
    :func:`reserve_memory` does.
    """
    on_host = state_on_host(engine) if engine is not None else True
    # Unknown: any number of requests of one batch key may step together.
    batch_size = int(getattr(engine, "max_batch_size", 0) or 0) or _ANY_BATCH
    est = estimate_memory(model, params, on_host=on_host, batch_size=batch_size)
    limit = budget.limit
    env = ServerLimits.env_name("max_memory_bytes")
    cap = int(limit * MAX_REQUEST_MEMORY_SHARE)
    if est.alone > cap:
        parts = [f"one frame {_mib(est.frame_bytes)}"] if est.frame_bytes else []
        if est.model_bytes:
            parts.append(f"the model's state for it {_mib(est.model_bytes)}, as its params ask: a cache, say")
        frame = f" ({'; '.join(parts)})" if parts else ""
        fits = largest_fitting(model, params, cap, on_host=on_host, batch_size=batch_size)
        raise MessageError(
            "limit_exceeded",
            f"this request would hold about {_mib(est.alone)} of memory while it runs{frame}, over "
            f"half of this server's max_memory_bytes={limit} ({env}); ask for a smaller "
            f"{est.field}" + (f": the largest that fits here is {fits}" if fits else ""),
            field=est.field,
            request_id=request_id,
        )
    if not budget.fits(
        est.own, est.shared, group=est.group, batch_size=est.batch_size, batch_cost=est.batch_cost
    ):
        retry = retry_after_s() if retry_after_s is not None else RETRY_AFTER_MIN_S
        raise ServerBusyError(
            f"the server is short of memory: it holds {_mib(budget.total)} of max_memory_bytes="
            f"{limit} ({env}) for running requests and queued messages, and this request needs "
            f"about {_mib(est.alone)}; try again in about {retry:g} s",
            retry_after_s=retry,
            request_id=request_id,
        )
    return est


def reserve_memory(
    budget: MemoryBudget,
    model: StepModel,
    params: Mapping[str, Any],
    *,
    engine: Any = None,
    request_id: str,
    retry_after_s: Callable[[], float] | None = None,
) -> MemoryReservation:
    """Reserve a request's expected memory (:func:`estimate_memory`) in the server's ``budget``.

    Call after :func:`check_params`; release the reservation when the
    request ends (the consumer does: ``stream_request(memory=...)``), or at
    once if it never reaches the engine. ``engine`` tells where requests
    compute (:func:`state_on_host`) and its ``max_batch_size`` (None: on
    the host, batches of any size).

    Raises MessageError ``limit_exceeded`` (field: the param the estimate
    comes from) when the estimate alone is over
    :data:`MAX_REQUEST_MEMORY_SHARE` of ``max_memory_bytes``, and ServerBusyError
    (``retry_after_s()``, else the minimum) when it does not fit beside
    what the server holds now: queued messages, retained results and the
    reservations of running requests.
    """
    est = check_memory(
        budget, model, params, engine=engine, request_id=request_id, retry_after_s=retry_after_s
    )
    return budget.reserve(
        est.own,
        est.shared,
        group=est.group,
        batch_size=est.batch_size,
        batch_cost=est.batch_cost,
        own_per_byte=est.own_per_byte,
        shared_per_byte=est.shared_per_byte,
        frame_bytes=est.frame_bytes,
    )
