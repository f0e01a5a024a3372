"""What every figure shares: the Figure record, interleaved sampling, calibration, threads.

Every figure is a ratio of two times measured side by side in the same run,
because absolute times drift by 2-5x on our shared 2-core machines. The
variants of a figure are sampled round-robin, alternating direction each
repetition (A B B A A B ...), so slow drift of the machine hits every
variant alike, and each figure reports the median of its samples.

Process state matters to torch on the CPU (see ``threads.py``): which threads
have ever run parallel torch ops decides whether OpenMP teams spin or sleep.
``warm_main_thread`` puts the process in the state a user's script is in
(the model was built in the main thread) before anything is measured, and
``python -m benchmarks`` runs each figure in a fresh process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch


__all__ = [
    "Context",
    "Figure",
    "reset_main_thread",
    "Target",
    "calibrate_work",
    "interleave",
    "median",
    "new_event_loop",
    "percentile",
    "rss_bytes",
    "run_in_thread",
    "stream_all",
    "torch_threads",
    "warm_main_thread",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Target:
    """A figure's pass condition: ``value <op> bound`` with op ``<=`` or ``>=``."""

    op: str
    bound: float

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"Target op must be '<=' or '>=', got {self.op!r}")

    def met(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass(slots=True)
class Figure:
    """One measured figure.

    ``value`` is the ratio (or, for loop lag, milliseconds) compared with
    ``target``; ``baseline`` and ``engine`` hold the raw medians behind it
    (seconds unless the key says otherwise); ``limits`` says what bounds the
    value on this machine; ``details`` holds everything else worth keeping
    (all samples, settings, diagnostic ratios).
    """

    name: str
    value: float
    target: Target | None
    baseline: dict[str, float]
    engine: dict[str, float]
    limits: str
    unit: str = "x"
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool | None:
        """None when the figure has no target (reported for information)."""
        return None if self.target is None else self.target.met(self.value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": None if self.target is None else str(self.target),
            "passed": self.passed,
            "baseline": self.baseline,
            "engine": self.engine,
            "limits": self.limits,
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Figure:
        target = data.get("target")
        parsed = None
        if target:
            op, bound = str(target).split()
            parsed = Target(op, float(bound))
        return cls(
            name=data["name"],
            value=float(data["value"]),
            target=parsed,
            baseline=dict(data.get("baseline", {})),
            engine=dict(data.get("engine", {})),
            limits=data.get("limits", ""),
            unit=data.get("unit", "x"),
            details=dict(data.get("details", {})),
        )


@dataclass(slots=True)
class Context:
    """Settings every figure reads: quick mode, repetitions, the calibration cache."""

    quick: bool = False
    reps: int = 5
    verbose: bool = True
    _work: dict[tuple[float, tuple[int, ...], int | None], int] = field(default_factory=dict)

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  {msg}", file=sys.stderr, flush=True)

    def work_for(
        self, step_s: float, shape: Sequence[int] = (4, 64, 64), *, threads: int | None = 1
    ) -> int:
        """Synthetic ``work`` for a ~``step_s`` step (batch of one), calibrated once per value.

        See :func:`calibrate_work` for ``threads``.
        """
        key = (step_s, tuple(shape), threads)
        if key not in self._work:
            self._work[key] = calibrate_work(step_s, shape=shape, threads=threads)
            self.log(f"calibrated Synthetic work={self._work[key]} for ~{step_s * 1e3:g} ms steps of {list(shape)}")
        return self._work[key]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def interleave(
    variants: Mapping[str, Callable[[], Awaitable[T]]], reps: int, *, ctx: Context | None = None
) -> dict[str, list[T]]:
    """Run each variant ``reps`` times, round-robin, reversing the order every other round.

    A B C C B A A B C ...: a machine that slows down (or speeds up) during
    the run shifts every variant alike, and no variant always runs first.
    Returns the samples per variant, in run order.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    names = list(variants)
    out: dict[str, list[T]] = {n: [] for n in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            out[name].append(await variants[name]())
        if ctx is not None and ctx.verbose:
            summary = ", ".join(
                f"{n}={v[-1]:.4g}" for n, v in out.items() if isinstance(v[-1], (int, float))
            )
            ctx.log(f"rep {rep + 1}/{reps}: {summary}")
    return out


def warm_main_thread() -> None:
    """Run parallel torch ops on the calling (main) thread, as building a model does.

    A user's script loads its model in the main thread before it starts any
    engine; from then on the main thread owns an OpenMP team. Measuring
    without that team would measure a process no user has.
    """
    a = torch.randn(256, 256)
    (a @ a).sum()
    torch.tanh(torch.randn(1 << 17)).sum()


#: torch's intra-op threads when the harness was imported (its default here).
DEFAULT_TORCH_THREADS = torch.get_num_threads()


def reset_main_thread() -> None:
    """Put the process back in the state a user's script is in: call on the main thread.

    An engine changes two things a later variant would inherit: its producer's
    ``torch.set_num_threads`` also sets the count new threads start with (and
    MKL's), and ``Engine.start`` releases the main thread's OpenMP team. So
    each variant starts from torch's default count and a main thread that
    has a team, as after building a model.
    """
    torch.set_num_threads(DEFAULT_TORCH_THREADS)
    warm_main_thread()


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Set torch's intra-op threads for the calling thread's work, then restore them.

    ``torch.set_num_threads`` also sets MKL's process-wide thread count and
    the default later threads start with, so it is always put back: one
    variant must not change the conditions of the next. ``None`` changes nothing.
    """
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_in_thread(fn: Callable[[], T], *, threads: int | None = None) -> T:
    """Run ``fn`` in a fresh thread (torch intra-op threads set to ``threads``) and return its result.

    The thread is joined before this returns, so its OpenMP team (if any)
    is gone before the next measurement. Re-raises what ``fn`` raised.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            with torch_threads(threads):
                result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    t = threading.Thread(target=body, name="bench-worker")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def calibrate_work(
    step_s: float, *, shape: Sequence[int] = (4, 64, 64), threads: int | None = 1
) -> int:
    """The Synthetic ``work`` that makes one step (batch of one) take about ``step_s``.

    Measured in a worker thread with ``threads`` torch threads (None: torch's
    default). One thread, the default here, is the arrangement least
    sensitive to other load on the machine, so the calibration repeats; the
    figures then measure every arrangement side by side.
    """
    from omni_stream.models import Synthetic

    model = Synthetic()
    cpu = torch.device("cpu")

    def step_time(work: int) -> float:
        model.load(cpu)
        state = model.start(model.validate({"steps": 10_000, "work": work, "shape": list(shape)}), cpu)
        for _ in range(3):
            model.step([state])
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            model.step([state])
            times.append(time.perf_counter() - t0)
        return median(times)

    def search() -> int:
        base = step_time(0)
        probe = 40
        per_round = max((step_time(probe) - base) / probe, 1e-6)
        work = max(1, round((step_s - base) / per_round))
        # One correction: the per-round cost is not quite linear in work.
        got = step_time(work)
        per_round = max((got - base) / work, 1e-6)
        return max(1, min(10_000, round((step_s - base) / per_round)))

    return run_in_thread(search, threads=threads)


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A fresh event loop of ``kind`` ("uvloop" or "asyncio")."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    if kind == "asyncio":
        return asyncio.new_event_loop()
    raise ValueError(f"loop must be 'uvloop' or 'asyncio', got {kind!r}")


async def stream_all(
    engine: Any,
    params: Sequence[Mapping[str, Any]],
    *,
    on_frame: Callable[[Any], Awaitable[None]] | None = None,
    policy: str = "all",
) -> float:
    """Submit every request at once, read every frame; returns seconds from submit to the last frame.

    ``on_frame`` (awaited for each frame, in its request's reader task) is
    where a figure does per-frame work such as rendering a preview.
    """

    async def read(stream: Any) -> None:
        async with stream:
            async for frame in stream:
                if on_frame is not None:
                    await on_frame(frame)

    t0 = time.perf_counter()
    streams = [engine.stream(p, policy=policy) for p in params]
    async with asyncio.TaskGroup() as tg:
        for s in streams:
            tg.create_task(read(s))
    return time.perf_counter() - t0


