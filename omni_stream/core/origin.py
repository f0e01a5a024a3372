"""Which browser pages may use the server: the Origin and Host rules (pure, no I/O).

docs/protocol.md, "Security", is the contract; every door applies them:
``Origin`` to a websocket's handshake and to every request that changes
state over HTTP (POST, DELETE), ``Host`` to every request. Why the Origin rules are
what they are: a browser lets any page open a websocket to any host, with
the page's ``Origin`` attached, so the server itself must refuse foreign
origins (Cross-Site WebSocket Hijacking). A loopback-bound server must not
trust the ``Host`` header to decide what "same origin" is: with DNS
rebinding, evil.example resolves to 127.0.0.1 and its page's Origin and Host
agree. So loopback servers only accept loopback names; servers bound to a
real address also accept the origin that matches the ``Host`` they were
reached by (the page was served by this server), since anyone who can reach
them can also connect without any Origin at all.

The same forgery reads answers: a page on evil.example rebound to
127.0.0.1 is same-origin with whatever it fetches from there, so a
loopback-bound server also refuses a ``Host`` that is not a loopback name
(:func:`host_allowed`). A server bound to another address answers any
``Host`` unless ``allowed_hosts`` names the ones it answers to (behind an
ingress or a proxy the name is the operator's to know; and an exposed
server should require a token, which a rebound page does not have).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

__all__ = ["host_allowed", "is_loopback", "origin_allowed", "own_origins", "split_host", "token_ok"]

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def token_ok(expected: str, headers: Mapping[str, str], query: str) -> bool:
    """True when ``Authorization: Bearer TOKEN`` or ``?token=TOKEN`` matches ``expected``.

    Compared with ``hmac.compare_digest`` so the time taken does not reveal
    how much of a guess was right.
    """
    want = expected.encode()
    auth = headers.get("Authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), want):
            return True
    for value in parse_qs(query, keep_blank_values=True).get("token", []):
        if hmac.compare_digest(value.encode(), want):
            return True
    return False


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _authority(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host.lower() if port == 80 else f"{host.lower()}:{port}"


def own_origins(host: str, port: int) -> frozenset[str]:
    """The origins that are this server itself (``http://`` and ``https://``)."""
    names = {host}
    if is_loopback(host):
        names.update(_LOOPBACK_NAMES)
    out = set()
    for name in names:
        if name in ("", "0.0.0.0", "::"):
            continue
        out.add(f"http://{_authority(name, port)}")
        out.add(f"https://{_authority(name, port)}")
    return frozenset(out)


def origin_allowed(
    origin: str | None,
    *,
    allowed: Iterable[str],
    own: frozenset[str],
    bound_host: str,
    host_header: str | None,
) -> bool:
    """Apply docs/protocol.md's Origin rules; ``allowed`` entries are lowercased, no trailing slash."""
    if origin is None:
        return True  # not a browser
    norm = origin.strip().rstrip("/").lower()
    allowed = tuple(allowed)
    if "*" in allowed or norm in allowed or norm in own:
        return True
    if is_loopback(bound_host) or not host_header:
        return False
    parts = urlsplit(norm)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    host = host_header.strip().lower()
    default_port = ":80" if parts.scheme == "http" else ":443"
    return parts.netloc in (host, host.removesuffix(default_port))


def split_host(host_header: str) -> str:
    """The host name of a ``Host`` header, lowercased, without its port (IPv6 without brackets)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host_header: str | None, *, bound_host: str, allowed: Iterable[str]) -> bool:
    """Apply the Host rules (module docstring) to a request's ``Host`` header.

    ``bound_host``: the address the server listens on (``scope["server"]``);
    ``allowed``: configured names, lowercased (``*.example.com`` matches
    subdomains; ``*`` answers any). No ``Host`` at all (HTTP/1.0) is not a
    browser: allowed.
    """
    if host_header is None:
        return True
    allowed = tuple(allowed)
    if "*" in allowed:
        return True
    name = split_host(host_header)
    if name in allowed or any(a.startswith("*.") and name.endswith(a[1:]) for a in allowed):
        return True
    bound = bound_host.strip("[]").lower()
    if is_loopback(bound):
        return is_loopback(name)  # a loopback name or address, never a rebound name
    if not allowed:
        return True  # see the module docstring: not checked until names are configured
    if bound in ("", "0.0.0.0", "::"):
        return _is_ip(name) or is_loopback(name)
    return name == bound or is_loopback(name)
