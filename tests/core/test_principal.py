"""Principals: who a client is, decided once at the door (core/principal.py)."""

from __future__ import annotations

import pytest

from omni_stream.core.principal import Principal, TrustedProxies, address_key
from omni_stream.core.tokens import TokenGrant
from omni_stream.errors import ParamsError


def test_each_kind_has_its_own_key_and_only_a_token_is_authenticated() -> None:
    token = Principal.of_token(TokenGrant("ann", "s"))
    conn = Principal.of_connection("c1")
    addr = Principal.of_address("10.1.2.3")
    assert (token.key, conn.key, addr.key) == ("token:ann", "connection:c1", "address:10.1.2.3")
    assert token.authenticated and not conn.authenticated and not addr.authenticated
    # A token named like an address is still another principal.
    assert Principal.of_token(TokenGrant("10.1.2.3", "x")).key != addr.key


def test_priority_counts_against_other_principals_only_as_far_as_granted() -> None:
    plain = Principal.of_token(TokenGrant("ann", "s"))
    ops = Principal.of_token(TokenGrant("ops", "t", priority=5))
    assert [plain.cross_priority(p) for p in (-10, 0, 10)] == [0, 0, 0]
    assert [ops.cross_priority(p) for p in (-10, 0, 3, 5, 10)] == [0, 0, 3, 5, 5]
    assert Principal.of_address("1.2.3.4").cross_priority(10) == 0


def test_an_ipv6_address_counts_by_its_64_block_and_a_mapped_ipv4_as_the_ipv4() -> None:
    # One host is usually given a /64: per-address rules per /64, or one host is 2**64 clients.
    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("[::ffff:10.0.0.7]") == "10.0.0.7"
    assert address_key("127.0.0.1") == "127.0.0.1"
    assert address_key("not an address") == "not an address"


def test_forwarded_for_is_believed_only_from_a_trusted_proxy() -> None:
    proxies = TrustedProxies(["10.0.0.0/8", "192.168.1.1"])
    # From a trusted proxy: the nearest hop that is not a proxy.
    assert proxies.client_address("10.0.0.5", "203.0.113.9, 10.0.0.6") == "203.0.113.9"
    # A client cannot name itself: what it put first is left of the real hop.
    assert proxies.client_address("10.0.0.5", "1.1.1.1, 203.0.113.9") == "203.0.113.9"
    # Not from a proxy: the header is anybody's words.
    assert proxies.client_address("203.0.113.9", "1.1.1.1") == "203.0.113.9"
    # Garbage where the client's address should be: the proxy itself, not the garbage.
    assert proxies.client_address("192.168.1.1", "evil, 10.0.0.1") == "192.168.1.1"
    assert proxies.client_address("10.0.0.5", None) == "10.0.0.5"
    # None configured: never believed.
    assert TrustedProxies().client_address("10.0.0.5", "1.1.1.1") == "10.0.0.5"


def test_a_trusted_proxy_that_is_not_an_address_is_refused_naming_it() -> None:
    with pytest.raises(ParamsError) as info:
        TrustedProxies(["10.0.0.0/8", "proxy.local"])
    assert info.value.field == "trusted_proxies" and "proxy.local" in info.value.message
    assert "OMNI_STREAM_TRUSTED_PROXIES" in info.value.message
