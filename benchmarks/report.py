"""The machine a run measured, and the figures as a table, markdown or JSON."""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .harness import Figure

__all__ = ["format_markdown", "format_table", "machine_info", "parallel_capacity"]


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except ImportError:
        return "-"
    return str(getattr(mod, "__version__", "?"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parallel_capacity(seconds: float = 0.3) -> float:
    """How many cores' worth of work two threads get done now, from 1.0 to 2.0.

    Two threads run numpy ufuncs (which release the GIL) for ``seconds``
    and their work is compared with one thread's. On an idle 2-core machine
    this is close to 2.0; with another process keeping one core busy it
    falls towards 1.0, and every figure that needs overlap (previews beside
    compute, the loop beside the producer) loses its headroom with it.
    """
    import numpy as np

    a = np.random.default_rng(0).random(1 << 16)

    def spin(deadline: float, out: list[int]) -> None:
        n = 0
        while time.perf_counter() < deadline:
            np.sqrt(a, out=a)
            np.add(a, 1.0, out=a)
            n += 1
        out.append(n)

    one: list[int] = []
    spin(time.perf_counter() + seconds, one)
    two: list[int] = []
    deadline = time.perf_counter() + seconds
    threads = [threading.Thread(target=spin, args=(deadline, two)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(two) / max(1, one[0])


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, load, and the versions that shape the numbers."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan, math.nan, math.nan)
    import torch

    return {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": _version("numpy"),
        "pillow": _version("PIL"),
        "simplejpeg": _version("simplejpeg"),
        "websockets": _version("websockets"),
        "uvloop": _version("uvloop"),
        "anyio": _version("anyio"),
        "loadavg": [round(x, 2) for x in load],
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "MKL_"))},
    }


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _raw(d: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in d.items())


def _status(fig: Figure) -> str:
    return {True: "pass", False: "FAIL", None: "info"}[fig.passed]


def format_table(figures: Sequence[Figure]) -> str:
    """A plain-text table, one block per figure (name, value, target, status, raws, limits)."""
    lines = []
    width = max((len(f.name) for f in figures), default=10)
    header = f"{'figure':<{width}}  {'value':>9}  {'target':>8}  status"
    lines.append(header)
    lines.append("-" * max(len(header), 72))
    for f in figures:
        target = str(f.target) if f.target else "-"
        value = f"{_fmt(f.value)} {f.unit}"
        lines.append(f"{f.name:<{width}}  {value:>9}  {target:>8}  {_status(f)}")
        lines.append(f"{'':<{width}}    baseline: {_raw(f.baseline)}")
        lines.append(f"{'':<{width}}    engine:   {_raw(f.engine)}")
        lines.append(f"{'':<{width}}    limited by: {f.limits}")
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(figures: Iterable[Figure], meta: Mapping[str, Any]) -> str:
    """The table for docs/performance.md, with the machine and command above it."""
    m = meta.get("machine", {})
    command = (
        f"Command: `{meta.get('command', 'python -m benchmarks')}` "
        f"({meta.get('elapsed_s', math.nan):.0f} s, event loop: {meta.get('loop', '?')})"
    )
    machine = (
        f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}), Python {m.get('python')}, "
        f"torch {m.get('torch')}, numpy {m.get('numpy')}, Pillow {m.get('pillow')}, "
        f"simplejpeg {m.get('simplejpeg')}, "
        f"websockets {m.get('websockets')}, uvloop {m.get('uvloop')}; "
        f"load average at start {m.get('loadavg')}, at end {meta.get('loadavg_end')}; "
        f"parallel capacity (2 threads / 1 thread of GIL-free numpy) at start "
        f"{_fmt(meta.get('capacity_start', math.nan))}, at end {_fmt(meta.get('capacity_end', math.nan))}."
    )
    out = [
        command,
        "",
        machine,
        "",
        "| figure | value | target | status | baseline (raw) | engine (raw) | what limits it |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        target = str(f.target) if f.target else "-"
        out.append(
            "| "
            + " | ".join(
                _md_cell(x)
                for x in (
                    f.name,
                    f"{_fmt(f.value)} {f.unit}",
                    target,
                    _status(f),
                    _raw(f.baseline),
                    _raw(f.engine),
                    f.limits,
                )
            )
            + " |"
        )
    return "\n".join(out)
