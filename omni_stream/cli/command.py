"""``main`` and ``entry``: parse, dispatch to a command, the exit status; ``bench``.

Exit status: 0 done; 1 the run failed (the model raised, the engine died,
a file could not be written); 2 bad arguments or params; 130 interrupted;
``serve`` 3 and 4 when it shut itself down (serve.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ..errors import OmniStreamError, ParamsError
from .console import PROG, CliLogging, UsageError, describe_error, print_error
from .parser import build_parser

__all__ = ["cmd_bench", "entry", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    verbose = bool({"-v", "--verbose"} & set(args_list[:1]))
    with CliLogging(verbose) as log:
        return _main(args_list, log)


def _main(args_list: list[str], log: CliLogging) -> int:
    try:
        command_at = 1 if args_list[:1] in (["-v"], ["--verbose"]) else 0
        if args_list[command_at : command_at + 1] == ["bench"]:
            return cmd_bench(args_list[command_at + 1 :])
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as exc:  # --help, --version, or a usage error
            return exc.code if isinstance(exc.code, int) else 2
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return 2
        args.log = log
        return int(handler(args))
    except UsageError as exc:
        print_error(str(exc))
        return 2
    except ParamsError as exc:
        print_error(describe_error(exc))
        return 2
    except OmniStreamError as exc:
        print_error(describe_error(exc))
        return 1
    except OSError as exc:
        print_error(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


def entry(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``omni-stream`` command: :func:`main`, then end the process with its status.

    Everything of ours is finished when ``main`` returns (the engine closed,
    its producer thread done, files closed), but a thread that ran torch code
    may still be tearing down its native per-thread state. A normal exit runs
    C++ static destructors beside it, and one that finds a native thread still
    running aborts the process ("terminate called without an active exception",
    status 134): seen on about 1 in 8 Ctrl-Cs under CPU load, where nothing
    (saving the result) stands between the engine's close and the exit. So the
    process ends deliberately, once its output is flushed, without running
    native destructors. Not after Ray was used: its exit hooks stop the
    local cluster it started.
    """
    status = main(argv)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the status
            stream.flush()
    if "ray" in sys.modules:
        sys.exit(status)
    logging.shutdown()
    os._exit(status)


def cmd_bench(rest: Sequence[str]) -> int:
    # benchmarks/ ships with the repository, not with the installed package.
    root = Path.cwd()
    if not (root / "benchmarks" / "__main__.py").is_file():
        print_error(
            f"no benchmarks/ package in {root}; run `{PROG} bench` from the root of an omni_stream checkout"
        )
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks", *rest], cwd=root)
