"""simcuda: the simulated GPU has torch.cuda's names, signatures and meanings.

The engine died on its first real GPU because the simulator's ``Event.wait``
meant "wait on the host, with a timeout" while torch's makes a *stream* wait.
So: every method or function the simulator shares a name with in torch
(the installed torch, CPU build or CUDA) has torch's signature, every
method of torch's ``Event`` and ``Stream`` exists here, and the meanings are
checked one by one below.
"""

from __future__ import annotations

import gc
import inspect
import threading
import time
from typing import Any

import pytest
import torch

import omni_stream.device as device_package
from omni_stream.device import base, simcuda

# Parameters the simulator has and an older torch may not: they exist in the torch the
# project is developed on (2.13), and the GPU machine's torch (2.11) may lack them.
_NEWER_TORCH = {("Event", "__init__"): {"external"}}


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _same_signature(fake: Any, real: Any, where: tuple[str, str]) -> str | None:
    """None if ``fake`` takes exactly ``real``'s parameters (annotations aside), else why not."""
    try:
        want = _params(real)
    except (TypeError, ValueError):
        return None  # a C method without a signature (a CUDA build's base class): nothing to compare
    got = _params(fake)
    extra = _NEWER_TORCH.get(where, set())
    trimmed = [p for p in got if p[0] not in extra or p[0] in {w[0] for w in want}]
    if trimmed != want:
        return f"{where[0]}.{where[1]}: {got} != torch's {want}"
    return None


def _methods(cls: type) -> dict[str, Any]:
    """Public methods (and dunder protocol methods) a class defines, with its bases but object's."""
    out: dict[str, Any] = {}
    for name in dir(cls):
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            continue
        if name in vars(object) or name in {"__dict__", "__weakref__", "__module__", "__init__", "__new__"}:
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr):
            out[name] = getattr(cls, name)
    for name in ("__eq__", "__hash__", "__repr__"):
        if name in vars(cls):
            out[name] = getattr(cls, name)
    return out


def _torch_methods(cls: type) -> dict[str, Any]:
    """The methods torch's Python class defines (the same on CPU and CUDA builds)."""
    return {
        name: getattr(cls, name)
        for name, attr in vars(cls).items()
        if (isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr))
        and name not in {"__new__", "__init__"}
    }


@pytest.mark.parametrize(("fake", "real"), [(simcuda.Event, torch.cuda.Event), (simcuda.Stream, torch.cuda.Stream)],
                         ids=["Event", "Stream"])
def test_the_simulators_event_and_stream_have_exactly_torchs_methods_and_signatures(fake: type, real: type) -> None:
    name = real.__name__
    problems = []
    # Construction: torch's __new__ against the simulator's constructor.
    problem = _same_signature(fake, real, (name, "__init__"))
    if problem:
        problems.append(problem)
    theirs, ours = _torch_methods(real), _methods(fake)
    problems += [f"{name}.{m}: missing (torch has it)" for m in sorted(set(theirs) - set(ours))]
    problems += [f"{name}.{m}: torch has no such method" for m in sorted(set(ours) - set(theirs))
                 if not hasattr(real, m)]
    for m in sorted(set(ours) & set(dir(real))):
        problem = _same_signature(ours[m], getattr(real, m), (name, m))
        if problem:
            problems.append(problem)
    assert problems == []


def test_every_fake_event_or_stream_of_the_device_package_uses_torchs_names_with_torchs_signatures() -> None:
    # Any class in omni_stream.device standing in for an event or a stream: a method whose
    # name torch's Event or Stream uses must take torch's parameters (CompletedEvent's query
    # and synchronize, the simulator's whole API).
    fakes = {
        cls
        for module in (base, simcuda, *[getattr(device_package, n) for n in ("cpu", "sim", "pool")])
        for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__.startswith("omni_stream.device")
        and (cls.__name__.endswith("Event") or cls.__name__.endswith("Stream"))
        and cls is not base.CopyEvent
    }
    assert {simcuda.Event, simcuda.Stream, base.CompletedEvent} <= fakes
    problems = []
    for fake in sorted(fakes, key=lambda c: c.__qualname__):
        for real in (torch.cuda.Event, torch.cuda.Stream):
            for name, method in _methods(fake).items():
                if name in dir(real) and name not in vars(object):
                    problem = _same_signature(method, getattr(real, name), (fake.__name__, name))
                    if problem:
                        problems.append(f"{problem} (against {real.__qualname__})")
    assert problems == []


