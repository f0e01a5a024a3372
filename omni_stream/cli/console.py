"""What a user reads on stderr: one line an error, the library's log records as lines.

Every error is one line, never a traceback (``--verbose`` adds the
tracebacks of logged errors): :class:`UsageError` for the command line's
own, :func:`describe_error` for what the library raised.
"""

from __future__ import annotations

import logging
import re
import sys

from ..errors import ParamsError

__all__ = ["PROG", "CliLogging", "UsageError", "describe_error", "one_line", "print_error"]

PROG = "omni-stream"


class UsageError(Exception):
    """Bad command-line usage found after parsing; exit status 2."""


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


def describe_error(exc: BaseException) -> str:
    text = one_line(str(exc)) or type(exc).__name__
    cause = exc.__cause__
    # What the model (or the machinery) raised is what a user needs to see,
    # once: most messages here already quote it.
    if cause is not None and not isinstance(exc, ParamsError):
        detail = one_line(str(cause))
        if detail not in text:
            text += f" ({type(cause).__name__}" + (f": {detail})" if detail else ")")
    return text


class _StderrLogHandler(logging.Handler):
    """Library log records as ``omni-stream: warning: ...`` lines on stderr.

    Looks ``sys.stderr`` up on every record (it may be swapped, as pytest
    does). Tracebacks only with ``--verbose``: a user sees one line per event.
    """

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.DEBUG if verbose else logging.WARNING)
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{PROG}: {record.levelname.lower()}: {one_line(record.getMessage())}"
            if self.verbose and record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            print(text, file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class CliLogging:
    """The library's log records on stderr while one command runs; levels restored after.

    Warnings always; INFO only from the loggers a command asks for
    (``show_info``), everything with ``--verbose``.
    """

    def __init__(self, verbose: bool) -> None:
        self.handler = _StderrLogHandler(verbose)
        self._verbose = verbose
        self._saved: dict[str, int] = {}

    def __enter__(self) -> CliLogging:
        logging.getLogger("omni_stream").addHandler(self.handler)
        if self._verbose:
            self.show_info("omni_stream")
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("omni_stream").removeHandler(self.handler)
        for name, level in self._saved.items():
            logging.getLogger(name).setLevel(level)

    def show_info(self, name: str) -> None:
        """Show INFO records of logger ``name`` (and below it) for the rest of the command."""
        logger = logging.getLogger(name)
        self._saved.setdefault(name, logger.level)
        logger.setLevel(logging.INFO)
        if self.handler.level > logging.INFO:
            self.handler.setLevel(logging.INFO)


def print_error(message: str) -> None:
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr)
