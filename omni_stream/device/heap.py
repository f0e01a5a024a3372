"""Give freed heap memory back to the system (glibc's ``malloc_trim``), where there is one.

glibc keeps freed blocks in its heaps for reuse, and raises its mmap
threshold each time a large mapped block is freed (up to 32 MiB), so after
building a large table (the Mixture's image bank for a new size: hundreds
of MiB of temporaries) a process can hold tens of MiB it no longer uses,
which the server's memory bound cannot see. ``malloc_trim(0)`` returns
what is free at the top and in the middle of every arena. It costs a walk
of the heap (milliseconds for a large one): call it after such a build or
release, from a worker thread where it can be.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import Literal

__all__ = ["trim_heap"]

_lock = threading.Lock()
_trim: Callable[[int], int] | Literal[False] | None = None


def _lookup() -> Callable[[int], int] | Literal[False]:
    global _trim
    with _lock:
        if _trim is None:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                fn = libc.malloc_trim
                fn.argtypes = [ctypes.c_size_t]
                fn.restype = ctypes.c_int
                _trim = fn
            except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
                _trim = False
        return _trim


def trim_heap() -> bool:
    """Return free heap memory to the system; whether the C library could (glibc only)."""
    fn = _lookup()
    if fn is False:
        return False
    fn(0)
    return True
