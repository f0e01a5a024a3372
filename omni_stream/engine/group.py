"""EngineGroup: one Engine per device of one machine, behind one EngineLike.

Each member is a plain ``Engine`` (its own producer thread, copier and
model); the group checks a request once, against member 0's model
(engine/intake.py), and routes it. A new request goes to the member with the
least work (active + queued), ties to the lowest index, skipping members
that are dead. The group keeps which member runs each request id, from
``stream()`` until the stream ends (its final frame or error read,
``aclose()``, or the stream dropped), so ``cancel(id)`` finds it and an id
is unique across the group.

A member that dies fails its own requests with EngineDeadError (its engine
does that) and takes no new work; the others keep serving, and ``health()``
stays ok, "degraded" and naming the dead member, until none is left. A
member whose model fails to build or load as the group starts is that same
dead member, from the start: logged once, skipped by routing, named by
health. Only when no member loads does ``start()`` raise.

Lifecycle: the members start one at a time, in order, each once the one
before has its model loaded on its device. Every member's task group is
entered in the task that enters the group, nested in member order, so they
are left in reverse order (anyio's cancel scopes must unwind last in,
first out). Do not start or close the members yourself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import config
from ..device import Device, resolve_device
from ..errors import EngineClosedError, EngineDeadError, ParamsError
from ..frame import Frame
from ..model import StepModel
from .engine import Engine
from .facade import EngineFacade, first_dead
from .intake import already_running, check_request, check_request_id
from .like import FrameStreamLike
from .options import RequestOptions, stream_keywords
from .stats import EngineStatistics, Health
from .stream import FrameStream

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = ["EngineGroup", "GroupStatistics", "GroupStream", "engine_for", "names_group"]

logger = logging.getLogger("omni_stream.engine")

#: What ``model_factory`` may be: a callable building one model (called once
#: per member, with no arguments), a registry spec ("mixture",
#: "diffusers:ID", "module:attr"), or one model for a one-device group.
ModelFactory = Callable[[], StepModel] | str | StepModel

#: What ``devices`` may be: "all", "cpu,cpu", or a sequence of device names
#: or Device instances.
DeviceSpec = str | Device | torch.device | Sequence[str | Device | torch.device]


@dataclass(frozen=True, slots=True)
class GroupStatistics(EngineStatistics):
    """The members' statistics summed, and each member's in ``members`` (in member order)."""

    members: tuple[EngineStatistics, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        # Explicit base call: zero-argument super() breaks in slotted dataclasses.
        out = EngineStatistics.to_dict(self)
        out["members"] = [m.to_dict() for m in self.members]
        return out


def names_group(device: str) -> bool:
    """Whether a ``--device`` value names a group: "all" or a comma-separated list."""
    return device.strip().lower() == "all" or "," in device


def _cuda_devices() -> list[str]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ParamsError(
            "devices='all' takes every CUDA device, and none exists here "
            "(torch.cuda.device_count() is 0); name the devices instead, e.g. devices='cpu,cpu'",
            field="devices",
        )
    return [f"cuda:{i}" for i in range(count)]


def _parse_devices(devices: DeviceSpec) -> list[Device]:
    """Resolve ``devices`` to one Device per member; raises ParamsError naming the bad one."""
    items: list[str | Device | torch.device]
    if isinstance(devices, str):
        if devices.strip().lower() == "all":
            items = list(_cuda_devices())
        else:
            items = [part.strip() for part in devices.split(",")]
            if not all(items):
                raise ParamsError(
                    f"devices {devices!r} has an empty entry; expected e.g. 'cuda:0,cuda:1'",
                    field="devices",
                )
    elif isinstance(devices, (Device, torch.device)):
        items = [devices]
    elif isinstance(devices, Sequence):
        items = list(devices)
    else:
        raise ParamsError(
            f"devices must be 'all', a comma-separated string or a sequence of devices, "
            f"got {type(devices).__name__}",
            field="devices",
        )
    if not items:
        raise ParamsError("devices is empty; an EngineGroup needs at least one device", field="devices")
    resolved: list[Device] = []
    for item in items:
        try:
            device = resolve_device(item)
        except ParamsError as exc:
            exc.field = "devices"
            raise
        if any(device is other for other in resolved):
            raise ParamsError(
                f"devices lists the Device instance {device.name!r} twice; each member needs its own "
                "(names such as 'cpu' or 'cuda:0' may repeat)",
                field="devices",
            )
        resolved.append(device)
    return resolved


def _member_models(model_factory: ModelFactory, count: int) -> list[StepModel | Callable[[], StepModel]]:
    """Member 0's model, built now, and a factory for each other member (built on its producer thread)."""
    if isinstance(model_factory, StepModel):
        if count != 1:
            raise ParamsError(
                f"one model cannot serve {count} devices (each member steps its own); pass a "
                "factory: a callable returning a new model, or a model spec such as 'mixture'",
                field="model_factory",
            )
        return [model_factory]
    if isinstance(model_factory, str):
        from ..models.registry import load_model

        spec = model_factory

        def call() -> Any:
            return load_model(spec)

    elif callable(model_factory):
        call = model_factory
    else:
        raise ParamsError(
            "model_factory must be a callable returning a StepModel, a model spec string or a "
            f"StepModel, got {type(model_factory).__name__}",
            field="model_factory",
        )
    built: set[int] = set()  # ids of the models made: each member needs its own
    lock = threading.Lock()

    def build() -> StepModel:
        model = call()
        if not isinstance(model, StepModel):
            raise ParamsError(
                f"model_factory returned {type(model).__name__}, not an omni_stream.StepModel",
                field="model_factory",
            )
        with lock:
            if id(model) in built:
                raise ParamsError(
                    "model_factory returned the same model twice; each member needs its own",
                    field="model_factory",
                )
            built.add(id(model))
        return model

    # Member 0's model now: requests are checked against it, by a server
    # too, before anything starts. The others are built one at a time as
    # the group starts, each on its member's producer thread once the
    # previous member loaded its own (one model in host memory at a time,
    # not N before any moves to its device).
    first = build()
    return [first, *([build] * (count - 1))]


