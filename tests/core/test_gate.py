"""The gate: at most max_active requests in the engine; the other admitted ones wait, unstarted.

First the pure bookkeeping (``Gate``), then the service around it (no
sockets): what the engine holds, what a waiting request's client sees,
cancelling, disconnecting and shutting down while it waits, and the
per-step pace of a request beside a flood (the red team's attack 3: before
the gate, every admitted request was stepped in turn).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from omni_stream.engine.scheduler import AGE_ROUNDS
from omni_stream.core.gate import OVERDUE_LET_INS, Gate

# The gate's own order is tested under round-robin scheduling: under preemptive (the
# default) a short request may take a long one's place at once (tests/server/test_preempt.py).
from ..server.test_service import LONG, SHORT, Client, check_stream, serving, wait_for

# -- the bookkeeping -----------------------------------------------------------------


def test_room_until_the_bound_then_requests_wait() -> None:
    gate = Gate(lambda: 2)
    assert gate.has_room()
    gate.entered("a")
    gate.entered("a")
    assert not gate.has_room() and gate.pop() is None
    gate.wait("w", "b", 0, "payload")
    assert "w" in gate and gate.waiting == 1 and gate.pop() is None  # still full
    gate.left("a")
    assert not gate.has_room()  # someone waits: a newcomer does not jump it
    item = gate.pop()
    assert item is not None and (item.request_id, item.payload) == ("w", "payload")
    assert "w" not in gate and gate.waiting == 0


def test_a_granted_cross_priority_first_then_the_principal_with_least_inside_then_arrival() -> None:
    gate = Gate(lambda: 3)
    gate.entered("busy")  # "busy" has two in the engine already
    gate.entered("busy")
    for rid, owner, prio in [("b1", "busy", 0), ("b2", "busy", 0), ("q1", "quiet", 0)]:
        gate.wait(rid, owner, prio, None)
    gate.wait("hi", "busy", 3, None, cross=3)  # its token is granted priority 3
    assert gate.order()[0] == "hi"
    item = gate.pop()
    assert item is not None and item.request_id == "hi"
    gate.entered(item.owner)  # "busy" now has 3 inside: its others wait behind "quiet"'s
    assert gate.order() == ["q1", "b1", "b2"]


def test_a_principals_own_priority_orders_its_own_requests_only() -> None:
    # A priority-10 flood does not go before another principal's priority 0
    # (issue #19, finding 9): between principals the least inside goes first.
    gate = Gate(lambda: 1)
    gate.entered("flood")
    for i in range(3):
        gate.wait(f"f{i}", "flood", 10, None)
    gate.wait("honest", "me", 0, None)
    gate.wait("f-low", "flood", -5, None)
    gate.left("flood")
    item = gate.pop()
    assert item is not None and item.request_id == "honest"
    gate.entered(item.owner)
    gate.left(item.owner)
    # Within the flood's own requests: its highest priority first, then arrival.
    assert gate.order() == ["f0", "f1", "f2", "f-low"]


def test_a_low_priority_waits_but_is_not_starved() -> None:
    gate = Gate(lambda: 1)
    gate.wait("low", "a", 0, None)
    let_in = 0
    while True:
        gate.wait(f"hi{let_in}", "b", 10, None, cross=10)
        item = gate.pop()
        assert item is not None
        gate.entered(item.owner)
        gate.left(item.owner)
        if item.request_id == "low":
            break
        let_in += 1
        assert let_in < 1000, "starved"
    # 10 points of cross priority apart: it leads after 10 * AGE_ROUNDS let in.
    assert let_in == 10 * AGE_ROUNDS


def test_a_removed_request_is_never_let_in() -> None:
    gate = Gate(lambda: 1)
    gate.entered("a")
    gate.wait("w", "b", 0, None)
    assert gate.remove("w") is not None and gate.remove("w") is None
    gate.left("a")
    assert gate.pop() is None and gate.has_room()


def _cycle(gate: Gate) -> str:
    """Let the next one in and let it finish at once; its id."""
    item = gate.pop()
    assert item is not None
    gate.entered(item.owner, item.cost)
    gate.left(item.owner)
    return item.request_id


def test_a_newcomer_is_not_put_behind_every_request_the_flood_queued_before_it() -> None:
    # Four connections queued 8 long requests each; a dozen ran. Then a
    # client asks for one short request: it goes in next. (Ageing each
    # request from its own arrival made the gate first come, first served:
    # it went in after the 20 flood requests older than it.)
    gate = Gate(lambda: 1)
    for i in range(4):
        for j in range(8):
            gate.wait(f"f{i}-{j}", f"flood{i}", 0, None, cost=400)
    ran = [_cycle(gate) for _ in range(12)]
    assert ran[:4] == ["f0-0", "f1-0", "f2-0", "f3-0"]  # one per connection in turn
    gate.wait("honest", "honest", 0, None, cost=20)
    assert gate.order()[0] == "honest"
    assert _cycle(gate) == "honest"


def test_between_connections_with_nothing_inside_the_one_let_in_fewer_steps_goes_first() -> None:
    gate = Gate(lambda: 1)
    gate.wait("a1", "a", 0, None, cost=1000)
    gate.wait("b1", "b", 0, None, cost=10)
    gate.wait("a2", "a", 0, None, cost=1000)
    gate.wait("b2", "b", 0, None, cost=10)
    # a1 is oldest; then "a" has had 1000 steps, "b" 10: b's go first.
    assert [_cycle(gate) for _ in range(4)] == ["a1", "b1", "b2", "a2"]


def test_a_connection_with_nothing_waiting_or_inside_is_forgotten() -> None:
    gate = Gate(lambda: 2)
    for i in range(50):
        gate.wait(f"r{i}", f"conn{i}", 0, None, cost=5)
        assert _cycle(gate) == f"r{i}"
    assert gate.owners_known() == 0
    gate.wait("x", "kept", 0, None)
    assert gate.owners_known() == 0  # nothing let in yet: nothing to remember
    gate.entered("inside", 7)
    assert gate.owners_known() == 1
    gate.left("inside")
    gate.remove("x")
    assert gate.owners_known() == 0 and gate.waiting == 0


def test_a_request_passed_over_by_every_rule_goes_first_once_overdue() -> None:
    # "hog" has had many steps, so every newcomer (fewer steps) goes before
    # its waiting request, until it has waited OVERDUE_LET_INS let-ins.
    gate = Gate(lambda: 1)
    gate.wait("hogs", "hog", 0, None, cost=10_000)
    gate.entered("hog", 10_000)  # an earlier request of its, run and ended
    gate.left("hog")
    let_in = 0
    while True:
        gate.wait(f"n{let_in}", f"new{let_in}", 0, None, cost=1)
        if _cycle(gate) == "hogs":
            break
        let_in += 1
        assert let_in < 1000, "starved"
    assert let_in == OVERDUE_LET_INS - 1  # the hog's own entry counted one


# -- the service around it -------------------------------------------------------------


@pytest.mark.asyncio
async def test_beyond_max_active_requests_wait_unstarted_and_go_in_as_others_end() -> None:
    async with serving(scheduling="round-robin", max_active=1, max_queued=4) as service:
        a = Client(service)
        first = a.generate("first", {**SHORT, "steps": 30})
        second = a.generate("second", SHORT)
        assert first["type"] == second["type"] == "accepted"
        # One in the engine; the other waits, unstarted, and says so.
        stats = service.engine.statistics()
        assert stats.active + stats.queued == 1 and service.gate.waiting == 1
        assert list(service.rules.queue_positions())[-1] == "second"
        h = service.health_payload()[1]["load"]
        assert (h["active"], h["queued"]) == (1, 1)
        msgs = await a.until_end("first")
        check_stream([first, *msgs], "first", 30)
        later = await a.until_end("second")
        check_stream([second, *later], "second", SHORT["steps"])
        assert service.gate.in_engine == 0 and service.memory.reserved == 0


@pytest.mark.asyncio
async def test_health_says_one_thing_by_queued_counting_the_gate() -> None:
    async with serving(scheduling="round-robin", max_active=1, max_queued=4) as service:
        a = Client(service)
        a.generate("first", {**SHORT, "steps": 30})
        a.generate("second", SHORT)  # waits in the gate: the engine never saw it
        body = service.health_payload()[1]
        assert (body["active"], body["queued"]) == (body["load"]["active"], body["load"]["queued"]) == (1, 1)
        # Where requests sit inside the engine: its own counts, under their own name.
        assert body["engine"]["active"] + body["engine"]["queued"] == 1
        await a.until_end("first")
        await a.until_end("second")


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "disconnect", "shutdown"])
async def test_a_waiting_request_ends_at_once_and_gives_its_memory_back(how: str) -> None:
    async with serving(scheduling="round-robin", max_active=1, max_queued=4) as service:
        a = Client(service)
        a.generate("running", LONG)
        a.generate("waiting", LONG)
        assert service.gate.waiting == 1
        reserved = service.memory.reserved
        record = service.registry.get("waiting")
        assert record is not None
        if how == "cancel":
            assert a.exchange('{"type": "cancel", "id": "waiting"}') == [
                {"type": "cancelled", "id": "waiting", "reason": "client"}
            ]
        elif how == "disconnect":
            a.close()
        else:
            with anyio.fail_after(10):
                await service.shutdown_requests(grace_s=0.0)
        assert service.gate.waiting == 0 and "waiting" not in service.gate
        assert service.memory.reserved < reserved
        assert record.ended and record.outcome == "cancelled"
        if how == "cancel":
            a.send(type="cancel", id="running")
        await wait_for(lambda: not service.registry.running(), "the running one to end")


def _flood(service: Any, connections: int, each: int) -> list[Client]:
    """``connections`` clients with ``each`` long requests accepted, ids ``f{i}-{j}``."""
    flood = [Client(service) for _ in range(connections)]
    for i, c in enumerate(flood):
        for j in range(each):
            assert c.generate(f"f{i}-{j}", LONG)["type"] == "accepted"
    return flood


@pytest.mark.asyncio
async def test_a_freed_slot_goes_to_the_connection_with_least_inside_not_to_the_flood() -> None:
    # 3 connections x 8 long requests: the first 4 in the engine (all of the
    # first connection's), 20 waiting. A request of a fourth connection waits
    # too: freed slots go one per connection (least inside first), so it is
    # in after 3, not after the 20 that arrived before it; then it runs
    # beside max_active - 1 others, not beside all 25 (before the gate every
    # admitted request was stepped in turn).
    async with serving(scheduling="round-robin", max_active=4, max_queued=64) as service:
        flood = _flood(service, 3, 8)
        honest = Client(service)
        accepted = honest.generate("honest", SHORT)
        assert accepted["type"] == "accepted" and service.gate.waiting == 21
        stats = service.engine.statistics()
        assert stats.active + stats.queued == 4, "the engine holds more than max_active"
        for j in range(3):  # three slots free, one after the other
            assert "honest" in service.gate
            flood[0].send(type="cancel", id=f"f0-{j}")
            await wait_for(lambda j=j: service.gate.waiting == 20 - j, "a waiting request to go in")
        assert "honest" not in service.gate  # f1-0, f2-0, then it: one per connection
        msgs = await honest.until_end("honest", timeout=60)
        check_stream([accepted, *msgs], "honest", SHORT["steps"])
        stats = service.engine.statistics()
        assert stats.active + stats.queued <= 4
        for c in flood:
            c.close()


@pytest.mark.asyncio
async def test_a_short_request_arriving_mid_flood_goes_in_at_the_next_freed_slot() -> None:
    # The red team's flood, small: 4 connections x 6 long requests, two in
    # the engine; six of them end (cancelled here) before a client asks for
    # one short request. The next slot that frees is its: it does not wait
    # for the 16 flood requests queued before it (it did while the gate
    # aged each request from its own arrival: first come, first served).
    async with serving(scheduling="round-robin", max_active=2, max_queued=64) as service:
        flood = _flood(service, 4, 6)

        def inside() -> list[str]:
            return sorted(r.id for r in service.registry.running() if r.id not in service.gate)

        for k in range(6):
            victim = inside()[0]
            owner = flood[int(victim[1])]
            owner.send(type="cancel", id=victim)
            await wait_for(lambda k=k: service.gate.waiting == 21 - k, "the next flood request to go in")
        honest = Client(service)
        accepted = honest.generate("honest", SHORT)
        assert accepted["type"] == "accepted" and "honest" in service.gate
        assert service.gate.order()[0] == "honest"
        victim = inside()[0]
        flood[int(victim[1])].send(type="cancel", id=victim)
        await wait_for(lambda: "honest" not in service.gate, "the honest request to go in")
        assert service.gate.waiting == 16  # every flood request still waits
        msgs = await honest.until_end("honest", timeout=60)
        check_stream([accepted, *msgs], "honest", SHORT["steps"])
        for c in flood:
            c.close()
