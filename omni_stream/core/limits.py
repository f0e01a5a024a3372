"""The server's limits and knobs: keyword arguments first, then ``OMNI_STREAM_*`` variables.

Read once when a server starts, through :mod:`omni_stream.config` (a
malformed variable warns once, naming it, and the default applies). A bad
keyword value raises :class:`~omni_stream.errors.ParamsError` naming the
keyword. docs/protocol.md lists them all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from ..config import TOKEN_ENV, env_float, env_int, env_str, token as env_token
from ..errors import ParamsError
from ..params import positive_int

# TOKEN_ENV (config.py's) is re-exported: it was defined here before.
__all__ = [
    "ALLOW_ORIGINS_ENV",
    "TOKEN_ENV",
    "ServerLimits",
    "check_request_limits",
    "resolve_origins",
    "resolve_token",
]

ALLOW_ORIGINS_ENV = "OMNI_STREAM_ALLOW_ORIGINS"

# keyword -> (environment variable, kind)
_ENV: dict[str, tuple[str, type]] = {
    "max_message_bytes": ("OMNI_STREAM_MAX_MESSAGE_BYTES", int),
    "max_connections": ("OMNI_STREAM_MAX_CONNECTIONS", int),
    "max_requests_per_connection": ("OMNI_STREAM_MAX_REQUESTS_PER_CONNECTION", int),
    "max_active": ("OMNI_STREAM_MAX_ACTIVE", int),
    "max_queued": ("OMNI_STREAM_MAX_QUEUED", int),
    "max_steps": ("OMNI_STREAM_MAX_STEPS", int),
    "max_image_size": ("OMNI_STREAM_MAX_IMAGE_SIZE", int),
    "max_frames": ("OMNI_STREAM_MAX_FRAMES", int),
    "max_pending": ("OMNI_STREAM_MAX_PENDING", int),
    "max_pending_bytes": ("OMNI_STREAM_MAX_PENDING_BYTES", int),
    "max_memory_bytes": ("OMNI_STREAM_MAX_MEMORY_BYTES", int),
    "send_timeout_s": ("OMNI_STREAM_SEND_TIMEOUT", float),
    "retention_s": ("OMNI_STREAM_RETENTION", float),
    "max_retained": ("OMNI_STREAM_MAX_RETAINED", int),
    "shutdown_timeout_s": ("OMNI_STREAM_SHUTDOWN_TIMEOUT", float),
    "close_timeout_s": ("OMNI_STREAM_CLOSE_TIMEOUT", float),
    "preview_threads": ("OMNI_STREAM_PREVIEW_THREADS", int),
    "max_messages_per_s": ("OMNI_STREAM_MAX_MESSAGES_PER_S", float),
}


#: Limits whose None default is derived from the engine (``active_bound``).
_ENGINE_DEFAULTS = frozenset({"max_active"})

#: The default ``max_active`` for an engine that computes on the host CPU.
#: There a batch of N costs about N single steps (torch already spreads one
#: step over every core), and each step's preview is rendered and sent by
#: the same cores: a request more in the engine adds few frames a second,
#: it divides them, slowing every request it shares them with; the rest
#: wait unstarted and finish sooner for it. Not 2: nothing takes a long
#: request out of the engine once it is in, and one heavy request (1024 px
#: raw frames, 10,000 steps) beside 100 small ones left 18-36 of them
#: unfinished after 20 s with 2 in the engine, none with 4. Measured
#: (docs/reliability.md, performance.md): during a flood of 256 long
#: requests an honest client's step p99 was 11.7-12.9x its quiet p99 with
#: 16 in the engine, 2.9-3.9x with 4 (2.0-2.4x after the flood's first
#: second, its burst of handshakes and generates).
HOST_ACTIVE_PER_ENGINE: Final = 4


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Every bound the server enforces (docs/protocol.md, "Limits")."""

    max_message_bytes: int = 1 << 20
    max_connections: int = 64
    max_requests_per_connection: int = 16
    #: Requests in the engine at once; None: on an accelerator, twice the
    #: engine's max_batch_size, two batches, so each steps at least every
    #: other model call (16 with the defaults; 2 for a whole-request
    #: model); on an engine that computes on the host CPU (``cpu``,
    #: ``sim``), HOST_ACTIVE_PER_ENGINE per engine (see there).
    max_active: int | None = None
    #: Requests admitted beyond max_active, waiting unstarted in the
    #: server's gate (gate.py says who goes in next: priority, then the
    #: connections using the engine least, then arrival) until one leaves
    #: the engine; past both, a generate gets ``busy``. They cost the
    #: running ones nothing (the engine steps only what it holds). 128,
    #: not fewer: the fanout load of docs/performance.md (100 clients with
    #: a request each on two cores) must still be admitted; the red team's
    #: 1,009 was 7x past it.
    max_queued: int = 128
    max_steps: int = 10_000
    max_image_size: int = 2048
    #: Frames of a video (int params named ``num_frames``): each multiplies
    #: a request's memory and step time. 257 is LTX-Video's longest clip.
    max_frames: int = 257
    max_pending: int = 256
    #: Bytes of messages waiting for one client (outbox.py: previews give
    #: way first; must-deliver ones over it close the client, 1008).
    max_pending_bytes: int = 64 << 20
    #: Bytes the server holds for all clients: every outbox plus what
    #: request records keep for attach (outbox.MemoryBudget).
    max_memory_bytes: int = 1 << 30
    send_timeout_s: float = 30.0
    retention_s: float = 600.0
    #: Detached requests held, running or ended. Every generation started
    #: over HTTP is detached, so this is above what admission lets run
    #: (max_active + max_queued): a full server answers busy with
    #: Retry-After first, not too_many_requests. What results hold is
    #: bounded in bytes by max_memory_bytes (the oldest ended go first).
    max_retained: int = 256
    shutdown_timeout_s: float = 10.0
    close_timeout_s: float = 5.0
    #: Previews rendered at once. One by default: on a small CPU box the
    #: producer needs the other core. With the model on a GPU, or many
    #: clients each watching its own request, more keep previews fresh
    #: (docs/performance.md, "fanout").
    preview_threads: int = 1
    #: Websocket messages one connection may send a second on average, in
    #: bursts of as many (a message counts one more for every 64 KiB:
    #: connection.message_cost); past that its next message is read later (TCP
    #: holds it; nothing is refused, every message still gets its reply),
    #: so one client sending as fast as it is answered cannot take the
    #: event loop from every other (docs/reliability.md, the fuzz). A
    #: person's page sends a few a minute; a script submitting work, a few
    #: a second.
    max_messages_per_s: float = 100.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _ENV[f.name][1]
            if value is None and f.name in _ENGINE_DEFAULTS:
                continue
            if kind is int:
                positive_int(value, f.name, what=f"server limit {f.name}", env=_ENV[f.name][0])
            else:
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise ParamsError(
                        f"server limit {f.name} ({_ENV[f.name][0]}) must be a finite number > 0, "
                        f"got {value!r}",
                        field=f.name,
                    )
                object.__setattr__(self, f.name, float(value))

    @classmethod
    def from_env(cls, overrides: Mapping[str, Any] | None = None) -> ServerLimits:
        """Limits from ``overrides`` (keyword arguments), else the environment, else defaults.

        Raises ParamsError for an unknown keyword (listing the known ones) or
        a bad value, naming the keyword.
        """
        overrides = dict(overrides or {})
        unknown = sorted(k for k in overrides if k not in _ENV)
        if unknown:
            raise ParamsError(
                f"unknown server option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(_ENV)}",
                field=unknown[0],
            )
        values: dict[str, Any] = {}
        defaults = cls()
        for name, (env, kind) in _ENV.items():
            if name in overrides:
                values[name] = overrides[name]
            elif kind is int:
                values[name] = env_int(env, getattr(defaults, name), minimum=1)
            else:
                values[name] = env_float(env, getattr(defaults, name))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def active_bound(self, engine_batch_size: int, *, host_engines: int = 0) -> int:
        """``max_active``, or its default (see the field).

        ``engine_batch_size``: requests the engine advances in one call;
        ``host_engines``: how many engines compute on the host CPU (an
        engine group's members), 0 for an accelerator or an engine
        elsewhere (a Ray deployment).
        """
        if self.max_active is not None:
            return self.max_active
        if host_engines > 0:
            return HOST_ACTIVE_PER_ENGINE * host_engines
        return 2 * max(1, engine_batch_size)

    @staticmethod
    def env_name(name: str) -> str:
        """The environment variable behind limit ``name``."""
        return _ENV[name][0]


