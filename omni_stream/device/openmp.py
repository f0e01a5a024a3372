"""Release the calling thread's idle OpenMP team (GNU libgomp, as in torch's CPU wheels).

Every thread that runs a parallel torch op gets its own OpenMP team, kept
for the thread's lifetime. libgomp picks how a team's helpers wait by
counting every helper in the process: once they outnumber the CPUs, each
wait spins briefly and then sleeps on a futex, so every parallel region of
every team pays a wake-up. A user builds a model in the main thread (one
team) and the engine steps it in its producer thread (a second team): on a
small machine that is over the line for good, and the producer's steps run
up to 3x slower than the same steps in the main thread
(docs/performance.md, benchmarks/threads.py).

``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0) makes libgomp free
the *calling* thread's pool: its helpers exit, and the count drops back. The
team is rebuilt, transparently, the next time that thread runs a parallel
region. Nothing else is touched: other threads' teams, thread counts and
results are unchanged. The engine calls this on the event-loop thread when
it starts, so the producer's team is the only one in a serving process.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from collections.abc import Callable
from typing import Literal

import torch

__all__ = ["release_idle_team", "set_torch_threads_here", "supported"]

logger = logging.getLogger("omni_stream.device")

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
#: ``omp_pause_resource_all(kind) -> int`` (0: done), through ctypes.
_PauseFn = Callable[[int], int]
_pause: _PauseFn | Literal[False] | None = None  # None: not looked up yet; False: unavailable


def _find_pause() -> _PauseFn | Literal[False]:
    """``omp_pause_resource_all`` from the libgomp torch loaded, or False."""
    here = os.path.dirname(torch.__file__)
    # Only the GNU libgomp shipped with torch (torch/lib on x86-64 wheels,
    # torch.libs beside it on others): it frees the calling thread's pool
    # alone. Other runtimes (LLVM's libomp, Intel's libiomp5) pause
    # process-wide, and some other libgomp in the process is not torch's.
    candidates = sorted(
        glob.glob(os.path.join(here, "lib", "libgomp*.so*"))
        + glob.glob(os.path.join(os.path.dirname(here), "torch.libs", "libgomp*.so*"))
    )
    for path in candidates:
        try:
            # NOLOAD: only a library already in the process (the one torch
            # loaded); LOCAL: leave its symbol scope as it was.
            lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOLOAD)
        except OSError:
            continue  # not the library torch loaded
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            pause: _PauseFn = fn
            return pause
    return False


def _lookup() -> _PauseFn | Literal[False]:
    global _pause
    with _lock:
        if _pause is None:
            try:
                _pause = _find_pause()
            except Exception:  # a performance nicety must never stop an engine
                logger.debug("looking up omp_pause_resource_all failed", exc_info=True)
                _pause = False
        return _pause


def supported() -> bool:
    """True where torch runs on a GNU libgomp that can release a thread's team."""
    return _lookup() is not False


def release_idle_team() -> bool:
    """Free the calling thread's idle OpenMP team, if it has one.

    True when libgomp accepted the call (also when there was no team to
    free); False where torch does not run on GNU libgomp, on libgomp older
    than OpenMP 5.0, or inside a parallel region (nothing is done then).
    """
    fn = _lookup()
    if fn is False:
        return False
    return fn(_OMP_PAUSE_SOFT) == 0


def set_torch_threads_here(n: int) -> None:
    """``torch.set_num_threads(n)`` for the calling thread only.

    torch's call also sets the count that every thread started afterwards
    begins with: an engine whose producer took one thread would make every
    later thread of the user's process (their own workers included) run torch
    on one thread. A throwaway thread sets that count back; the calling
    thread's own OpenMP and MKL settings are thread-local and stay at ``n``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    if before != n:
        restore = threading.Thread(
            target=torch.set_num_threads, args=(before,), name="omni-stream-torch-threads"
        )
        restore.start()
        restore.join()
