"""lifecycle.py: Engine, EngineGroup, Server and Client start once, and say so with one error."""

from __future__ import annotations

import pytest

import omni_stream as om
from omni_stream import client as omc
from omni_stream.lifecycle import Lifecycle
from omni_stream.models import Synthetic
from omni_stream.server import Server

from .conftest import running


def test_only_closing_and_closed_are_ending() -> None:
    assert [s for s in Lifecycle if s.ending] == [Lifecycle.CLOSING, Lifecycle.CLOSED]


@pytest.mark.asyncio
async def test_an_engine_starts_once_and_is_refused_after_close() -> None:
    engine = om.Engine(Synthetic(), device="cpu")
    async with engine:
        with pytest.raises(om.LifecycleError, match="started once") as info:
            await engine.start()
        assert isinstance(info.value, om.EngineClosedError)
    with pytest.raises(om.LifecycleError, match="shut down"):
        engine.stream({})
    with pytest.raises(om.EngineClosedError):
        await engine.start()
    await engine.aclose()  # idempotent


@pytest.mark.asyncio
async def test_an_engine_group_starts_once() -> None:
    group = om.EngineGroup(lambda: Synthetic(), devices=["cpu"])
    with pytest.raises(om.LifecycleError, match="not started"):
        group.stream({})
    async with group:
        with pytest.raises(om.LifecycleError, match="started once"):
            await group.start()


@pytest.mark.asyncio
async def test_a_server_starts_once_and_has_no_port_before() -> None:
    server = Server(Synthetic(), host="127.0.0.1", port=0, device="cpu",
                    shutdown_timeout_s=0.5, close_timeout_s=1.0)
    with pytest.raises(om.LifecycleError, match="not started"):
        server.port  # noqa: B018 - the property is what raises
    async with server:
        # A RuntimeError too: what it raised before LifecycleError existed.
        with pytest.raises(RuntimeError, match="started once") as info:
            await server.start()
        assert isinstance(info.value, om.LifecycleError)
    with pytest.raises(om.LifecycleError):
        await server.start()
    await server.aclose()  # idempotent


@pytest.mark.asyncio
async def test_a_client_is_entered_once() -> None:
    async with running() as server:
        client = omc.Client(server.url)
        async with client:
            with pytest.raises(om.LifecycleError, match="entered once"):
                await client.__aenter__()
        assert client.closed
        with pytest.raises(RuntimeError, match="entered once"):
            await client.__aenter__()
