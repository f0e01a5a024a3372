"""A simulated GPU behind torch.cuda's own API: streams, events and asynchronous copies on the CPU.

The engine's CUDA code (``device/cuda.py``) and the GPU tests run unchanged
against this module in place of ``torch.cuda``, so CI exercises the real
copy path without a GPU. Hence the rule this module keeps: every name it
shares with ``torch.cuda`` has torch's signature and torch's meaning
(``tests/device/test_simcuda.py`` compares them with the installed torch).
The engine once died on its first real GPU because an earlier simulator gave
``Event.wait`` a timed-host-wait meaning; on CUDA, ``Event.wait(stream)``
makes a *stream* wait for the event, device side, and returns None.

What is simulated, and how:

* Each ``Stream`` is a FIFO of operations run in order by one worker thread
  (a stream's work is ordered; two streams' work overlaps). The default
  stream is one such stream, and ``current_stream()`` is per thread, as in
  torch.
* Kernels cost time only where a caller says so: ``_sleep(cycles)`` keeps a
  stream busy for ``cycles / CLOCK_HZ`` seconds (``torch.cuda._sleep`` spins
  the GPU for that many cycles). Tensor operations themselves run on the CPU,
  synchronously, on the thread that calls them: tensors of the simulated GPU
  are CPU tensors.
* ``Event.record(stream)`` completes when the stream reaches it;
  ``Event.wait(stream)`` holds the stream until the event's latest record
  (at the time of the call) completed; ``query()`` never blocks;
  ``synchronize()`` blocks the calling thread. An event never recorded
  queries True, and waiting on it is a no-op (CUDA's lazily created events).
* ``dst.copy_(src, non_blocking=True)`` inside ``with stream(s)``, into a
  buffer from :func:`pinned_empty`, is queued on ``s``: ``dst`` keeps its
  stale bytes until the stream gets there, and only an event recorded after
  it says when. Into any other (pageable) buffer the copy is synchronous, as
  CUDA makes it. A source whose every reference the caller dropped before
  the copy ran is read as garbage (the bytes of ``POISON``): on a GPU the
  caching allocator hands freed memory to the next kernel, so a copier that
  does not keep its source alive reads another step's data, and the frame
  tests comparing bit for bit catch it here.

Not simulated: several devices (there is one, and its tensors live on the
CPU: ``Stream.device`` is ``cpu``), IPC, graphs, allocator statistics.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "CLOCK_HZ",
    "POISON",
    "Event",
    "Stream",
    "StreamContext",
    "current_device",
    "current_stream",
    "default_stream",
    "device_count",
    "is_available",
    "pinned_empty",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]

#: Cycles a second of the simulated GPU: ``_sleep(cycles)`` is busy ``cycles / CLOCK_HZ`` s.
CLOCK_HZ = 1.0e9
#: The byte a copy from a source already freed fills its destination with.
POISON = 0xA5

_DEVICE = torch.device("cpu")


def _check_stream(stream: Any) -> Stream:
    # torch's own words for a stream argument that is not a stream (a timeout, say).
    if not isinstance(stream, Stream):
        raise RuntimeError("expected stream to be a torch.Stream or torch.cuda.Stream object")
    return stream


def _check_device(device: Any) -> None:
    """The simulated GPU's tensors are CPU tensors: it is named by None, 0, "cpu", "cuda" or its device."""
    if device is None or device == 0:
        return
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type in ("cpu", "cuda") and device.index in (None, 0):
        return
    raise ValueError(f"the simulated GPU is one device (cpu, cuda or cuda:0); got {device!r}")


# -- streams ------------------------------------------------------------------------------------


class _Queue:
    """One stream's work: operations run in order by a worker thread of its own.

    ``busy`` keeps a device clock: back-to-back busy operations end at
    ``previous end + duration``, not ``now + duration``, so a sleep's late
    wake-up does not add up over many kernels (a GPU runs queued kernels back
    to back too). No lock on the way in: a lock the worker held while it
    waited for the GIL made the enqueuing thread (the producer) wait on it,
    a cost no GPU has.
    """

    def __init__(self, name: str) -> None:
        self._ops: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._clock = 0.0
        self._numbers = itertools.count(1)
        self._issued = 0  # the number of the latest operation queued
        self._done = 0  # the number of the latest operation run
        thread = threading.Thread(target=self._run, args=(self._ops,), name=name, daemon=True)
        thread.start()

    def put(self, op: Callable[[], None]) -> None:
        number = next(self._numbers)  # (a C call: atomic under the GIL)
        if number > self._issued:
            self._issued = number
        self._ops.put((number, op))

    def busy(self, seconds: float) -> None:
        """Occupy the stream for ``seconds`` (called from an operation on it)."""
        now = time.monotonic()
        end = max(self._clock, now) + seconds
        self._clock = end
        if end > now:
            time.sleep(end - now)

    def idle(self) -> bool:
        return self._done >= self._issued

    def _run(self, ops: queue.SimpleQueue[tuple[int, Callable[[], None]] | None]) -> None:
        while True:
            item = ops.get()
            if item is None:
                return
            number, op = item
            try:
                op()
            finally:
                self._done = number

    def close(self) -> None:
        self._ops.put(None)


