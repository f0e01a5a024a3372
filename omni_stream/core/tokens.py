"""Named tokens: who a bearer token says a client is, and what it grants (pure, no I/O).

One server may serve several tenants, each with a token of its own; the
token's *name* is the tenant's identity (its principal, principal.py), so
every per-principal rule (requests, connections, rates, the fair share)
applies to the tenant whatever door or how many connections it uses. A
token is given as:

- ``SECRET``: one unnamed token, named ``default`` (``--token T``,
  ``OMNI_STREAM_TOKEN``, ``Server(token=...)``): every holder is one tenant;
- ``NAME=SECRET``: a named token (``--token NAME=SECRET``, repeatable);
- a tokens file (``--tokens-file``, ``OMNI_STREAM_TOKENS_FILE``): one
  ``NAME=SECRET`` per line, optionally followed by grants as
  ``key=value`` words; ``#`` starts a comment.

The one grant today is ``priority=N`` (0 to 10): a tenant's ``priority``
orders its own requests only, unless its token is granted more; then its
requests rank across tenants with their priority up to N (core/gate.py).

A presented token is compared with every configured secret with
``hmac.compare_digest``, all of them, so neither the time taken nor an
early exit says how much of a guess was right or which token came close.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs

from ..errors import ParamsError

__all__ = [
    "DEFAULT_TOKEN_NAME",
    "MAX_GRANTED_PRIORITY",
    "TOKENS_FILE_ENV",
    "TokenGrant",
    "Tokens",
    "parse_token",
    "read_tokens_file",
]

#: The name of a token given without one.
DEFAULT_TOKEN_NAME: Final = "default"
#: The environment variable naming a tokens file.
TOKENS_FILE_ENV: Final = "OMNI_STREAM_TOKENS_FILE"
#: The highest ``priority=`` a token may be granted (the protocol's highest priority).
MAX_GRANTED_PRIORITY: Final = 10

_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")
_NAMED: Final = re.compile(r"([A-Za-z][A-Za-z0-9_.\-]{0,63})=(.+)", re.DOTALL)
_GRANTS: Final = ("priority",)


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """One configured token: its ``name`` (the tenant), its secret, and what it grants."""

    name: str
    secret: str = field(repr=False)
    #: The highest priority its requests carry across tenants (0: its own only).
    priority: int = 0


def parse_token(text: str, *, where: str = "token") -> TokenGrant:
    """``SECRET`` (named ``default``) or ``NAME=SECRET``, as a :class:`TokenGrant`.

    A secret that is only ``=`` signs after a name-like prefix is taken as
    one unnamed token (base64's padding: ``abc==`` is a secret, not a name
    ``abc`` with the secret ``=``). Raises ParamsError (field ``token``)
    for an empty token or secret, or whitespace inside one.
    """
    if not isinstance(text, str) or not text.strip():
        raise ParamsError(f"{where}: a token must be a non-empty string", field="token")
    text = text.strip()
    match = _NAMED.fullmatch(text)
    if match is not None and match.group(2).strip("="):
        name, secret = match.group(1), match.group(2)
    else:
        name, secret = DEFAULT_TOKEN_NAME, text
    if any(c.isspace() for c in secret):
        raise ParamsError(f"{where}: the secret of token {name!r} contains whitespace", field="token")
    return TokenGrant(name, secret)


def _grant(grant: TokenGrant, word: str, where: str) -> TokenGrant:
    key, eq, value = word.partition("=")
    if not eq or key not in _GRANTS:
        raise ParamsError(
            f"{where}: unknown grant {word[:40]!r} for token {grant.name!r}; known: "
            + ", ".join(f"{g}=N" for g in _GRANTS),
            field="token",
        )
    try:
        priority = int(value)
    except ValueError:
        priority = -1
    if not 0 <= priority <= MAX_GRANTED_PRIORITY:
        raise ParamsError(
            f"{where}: priority= must be an integer from 0 to {MAX_GRANTED_PRIORITY}, got {value[:20]!r}",
            field="token",
        )
    return TokenGrant(grant.name, grant.secret, priority=priority)


def read_tokens_file(path: str | Path) -> list[TokenGrant]:
    """The tokens of a tokens file (see the module docstring).

    Raises ParamsError (field ``tokens_file``) naming the file and line of
    what is wrong, or the file when it cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ParamsError(f"tokens file {str(path)!r} cannot be read: {exc}", field="tokens_file") from None
    grants: list[TokenGrant] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"tokens file {str(path)!r} line {number}"
        first, *words = line.split()
        if _NAMED.fullmatch(first) is None:
            raise ParamsError(f"{where}: expected NAME=SECRET, got {first[:20]!r}...", field="tokens_file")
        try:
            grant = parse_token(first, where=where)
            for word in words:
                grant = _grant(grant, word, where)
        except ParamsError as exc:
            raise ParamsError(exc.message, field="tokens_file") from None
        grants.append(grant)
    if not grants:
        raise ParamsError(f"tokens file {str(path)!r} holds no token", field="tokens_file")
    return grants


