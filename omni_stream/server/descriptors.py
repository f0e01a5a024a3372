"""The process's file descriptors: how many are open, the limit, and the warning when out of them.

uvloop (``serve()``'s loop) accepts and drops connections silently when the
process is out of descriptors (libuv's EMFILE trick), and asyncio's own
loop reports it through the loop's exception handler: so the service
counts them (:func:`open_fds` against :func:`fd_soft_limit`, its
watcher in ``service.py``) and both paths log the same
:class:`FdWarning`, at most once a minute (it recurs on every accept).
No task, no loop here: what to count and how to say it, so the app's
exception handler (``app.py``) and the service share it.
"""

from __future__ import annotations

import errno
import logging
import os
import time

__all__ = ["FdWarning", "fd_soft_limit", "open_fds"]

logger = logging.getLogger("omni_stream.server")

#: The least seconds between two out-of-descriptors warnings.
_FD_WARN_EVERY_S = 60.0


class FdWarning:
    """The out-of-file-descriptors warning, at most once a minute (it recurs on every accept)."""

    def __init__(self) -> None:
        self._last: float | None = None

    def warn(self, detail: str) -> bool:
        """Log it unless it was logged less than a minute ago; returns whether it was."""
        now = time.monotonic()
        if self._last is not None and now - self._last < _FD_WARN_EVERY_S:
            return False
        self._last = now
        logger.warning(
            "out of file descriptors (%s): new connections are refused or dropped unanswered; "
            "raise the limit (ulimit -n, systemd LimitNOFILE=) or lower max_connections",
            detail,
        )
        return True


def fd_soft_limit() -> int | None:
    """The soft RLIMIT_NOFILE; None where there is none (unlimited, or no ``resource``)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def open_fds() -> int | None:
    """Descriptors this process has open; None where it cannot tell."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Listing needs a descriptor itself: none is left.
                return fd_soft_limit()
    return None
