"""Configuration read from the environment: one place, validated, documented.

Every knob is read where it is used, through a function here, on every call:
never frozen at import, so a malformed value cannot break ``import`` and a
test can set it with ``monkeypatch.setenv`` without reloading anything.
Each variable is listed in ``docs/configuration.md``. The server's limits
(``OMNI_STREAM_MAX_*`` and the like) are named beside the limits they set,
in ``omni_stream/core/limits.py``, and read through the functions here.
:func:`run` is the one place that picks the event loop.

Why the step timeout is long and never raises: the engine we learn from
bounded the wait for a step's output at a hard-coded 30 s. The wait covers
the step's compute (the copy is queued behind it), so finished renders of
31 minutes were thrown away on slow single-GPU boxes. A bad value in the
environment must not fail requests mid-render either: it warns once and
the default applies.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .errors import ParamsError
from .params import positive_int

__all__ = [
    "TOKEN_ENV",
    "WEBHOOK_ALLOW_ENV",
    "WEBHOOK_SECRET_ENV",
    "STATE_DIR_ENV",
    "CHECKPOINT_EVERY_ENV",
    "CHECKPOINT_SECONDS_ENV",
    "STATE_MAX_BYTES_ENV",
    "state_dir",
    "token",
    "webhook_allow",
    "webhook_secret",
    "run",
    "STEP_TIMEOUT_ENV",
    "DEFAULT_STEP_TIMEOUT_S",
    "timeout",
    "TORCH_THREADS_ENV",
    "PREVIEW_VAE_ENV",
    "preview_vae",
    "torch_threads",
    "default_torch_threads",
    "usable_cores",
    "SERVING_CORES",
    "env_float",
    "env_int",
    "env_str",
]

logger = logging.getLogger("omni_stream.config")

T = TypeVar("T")

STEP_TIMEOUT_ENV = "OMNI_STREAM_STEP_TIMEOUT"
DEFAULT_STEP_TIMEOUT_S = 600.0
TORCH_THREADS_ENV = "OMNI_STREAM_TORCH_THREADS"
#: A tiny autoencoder (path or model id) that decodes previews on the producer's device.
PREVIEW_VAE_ENV = "OMNI_STREAM_PREVIEW_VAE"
#: The server's bearer token, where ``serve --token`` / ``Server(token=)`` give none.
TOKEN_ENV = "OMNI_STREAM_TOKEN"
#: The webhook signing secret (``whsec_`` base64), where ``serve --webhook-secret`` gives none.
WEBHOOK_SECRET_ENV = "OMNI_STREAM_WEBHOOK_SECRET"
#: The URL patterns webhooks may call, commas or spaces between them (none: no webhooks).
WEBHOOK_ALLOW_ENV = "OMNI_STREAM_WEBHOOK_ALLOW"

#: The server's state directory (``serve --state-dir``; unset: nothing survives the process).
STATE_DIR_ENV = "OMNI_STREAM_STATE_DIR"
#: Steps between two checkpoints of a request, with a state directory.
CHECKPOINT_EVERY_ENV = "OMNI_STREAM_CHECKPOINT_EVERY"
#: The least seconds between two checkpoints written for one request (unset: no such floor).
CHECKPOINT_SECONDS_ENV = "OMNI_STREAM_CHECKPOINT_SECONDS"
#: Bytes the state directory may hold (checkpoints, results, recorded messages).
STATE_MAX_BYTES_ENV = "OMNI_STREAM_STATE_MAX_BYTES"

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(name: str, raw: str, default: object, why: str) -> None:
    # One warning per (variable, value): a value that changes to another bad
    # value warns again, a bad value read on every step does not flood logs.
    key = (name, raw)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("ignoring %s=%r (%s); using the default %s", name, raw, why, default)


def env_float(name: str, default: float, *, positive: bool = True, finite: bool = True) -> float:
    """Read a float knob; a malformed value warns once and gives ``default``."""
    return _parse_float(name, os.environ.get(name), default, positive=positive, finite=finite)


def _parse_float(
    name: str, raw: str | None, default: float, *, positive: bool = True, finite: bool = True
) -> float:
    """``env_float`` of a value already read (``raw``; None: unset)."""
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        _warn_once(name, raw, default, "not a number")
        return default
    if math.isnan(value) or (finite and math.isinf(value)):
        _warn_once(name, raw, default, "not a finite number")
        return default
    if positive and value <= 0:
        _warn_once(name, raw, default, "must be greater than zero")
        return default
    return value


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """Read an integer knob; a malformed value warns once and gives ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        _warn_once(name, raw, default, "not an integer")
        return default
    if value < minimum:
        _warn_once(name, raw, default, f"must be at least {minimum}")
        return default
    return value


