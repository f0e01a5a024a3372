"""facade.py: one lifecycle, one refusal while not running, one check_health, for every facade.

A toy facade stands for the four (each is tested in its own module too):
what the base promises holds whatever ``_start`` and ``_shutdown`` do.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

import omni_stream as om
from omni_stream.engine.facade import EngineFacade, first_dead
from omni_stream.engine.router import ModelRouter
from omni_stream.errors import EngineClosedError, EngineDeadError, EngineStalledError
from omni_stream.integrations.ray_serve.remote import RemoteEngine
from omni_stream.lifecycle import Lifecycle, Lifetime
from omni_stream.models import Synthetic

pytestmark = pytest.mark.anyio


class Toy(EngineFacade):
    """Records what the base asks of it; ``fail`` makes its start raise, ``block`` wait forever."""

    _noun = "toy"

    def __init__(self, *, fail: BaseException | None = None, block: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.block = block
        self.calls: list[str] = []
        self.status = "ok"
        self.cause: BaseException | None = None

    async def _start(self) -> None:
        self.calls.append("start")
        if self.fail is not None:
            raise self.fail
        if self.block:
            await anyio.sleep_forever()

    async def _shutdown(self) -> None:
        self.calls.append("shutdown")

    @property
    def model(self) -> om.StepModel:
        return Synthetic()

    @property
    def max_batch_size(self) -> int:
        return 1

    def stream(self, params: Mapping[str, Any] | None = None, **options: Any) -> Any:
        self._check_open(options.get("request_id"))

    def cancel(self, request_id: str) -> bool:
        return False

    def statistics(self) -> om.EngineStatistics:
        return om.EngineStatistics(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def health(self) -> om.Health:
        closed = self._lifecycle_health(self.statistics(), "toy")
        return closed or om.Health(self.status, None, self.statistics(), "toy")

    def _death_cause(self) -> BaseException | None:
        return self.cause


def test_a_lifetime_moves_only_forward() -> None:
    life = Lifetime("a thing")
    assert life.state is Lifecycle.NEW
    life.start()
    with pytest.raises(om.LifecycleError, match="a thing can be started once"):
        life.start()
    assert life.close() and life.state is Lifecycle.CLOSING
    assert not life.close() and life.state is Lifecycle.CLOSING  # a second close has nothing to do
    life.closed()
    assert not life.close() and life.state is Lifecycle.CLOSED
    never = Lifetime("another", error=EngineClosedError)
    assert not never.close() and never.state is Lifecycle.CLOSED  # closed before start: nothing ran
    with pytest.raises(EngineClosedError):
        never.start()


async def test_a_facade_starts_once_and_closes_once() -> None:
    toy = Toy()
    with pytest.raises(EngineClosedError, match=r"the toy is not started \(use `async with Toy\(...\)`\)"):
        toy.stream({}, request_id="a")
    assert toy.health().reason == "the toy was not started"
    async with toy as entered:
        assert entered is toy and toy._state is Lifecycle.RUNNING
        with pytest.raises(EngineClosedError, match="a Toy can be started once"):
            await toy.start()
    await toy.aclose()
    assert toy.calls == ["start", "shutdown"] and toy._state is Lifecycle.CLOSED
    with pytest.raises(EngineClosedError, match="the toy is shut down") as info:
        toy.stream({}, request_id="a")
    assert info.value.request_id == "a"
    assert toy.health().reason == "the toy was shut down"


async def test_closed_before_start_runs_no_shutdown() -> None:
    toy = Toy()
    await toy.aclose()
    assert toy.calls == [] and toy._state is Lifecycle.CLOSED
    with pytest.raises(EngineClosedError):
        await toy.start()


async def test_a_failed_start_closes_what_it_started_and_raises() -> None:
    toy = Toy(fail=RuntimeError("no weights"))
    with pytest.raises(RuntimeError, match="no weights"):
        await toy.start()
    assert toy.calls == ["start", "shutdown"] and toy._state is Lifecycle.CLOSED


async def test_a_start_cancelled_closes_too() -> None:
    toy = Toy(block=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(toy.start)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert toy.calls == ["start", "shutdown"] and toy._state is Lifecycle.CLOSED


async def test_check_health_raises_what_health_says_with_the_cause() -> None:
    toy = Toy()
    async with toy:
        toy.check_health()
        toy.status, toy.cause = "dead", OSError("the device fell off")
        with pytest.raises(EngineDeadError, match="the toy is dead") as info:
            toy.check_health()
        assert info.value.__cause__ is toy.cause
        assert first_dead([Toy(), toy]) is toy.cause
        toy.status = "stalled"
        with pytest.raises(EngineStalledError, match="the toy is stalled"):
            toy.check_health()
        assert first_dead([toy]) is None
    with pytest.raises(EngineClosedError, match="the toy was shut down"):
        toy.check_health()


async def test_a_call_from_another_thread_is_scheduled_on_the_loop() -> None:
    toy = Toy()
    assert toy._call_soon_threadsafe(print) is None  # before start: the caller calls it
    async with toy:
        ran = anyio.Event()
        assert toy._call_soon_threadsafe(ran.set) is None  # on the loop's thread: the caller's
        scheduled: list[bool | None] = []
        thread = threading.Thread(target=lambda: scheduled.append(toy._call_soon_threadsafe(ran.set)))
        thread.start()
        thread.join()
        with anyio.fail_after(5):
            await ran.wait()
        assert scheduled == [True]


def test_every_facade_is_one() -> None:
    for facade in (om.Engine, om.EngineGroup, ModelRouter, RemoteEngine):
        assert issubclass(facade, EngineFacade)
        # The surface is the base's, not restated.
        for name in ("__aenter__", "__aexit__", "start", "aclose", "check_health"):
            assert name not in vars(facade), (facade.__name__, name)
