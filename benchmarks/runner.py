"""``python -m benchmarks``: run the figures, print the table, write the JSON.

Each figure runs in a fresh Python process by default: whether torch's
OpenMP teams spin or sleep depends on which threads of the process have
ever run parallel torch ops (see ``threads.py``), so a figure measured after
another one would inherit that figure's threads. ``--in-process`` (implied
by ``--quick``, whose numbers only show that everything runs) runs them all
here instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from . import FIGURES
from .harness import Context, Figure, new_event_loop, warm_main_thread
from .report import format_markdown, format_table, machine_info, parallel_capacity

__all__ = ["main", "run_figure", "run_suite"]


def _default_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_figure(name: str, ctx: Context, *, loop: str = "uvloop") -> list[Figure]:
    """Run one figure in this process on a fresh event loop of kind ``loop``.

    Raises KeyError for an unknown figure name.
    """
    module = importlib.import_module(FIGURES[name])
    warm_main_thread()
    event_loop = new_event_loop(loop)
    try:
        return event_loop.run_until_complete(module.run(ctx))
    finally:
        event_loop.close()


def _run_child(name: str, quick: bool, loop: str, reps: int | None) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        cmd = [sys.executable, "-m", "benchmarks", "--child", name, "--child-out", out, "--loop", loop]
        if quick:
            cmd.append("--quick")
        if reps is not None:
            cmd += ["--reps", str(reps)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run(cmd, cwd=root, check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"figure {name!r} failed (exit status {proc.returncode}); see its output above")
        with open(out) as f:
            return [Figure.from_dict(d) for d in json.load(f)]


def run_suite(
    names: Sequence[str],
    *,
    quick: bool = False,
    loop: str = "uvloop",
    reps: int | None = None,
    isolate: bool = True,
    verbose: bool = True,
) -> tuple[list[Figure], dict[str, str]]:
    """Run ``names`` in order; returns the figures and, per failed figure, why it failed.

    One figure failing (a missing dependency, a crash) does not stop the others.
    """
    figures: list[Figure] = []
    errors: dict[str, str] = {}
    for name in names:
        if verbose:
            print(f"[{name}]", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            if isolate:
                got = _run_child(name, quick, loop, reps)
            else:
                ctx = _context(quick, reps, verbose)
                got = run_figure(name, ctx, loop=loop)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON; the suite goes on
            errors[name] = f"{type(exc).__name__}: {exc}"
            if verbose:
                print(f"  {name} failed: {errors[name]}", file=sys.stderr, flush=True)
            continue
        if verbose:
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        figures.extend(got)
    return figures, errors


def _context(quick: bool, reps: int | None, verbose: bool) -> Context:
    if reps is None:
        reps = 2 if quick else 5
    return Context(quick=quick, reps=reps, verbose=verbose)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The omni_stream benchmark suite (docs/performance.md).",
    )
    p.add_argument("--quick", action="store_true", help="a few seconds per figure (CI, smoke tests)")
    p.add_argument(
        "--only", nargs="+", metavar="NAME", choices=list(FIGURES), help=f"figures to run: {', '.join(FIGURES)}"
    )
    p.add_argument("--json", metavar="PATH", help="write every figure, raw samples and the machine to PATH")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--from", dest="from_json", metavar="PATH", help="print the tables of an earlier --json run")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default=_default_loop(), help="event loop")
    p.add_argument("--reps", type=int, help="repetitions per variant (default 5, 2 with --quick)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every figure in this process (the default with --quick, whose numbers are a smoke check)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.reps is not None and args.reps < 1:
        _parser().error(f"--reps must be >= 1, got {args.reps}")
    if args.child:
        ctx = _context(args.quick, args.reps, True)
        figures = run_figure(args.child, ctx, loop=args.loop)
        with open(args.child_out, "w") as f:
            json.dump([fig.to_dict() for fig in figures], f)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        figures = [Figure.from_dict(d) for d in data["figures"]]
        print(format_table(figures))
        if args.markdown:
            print()
            print(format_markdown(figures, data["meta"]))
        return 0

    names = args.only or list(FIGURES)
    started = time.perf_counter()
    meta: dict[str, Any] = {
        "command": "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else list(argv)),
        "quick": args.quick,
        "loop": args.loop,
        "machine": machine_info(),
        "capacity_start": parallel_capacity(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    figures, errors = run_suite(
        names, quick=args.quick, loop=args.loop, reps=args.reps, isolate=not (args.in_process or args.quick)
    )
    meta["elapsed_s"] = time.perf_counter() - started
    meta["capacity_end"] = parallel_capacity()
    try:
        meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        meta["loadavg_end"] = [math.nan] * 3
    meta["errors"] = errors
    print(format_table(figures))
    for name, why in errors.items():
        print(f"{name}: not measured: {why}")
    if args.markdown:
        print()
        print(format_markdown(figures, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "figures": [fig.to_dict() for fig in figures]}, f, indent=1)
    failed = [f.name for f in figures if f.passed is False]
    print(
        f"\n{len(figures)} figures in {meta['elapsed_s']:.0f} s: "
        f"{sum(f.passed is True for f in figures)} pass, {len(failed)} fail, "
        f"{sum(f.passed is None for f in figures)} info; {len(errors)} not measured"
    )
    return 0
