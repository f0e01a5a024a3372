"""A request whose params an engine refuses after it was accepted (a remote replica's model)."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.asyncio.client import connect

import omni_stream as om
from omni_stream.models import Synthetic

from .conftest import SMALL, running, send, until_end


class _LateRefusal:
    """A stream that raises ParamsError on its first frame, as a RemoteEngine's may."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __aiter__(self) -> _LateRefusal:
        return self

    async def __anext__(self) -> Any:
        raise om.ParamsError("shape must be a multiple of 8 on this model", field="shape")

    async def __aenter__(self) -> _LateRefusal:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._inner.__aexit__(*exc)


class _RefusingEngine(om.Engine):
    def stream(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return _LateRefusal(super().stream(*args, **kwargs))


@pytest.mark.asyncio
async def test_a_late_param_refusal_ends_the_request_with_the_models_words() -> None:
    engine = _RefusingEngine(Synthetic(), device="cpu")
    async with engine, running(engine) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="late", params={**SMALL, "steps": 3})
        end = (await until_end(ws, "late"))[-1]
        # A request-ending code (a client waits for one after accepted), not "internal".
        assert (end["type"], end["code"], end["field"]) == ("error", "step_failed", "shape")
        assert "multiple of 8" in end["message"]
        assert server.engine.health().ok
