"""Who a client is: the identity every per-client rule keys on (pure, no I/O).

A request gets its *principal* at the door, once, and every rule that is
about a client (requests held, connections open, messages a second, the
fair share when the server is crowded, who may see a request) counts per
principal, whichever door the client came through:

1. the name of the token it presented, where tokens are configured
   (tokens.py): a tenant is one principal over any number of
   connections, websockets and HTTP alike;
2. otherwise, on a websocket, the connection itself (a page or a script
   holds one connection; ``max_connections`` bounds how many there are);
3. otherwise, over HTTP (each call its own connection), the client's
   address: the peer's, or, when the peer is a configured trusted proxy,
   the address it forwarded (``X-Forwarded-For``, read right to left,
   skipping trusted proxies, so a client cannot name itself by sending
   the header). An IPv6 address counts by its /64, the block one host
   is usually given: otherwise one host would be 2**64 clients.

Without (3), every HTTP call was its own client and the per-client rules
never applied to it: one HTTP client filled every place of the server
(issue #19, finding 5).

The peer's address is the socket's, as the HTTP server gives it: the
server must not rewrite it from headers itself. uvicorn did, by default
(``proxy_headers``), for any loopback peer, so a client behind an SSH
tunnel or a sidecar named itself anew in each call and every
per-principal bound was bypassed (issue #39, attack 5); ``Server`` turns
it off, and hypercorn never does it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from ..errors import ParamsError
from .tokens import TokenGrant

__all__ = [
    "TRUSTED_PROXIES_ENV",
    "Principal",
    "TrustedProxies",
    "address_key",
]

TRUSTED_PROXIES_ENV: Final = "OMNI_STREAM_TRUSTED_PROXIES"

Kind = Literal["token", "connection", "address"]


@dataclass(frozen=True, slots=True)
class Principal:
    """A client's identity (see the module docstring); ``key`` is what rules count by."""

    kind: Kind
    name: str
    #: The highest priority this principal's requests carry across principals
    #: (its token's ``priority=`` grant; 0: its priority orders its own only).
    priority_grant: int = 0

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def authenticated(self) -> bool:
        """It presented a configured token."""
        return self.kind == "token"

    @classmethod
    def of_token(cls, grant: TokenGrant) -> Principal:
        return cls("token", grant.name, priority_grant=grant.priority)

    @classmethod
    def of_connection(cls, conn_id: str) -> Principal:
        return cls("connection", conn_id)

    @classmethod
    def of_address(cls, host: str) -> Principal:
        return cls("address", address_key(host))

    def cross_priority(self, priority: int) -> int:
        """The part of ``priority`` that ranks against other principals' requests.

        0 unless granted: a principal's priority orders its own requests only.
        """
        return max(0, min(priority, self.priority_grant))

    def __str__(self) -> str:
        return self.key


def address_key(host: str) -> str:
    """``host`` as a principal name: an IPv4 address as is, an IPv6 one as its /64."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host or "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class TrustedProxies:
    """The proxies whose ``X-Forwarded-For`` names the client (addresses or networks)."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        """Raises ParamsError (field ``trusted_proxies``) for an entry that is not an address or network."""
        networks = []
        for entry in entries:
            text = entry.strip()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                raise ParamsError(
                    f"trusted_proxies ({TRUSTED_PROXIES_ENV}): {text[:60]!r} is not an IP address or "
                    "network (e.g. 10.0.0.1, 10.0.0.0/8)",
                    field="trusted_proxies",
                ) from None
        self._networks = tuple(networks)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def trusts(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(address in net for net in self._networks)

    def client_address(self, peer: str, forwarded_for: str | None) -> str:
        """The client's address: ``peer``, or what a trusted ``peer`` says it forwarded."""
        if not self._networks or forwarded_for is None or not self.trusts(peer):
            return peer
        hops = [h.strip() for h in forwarded_for.split(",")][-32:]
        for hop in reversed(hops):
            if not hop:
                continue
            if not self.trusts(hop):
                try:
                    ipaddress.ip_address(hop.strip("[]"))
                except ValueError:
                    return peer  # garbage from the client's side: not an address to key on
                return hop
        return peer

    def __repr__(self) -> str:
        return f"TrustedProxies({', '.join(map(str, self._networks)) or 'none'})"
