"""A request's body, read within the server's bounds: one reader for every HTTP door.

``/v1/generations`` and the OpenAI doors read their bodies here: at most
``max_message_bytes`` (a declared ``Content-Length`` over it is refused
before a byte is read), within ``body_timeout_s``, and counted in
``max_memory_bytes`` while it arrives (a body is refused rather than making
room: the budget would shed other clients' queues for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
from starlette.requests import Request

from ..core import admission
from ..errors import BodyRefused, ServerBusyError

if TYPE_CHECKING:
    from .service import Service

__all__ = ["BodyRefused", "read_body"]


async def read_body(request: Request, service: Service) -> bytes:
    """The body, within ``max_message_bytes`` and ``body_timeout_s``, counted in
    ``max_memory_bytes`` while it arrives.

    Raises BodyRefused (413 ``limit_exceeded``, 408 ``body_timeout``),
    ServerBusyError (the server is out of memory for it), starlette's
    ClientDisconnect.
    """
    limits = service.limits
    limit = limits.max_message_bytes
    memory = service.memory
    declared = request.headers.get("content-length")
    too_large = BodyRefused(
        413,
        "limit_exceeded",
        f"the body is over {limit} bytes (max_message_bytes, OMNI_STREAM_MAX_MESSAGE_BYTES)",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    counted = 0
    try:
        with anyio.move_on_after(limits.body_timeout_s) as waited:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
                if memory.over(len(chunk)):
                    raise ServerBusyError(
                        f"the server holds max_memory_bytes={memory.limit} bytes "
                        "(OMNI_STREAM_MAX_MEMORY_BYTES); try again shortly",
                        retry_after_s=admission.RETRY_AFTER_MIN_S,
                    )
                memory.add(len(chunk))
                counted += len(chunk)
        if waited.cancelled_caught:
            raise BodyRefused(
                408,
                "body_timeout",
                f"the body did not arrive within {limits.body_timeout_s:g} s "
                "(body_timeout_s, OMNI_STREAM_BODY_TIMEOUT)",
            )
        return bytes(body)
    finally:
        memory.release(counted)