def resolve_token(token: str | None) -> str | None:
    """The token to require: ``token``, else ``OMNI_STREAM_TOKEN``, else None.

    Raises ParamsError (field ``token``) for an empty or non-string token.
    """
    if token is None:
        return env_token()
    if not isinstance(token, str) or not token.strip():
        raise ParamsError("token must be a non-empty string", field="token")
    return token


def resolve_origins(allow_origins: Any) -> tuple[str, ...]:
    """Allowed browser origins: ``allow_origins``, else ``OMNI_STREAM_ALLOW_ORIGINS`` (commas).

    Each is ``scheme://host[:port]`` (compared lowercased, without a trailing
    slash) or ``*``. Raises ParamsError (field ``allow_origins``) for a
    malformed entry.
    """
    if allow_origins is None or (isinstance(allow_origins, (tuple, list)) and not allow_origins):
        raw = env_str(ALLOW_ORIGINS_ENV)
        entries = [e for e in (raw or "").split(",") if e.strip()]
        where = ALLOW_ORIGINS_ENV
    elif isinstance(allow_origins, str):
        entries = [allow_origins]
        where = "allow_origins"
    else:
        entries = list(allow_origins)
        where = "allow_origins"
    out = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ParamsError(f"{where}: origins must be strings, got {entry!r}", field="allow_origins")
        origin = entry.strip().rstrip("/").lower()
        if origin != "*" and ("://" not in origin or origin.split("://", 1)[1] in ("", "*")):
            raise ParamsError(
                f"{where}: {entry!r} is not an origin; use scheme://host[:port] or *",
                field="allow_origins",
            )
        out.append(origin)
    return tuple(out)