def _sum_statistics(members: Sequence[EngineStatistics]) -> GroupStatistics:
    totals: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStatistics):
        values = [getattr(s, f.name) for s in members]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            totals[f.name] = sum(values)
        elif all(isinstance(v, Mapping) for v in values):
            merged: dict[Any, Any] = {}
            for v in values:
                for key, count in v.items():
                    merged[key] = merged.get(key, 0) + count
            totals[f.name] = merged
        else:  # a field that does not add up: member 0's
            totals[f.name] = values[0]
    return GroupStatistics(**totals, members=tuple(members))


class GroupStream(FrameStreamLike):
    """One request's frames from the member running it; a FrameStream that frees its id at its end."""

    def __init__(self, group: EngineGroup, inner: FrameStream, member: int) -> None:
        self._group = group
        self._inner = inner
        self._member = member
        # What the group's map holds for this stream: not the stream itself,
        # or a dropped stream would never be collected (nor its request cancelled).
        self._token = object()
        self._released = False

    @property
    def request_id(self) -> str:
        return self._inner.request_id

    @property
    def total(self) -> int:
        return self._inner.total

    @property
    def params(self) -> Mapping[str, Any]:
        """The request's params as the model checked them, defaults filled in."""
        return self._inner.params

    @property
    def member(self) -> int:
        """The index of the member (and of its device in ``group.devices``) running the request."""
        return self._member

    async def __anext__(self) -> Frame:
        try:
            frame = await self._inner.__anext__()
        except BaseException:
            # The end (StopAsyncIteration), the request's error, or the
            # reader's cancellation: either way the id is free again.
            self._release()
            raise
        if frame.final:
            self._release()
        return frame

    def poll(self) -> Frame | None:
        """The next frame if one is ready now, else None; never waits, never raises."""
        frame = self._inner.poll()
        if frame is not None and frame.final:
            self._release()
        return frame

    async def aclose(self) -> None:
        """Stop the request if it has not finished; idempotent."""
        try:
            await self._inner.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._group._forget(self.request_id, self._token)

    def __del__(self) -> None:
        # The inner stream's own __del__ cancels the request; this frees the id.
        if not getattr(self, "_released", True):
            self._release()


