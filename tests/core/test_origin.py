"""Token and Origin rules (pure)."""

from __future__ import annotations

import pytest

from omni_stream.core.origin import (
    is_loopback,
    origin_allowed,
    own_origins,
    token_ok,
)


def test_token_header_or_query() -> None:
    assert token_ok("s3cret", {"Authorization": "Bearer s3cret"}, "")
    assert token_ok("s3cret", {"Authorization": "bearer  s3cret "}, "")
    assert token_ok("s3cret", {}, "a=1&token=s3cret")
    assert not token_ok("s3cret", {}, "")
    assert not token_ok("s3cret", {"Authorization": "Bearer s3cre"}, "")
    assert not token_ok("s3cret", {"Authorization": "Basic s3cret"}, "")
    assert not token_ok("s3cret", {}, "token=")
    assert not token_ok("s3cret", {}, "token=S3CRET")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("192.168.1.2", False), ("example.com", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def allowed(origin: str | None, *, host: str = "127.0.0.1", port: int = 8765,
            allow: tuple[str, ...] = (), host_header: str | None = None) -> bool:
    return origin_allowed(
        origin, allowed=allow, own=own_origins(host, port), bound_host=host, host_header=host_header
    )


def test_no_origin_is_a_non_browser_client() -> None:
    assert allowed(None)


def test_loopback_server_allows_only_its_own_loopback_origins() -> None:
    assert allowed("http://127.0.0.1:8765")
    assert allowed("http://localhost:8765/")
    assert allowed("http://[::1]:8765")
    assert not allowed("http://127.0.0.1:9999")
    assert not allowed("http://evil.example")
    # DNS rebinding: the page's origin and the Host header agree, and must
    # still not be trusted by a loopback server.
    assert not allowed("http://evil.example:8765", host_header="evil.example:8765")


def test_allow_list_and_wildcard() -> None:
    assert allowed("https://app.example", allow=("https://app.example",))
    assert allowed("HTTPS://APP.EXAMPLE", allow=("https://app.example",))
    assert not allowed("https://app.example.evil", allow=("https://app.example",))
    assert allowed("https://anything.example", allow=("*",))


def test_public_bind_allows_the_origin_it_was_reached_by() -> None:
    assert allowed("http://gpu-box:8765", host="0.0.0.0", host_header="gpu-box:8765")
    assert allowed("http://gpu-box", host="0.0.0.0", port=80, host_header="gpu-box:80")
    assert not allowed("http://other:8765", host="0.0.0.0", host_header="gpu-box:8765")
    assert not allowed("http://gpu-box:8765", host="0.0.0.0", host_header=None)
