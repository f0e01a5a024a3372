"""AUTOMATIC1111's credentials as our token (pure).

A1111 protects its API with HTTP basic auth (``--api-auth user:password``),
and its clients send it (webuiapi's ``WebUIApi(username=..., password=...)``).
Here the password is the server's token (``serve --token``) and the user
name is not read: ``Authorization: Basic base64(user:TOKEN)`` on an A1111
route is taken as ``Authorization: Bearer TOKEN``, so the core's one token
check (core/tokens.py) decides, and the principal is the token's tenant.
"""

from __future__ import annotations

import base64
import binascii

__all__ = ["bearer_of_basic"]


def bearer_of_basic(authorization: str) -> str | None:
    """``Bearer PASSWORD`` for a basic ``Authorization`` header's value, else None (another
    scheme, or credentials that do not decode: the token check then refuses them as sent)."""
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    if not colon or not password:
        return None
    return f"Bearer {password}"
