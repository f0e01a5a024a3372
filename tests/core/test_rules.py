"""The rules every door shares (core/rules.py), driven with no socket and no event loop.

The engine here is a stand-in that records what it is asked (``stream``,
``cancel``) and answers ``health``: what the rules decide is the subject,
not what an engine does with it (tests/server/test_service.py drives the
same rules over a real engine). Every test is a plain function: nothing
here awaits.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_stream import protocol
from omni_stream.core.limits import ServerLimits
from omni_stream.core.outbox import Outbox
from omni_stream.core.principal import Principal
from omni_stream.core.rules import Client, Rules
from omni_stream.core.tokens import TokenGrant, Tokens
from omni_stream.engine.stats import EngineStatistics, Health
from omni_stream.models import Synthetic

from .shell import RecordingShell

SMALL = {"shape": [3, 8, 8], "work": 0, "steps": 4}


class Stream:
    """What the rules need of a submitted request's frames (FrameStreamLike's members)."""

    def __init__(self, request_id: str, params: Any) -> None:
        self.request_id = request_id
        self.total = 4
        self.params = params

    def poll(self) -> None:
        return None

    async def aclose(self) -> None: ...

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: Any) -> None: ...


class StandIn:
    """An engine that records what it is asked; its statistics are what the rules gave it."""

    def __init__(self) -> None:
        self.model = Synthetic()
        self.max_batch_size = 8
        self.submitted: dict[str, int] = {}  # request id -> the priority it was given
        self.params: dict[str, Any] = {}  # request id -> the params it was given
        self.cancelled: list[str] = []

    def stream(self, params: Any, *, request_id: str, policy: str = "all", preview_every: int | None = None,
               priority: int = 0) -> Stream:
        self.submitted[request_id] = priority
        self.params[request_id] = params
        return Stream(request_id, params)

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def health(self) -> Health:
        live = len(self.submitted) - len(self.cancelled)
        stats = EngineStatistics(max(0, live), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        return Health("ok", None, stats, device="sim")


def make_rules(*, tokens: Tokens | None = None, **limits: Any) -> tuple[Rules, StandIn, list[str]]:
    engine = StandIn()
    rules = Rules(engine, limits=ServerLimits.from_env(limits), tokens=tokens)  # type: ignore[arg-type]
    shell = RecordingShell()
    rules.bind(shell)
    rules.started = True
    return rules, engine, shell.started


def connect(rules: Rules, principal: Principal, door: str = "websocket") -> Client:
    client = rules.connect(principal, door)
    client.outbox = Outbox(max_pending=64)
    return client


def generate(rules: Rules, client: Client, rid: str, **fields: Any) -> dict[str, Any]:
    """Send a generate; its one reply (an ``error``, or the ``accepted`` the record queued), past
    the ``queued`` (where it waits) that follows an earlier one's ``accepted``."""
    message = {"type": "generate", "id": rid, "params": SMALL, "preview": {"format": "raw"}, **fields}
    rules.handle(client, json.dumps(message))
    assert client.outbox is not None
    while True:
        item = client.outbox.get_nowait()
        assert item is not None, "no reply"
        if item.message.kind != "queued":
            return dict(json.loads(item.message.wire))


ANN = Principal.of_token(TokenGrant("ann", "a"))
BOB = Principal.of_token(TokenGrant("bob", "b"))


def test_requests_are_counted_per_principal_across_its_connections_and_doors() -> None:
    rules, _, started = make_rules(max_requests_per_principal=3, max_active=100)
    ws1, ws2, call = connect(rules, ANN), connect(rules, ANN), connect(rules, ANN, "http")
    assert generate(rules, ws1, "a1")["type"] == "accepted"
    assert generate(rules, ws2, "a2")["type"] == "accepted"
    assert generate(rules, call, "a3")["type"] == "accepted"
    refused = generate(rules, ws2, "a4")
    assert (refused["code"], refused["id"]) == ("too_many_requests", "a4")
    assert "token 'ann'" in refused["message"] and "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL" in refused["message"]
    # Another principal is not affected.
    assert generate(rules, connect(rules, BOB), "b1")["type"] == "accepted"
    assert started == ["a1", "a2", "a3", "b1"]


