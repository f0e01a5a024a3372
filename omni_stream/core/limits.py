"""The server's limits and knobs: keyword arguments first, then ``OMNI_STREAM_*`` variables.

Read once when a server starts, through :mod:`omni_stream.config` (a
malformed variable warns once, naming it, and the default applies). A bad
keyword value raises :class:`~omni_stream.errors.ParamsError` naming the
keyword. docs/protocol.md lists them all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from ..config import TOKEN_ENV, env_float, env_int, env_str, token as env_token
from ..errors import ParamsError
from ..params import positive_int
from .principal import TRUSTED_PROXIES_ENV, TrustedProxies
from .tokens import TOKENS_FILE_ENV, Tokens

# TOKEN_ENV (config.py's) is re-exported: it was defined here before.
__all__ = [
    "ALLOWED_HOSTS_ENV",
    "ALLOW_ORIGINS_ENV",
    "TOKEN_ENV",
    "ServerLimits",
    "check_request_limits",
    "resolve_origins",
    "resolve_hosts",
    "resolve_proxies",
    "resolve_token",
    "resolve_tokens",
]

ALLOW_ORIGINS_ENV = "OMNI_STREAM_ALLOW_ORIGINS"
ALLOWED_HOSTS_ENV = "OMNI_STREAM_ALLOWED_HOSTS"

logger = logging.getLogger("omni_stream.server")

# keyword -> (environment variable, kind)
_ENV: dict[str, tuple[str, type]] = {
    "max_message_bytes": ("OMNI_STREAM_MAX_MESSAGE_BYTES", int),
    "max_connections": ("OMNI_STREAM_MAX_CONNECTIONS", int),
    "max_connections_per_principal": ("OMNI_STREAM_MAX_CONNECTIONS_PER_PRINCIPAL", int),
    "max_requests_per_principal": ("OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL", int),
    "max_active": ("OMNI_STREAM_MAX_ACTIVE", int),
    "max_queued": ("OMNI_STREAM_MAX_QUEUED", int),
    "max_steps": ("OMNI_STREAM_MAX_STEPS", int),
    "max_image_size": ("OMNI_STREAM_MAX_IMAGE_SIZE", int),
    "max_frames": ("OMNI_STREAM_MAX_FRAMES", int),
    "max_pending": ("OMNI_STREAM_MAX_PENDING", int),
    "max_pending_bytes": ("OMNI_STREAM_MAX_PENDING_BYTES", int),
    "max_memory_bytes": ("OMNI_STREAM_MAX_MEMORY_BYTES", int),
    "send_timeout_s": ("OMNI_STREAM_SEND_TIMEOUT", float),
    "body_timeout_s": ("OMNI_STREAM_BODY_TIMEOUT", float),
    "retention_s": ("OMNI_STREAM_RETENTION", float),
    "max_retained": ("OMNI_STREAM_MAX_RETAINED", int),
    "shutdown_timeout_s": ("OMNI_STREAM_SHUTDOWN_TIMEOUT", float),
    "close_timeout_s": ("OMNI_STREAM_CLOSE_TIMEOUT", float),
    "preview_threads": ("OMNI_STREAM_PREVIEW_THREADS", int),
    "max_messages_per_s": ("OMNI_STREAM_MAX_MESSAGES_PER_S", float),
    "max_pause_s": ("OMNI_STREAM_MAX_PAUSE", float),
    "repeat_cache_bytes": ("OMNI_STREAM_REPEAT_CACHE_BYTES", int),
}

#: Limits where 0 turns the feature off (every other limit is > 0).
_ZERO_OFF = frozenset({"repeat_cache_bytes"})


#: Names a limit was known by before: keyword -> (its name now, its old variable).
_RENAMED: dict[str, tuple[str, str]] = {
    "max_requests_per_connection": ("max_requests_per_principal", "OMNI_STREAM_MAX_REQUESTS_PER_CONNECTION"),
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
    #: Open clients at once: websockets, HTTP calls (an open POST, a
    #: ``?wait``) and event streams alike.
    max_connections: int = 64
    #: Open clients of one principal (principal.py): a tenant's token, an
    #: HTTP client's address; a websocket without a token is its own.
    max_connections_per_principal: int = 32
    #: Requests one principal holds running or queued (was
    #: max_requests_per_connection, a websocket's own count).
    max_requests_per_principal: int = 16
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
    #: Seconds any one send to a client may wait for it to read (websocket
    #: messages, event-stream events, HTTP response bodies): past that the
    #: client is cut off and what was queued for it is released.
    send_timeout_s: float = 30.0
    #: Seconds an HTTP request's body may take to arrive, from its headers
    #: (a client sending 10 bytes of a declared megabyte held a descriptor
    #: and a buffer for as long as it liked).
    body_timeout_s: float = 30.0
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
    #: Seconds a request may spend paused by its clients, all its pauses together. A paused
    #: request holds no place in the engine (it comes back through the gate when resumed),
    #: but it holds its state, its memory and its principal's count: once paused this long
    #: it resumes by itself (its watchers get ``resumed`` with ``reason: max_pause``) and a
    #: further pause of it is refused. Four requests paused for good once kept every other
    #: tenant's request queued with no end (issue #39, attack 1).
    max_pause_s: float = 300.0
    #: Bytes of finished results kept to answer an exact repeat of a request (its model, every
    #: param, the seed it ran with, its output settings: core/repeats.py) without running it
    #: again; 0 keeps none. Outside max_memory_bytes: a bound of its own, least recently used
    #: out first.
    repeat_cache_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _ENV[f.name][1]
            if value is None and f.name in _ENGINE_DEFAULTS:
                continue
            if f.name in _ZERO_OFF and value == 0 and type(value) is int:
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
        for old, (new, _) in _RENAMED.items():
            if old in overrides:
                if new in overrides:
                    raise ParamsError(
                        f"server options {old!r} and {new!r} are one limit; give {new!r}", field=old
                    )
                logger.warning("server option %r is now %r", old, new)
                overrides[new] = overrides.pop(old)
        unknown = sorted(k for k in overrides if k not in _ENV)
        if unknown:
            raise ParamsError(
                f"unknown server option(s) {', '.join(map(repr, unknown))}; known: {', '.join(_ENV)}",
                field=unknown[0],
            )
        values: dict[str, Any] = {}
        defaults = cls()
        for name, (env, kind) in _ENV.items():
            old_env = next((e for o, (n, e) in _RENAMED.items() if n == name), None)
            if name in overrides:
                values[name] = overrides[name]
            elif old_env is not None and env_str(env) is None and env_str(old_env) is not None:
                logger.warning("%s is now %s", old_env, env)
                values[name] = env_int(old_env, getattr(defaults, name), minimum=1)
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
    """The one unnamed token to require: ``token``, else ``OMNI_STREAM_TOKEN``, else None.

    Raises ParamsError (field ``token``) for an empty or non-string token.
    """
    if token is None:
        return env_token()
    if not isinstance(token, str) or not token.strip():
        raise ParamsError("token must be a non-empty string", field="token")
    return token


def resolve_tokens(token: Any = None, tokens_file: str | None = None) -> Tokens:
    """The tokens a server accepts (tokens.py): ``token`` (one ``SECRET`` or ``NAME=SECRET``,
    several, or a name -> secret mapping), else ``OMNI_STREAM_TOKEN``; plus ``tokens_file``,
    else ``OMNI_STREAM_TOKENS_FILE``. None of them: an open server.

    Raises ParamsError naming the option, the file and line of what is wrong.
    """
    if token is None:
        token = env_token()
    elif isinstance(token, str) and not token.strip():
        raise ParamsError("token must be a non-empty string", field="token")
    elif not isinstance(token, (str, Tokens, Mapping)) and not isinstance(token, (list, tuple)):
        raise ParamsError(
            f"token must be a string, a list of them or a name -> secret mapping, got {type(token).__name__}",
            field="token",
        )
    if tokens_file is None:
        tokens_file = env_str(TOKENS_FILE_ENV)
    return Tokens.of(token, tokens_file=tokens_file)


def resolve_hosts(allowed_hosts: Any = None) -> tuple[str, ...]:
    """Host names the server answers to besides its bound address: ``allowed_hosts``,
    else ``OMNI_STREAM_ALLOWED_HOSTS`` (commas); ``*`` answers any (origin.py says when).

    Raises ParamsError (field ``allowed_hosts``) for an entry that is not a host name.
    """
    if allowed_hosts is None or (isinstance(allowed_hosts, (tuple, list)) and not allowed_hosts):
        entries = [e for e in (env_str(ALLOWED_HOSTS_ENV) or "").split(",") if e.strip()]
        where = ALLOWED_HOSTS_ENV
    elif isinstance(allowed_hosts, str):
        entries, where = [allowed_hosts], "allowed_hosts"
    else:
        entries, where = list(allowed_hosts), "allowed_hosts"
    out = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise ParamsError(
                f"{where}: host names must be non-empty strings, got {entry!r}", field="allowed_hosts"
            )
        name = entry.strip().lower().rstrip(".")
        if name != "*" and (("/" in name) or any(c.isspace() for c in name)):
            raise ParamsError(
                f"{where}: {entry!r} is not a host name (give names as example.com or *.example.com, "
                "no scheme or path)",
                field="allowed_hosts",
            )
        out.append(name)
    return tuple(out)


def resolve_proxies(trusted_proxies: Any = None) -> TrustedProxies:
    """The proxies whose X-Forwarded-For names the client: ``trusted_proxies``, else
    ``OMNI_STREAM_TRUSTED_PROXIES`` (commas); raises ParamsError naming a bad entry."""
    if trusted_proxies is None:
        entries = (env_str(TRUSTED_PROXIES_ENV) or "").split(",")
    elif isinstance(trusted_proxies, str):
        entries = trusted_proxies.split(",")
    else:
        entries = list(trusted_proxies)
    return TrustedProxies(entries)


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