class Tokens:
    """The tokens a server accepts (none: an open server); ``identify`` says whose one is."""

    def __init__(self, grants: Iterable[TokenGrant] = ()) -> None:
        """Raises ParamsError (field ``token``) for two tokens of one name or one secret."""
        self._grants: tuple[TokenGrant, ...] = tuple(grants)
        names: set[str] = set()
        secrets: set[str] = set()
        for grant in self._grants:
            if _NAME.fullmatch(grant.name) is None:
                raise ParamsError(f"token name {grant.name[:40]!r} is not a name", field="token")
            if grant.name in names:
                raise ParamsError(f"two tokens are named {grant.name!r}", field="token")
            if grant.secret in secrets:
                raise ParamsError(f"tokens {grant.name!r} and another share one secret", field="token")
            names.add(grant.name)
            secrets.add(grant.secret)
        self._secrets = [(g, g.secret.encode()) for g in self._grants]

    @classmethod
    def of(
        cls,
        token: str | Iterable[str | TokenGrant] | Mapping[str, str] | Tokens | None = None,
        *,
        tokens_file: str | Path | None = None,
    ) -> Tokens:
        """From ``token`` (one ``SECRET`` / ``NAME=SECRET``, several of them or of
        :class:`TokenGrant`, a name -> secret mapping, or a :class:`Tokens`) and a
        ``tokens_file``; raises ParamsError naming what is wrong."""
        grants: list[TokenGrant] = []
        if isinstance(token, Tokens):
            grants.extend(token._grants)
        elif isinstance(token, str):
            grants.append(parse_token(token))
        elif isinstance(token, Mapping):
            for name, secret in token.items():
                grant = parse_token(f"{name}={secret}")
                if grant.name != name:
                    raise ParamsError(f"token name {str(name)[:40]!r} is not a name", field="token")
                grants.append(grant)
        elif token is not None:
            grants.extend(t if isinstance(t, TokenGrant) else parse_token(t) for t in token)
        if tokens_file is not None:
            grants.extend(read_tokens_file(tokens_file))
        return cls(grants)

    def __bool__(self) -> bool:
        return bool(self._grants)

    def __len__(self) -> int:
        return len(self._grants)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self._grants)

    def named(self, name: str) -> TokenGrant | None:
        """The configured token called ``name``; None when there is none (a request resumed after a
        restart finds its token's grant here: server/state_restore.py)."""
        return next((g for g in self._grants if g.name == name), None)

    def identify(self, headers: Mapping[str, str], query: str) -> TokenGrant | None:
        """The grant of the token presented as ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``.

        None when none is presented or none matches (a 401 when tokens are configured).
        """
        presented: list[bytes] = []
        auth = headers.get("authorization")
        if auth is not None:
            scheme, _, bearer = auth.strip().partition(" ")
            if scheme.lower() == "bearer":
                presented.append(bearer.strip().encode())
        if "token=" in query:
            presented.extend(v.encode() for v in parse_qs(query, keep_blank_values=True).get("token", []))
        found: TokenGrant | None = None
        for candidate in presented:
            for grant, secret in self._secrets:
                # Every comparison runs (no early exit): see the module docstring.
                if hmac.compare_digest(candidate, secret) and found is None:
                    found = grant
        return found

    def __repr__(self) -> str:
        return f"Tokens({', '.join(self.names) or 'none'})"