def test_over_http_one_address_is_one_principal_however_many_calls() -> None:
    # Finding 5: each POST was its own client, so no per-client rule applied.
    rules, _, _ = make_rules(max_requests_per_principal=2, max_active=100)
    calls = [connect(rules, rules.principal_of_address("10.0.0.9", headers={}, query=""), "http") for _ in range(3)]
    assert generate(rules, calls[0], "h1", detach=True)["type"] == "accepted"
    assert generate(rules, calls[1], "h2", detach=True)["type"] == "accepted"
    assert generate(rules, calls[2], "h3", detach=True)["code"] == "too_many_requests"
    other = connect(rules, rules.principal_of_address("10.0.0.10", headers={}, query=""), "http")
    assert generate(rules, other, "o1", detach=True)["type"] == "accepted"


def test_a_websocket_without_a_token_is_its_own_principal() -> None:
    rules, _, _ = make_rules(max_requests_per_principal=1, max_active=100)
    pending = rules.principal_of_connection("pending", headers={}, query="")
    a, b = connect(rules, pending), connect(rules, pending)
    assert a.principal != b.principal and a.principal.key == f"connection:{a.id}"
    assert generate(rules, a, "a1")["type"] == "accepted"
    assert generate(rules, b, "b1")["type"] == "accepted"
    assert generate(rules, a, "a2")["code"] == "too_many_requests"


def test_a_token_names_the_principal_whatever_the_door() -> None:
    rules, _, _ = make_rules(tokens=Tokens.of(["ann=aaa"]))
    headers = {"authorization": "Bearer aaa"}
    assert rules.principal_of_connection("c", headers=headers, query="") == Principal("token", "ann")
    assert rules.principal_of_address("1.2.3.4", headers={}, query="token=aaa") == Principal("token", "ann")
    assert rules.principal_of_address("1.2.3.4", headers={}, query="token=nope").key == "address:1.2.3.4"


def test_connections_are_bounded_per_principal_and_in_all() -> None:
    rules, _, _ = make_rules(max_connections=4, max_connections_per_principal=2)
    addr = Principal.of_address("10.0.0.1")
    connect(rules, addr, "http")
    connect(rules, addr, "events")
    refusal = rules.connection_refusal(addr)
    assert refusal is not None and (refusal.status, refusal.code) == (429, "too_many_connections")
    assert "OMNI_STREAM_MAX_CONNECTIONS_PER_PRINCIPAL" in refusal.message
    assert rules.connection_refusal(Principal.of_address("10.0.0.2")) is None
    connect(rules, Principal.of_address("10.0.0.2"))
    last = connect(rules, Principal.of_address("10.0.0.3"))
    refusal = rules.connection_refusal(Principal.of_address("10.0.0.4"))
    assert refusal is not None and (refusal.status, refusal.code) == (503, "too_many_connections")
    rules.disconnect(last)
    assert rules.connection_refusal(Principal.of_address("10.0.0.4")) is None


def test_the_message_rate_is_one_bucket_per_principal() -> None:
    now = [0.0]
    rules, _, _ = make_rules(max_messages_per_s=2)
    rules.clock = lambda: now[0]
    rules.rates.rate = 2.0
    a1, a2, b = connect(rules, ANN), connect(rules, ANN), connect(rules, BOB)
    assert rules.pace(a1, 10) == 0.0 and rules.pace(a2, 10) == 0.0
    assert rules.pace(a1, 10) == pytest.approx(0.5)  # a second connection did not double the rate
    assert rules.pace(b, 10) == 0.0


def test_a_crowded_server_shares_its_places_among_principals_not_connections() -> None:
    # 9 places (max_active 1 + max_queued 8); once over half the queue is
    # used, each principal may hold its share: 9 // 2 principals = 4.
    rules, _, _ = make_rules(max_active=1, max_queued=8, max_requests_per_principal=100)
    bob = connect(rules, BOB)
    flood = [connect(rules, ANN) for _ in range(8)]  # one tenant, eight connections
    accepted = 0
    for i in range(20):
        reply = generate(rules, flood[i % 8], f"f{i}")
        if reply["type"] != "accepted":
            assert reply["code"] == "busy" and "fair share of 4 among 2 clients" in reply["message"], reply
            break
        accepted += 1
    # Crowded from the 6th on (5 queued), and ann holds its share: more
    # connections buy no more (counted per connection, it got 8 of 9).
    assert accepted == 6
    assert generate(rules, bob, "honest")["type"] == "accepted"


def test_priority_orders_a_principals_own_requests_and_only_a_grant_reaches_others() -> None:
    ops = Principal.of_token(TokenGrant("ops", "o", priority=4))
    rules, engine, _ = make_rules(max_active=100)
    assert generate(rules, connect(rules, ANN), "mine", priority=9)["type"] == "accepted"
    assert generate(rules, connect(rules, ops), "ops", priority=9)["type"] == "accepted"
    # What the engine ranks every request it holds by: only the granted part.
    assert engine.submitted == {"mine": 0, "ops": 4}
    record = rules.registry.get("mine")
    assert record is not None and (record.priority, record.cross_priority) == (9, 0)


