"""An engine of one's own behind the server: what the server checks up front, and what it passes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest

import omni_stream as om
from omni_stream.engine import EngineLike, Health
from omni_stream.models import Synthetic
from omni_stream.server import Server, create_app

from .conftest import SMALL, running, wait_for


class DocumentedEngine:
    """Written to docs/configuration.md's ``stream(params, request_id=None, policy="all", timeout=None)``.

    It wraps an Engine (as a user's logging or routing engine would) and
    records what the server asked of it.
    """

    def __init__(self, inner: om.Engine) -> None:
        self._inner = inner
        self.calls: list[dict[str, Any]] = []

    @property
    def model(self) -> Any:
        return self._inner.model

    @property
    def max_batch_size(self) -> int:
        return self._inner.max_batch_size

    def stream(
        self,
        params: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        policy: str = "all",
        timeout: float | None = None,
    ) -> Any:
        self.calls.append({"request_id": request_id, "policy": policy})
        return self._inner.stream(params, request_id=request_id, policy=policy, timeout=timeout)

    async def generate(self, params: Mapping[str, Any] | None = None, **options: Any) -> Any:
        return await self._inner.generate(params, **options)

    def cancel(self, request_id: str) -> bool:
        return self._inner.cancel(request_id)

    def health(self) -> Health:
        return self._inner.health()

    def check_health(self) -> None:
        self._inner.check_health()

    def statistics(self) -> Any:
        return self._inner.statistics()

    async def __aenter__(self) -> DocumentedEngine:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.__aexit__(*exc)


@pytest.mark.asyncio
async def test_an_engine_written_to_the_documented_stream_serves_requests() -> None:
    engine = DocumentedEngine(om.Engine(Synthetic(), device="cpu"))
    assert isinstance(engine, EngineLike)  # members only: its stream takes fewer keywords
    async with engine, running(engine) as server, httpx.AsyncClient(base_url=server.http_url) as client:
        body = {"params": {**SMALL, "steps": 3}}
        reply = await client.post("/v1/generations?wait=1", json=body, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"] == "image/png", reply.text
    # The keywords it takes, "latest" among them; none it does not (preview_every, priority).
    assert [c["policy"] for c in engine.calls] == ["latest"] and engine.calls[0]["request_id"]


class NoHealth:
    model = Synthetic()
    max_batch_size = 1

    def stream(self, params: Any = None, *, request_id: str | None = None) -> Any:
        raise AssertionError("never called")

    def cancel(self, request_id: str) -> bool:
        return False


class NoRequestId(NoHealth):
    def health(self) -> Health:
        raise AssertionError("never called")

    def stream(self, params: Any = None) -> Any:  # type: ignore[override]
        raise AssertionError("never called")


class AsyncGeneratorStream(NoRequestId):
    async def stream(self, params: Any = None, *, request_id: str | None = None) -> AsyncIterator[Any]:  # type: ignore[override]
        yield None


@pytest.mark.parametrize(
    ("engine", "named"),
    [(NoHealth(), "it lacks health"), (NoRequestId(), "request_id"), (AsyncGeneratorStream(), "async def")],
    ids=["no health()", "no request_id", "async stream"],
)
@pytest.mark.parametrize("build", [create_app, Server], ids=["create_app", "Server"])
def test_an_engine_the_server_cannot_run_is_refused_at_construction(
    engine: Any, named: str, build: Any
) -> None:
    with pytest.raises(TypeError) as info:
        build(engine)
    assert type(engine).__name__ in str(info.value) and named in str(info.value)


class StreamWithoutPoll:
    """What a stream of one's own may forget: everything but iteration and closing."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> Any:
        return await self._inner.__anext__()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.aclose()

    async def aclose(self) -> None:
        await self._inner.aclose()


class ForgetfulEngine(DocumentedEngine):
    def stream(self, params: Mapping[str, Any] | None = None, **options: Any) -> Any:  # type: ignore[override]
        return StreamWithoutPoll(super().stream(params, **{k: options[k] for k in ("request_id", "policy")}))


@pytest.mark.asyncio
async def test_a_stream_lacking_what_the_server_uses_is_refused_naming_it_not_an_internal_error() -> None:
    engine = ForgetfulEngine(om.Engine(Synthetic(), device="cpu"))
    async with engine, running(engine) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            reply = await client.post("/v1/generations?wait=1", json={"params": {**SMALL, "steps": 3}})
        stats = engine.statistics
        await wait_for(lambda: stats().active + stats().queued == 0, what="the request it submitted to end")
    body = reply.json()
    assert reply.status_code == 503 and body["error"] == "engine_unavailable", body
    message = body["message"]
    assert "StreamWithoutPoll" in message and "poll" in message and "params" in message