def env_str(name: str, default: str | None = None) -> str | None:
    """Read a string knob; empty counts as unset."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip()


def timeout() -> float:
    """Seconds one step's output may take to arrive, compute plus copy.

    Read from ``OMNI_STREAM_STEP_TIMEOUT`` on every call; default 600.0.
    Never raises: a non-numeric, empty, ``nan``, infinite, zero or negative
    value logs one warning naming the variable and the default applies.
    """
    # A reader asks once a frame, on the event loop: the variable is looked
    # up in os.environ's own store (one dict look-up, where os.environ.get is
    # four Python calls) and parsed again only when its value changed.
    global _timeout_read
    data = _ENVIRON_DATA
    if data is None or os.environ is not _ENVIRON:
        # Not CPython's store, or os.environ was replaced (a test's patch): the plain read.
        return env_float(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)
    raw = data.get(_STEP_TIMEOUT_KEY)
    last_raw, value = _timeout_read
    if raw is last_raw:
        return value
    # The value read is the one parsed (a second read could see another thread's newer
    # value and cache it under this one's key), and kept with the object itself, which this
    # reference keeps alive: a value set again is looked at again unless it is that object.
    text = None if raw is None else _DECODE(raw)
    value = _parse_float(STEP_TIMEOUT_ENV, text, DEFAULT_STEP_TIMEOUT_S)
    _timeout_read = (raw, value)
    return value


def _environ_store() -> tuple[dict[object, object] | None, object]:
    """os.environ's backing dict and the step timeout's key in it; (None, None) where not CPython's."""
    data = getattr(os.environ, "_data", None)
    encodekey = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encodekey is None or not hasattr(os.environ, "decodevalue"):
        return None, None
    return data, encodekey(STEP_TIMEOUT_ENV)