def test_a_queued_request_goes_in_as_one_leaves_and_a_shutdowns_grace_still_lets_it_in() -> None:
    rules, _, started = make_rules(max_active=1)
    client = connect(rules, ANN)
    generate(rules, client, "first")
    generate(rules, client, "queued")
    assert started == ["first"] and rules.gate.waiting == 1
    # Shutting down gracefully: no new work, but what was accepted still runs.
    rules.closing = True
    assert generate(rules, client, "late")["code"] == "shutting_down"
    first = rules.registry.get("first")
    assert first is not None
    rules.consumer_done(first, protocol.Done.build("first", total=4, elapsed_s=0.1))
    assert started == ["first", "queued"]


def test_once_the_grace_is_over_nothing_queued_goes_in() -> None:
    rules, _, started = make_rules(max_active=1)
    client = connect(rules, ANN)
    generate(rules, client, "first")
    generate(rules, client, "queued")
    rules.closing, rules.letting_in = True, False
    first = rules.registry.get("first")
    assert first is not None
    rules.consumer_done(first, protocol.Done.build("first", total=4, elapsed_s=0.1))
    assert started == ["first"]


def test_a_tenant_sees_and_cancels_its_own_requests_and_never_anothers() -> None:
    rules, engine, _ = make_rules(max_active=100)
    ann1, ann2, bob = connect(rules, ANN), connect(rules, ANN), connect(rules, BOB)
    generate(rules, ann1, "secret")
    assert rules.lookup(ann2, "secret").id == "secret"
    for verb in ("cancel", "attach"):
        rules.handle(bob, json.dumps({"type": verb, "id": "secret"}))
        assert bob.outbox is not None
        reply = json.loads(bob.outbox.get_nowait().message.wire)  # type: ignore[union-attr]
        assert reply["code"] == "not_found"
    rules.handle(ann2, json.dumps({"type": "cancel", "id": "secret"}))
    assert engine.cancelled == ["secret"]


@pytest.mark.parametrize("rid", [".", ".."])
def test_ids_that_a_url_would_normalise_away_are_refused(rid: str) -> None:
    rules, engine, _ = make_rules()
    reply = generate(rules, connect(rules, ANN), rid)
    assert (reply["type"], reply["code"], reply["field"]) == ("error", "invalid_field", "id")
    assert engine.submitted == {}


def test_a_client_gone_cancels_its_own_requests_that_are_not_detached() -> None:
    rules, engine, _ = make_rules(max_active=100)
    client = connect(rules, ANN)
    generate(rules, client, "own")
    generate(rules, client, "kept", detach=True)
    rules.disconnect(client)
    assert engine.cancelled == ["own"]
    assert rules.clients == {} and not rules.open_by_principal


def test_nothing_is_admitted_before_the_shell_started() -> None:
    rules, engine, _ = make_rules()
    rules.started = False
    reply = generate(rules, connect(rules, ANN), "early")
    assert reply["code"] == "engine_unavailable" and "lifespan" in reply["message"]
    assert engine.submitted == {}


# ---- seeds ----------------------------------------------------------------------


