"""The model interface the engine drives, and ``from_generator`` for plain loops.

The engine talks to every model through :class:`StepModel`, a *batched*
interface: ``step(states)`` advances several requests by one step each in
one call, each at its own step index. A model that cannot batch simply
returns ``None`` from ``batch_key`` and is always called with one state.

Threading contract: ``load``, ``start``, ``step`` and ``close`` run on the
engine's producer thread, the one thread that owns the accelerator, never on
the event loop. ``validate``, ``total_steps`` and ``batch_key`` run on the
event loop at submission and must be cheap and pure.

Lifecycle of one request::

    params = model.validate(raw)            # loop; raises ParamsError
    total = model.total_steps(params)       # loop
    key = model.batch_key(params)           # loop; None = never batched
    state = model.start(params, device)     # producer thread, before step 1
    frames = model.step([state, ...])       # producer thread, once per step
    model.close(state)                      # producer thread, exactly once

``step`` returns one tensor per state, on any device, holding that step's
frame. The device-to-host copy of it runs on a side stream *while later
steps compute*, so the model must not modify a returned tensor in place
afterwards: return a fresh tensor (or a clone) each step. The engine keeps
the tensor referenced until its copy has completed. A ``step`` that raises
must leave the states it was given unchanged: the engine then retries each
state alone, so one request's failure does not fail the others in its batch.

The result of a request (``output``): every request carries a param
``output``, ``"image"`` (the default) or ``"latent"``, which the engine
checks and adds to the params a model sees unless the model declares an
``output`` param itself. With ``"image"`` the engine calls
``decode(state, frame)`` on the final frame, on the producer thread, as part
of the last step (the accelerator is touched by that thread only); what it
returns is the final frame, copied like any other. A latent model returns its
decoded image there (``[3, H, W]``, floats in ``[-1, 1]`` or ``uint8``) or
video (``[T, 3, H, W]``); the default returns the frame itself, for models
whose frames are pictures already. ``Frame.decoded`` then tells a reader
which frames are decoded output.

Whole-request models: a model that cannot stop between steps on its own (a
library pipeline that runs its loop in one call, with a per-step callback)
sets ``runs_whole_requests = True`` and implements ``run(state, emit)``
instead of ``step``. The producer calls ``run`` for one request at a time;
``run`` calls ``emit(frame)`` once per step, and for the last frame
``emit(frame, decoded=...)`` with the request's output. ``emit`` hands the
frame to the copier and returns when the request may take its next step; if
the request was cancelled, timed out or the engine is stopping, it raises
:class:`RequestStopped`, which ``run`` must let propagate (it ends the
pipeline's loop within one step). Such models are never batched.

Memory (optional, :class:`ModelMemory`): a model that builds buffers for
requests (rendered images, per-size tables) and keeps some of them cached
tells the server about them with three methods; :func:`model_memory`
returns the model when it has all three, else None, and models without
them are unaffected. ``request_memory_bytes(params)`` (event loop, at
admission; params checked, defaults filled in, as ``validate`` returns
them) is the bytes on the model's device one request adds beyond its
frames while it runs: buffers built for it that are not there yet,
counted at their building peak, and its decoded inputs; 0 when everything
it needs is cached. ``cache_bytes()`` is the bytes held now in caches that
requests built and ``trim_cache`` can give back (not what ``load`` built:
that is there when the server is idle). ``trim_cache(keep_bytes=0)``
evicts cached entries, least recently used first, until ``cache_bytes() <=
keep_bytes``, never what ``load`` built, and returns the bytes the cache
no longer holds (a running request keeps what it uses alive through its
state). All three are cheap (no building, no device work) and safe to call
from any thread while the producer thread builds or uses those buffers.

Preparing (optional): a model may define ``prepare(params, device)`` to
build, before a request's ``start``, what that start would otherwise build
on the producer thread (the Mixture's image bank for a new size: seconds
of work during which every other request's steps would wait). The engine
calls it in a worker thread (one request at a time, with one torch thread
on a CPU device) for each request for which ``needs_prepare(params)``
(event loop, cheap; absent: always) is true, and makes that request
runnable only when it returns; the producer keeps stepping the others
meanwhile, and requests with nothing to prepare do not queue behind it. It must be
thread-safe against the producer (which may be building or using the same
buffers) and leave what it built ready for ``start`` (on a CUDA device:
synchronised). Raising fails that request alone (StepFailedError, step 0).

Snapshot and restore (optional): a model whose ``can_snapshot(params)`` is
true for a request (event loop, cheap; the default is False) can turn that
request's state, between two steps, into a :class:`~omni_stream.checkpoint.Checkpoint`
with ``snapshot(state)`` (host tensors and JSON values; the state is not
changed and goes on stepping) and back into a state on any device with
``restore(checkpoint, device)``; the steps after a restore give the frames
the uninterrupted request would have given, bit for bit on the same device
and torch thread count. Both run on the producer thread; both raise
:class:`~omni_stream.errors.CheckpointError` (snapshot: for a state it cannot
capture exactly; restore: for a checkpoint of another model, of a state
format it does not read, or whose params it no longer takes).
``restored_params(checkpoint)`` gives the checked params a restored request
runs with (for ``batch_key`` and ``total_steps``); a restored state is closed
with ``close`` like any other. A model without these (callback mode, a
``from_generator`` model) is never paused, and restarts from step 0.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch

from .checkpoint import Checkpoint
from .errors import CheckpointError, ParamsError, StepFailedError
from .params import Param, positive_int, validate

__all__ = [
    "StepModel",
    "GeneratorModel",
    "from_generator",
    "RequestStopped",
    "Emit",
    "OUTPUTS",
    "OUTPUT_PARAM",
    "split_output",
    "ModelMemory",
    "model_memory",
]

#: The values of the ``output`` param every request has.
OUTPUTS = ("image", "latent")
#: Every request's ``output`` param (see the module docstring).
OUTPUT_PARAM = Param(
    "output",
    "str",
    "image",
    "the final frame: the decoded image (or video), or the final latent",
    choices=OUTPUTS,
)


class RequestStopped(BaseException):
    """Raised by ``emit`` inside :meth:`StepModel.run`: stop this request now.

    The request was cancelled, timed out, or the engine is shutting down.
    A model lets it propagate out of ``run`` (through the library's loop).
    Like ``asyncio.CancelledError`` it derives from BaseException, so that
    an ``except Exception`` in library code around its callbacks does not
    swallow it. Raised by a model itself, it fails the request.
    """


class Emit(Protocol):
    """``emit(frame, *, decoded=False)``: hand one step's frame to the engine (see ``run``)."""

    def __call__(self, frame: torch.Tensor, *, decoded: bool = False) -> None: ...


@runtime_checkable
class ModelMemory(Protocol):
    """A model that reports and gives back the memory it builds for requests (see the module docstring)."""

    def request_memory_bytes(self, params: Mapping[str, Any]) -> int:
        """Bytes one request with these checked params adds on the model's device beyond its frames."""
        ...

    def cache_bytes(self) -> int:
        """Bytes held now in caches requests built (not ``load``'s), that ``trim_cache`` can give back."""
        ...

    def trim_cache(self, keep_bytes: int = 0) -> int:
        """Evict least recently used entries until ``cache_bytes() <= keep_bytes``; the bytes given back."""
        ...


#: The methods of ModelMemory, each of which a model must have, callable.
_MEMORY_METHODS = ("request_memory_bytes", "cache_bytes", "trim_cache")


def model_memory(model: object) -> ModelMemory | None:
    """``model`` as a :class:`ModelMemory` when it has all three methods, else None.

    Stricter than ``isinstance(model, ModelMemory)``, which only checks that
    the names exist: an attribute of one of these names that is not
    callable (a ``cache_bytes`` setting, say) does not make a model one.
    Raises nothing.
    """
    if all(callable(getattr(model, name, None)) for name in _MEMORY_METHODS):
        return cast(ModelMemory, model)
    return None


class StepModel(abc.ABC):
    """Base class of every model the engine can run (see the module docstring)."""

    #: Short name shown in errors, ``omni-stream models`` and metrics.
    name: str = "model"
    #: Declared params; ``validate`` checks against them by default.
    params: tuple[Param, ...] = ()
    #: Largest batch ``step`` accepts; the engine never exceeds it.
    max_batch_size: int = 64
    #: True when the request's output is a video ``[T, 3, H, W]`` (the server
    #: then encodes results as MP4 by default).
    produces_video: bool = False
    #: Name of the ``omni_stream.preview`` decoder for this model's frames
    #: ("rgb", "sd15", "sdxl", "sd3", "flux"); None lets tools guess from the shape.
    preview_decoder: str | None = None

    def describe(self) -> str:
        """One line for ``omni-stream models``."""
        return (self.__doc__ or self.name).strip().splitlines()[0]

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Return complete, checked params; raise ParamsError naming the bad field."""
        return validate(self.params, params, model=self.name)

    @abc.abstractmethod
    def total_steps(self, params: Mapping[str, Any]) -> int:
        """How many frames this request will produce (>= 1)."""

    def batch_key(self, params: Mapping[str, Any]) -> Hashable | None:
        """Requests with equal keys may share a ``step`` call; None never batches."""
        return None

    def load(self, device: torch.device) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Called once on the producer thread before the first ``start``."""

    def unload(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Free the device memory ``load`` took (a worker thread, after the model's engine closed).

        A :class:`~omni_stream.engine.router.ModelRouter` calls it when it
        unloads the model to load another (``max_loaded``); the next ``load``
        brings it back. The default keeps everything where it is.
        """

    @abc.abstractmethod
    def start(self, params: Mapping[str, Any], device: torch.device) -> Any:
        """Create one request's state (latents, RNG, ...) on ``device``."""

    @abc.abstractmethod
    def step(self, states: Sequence[Any]) -> Sequence[torch.Tensor]:
        """Advance every state by one step; return one frame tensor per state."""

    def close(self, state: Any) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Release one request's state; called exactly once, however it ended."""

    def decode(self, state: Any, frame: torch.Tensor) -> torch.Tensor:
        """The request's output, made from its final frame (producer thread).

        Called once per request with ``output: "image"``, right after the step
        that produced ``frame`` (the final one), on the model's device. Return
        the decoded image ``[3, H, W]`` or video ``[T, 3, H, W]`` (floats in
        ``[-1, 1]`` or ``uint8``), a fresh tensor; it becomes the final
        frame. The default returns ``frame`` itself: the frame is the
        picture already. Raising fails the request like a raising step.
        """
        return frame

    def decode_preview(self, state: Any, frame: torch.Tensor) -> torch.Tensor | None:
        """Pixels for a step a reader will preview, or None (producer thread).

        For models with a cheap decoder network (a tiny autoencoder): called
        on the steps the reader asked to preview (``Engine.stream(...,
        preview_every=N)``), not on the final one, right after the step, on
        the model's device. Return an image ``[3, H, W]`` (floats in
        ``[-1, 1]``) to replace the frame, marked ``decoded``; None keeps the
        frame (the default: previews then use the linear decoders). Raising
        fails the request like a raising step.
        """
        return None

    #: True for a model that runs a whole request in one ``run`` call.
    runs_whole_requests: bool = False

    def run(self, state: Any, emit: Emit) -> None:
        """Run a whole request, calling ``emit`` once per step (producer thread).

        Only called when ``runs_whole_requests`` is True (see the module
        docstring). ``emit`` raises :class:`RequestStopped` when the request
        must stop; let it propagate. Emitting more frames than
        ``total_steps`` or returning after fewer fails the request.
        """
        raise NotImplementedError(f"{type(self).__name__} sets runs_whole_requests but has no run()")

    # -- snapshot and restore (optional; see the module docstring) -------------

    #: The layout of the state in this model's checkpoints (``Checkpoint.format``);
    #: a model raises it when it changes what ``snapshot`` writes.
    snapshot_format: int = 1

    @property
    def snapshot_kind(self) -> str:
        """What ``Checkpoint.model`` says for this model; ``restore`` refuses a checkpoint of another."""
        return type(self).__name__

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        """Whether ``snapshot`` can capture a request with these checked params (event loop, cheap).

        The default: no. Such a request is never paused and, after a crash,
        restarts from step 0.
        """
        return False

    def snapshot(self, state: Any) -> Checkpoint:
        """The request's state between two steps as a Checkpoint (producer thread); ``state`` is unchanged.

        Raises CheckpointError where the model cannot capture it exactly (the default: always).
        """
        raise CheckpointError(f"{self.name} cannot snapshot a request's state")

    def restore(self, checkpoint: Checkpoint, device: torch.device) -> Any:
        """A state on ``device`` that goes on from ``checkpoint`` (producer thread).

        Raises CheckpointError for a checkpoint this model cannot restore (the default: any).
        """
        raise CheckpointError(f"{self.name} cannot restore a request's state")

    def restored_params(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """The checked params a request restored from ``checkpoint`` runs with.

        The checkpoint's params checked again by ``validate`` (with the
        ``output`` param the engine adds), so a checkpoint whose params this
        model no longer takes (a LoRA not loaded, a sampler gone) is refused
        before any state is built. Raises CheckpointError for a checkpoint of
        another kind of model (``snapshot_kind``), of another state format
        (``snapshot_format``), with params ``validate`` rejects, or whose step
        count differs from what ``total_steps`` says for them now.
        """
        if checkpoint.model != self.snapshot_kind:
            raise CheckpointError(
                f"{self.name}: the checkpoint is of a {checkpoint.model!r} model, not {self.snapshot_kind!r}"
            )
        if checkpoint.format != self.snapshot_format:
            raise CheckpointError(
                f"{self.name}: checkpoint state format {checkpoint.format} is not the one this model "
                f"reads ({self.snapshot_format})"
            )
        raw, output = split_output(self, self._params_from_checkpoint(checkpoint.params))
        try:
            params = self.validate(raw)
            total = self.total_steps(params)
        except ParamsError as exc:
            raise CheckpointError(f"{self.name}: the checkpoint's params are refused now: {exc}") from exc
        if output is not None:
            params["output"] = output
        if total != checkpoint.total:
            raise CheckpointError(
                f"{self.name}: the checkpoint's request has {checkpoint.total} steps; "
                f"its params give {total} now"
            )
        return params

    def _params_from_checkpoint(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``Checkpoint.params`` as ``validate`` takes them (a model whose checked params do not
        check again as they are converts them back here)."""
        return dict(params)


class GeneratorModel(StepModel):
    """A model made from ``fn(params) -> Iterator[torch.Tensor]``; see :func:`from_generator`."""

    name = "generator"

    def __init__(
        self,
        fn: Callable[[Mapping[str, Any]], Iterator[torch.Tensor]],
        *,
        total: int | Callable[[Mapping[str, Any]], int] | None = None,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"from_generator needs a callable, got {type(fn).__name__}")
        if total is not None and not callable(total):
            positive_int(total, "total", what="from_generator total")
        self._fn = fn
        self._total = total
        self.name = name or str(getattr(fn, "__name__", "generator"))

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        # The wrapped function owns its params; only the shape of the mapping
        # and the step count are ours to check.
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise ParamsError(f"{self.name} params must be a mapping, got {type(params).__name__}")
        out = dict(params)
        self.total_steps(out)
        return out

    def total_steps(self, params: Mapping[str, Any]) -> int:
        total: Any
        if self._total is None:
            total = params.get("steps")
            if total is None:
                raise ParamsError(
                    f"{self.name}: the step count is unknown; pass params['steps'] "
                    "or from_generator(..., total=)",
                    field="steps",
                )
        elif callable(self._total):
            total = self._total(params)
        else:
            total = self._total
        return positive_int(total, "steps", what=f"{self.name}: the step count")

    def start(self, params: Mapping[str, Any], device: torch.device) -> Iterator[torch.Tensor]:
        return iter(self._fn(params))

    def step(self, states: Sequence[Iterator[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for it in states:
            try:
                frame = next(it)
            except StopIteration:
                raise StepFailedError(
                    f"{self.name}: the generator ended before its declared total",
                    request_id=None,
                    step=-1,
                ) from None
            if not isinstance(frame, torch.Tensor):
                raise TypeError(
                    f"{self.name}: each step must yield a torch.Tensor, got {type(frame).__name__}"
                )
            out.append(frame)
        return out

    def close(self, state: Iterator[torch.Tensor]) -> None:
        close = getattr(state, "close", None)
        if close is not None:
            close()


def split_output(
    model: StepModel, params: Mapping[str, Any] | None
) -> tuple[Mapping[str, Any] | None, str | None]:
    """Split the ``output`` param off ``params`` unless ``model`` declares it itself.

    Returns the params for ``model.validate`` and the checked output (None
    when the model checks it). Raises ParamsError naming ``output``.
    """
    if any(p.name == "output" for p in model.params):
        return params, None
    if params is None or not isinstance(params, Mapping):
        return params, "image"  # validate reports a non-mapping
    rest = dict(params)
    output = OUTPUT_PARAM.check(rest.pop("output", "image"), model=model.name)
    return rest, output


def from_generator(
    fn: Callable[[Mapping[str, Any]], Iterator[torch.Tensor]],
    *,
    total: int | Callable[[Mapping[str, Any]], int] | None = None,
    name: str | None = None,
) -> GeneratorModel:
    """Wrap a denoise loop written as a generator.

    ``fn(params)`` yields one tensor (on any device) per step. ``total`` is
    the step count, an int or ``callable(params) -> int``; when omitted,
    ``params["steps"]`` is used. Raises TypeError/ValueError for a bad
    ``fn`` or ``total``.
    """
    return GeneratorModel(fn, total=total, name=name)