_stream_ids = itertools.count(1)
_live_streams: weakref.WeakSet[Stream] = weakref.WeakSet()


class Stream:
    """``torch.cuda.Stream``: an ordered queue of work on the simulated GPU.

    ``priority`` is kept and otherwise ignored. Its worker thread ends when
    the stream is garbage collected, after the work queued on it ran.
    """

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        _check_device(device)
        if kwargs:
            raise TypeError(f"the simulated Stream takes no {', '.join(sorted(kwargs))}")
        self.priority = int(priority)
        self.cuda_stream = next(_stream_ids)
        self._queue = _Queue(f"omni-stream-simcuda-stream-{self.cuda_stream}")
        weakref.finalize(self, self._queue.close)
        _live_streams.add(self)

    @property
    def device(self) -> torch.device:
        return _DEVICE

    def wait_event(self, event: Event) -> None:
        """Make all future work on this stream wait for ``event``'s latest record; returns at once."""
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        """Make all future work on this stream wait for the work queued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream; returns it."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True once all the work queued on this stream so far has run; never blocks."""
        return self._queue.idle()

    def synchronize(self) -> None:
        """Block the calling thread until all the work queued on this stream so far has run."""
        self.record_event().synchronize()

    def __eq__(self, o: object) -> bool:
        if isinstance(o, Stream):
            return self.cuda_stream == o.cuda_stream
        return False

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device))

    def __repr__(self) -> str:
        return f"<omni_stream.device.simcuda.Stream cuda_stream={self.cuda_stream:#x}>"

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)

    # -- the simulator's own --

    def _enqueue(self, op: Callable[[], None]) -> None:
        self._queue.put(op)

    def _busy(self, seconds: float) -> None:
        self._queue.busy(seconds)


# -- events -------------------------------------------------------------------------------------


class Event:
    """``torch.cuda.Event``: a marker in a stream's work.

    ``blocking`` and ``enable_timing`` have their meanings; a host thread in
    ``synchronize()`` always sleeps here (as CUDA's ``blocking=True`` does).
    """

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        if interprocess:
            raise RuntimeError("the simulated GPU has no interprocess events")
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self._cond = threading.Condition(threading.Lock())
        self._recorded = 0  # records issued
        self._completed = 0  # records the stream reached
        self._completed_at = 0.0  # monotonic time the latest completed record was reached

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: Any) -> Event:
        """Not simulated: raises RuntimeError."""
        raise RuntimeError("the simulated GPU has no interprocess events")

    def record(self, stream: Stream | None = None) -> None:
        """Record this event on ``stream`` (the current stream if None): it completes when the
        stream reaches this point. A new record replaces the last for ``query`` and ``wait``."""
        stream = current_stream() if stream is None else _check_stream(stream)
        with self._cond:
            self._recorded += 1
            mark = self._recorded

        def reached() -> None:
            with self._cond:
                if mark > self._completed:
                    self._completed = mark
                    self._completed_at = time.monotonic()
                self._cond.notify_all()

        stream._enqueue(reached)

    def wait(self, stream: Stream | None = None) -> None:
        """Make all future work on ``stream`` (the current stream if None) wait for this event's
        latest record; returns at once. A no-op for an event never recorded."""
        stream = current_stream() if stream is None else _check_stream(stream)
        with self._cond:
            mark = self._recorded
        if mark == 0:
            return
        stream._enqueue(lambda: self._wait_for(mark))

    def query(self) -> bool:
        """True once the latest record completed (or it was never recorded); never blocks."""
        with self._cond:
            return self._completed >= self._recorded

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event's completion to ``end_event``'s.

        Raises ValueError unless both were made with ``enable_timing=True`` and
        recorded, RuntimeError unless both completed (torch's checks).
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if not (self._recorded and end_event._recorded):
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end_event._completed_at - self._completed_at) * 1e3

    def synchronize(self) -> None:
        """Block the calling thread until the latest record completed (at once if never recorded)."""
        with self._cond:
            mark = self._recorded
        self._wait_for(mark)

    def ipc_handle(self) -> bytes:
        """Not simulated: raises RuntimeError."""
        raise RuntimeError("the simulated GPU has no interprocess events")

    def __repr__(self) -> str:
        state = "uninitialized" if not self._recorded else ("completed" if self.query() else "pending")
        return f"<omni_stream.device.simcuda.Event {state}>"

    def _wait_for(self, mark: int) -> None:
        with self._cond:
            while self._completed < mark:
                self._cond.wait()


# -- the current stream, and copies queued on it ------------------------------------------------

_default: Stream | None = None
_default_lock = threading.Lock()
_local = threading.local()