@pytest.mark.parametrize("given", [{}, {"seed": -1}, {"seed": None}])
def test_a_request_without_a_seed_runs_with_the_one_accepted_reports(given: dict[str, Any]) -> None:
    rules, engine, _ = make_rules()
    client = connect(rules, ANN)
    accepted = generate(rules, client, "s1", params={**SMALL, **given})
    seed = accepted["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    # The engine checks the params again: it must get the drawn seed, not draw its own.
    assert engine.params["s1"]["seed"] == seed
    record = rules.registry.get("s1")
    assert record is not None and record.seed == seed  # what HTTP status and attach report
    # Each request draws its own.
    seeds = {generate(rules, client, f"s{i}", params={**SMALL, **given})["seed"] for i in range(2, 6)}
    assert len(seeds | {seed}) > 1


def test_a_named_seed_is_kept_and_reported() -> None:
    rules, engine, _ = make_rules()
    accepted = generate(rules, connect(rules, ANN), "s1", params={**SMALL, "seed": 2**63 - 1})
    assert accepted["seed"] == 2**63 - 1 and engine.params["s1"]["seed"] == 2**63 - 1


# -- pauses (issue #39, attack 1) -----------------------------------------------------------


class Pausing(StandIn):
    """A StandIn that pauses and resumes (what Engine.pause / resume say)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused: set[str] = set()

    def pause(self, request_id: str, *, to_host: bool = False) -> bool:
        if request_id in self.paused:
            return False
        self.paused.add(request_id)
        return True

    def resume(self, request_id: str) -> bool:
        if request_id not in self.paused:
            return False
        self.paused.remove(request_id)
        return True


def pausing_rules(**limits: Any) -> tuple[Rules, Pausing, list[str], list[float]]:
    engine = Pausing()
    now = [0.0]
    rules = Rules(engine, limits=ServerLimits.from_env(limits), clock=lambda: now[0])  # type: ignore[arg-type]
    shell = RecordingShell()
    rules.bind(shell)
    rules.started = True
    return rules, engine, shell.started, now


def said(client: Client) -> list[dict[str, Any]]:
    out = []
    assert client.outbox is not None
    while (item := client.outbox.get_nowait()) is not None:
        out.append(json.loads(item.message.wire))
    return out


def test_a_paused_request_gives_its_place_to_the_next_and_comes_back_through_the_gate() -> None:
    # Four requests paused (= max_active on a CPU) kept another tenant's request queued with no
    # end: a paused request kept its place.
    rules, engine, started, _ = pausing_rules(max_active=2)
    ann, bob = connect(rules, ANN), connect(rules, BOB)
    for rid in ("a1", "a2"):
        generate(rules, ann, rid)
    generate(rules, bob, "b1")
    assert started == ["a1", "a2"] and rules.gate.waiting == 1
    said(ann)
    rules.handle(ann, json.dumps({"type": "pause", "id": "a1"}))
    assert started == ["a1", "a2", "b1"] and rules.gate.in_engine == 2  # b1 took a1's place
    assert said(ann)[-1] == {"type": "paused", "id": "a1", "step": 0, "reason": "client"}
    assert rules.queue_positions().get("a1") is None
    # Resumed while every place is held: it waits for one, paused in the engine meanwhile.
    rules.handle(ann, json.dumps({"type": "resume", "id": "a1"}))
    assert "a1" in engine.paused and "a1" in rules.gate and said(ann) == []
    rules.consumer_done(rules.registry.get("b1"), protocol.Done.build("b1", total=4, elapsed_s=1))
    assert "a1" not in engine.paused and rules.gate.in_engine == 2
    assert said(ann)[-1] == {"type": "resumed", "id": "a1", "step": 0, "reason": "client"}


def test_a_request_paused_max_pause_s_in_all_resumes_by_itself_and_is_not_paused_again() -> None:
    rules, engine, _, now = pausing_rules(max_active=2, max_pause_s=10)
    ann = connect(rules, ANN)
    generate(rules, ann, "a1")
    rules.pause(ann, "a1")
    assert rules.expire_pauses() == 10
    now[0] = 4.0
    rules.resume(ann, "a1")  # 4 s paused
    now[0] = 5.0
    rules.pause(ann, "a1")
    now[0] = 6.0
    assert rules.expire_pauses() == pytest.approx(5.0)  # 10 in all: 4 spent, then 1 of this one
    now[0] = 11.0
    said(ann)
    assert rules.expire_pauses() is None
    assert "a1" not in engine.paused and "a1" not in rules.paused
    assert said(ann)[-1] == {"type": "resumed", "id": "a1", "step": 0, "reason": "max_pause"}
    with pytest.raises(protocol.MessageError) as info:
        rules.pause(ann, "a1")
    assert info.value.code == "bad_message" and info.value.request_id == "a1"
    assert "max_pause_s=10" in info.value.message and "OMNI_STREAM_MAX_PAUSE" in info.value.message


def test_a_paused_request_that_ends_gives_back_no_place_twice() -> None:
    rules, engine, started, _ = pausing_rules(max_active=1)
    ann, bob = connect(rules, ANN), connect(rules, BOB)
    generate(rules, ann, "a1")
    generate(rules, bob, "b1")
    generate(rules, bob, "b2")
    rules.pause(ann, "a1")
    assert started == ["a1", "b1"]
    rules.cancel(ann, "a1")  # cancelled while paused: its consumer ends it
    assert engine.cancelled == ["a1"]
    rules.consumer_done(rules.registry.get("a1"), protocol.Cancelled.build("a1", reason="client"))
    assert started == ["a1", "b1"] and rules.gate.in_engine == 1 and rules.gate.waiting == 1