class EngineGroup(EngineFacade):
    """One Engine per device, used as one: ``async with EngineGroup(factory, devices="cpu,cpu")``.

    ``model_factory``: a callable returning a new StepModel (called once per
    member with no arguments: for member 0 in this constructor, so that the
    group has a model to check requests against before it starts; for each
    other member on its producer thread as the group starts, one member at
    a time, after the previous one loaded its model onto its device), a
    model spec string
    (``models.registry.load_model``: "mixture", "diffusers:ID",
    "module:attr"), or a StepModel when there is one device. A member
    whose model fails to build or load is left out (see ``start``).
    ``devices``:
    "all" (every CUDA device), a comma-separated string ("cuda:0,cuda:1"),
    or a sequence of device names or Device instances; names may repeat
    ("cpu,cpu"). ``engine_options`` go to every member's Engine; without
    ``torch_threads`` each member gets ``config.torch_threads(members=N)``
    for the N members computing on the CPU, which splits the cores.

    Raises ParamsError for bad devices, a bad factory or bad options.
    Satisfies EngineLike; enter and leave it from one task.
    """

    _noun = "engine group"

    def __init__(
        self,
        model_factory: ModelFactory,
        devices: DeviceSpec = "all",
        **engine_options: Any,
    ) -> None:
        resolved = _parse_devices(devices)
        models = _member_models(model_factory, len(resolved))
        if engine_options.get("torch_threads") is None:
            on_cpu = sum(1 for d in resolved if d.computes_on_cpu)
            engine_options["torch_threads"] = config.torch_threads(members=max(1, on_cpu))
        super().__init__()
        self._members: tuple[Engine, ...] = tuple(
            Engine(model, device=device, **engine_options)
            for model, device in zip(models, resolved, strict=True)
        )
        # request id -> (member index, its stream's token). Written on the loop; read
        # by cancel() from any thread and cleared by a stream's __del__
        # wherever the collector runs it: hence the lock (re-entrant, as a
        # collection may run __del__ while this thread holds it).
        self._where: dict[str, tuple[int, object]] = {}
        self._lock = threading.RLock()

    # -- what it is --------------------------------------------------------------

    @property
    def members(self) -> tuple[Engine, ...]:
        """The member engines, in device order (read-only use: the group starts and closes them)."""
        return self._members

    @property
    def devices(self) -> tuple[str, ...]:
        """Each member's device name, in member order."""
        return tuple(m.device.name for m in self._members)

    @property
    def model(self) -> StepModel:
        """Member 0's model: every member's is built alike, so requests are checked against it."""
        return self._members[0].model

    @property
    def max_batch_size(self) -> int:
        """The members' max_batch_size summed: the most requests advanced at once."""
        return sum(m.max_batch_size for m in self._members)

    def __repr__(self) -> str:
        return f"<EngineGroup {self._state.value} devices={','.join(self.devices)}>"

    # -- lifecycle ---------------------------------------------------------------

    async def _start(self) -> None:
        """Start the members in order, each once the one before has loaded its model.

        A member whose model fails to build or load (EngineDeadError) is
        left out, dead, as if it had died later. Raises EngineDeadError
        naming every member's cause if none loaded; anything else a member
        raises (the factory's ParamsError, a cancellation) propagates, and
        start() closes the members (one cancelled inside its own start may
        have entered its task group; one never started closes at once).
        """
        failures: list[str] = []
        first_cause: BaseException | None = None
        for i, member in enumerate(self._members):
            try:
                await member.start()
                # Explicitly, not left to start(): a member given a model
                # instance starts before it is loaded, and the next member
                # must not build its model until this one's is on its
                # device (one model in host memory at a time).
                await member.wait_loaded()
            except EngineDeadError as exc:
                # The innermost task group so far: closing it now keeps the order.
                await member.aclose()
                failures.append(f"member {i} ({member.device.name}): {exc}")
                first_cause = first_cause or exc.__cause__ or exc
                logger.error(
                    "engine group: member %d (%s) could not start and is left out: %s",
                    i,
                    member.device.name,
                    exc,
                    exc_info=exc.__cause__ or exc,
                )
        if len(failures) == len(self._members):
            raise EngineDeadError(
                f"no member of the engine group could start: {'; '.join(failures)}"
            ) from first_cause

    async def _shutdown(self) -> None:
        """Close every member (last started first); their pending streams end with EngineClosedError.

        A member whose device is wedged delays this by its ``shutdown_timeout``.
        The first error a member's close raised is re-raised once all are closed.
        """
        first: BaseException | None = None
        for member in reversed(self._members):
            try:
                await member.aclose()
            except BaseException as exc:  # a cancellation too: close the rest, then re-raise
                if first is None:
                    first = exc
                else:
                    logger.warning("closing %s raised %r", member.device.name, exc)
        if first is not None:
            raise first

    # -- submitting ----------------------------------------------------------------

    def _pick(self, request_id: str) -> int:
        """The member for a new request: the least loaded of the ok ones, else of the stalled ones."""
        ok: list[tuple[int, int]] = []
        stalled: list[tuple[int, int]] = []
        for i, member in enumerate(self._members):
            h = member.health()
            load = h.statistics.active + h.statistics.queued
            if h.status == "ok":
                ok.append((load, i))
            elif h.status == "stalled":
                stalled.append((load, i))  # may recover; better than refusing
        candidates = ok or stalled
        if candidates:
            return min(candidates)[1]
        reason = self._describe(self._health_of_members())
        dead = first_dead(self._members)
        if dead is not None:
            raise EngineDeadError(
                f"every member of the engine group is dead or closed: {reason}", request_id=request_id
            ) from dead
        raise EngineClosedError(
            f"every member of the engine group is closed: {reason}", request_id=request_id
        )

    @stream_keywords(RequestOptions)
    def stream(
        self, params: Mapping[str, Any] | None = None, **options: Unpack[RequestOptions]
    ) -> GroupStream:
        """Submit a request to the least loaded live member; returns its frames.

        The request is checked once, against ``model`` (engine/intake.py),
        then routed. Raises as ``Engine.stream`` does: ParamsError (bad
        params or options, or a request_id still running anywhere in the
        group), EngineDeadError (every member dead), EngineClosedError at
        once; iterating raises StepFailedError, StepTimeoutError,
        RequestCancelledError, EngineDeadError (its member died) or
        EngineClosedError.
        """
        request_id = options["request_id"] = check_request_id(options["request_id"])
        self._check_open(request_id)
        if request_id in self._where:
            raise already_running(request_id)
        checked = check_request(self.model, params, **options)
        index = self._pick(request_id)
        inner = self._members[index].submit(checked)
        stream = GroupStream(self, inner, index)
        with self._lock:
            self._where[inner.request_id] = (index, stream._token)
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a request on whichever member runs it; True if it was still running.

        Its reader gets RequestCancelledError. Safe to call from any thread.
        """
        with self._lock:
            entry = self._where.get(request_id)
        if entry is None:
            return False
        return self._members[entry[0]].cancel(request_id)

    def pause(self, request_id: str, *, to_host: bool = False) -> bool:
        """``Engine.pause`` on the member running the request: False as there, and for an id the
        group holds no stream of. Safe from any thread."""
        member = self._member_running(request_id)
        return member is not None and member.pause(request_id, to_host=to_host)

    def resume(self, request_id: str) -> bool:
        """``Engine.resume`` on the member running the request. Safe from any thread."""
        member = self._member_running(request_id)
        return member is not None and member.resume(request_id)

    def is_paused(self, request_id: str) -> bool:
        """Whether the request is paused now (``Engine.is_paused`` on its member)."""
        member = self._member_running(request_id)
        return member is not None and member.is_paused(request_id)

    def pause_refusal(self, request_id: str) -> str | None:
        """``Engine.pause_refusal`` on the member running the request (None for an id the group
        holds no stream of)."""
        member = self._member_running(request_id)
        return None if member is None else member.pause_refusal(request_id)

    def _member_running(self, request_id: str) -> Engine | None:
        index = self.member_of(request_id)
        return None if index is None else self._members[index]

    def member_of(self, request_id: str) -> int | None:
        """The index of the member running ``request_id``, or None if the group holds no such stream."""
        with self._lock:
            entry = self._where.get(request_id)
        return None if entry is None else entry[0]

    def _forget(self, request_id: str, token: object) -> None:
        with self._lock:
            entry = self._where.get(request_id)
            if entry is not None and entry[1] is token:  # not a later request reusing the id
                del self._where[request_id]

    # -- health and statistics -------------------------------------------------------

    def statistics(self) -> GroupStatistics:
        """The members' counters summed, with each member's in ``members``."""
        return _sum_statistics([m.statistics() for m in self._members])

    def _health_of_members(self) -> list[Health]:
        return [m.health() for m in self._members]

    def _describe(self, healths: Sequence[Health], *, only_bad: bool = False) -> str:
        return "; ".join(
            f"member {i} ({h.device}) is {h.status}" + (f": {h.reason}" if h.reason else "")
            for i, h in enumerate(healths)
            if not (only_bad and h.ok)
        )

    def _death_cause(self) -> BaseException | None:
        return first_dead(self._members)

    def health(self) -> Health:
        """ok while any member is ok (the reason, "degraded: ...", then names the members
        that are not); else stalled if any member is, else dead if any is, else closed."""
        healths = self._health_of_members()
        stats = _sum_statistics([h.statistics for h in healths])
        devices = ",".join(h.device for h in healths)
        closed = self._lifecycle_health(stats, devices)
        if closed is not None:
            return closed
        statuses = {h.status for h in healths}
        if "ok" in statuses:
            bad = self._describe(healths, only_bad=True)
            return Health("ok", f"degraded: {bad}" if bad else None, stats, devices)
        status = next(s for s in ("stalled", "dead", "closed") if s in statuses)
        return Health(status, self._describe(healths), stats, devices)


def engine_for(
    model: ModelFactory,
    device: str = "auto",
    **engine_options: Any,
) -> Engine | EngineGroup:
    """An Engine for one device name, or an EngineGroup when ``device`` names several.

    What ``--device`` means on the command line: "all" or a comma-separated
    list ("cuda:0,cuda:1", "cpu,cpu") gives a group; anything else one
    Engine. ``model`` is a StepModel, a factory or a model spec string, as
    for EngineGroup. Raises ParamsError as Engine and EngineGroup do.
    """
    if names_group(device):
        return EngineGroup(model, devices=device, **engine_options)
    if isinstance(model, str):
        from ..models.registry import load_model

        built = load_model(model)
    elif isinstance(model, StepModel):
        built = model
    elif callable(model):
        built = model()
    else:
        built = model  # Engine raises ParamsError naming what it got
    return Engine(built, device=device, **engine_options)