_ENVIRON = os.environ
_ENVIRON_DATA, _STEP_TIMEOUT_KEY = _environ_store()
# How os.environ turns a stored value into the str it returns (bytes -> str on POSIX).
_DECODE: Callable[[Any], str] = getattr(os.environ, "decodevalue", str)
# (the raw value last parsed, its value): None is "unset", the default.
_timeout_read: tuple[object, float] = (None, DEFAULT_STEP_TIMEOUT_S)


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota.

    ``os.sched_getaffinity`` where the platform has it (``taskset``, a
    container's cpuset), else ``os.cpu_count()``; a CFS quota (a container's
    ``--cpus``, a Kubernetes CPU limit) caps it, rounded down, at least 1.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    """The CPUs a cgroup quota allows (v2 ``cpu.max``, v1 ``cfs_quota_us``), or None."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, _, period = f.read().strip().partition(" ")
        if quota != "max":
            return int(quota) / int(period or "100000")
        return None
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read().strip())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:
        return None  # -1: no limit
    return quota_us / period_us


#: Cores left to the rest of a serving process on a machine with more than
#: two: the event loop (one core, it holds the GIL) and the default preview
#: thread (JPEG/PNG encoding, outside the GIL).
SERVING_CORES = 2


def default_torch_threads(members: int = 1, *, cores: int | None = None) -> int:
    """The producer's torch threads when ``OMNI_STREAM_TORCH_THREADS`` is unset.

    ``(cores - reserved) // members``, at least 1, where ``cores`` is
    ``usable_cores()`` and ``reserved`` is ``SERVING_CORES`` (one on a
    two-core machine, none on one core). ``members``: engines stepping on
    the CPU in this process (an EngineGroup of N cpu devices splits the
    cores N ways). Raises ParamsError for ``members`` < 1.
    """
    positive_int(members, "members")
    if cores is None:
        cores = usable_cores()
    reserved = min(SERVING_CORES, cores - 1)
    return max(1, (cores - reserved) // members)


def torch_threads(members: int = 1) -> int:
    """Torch intra-op threads for each producer thread on CPU devices.

    Read from ``OMNI_STREAM_TORCH_THREADS`` when an engine starts; the
    variable sets each member's count as given (it is not split). Unset (or
    malformed: one warning), ``default_torch_threads(members)``: the usable
    cores less two for the rest of the process, split among ``members``
    engines, at least 1. On 2 cores that is 1, as it has always been here.

    Why not every core: the event loop, the preview threads and the
    websockets need CPU while the producer computes, and a producer team on
    every core leaves them none (measured on 2 cores: with previews the
    engine went from 1.39x faster than the callback pattern to 0.87x,
    loop-lag p99 from 0.7 to 3.6 ms). Why not 1 on a large machine: a CPU
    model's steps scale with its team (the engine releases the loop
    thread's idle OpenMP team when it starts, so the producer's team is the
    only one and steps as fast as a plain script in the main thread;
    docs/performance.md, "Where torch runs"), and one thread left a 16-core
    box 15 cores idle. Raises ParamsError for ``members`` < 1.
    """
    default = default_torch_threads(members)
    return env_int(TORCH_THREADS_ENV, default)


def preview_vae() -> str | None:
    """The tiny autoencoder for previews (``OMNI_STREAM_PREVIEW_VAE``): a path or model id, or None."""
    return env_str(PREVIEW_VAE_ENV)


def token() -> str | None:
    """The server's bearer token from ``OMNI_STREAM_TOKEN``, or None when unset or empty."""
    return env_str(TOKEN_ENV)


def webhook_secret() -> str | None:
    """The webhook secret from ``OMNI_STREAM_WEBHOOK_SECRET`` (checked by core/webhooks.py), or None."""
    return env_str(WEBHOOK_SECRET_ENV)


def webhook_allow() -> str | None:
    """The webhook URL patterns from ``OMNI_STREAM_WEBHOOK_ALLOW`` as written, or None when unset."""
    return env_str(WEBHOOK_ALLOW_ENV)


def state_dir() -> str | None:
    """The server's state directory from ``OMNI_STREAM_STATE_DIR``, or None when unset or empty."""
    return env_str(STATE_DIR_ENV)


#: The event loops ``run`` (and ``serve --loop``) can run on; None: uvloop where installed.
LOOPS = ("asyncio", "uvloop", "trio")


def run(main: Callable[..., Awaitable[T]], *args: Any, loop: str | None = None) -> T:
    """Run ``main(*args)`` to completion on a new event loop; return what it returns.

    ``loop`` None: uvloop where it is installed (a dependency everywhere
    but Windows), else asyncio's own loop; or one of :data:`LOOPS` by name
    (``trio`` needs trio installed; the server then runs on hypercorn). The
    one place that picks the loop: ``omni-stream generate`` and ``serve``
    and :func:`omni_stream.server.serve` all run through here. Raises
    ParamsError for another name.
    """
    import anyio

    if loop is not None and loop not in LOOPS:
        raise ParamsError(f"loop must be one of {', '.join(LOOPS)}, got {str(loop)[:40]!r}", field="loop")
    if loop == "trio":
        return anyio.run(main, *args, backend="trio")
    if loop == "asyncio":
        return anyio.run(main, *args, backend="asyncio")
    try:
        import uvloop  # noqa: F401 - only whether it is there
    except ImportError:
        if loop == "uvloop":
            raise ParamsError("loop 'uvloop' is not installed: pip install uvloop", field="loop") from None
        options: dict[str, Any] = {}
    else:
        options = {"use_uvloop": True}
    return anyio.run(main, *args, backend="asyncio", backend_options=options)