def test_a_fake_whose_wait_means_something_else_is_caught() -> None:
    # What the old simulator had: the check above must see it.
    class TimedWaitEvent:
        def query(self) -> bool:
            return True

        def wait(self, timeout: float) -> bool:
            return True

    problem = _same_signature(TimedWaitEvent.wait, torch.cuda.Event.wait, ("TimedWaitEvent", "wait"))
    assert problem is not None and "timeout" in problem


_ENGINE_USES = ("Event", "Stream", "StreamContext", "stream", "current_stream", "default_stream",
                "set_stream", "synchronize", "_sleep", "set_device", "is_available", "device_count",
                "current_device")


@pytest.mark.parametrize("name", _ENGINE_USES)
def test_the_simulators_functions_are_torch_cudas(name: str) -> None:
    fake, real = getattr(simcuda, name), getattr(torch.cuda, name)
    assert _same_signature(fake, real, ("torch.cuda", name)) is None


# -- meanings ---------------------------------------------------------------------------

_MS = int(simcuda.CLOCK_HZ / 1000)  # cycles a millisecond


def test_an_event_never_recorded_is_complete_and_waiting_on_it_is_a_no_op() -> None:
    e = simcuda.Event()
    assert e.query()
    e.synchronize()  # returns at once
    s = simcuda.Stream()
    e.wait(s)
    assert s.record_event().query() or (s.synchronize() is None)


def test_a_recorded_event_completes_when_its_stream_reaches_it() -> None:
    s = simcuda.Stream()
    with simcuda.stream(s):
        simcuda._sleep(60 * _MS)
    e = simcuda.Event(blocking=True)
    e.record(s)
    assert not e.query() and not s.query()
    t0 = time.monotonic()
    e.synchronize()
    assert time.monotonic() - t0 > 0.03
    assert e.query() and s.query()


def test_event_wait_makes_a_stream_wait_and_returns_at_once() -> None:
    first, second = simcuda.Stream(), simcuda.Stream()
    with simcuda.stream(first):
        simcuda._sleep(80 * _MS)
    done = simcuda.Event()
    done.record(first)
    t0 = time.monotonic()
    assert done.wait(second) is None  # returns None, at once: the host does not wait
    assert time.monotonic() - t0 < 0.05
    after = second.record_event()
    assert not after.query(), "work queued on the waiting stream ran before the event"
    after.synchronize()
    assert done.query()


def test_event_wait_with_a_timeout_fails_as_torch_does() -> None:
    e = simcuda.Event()
    e.record(simcuda.Stream())
    with pytest.raises(RuntimeError, match="expected stream to be a torch.Stream"):
        e.wait(0.25)  # type: ignore[arg-type]


def test_a_stream_waits_for_the_record_that_was_latest_when_it_was_told_to_wait() -> None:
    busy, waiting = simcuda.Stream(), simcuda.Stream()
    e = simcuda.Event()
    e.record(busy)  # completes at once
    e.synchronize()
    waiting.wait_event(e)  # the record above: already complete
    with simcuda.stream(busy):
        simcuda._sleep(200 * _MS)
    e.record(busy)  # a later record: the wait above does not see it
    mark = waiting.record_event()
    mark.synchronize()
    assert not e.query(), "the stream waited for a record made after its wait"
    e.synchronize()


def test_wait_stream_orders_after_the_work_queued_so_far() -> None:
    compute, copy = simcuda.Stream(), simcuda.Stream()
    with simcuda.stream(compute):
        simcuda._sleep(50 * _MS)
    copy.wait_stream(compute)
    mark = copy.record_event()
    assert not mark.query()
    mark.synchronize()
    assert compute.query()