#: Int params with these names are image sides in pixels.
_SIDE_PARAMS = frozenset({"size", "width", "height"})


def check_request_limits(model: Any, params: Mapping[str, Any], limits: ServerLimits) -> int:
    """Check validated ``params`` against the server's limits; return the step count.

    Steps are ``model.total_steps(params)``; image sides are int params
    named ``size``, ``width`` or ``height`` and the last two entries of
    ``shape`` params; video frames are an int param named ``num_frames``.
    Raises MessageError (code ``limit_exceeded``) naming the param, the
    limit and its environment variable.
    """
    from ..protocol import MessageError  # here: protocol must not depend on limits

    total = int(model.total_steps(params))
    if total > limits.max_steps:
        raise MessageError(
            "limit_exceeded",
            f"{total} steps exceed this server's max_steps={limits.max_steps} "
            f"({ServerLimits.env_name('max_steps')})",
            field="steps" if "steps" in params else "params",
        )
    cap = limits.max_image_size
    where = f"max_image_size={cap} ({ServerLimits.env_name('max_image_size')})"
    for spec in getattr(model, "params", ()):
        value = params.get(spec.name)
        if value is None:
            continue
        if spec.kind == "int" and spec.name == "num_frames" and value > limits.max_frames:
            raise MessageError(
                "limit_exceeded",
                f"num_frames={value} exceeds this server's max_frames={limits.max_frames} "
                f"({ServerLimits.env_name('max_frames')})",
                field=spec.name,
            )
        if spec.kind == "int" and spec.name in _SIDE_PARAMS and value > cap:
            raise MessageError(
                "limit_exceeded",
                f"{spec.name}={value} exceeds this server's {where}",
                field=spec.name,
            )
        if spec.kind == "shape" and any(dim > cap for dim in tuple(value)[-2:]):
            raise MessageError(
                "limit_exceeded",
                f"{spec.name}={list(value)} has an image side over this server's {where}",
                field=spec.name,
            )
    return total
