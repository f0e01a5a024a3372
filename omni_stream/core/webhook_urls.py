"""Webhook URLs (pure): which may be called, matched in the one form they are sent in.

A URL is admitted only when it is already in the form the server sends it
in (:func:`sent_form`: RFC 3986's normalisation), so the string matched
against the allow-list is the string sent, byte for byte: issue #39, attack
8, was ``/hooks/tenant-a/../tenant-b/steal`` matching ``/hooks/tenant-a/*``
and httpx then sending ``/hooks/tenant-b/steal``. Allow-list patterns are
checked the same way at start (:func:`check_pattern`).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from ..errors import ParamsError

__all__ = ["check_pattern", "clip", "matches", "sent_form", "url_problem"]


#: What a URL's path and query may hold as they are (RFC 3986's pchar, '/', '?'):
#: anything else an HTTP client sends percent-encoded, a string other than the one matched.
_UNRESERVED: Final = frozenset(string.ascii_letters + string.digits + "-._~")
_PATH_CHARS: Final = _UNRESERVED | frozenset("!$&'()*+,;=:@/")
_QUERY_CHARS: Final = _PATH_CHARS | frozenset("?")
_HOST_CHARS: Final = frozenset(string.ascii_lowercase + string.digits + "-._~:[]")
_HEX: Final = frozenset(string.hexdigits)
_DEFAULT_PORT: Final[Mapping[str, int]] = {"http": 80, "https": 443}


def url_problem(url: str) -> str | None:
    """Why ``url`` may not be a webhook's whatever the allow-list says; None when it may."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F or c == "\\" for c in url):
        return "has spaces, backslashes or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # a malformed port raises here
    except ValueError as exc:
        return f"is not a URL ({exc})"
    del port
    if parts.scheme not in ("http", "https"):
        return "is not an http:// or https:// URL"
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        # user:pass@host would be sent as Basic credentials: never a client's to choose.
        return "carries credentials (user@host); put secrets in the path, or verify the signature"
    if not parts.hostname:
        return "has no host"
    try:
        sent = sent_form(url)
    except ValueError as exc:
        return str(exc)
    if sent != url:
        # Matching the string given and sending another is how /hooks/tenant-a/../tenant-b
        # passed /hooks/tenant-a/* (issue #39, attack 8): refused, and the form named.
        return (
            f"is not in the form it would be sent in, {clip(sent)!r} (dot segments, percent-encoded "
            "letters, digits or dots, an upper-case scheme or host, a default port or an empty path "
            "are normalised before sending); give that form"
        )
    return None


def sent_form(url: str) -> str:
    """``url`` (http or https, with a host) in the one form the server sends it in.

    Normalised as RFC 3986, 6.2.2, does it: scheme and host in lowercase, no
    default port, percent escapes of unreserved characters decoded (``%2e``
    is ``.``), dot segments removed, ``/`` for an empty path. Raises
    ValueError, saying why, for what has no such form: a fragment (never
    sent), a malformed percent escape, a percent-encoded ``/`` or ``\\``,
    a dot segment with ``;`` parameters (``..;``: some receivers resolve it
    as ``..``), or a character a client would send percent-encoded.
    """
    if "#" in url:
        raise ValueError("has a fragment (#...), which is never sent")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    if not set(host) <= _HOST_CHARS:
        raise ValueError("has characters in its host that are sent encoded (write it in ASCII, IDNA)")
    port = parts.port
    netloc = host if port is None or port == _DEFAULT_PORT.get(scheme) else f"{host}:{port}"
    path = _dot_segments_removed(_unreserved_decoded(parts.path, "path")) or "/"
    query = parts.query
    _unreserved_decoded(query, "query", allowed=_QUERY_CHARS)  # checked, kept as given
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _unreserved_decoded(text: str, where: str, *, allowed: frozenset[str] = _PATH_CHARS) -> str:
    """``text`` with percent escapes of unreserved characters decoded; raises ValueError for a
    malformed escape, an encoded '/' or '\\', or a character outside ``allowed``."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "%":
            if char not in allowed:
                raise ValueError(f"has {char!r} in its {where}, which is sent percent-encoded; encode it")
            out.append(char)
            i += 1
            continue
        code = text[i + 1 : i + 3]
        if len(code) != 2 or not set(code) <= _HEX:
            raise ValueError(f"has a malformed percent escape in its {where} ({text[i : i + 3]!r})")
        decoded = chr(int(code, 16))
        if decoded in "/\\" and where == "path":
            # A receiver that decodes it before routing sees a separator the match did not.
            raise ValueError(f"has a percent-encoded {decoded!r} in its path (%{code})")
        out.append(decoded if decoded in _UNRESERVED else text[i : i + 3])
        i += 3
    return "".join(out)


def _dot_segments_removed(path: str) -> str:
    """``path`` without ``.`` and ``..`` segments (RFC 3986, 5.2.4); raises ValueError for a
    dot segment with ``;`` parameters."""
    segments = path.split("/")
    out: list[str] = []
    for segment in segments:
        if ";" in segment and segment.partition(";")[0] in (".", ".."):
            raise ValueError(f"has a dot segment with parameters in its path ({segment[:20]!r})")
        if segment == "..":
            if len(out) > 1:
                out.pop()
        elif segment != ".":
            out.append(segment)
    if segments[-1] in (".", ".."):
        out.append("")  # "/a/b/.." is "/a/": the last dot segment leaves its slash
    return "/".join(out)


def matches(pattern: str, url: str) -> bool:
    # A prefix glob: '*' (last, after the host's '/') matches the rest; else the whole URL.
    if pattern.endswith("*"):
        return url.startswith(pattern[:-1])
    return url == pattern


def check_pattern(pattern: str, where: str) -> str:
    """``pattern`` if it is a valid allow-list entry; raises ParamsError (field ``webhook_allow``)."""
    text = pattern.strip()
    head = text[:-1] if text.endswith("*") else text
    why: str | None = None
    if "*" in head:
        why = "'*' may only end a pattern (it matches the rest of the URL)"
    elif text.endswith("*") and "/" not in head.partition("//")[2]:
        # https://hooks.example.com* would also match https://hooks.example.com.evil.net/.
        why = "end the host with '/' before '*' (https://hooks.example.com/*)"
    elif (problem := url_problem(head)) is not None:
        # Also one not in the form URLs are sent in (upper case, dot segments):
        # URLs are admitted only in that form, so it would match none, or more.
        why = f"the URL {problem}"
    if why is not None:
        raise ParamsError(f"{where}: {text!r} is not a webhook URL pattern: {why}", field="webhook_allow")
    return text


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
