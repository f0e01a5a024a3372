"""A request's params are validated once in the server's process (issue #36, "Validated once").

The server's admission validates them; the engine takes them as checked
(engine/intake.py's ``CheckedParams``) instead of validating them again.
Counted here on each door of a real server: the websocket, HTTP and the
OpenAI images door.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omni_stream.models import Mixture

from ..conftest import one_torch_thread
from .conftest import running, send, until_end

PARAMS: dict[str, Any] = {"prompt": "red circle", "size": 32, "steps": 2}


class Counted(Mixture):
    """Mixture counting its ``validate`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.validated = 0

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        self.validated += 1
        return super().validate(params)


@pytest.mark.asyncio
async def test_one_validate_per_request_on_every_door() -> None:
    model = Counted()
    with one_torch_thread():
        async with running(model) as server, httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="ws", params=PARAMS)
                msgs = await until_end(ws, "ws")
            assert msgs[-1]["type"] == "done", msgs[-1]
            assert model.validated == 1, "websocket"

            model.validated = 0
            reply = await http.post("/v1/generations?wait=true", json={"params": PARAMS})
            assert reply.status_code == 200, reply.text
            assert model.validated == 1, "HTTP"

            model.validated = 0
            reply = await http.post(
                "/v1/images/generations", json={"prompt": "red circle", "size": "32x32", "steps": 2}
            )
            assert reply.status_code == 200, reply.text
            assert model.validated == 1, "OpenAI images"