def default_stream(device: Any = None) -> Stream:
    """The simulated GPU's default stream."""
    global _default
    _check_device(device)
    with _default_lock:
        if _default is None:
            _default = Stream()
        return _default


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream (the default stream unless inside ``stream(s)``)."""
    _check_device(device)
    current: Stream | None = getattr(_local, "stream", None)
    return current if current is not None else default_stream()


class StreamContext:
    """``torch.cuda.StreamContext``: makes ``stream`` current on this thread; None does nothing.

    While it is entered, this thread's ``dst.copy_(src, non_blocking=True)``
    into a pinned buffer is queued on ``stream`` (see the module docstring).
    """

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self._previous: Stream | None = None
        self._mode: _QueuedCopies | None = None

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self._previous = getattr(_local, "stream", None)
        _local.stream = self.stream
        self._mode = _QueuedCopies()
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch

    def __exit__(self, *exc: object) -> None:
        if self.stream is None:
            return
        assert self._mode is not None
        self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped in torch
        self._mode = None
        _local.stream = self._previous


def set_stream(stream: Stream) -> None:
    """Make ``stream`` this thread's current stream (None: no change, as in torch).

    Unlike ``with stream(s)``, queues no copies: the simulator intercepts
    ``copy_`` only inside a ``stream()`` block.
    """
    if stream is None:
        return
    _local.stream = stream


def _reset_stream(stream: Stream) -> None:
    """This thread's current stream back to the default, if it is ``stream`` (a device closing)."""
    if getattr(_local, "stream", None) is stream:
        _local.stream = None


def stream(stream: Stream | None) -> StreamContext:
    """``with stream(s):`` makes ``s`` the current stream of this thread."""
    return StreamContext(stream)


def synchronize(device: Any = None) -> None:
    """Block until the work queued on every stream so far has run."""
    _check_device(device)
    for s in [default_stream(), *list(_live_streams)]:
        s.synchronize()


def _sleep(cycles: int) -> None:
    """Keep the current stream busy for ``cycles`` GPU cycles (``cycles / CLOCK_HZ`` seconds)."""
    seconds = cycles / CLOCK_HZ
    s = current_stream()
    s._enqueue(lambda: s._busy(seconds))


def set_device(device: Any) -> None:
    """The simulated GPU is the only device: checks ``device`` names it."""
    _check_device(device)


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


# The buffers pinned_empty made, by address: a copy into one of them is asynchronous. A buffer
# freed is noted in _unpinned without the lock (its finalizer may run inside a collection on a
# thread that holds the lock) and forgotten under the lock by the next look.
_pinned_ptrs: dict[int, int] = {}  # storage data_ptr -> nbytes
_unpinned: collections.deque[int] = collections.deque()
_pinned_lock = threading.Lock()


def _forget_unpinned() -> None:
    # Caller holds _pinned_lock.
    while _unpinned:
        _pinned_ptrs.pop(_unpinned.popleft(), None)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, pin_memory=True)`` on the simulated GPU's host.

    (CPU-only torch cannot pin memory: the simulator remembers the buffer instead.)
    """
    t = torch.empty(shape, dtype=dtype)
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    with _pinned_lock:
        _forget_unpinned()
        _pinned_ptrs[ptr] = nbytes
    weakref.finalize(t, _unpinned.append, ptr)
    return t


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a buffer from :func:`pinned_empty` (the simulator's ``Tensor.is_pinned``)."""
    ptr = t.data_ptr()
    with _pinned_lock:
        _forget_unpinned()
        spans = list(_pinned_ptrs.items())
    return any(start <= ptr < start + size for start, size in spans)


def _poison(dst: torch.Tensor) -> None:
    flat = dst.detach().reshape(-1) if dst.is_contiguous() else None
    if flat is not None and flat.numel():
        flat.view(torch.uint8).fill_(POISON)
    else:
        dst.detach().fill_(float("nan") if dst.is_floating_point() else -1)


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on one host core, as a GPU's copy engine takes none: a large torch copy
    would run as an OpenMP team of this stream thread's own, fighting the producer's."""
    if (
        dst.is_contiguous()
        and src.is_contiguous()
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and src.device.type == "cpu"
        and dst.numel()
    ):
        out = dst.detach().reshape(-1).view(torch.uint8).numpy()
        out[:] = src.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        dst.copy_(src)


def _queued_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    s = current_stream()
    # The source tensor object, weakly: if the caller lets it go before the copy runs,
    # the GPU's allocator would have recycled its memory. The bytes are kept (an alias)
    # only so the simulator can still read them when the caller did hold on.
    source = weakref.ref(src)
    alias = src.detach()

    def copy() -> None:
        if source() is None:
            _poison(dst)
        else:
            _memcpy(dst, alias)

    s._enqueue(copy)


class _QueuedCopies(TorchFunctionMode):
    """Inside ``stream(s)``: non-blocking copies into pinned buffers go on ``s``'s queue."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if non_blocking and dst.device.type == "cpu" and is_pinned(dst):
                _queued_copy(dst, src)
                return dst
            # A blocking copy, or one into pageable memory, waits for the stream (CUDA's rule).
            current_stream().synchronize()
        return func(*args, **kwargs)
