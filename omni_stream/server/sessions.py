"""A browser's session without a token: the cookie that makes its requests its own (issue #38).

On a server without tokens, an HTTP caller's principal is its address
(principal.py), which proves nothing: many people may share one address
behind a NAT or a proxy, so the queue view (``GET /v1/generations``)
showed nobody any id, and a page could not list its own jobs. So the
server sets a session cookie on the first page or API call that comes
without one, and the requests made with that cookie (over HTTP, or the
websocket the page opens, which carries it) are that session's: the
queue view shows their ids to it, and to nobody else; it may look them
up, attach, cancel, like their owner.

The session is visibility only, never a principal: a client may drop its
cookie at will, so counting by it would let one client be many. Its value
is 192 random bits, the server's own (one that is not in its form is
replaced), ``HttpOnly`` (no script reads it) and ``SameSite=Lax``
(another site's calls do not carry it; a link to the page still does, so
following one does not lose the session). Sessions live in the server's
memory with their requests: a request the state directory brings back
after a restart has none.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Final

__all__ = ["COOKIE", "cookie_header", "mint", "read"]

#: The cookie's name.
COOKIE: Final = "omni_session"
#: A year: the session outlives a browser restart; the requests it names do not outlive retention_s.
MAX_AGE_S: Final = 365 * 24 * 3600
_FORM: Final = re.compile(r"[A-Za-z0-9_-]{32}")


def read(cookies: Mapping[str, str]) -> str | None:
    """The session the request's ``cookies`` name, if one of the server's form; else None."""
    value = cookies.get(COOKIE)
    return value if value is not None and _FORM.fullmatch(value) else None


def mint() -> str:
    """A new session's value: 192 random bits, URL-safe."""
    return secrets.token_urlsafe(24)


def cookie_header(session: str, *, path: str = "/", secure: bool = False) -> str:
    """The ``Set-Cookie`` value that gives a browser ``session`` (``secure`` over HTTPS)."""
    value = f"{COOKIE}={session}; Path={path or '/'}; Max-Age={MAX_AGE_S}; HttpOnly; SameSite=Lax"
    return value + "; Secure" if secure else value