def test_elapsed_time_follows_torchs_rules() -> None:
    s = simcuda.Stream()
    start, end = simcuda.Event(enable_timing=True), simcuda.Event(enable_timing=True)
    with pytest.raises(ValueError, match="recorded"):
        start.elapsed_time(end)
    with pytest.raises(ValueError, match="enable_timing"):
        simcuda.Event().elapsed_time(end)
    start.record(s)
    with simcuda.stream(s):
        simcuda._sleep(30 * _MS)
    end.record(s)
    if not end.query():
        with pytest.raises(RuntimeError, match="completed"):
            start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) >= 25


def test_a_non_blocking_copy_into_pinned_memory_is_queued_on_the_current_stream() -> None:
    s = simcuda.Stream()
    src = torch.arange(8, dtype=torch.float32)
    dst = simcuda.pinned_empty((8,), torch.float32)
    dst.fill_(-1)
    with simcuda.stream(s):
        simcuda._sleep(50 * _MS)
        dst.copy_(src, non_blocking=True)
        landed = simcuda.Event()
        landed.record()  # the current stream: s
    assert torch.equal(dst, torch.full((8,), -1.0)), "the bytes landed before the stream got there"
    landed.synchronize()
    assert torch.equal(dst, src)


def test_a_copy_into_pageable_memory_waits_for_the_stream_as_cuda_makes_it() -> None:
    s = simcuda.Stream()
    src = torch.arange(4, dtype=torch.float32)
    dst = torch.full((4,), -1.0)
    with simcuda.stream(s):
        simcuda._sleep(50 * _MS)
        dst.copy_(src, non_blocking=True)
        assert s.query(), "a pageable copy returned before the stream's queued work ran"
    assert torch.equal(dst, src)


def test_a_source_dropped_before_its_copy_ran_is_read_as_garbage() -> None:
    # On a GPU the caching allocator hands a freed source to the next kernel: the simulator
    # makes that read deterministic, so a copier that lets go too early fails bit-for-bit checks.
    s = simcuda.Stream()
    dst = simcuda.pinned_empty((16,), torch.float32)
    with simcuda.stream(s):
        simcuda._sleep(30 * _MS)
        dst.copy_(torch.ones(16), non_blocking=True)  # nobody keeps the source
        landed = s.record_event()
    gc.collect()
    landed.synchronize()
    assert torch.equal(dst.view(torch.uint8), torch.full((64,), simcuda.POISON, dtype=torch.uint8))
    kept = torch.ones(16)
    with simcuda.stream(s):
        dst.copy_(kept, non_blocking=True)
        landed = s.record_event()
    landed.synchronize()
    assert torch.equal(dst, kept)


def test_the_current_stream_is_per_thread_and_stream_contexts_nest() -> None:
    a, b = simcuda.Stream(), simcuda.Stream()
    assert simcuda.current_stream() == simcuda.default_stream()
    with simcuda.stream(a):
        assert simcuda.current_stream() == a
        seen: list[Any] = []
        t = threading.Thread(target=lambda: seen.append(simcuda.current_stream()))
        t.start()
        t.join()
        assert seen == [simcuda.default_stream()]
        with simcuda.stream(b):
            assert simcuda.current_stream() == b
        assert simcuda.current_stream() == a
        with simcuda.stream(None):  # torch: None does nothing
            assert simcuda.current_stream() == a
    assert simcuda.current_stream() == simcuda.default_stream()


def test_stream_synchronize_and_query_cover_all_work_queued_so_far() -> None:
    s = simcuda.Stream()
    with simcuda.stream(s):
        simcuda._sleep(40 * _MS)
    assert not s.query()
    s.synchronize()
    assert s.query()


def test_the_simulated_gpu_is_one_device() -> None:
    simcuda.set_device(0)
    simcuda.set_device("cuda:0")
    simcuda.set_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="one device"):
        simcuda.set_device("cuda:1")
    with pytest.raises(ValueError, match="one device"):
        simcuda.Stream(device="cuda:3")
    assert simcuda.is_available() and simcuda.device_count() == 1 and simcuda.current_device() == 0
