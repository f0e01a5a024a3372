"""A request's deadline_s (issue #38): expired before it starts, cancelled (deadline) while it runs.

Driven on the rules with no socket and no loop (a stand-in engine, a clock
the test moves), as tests/core/test_rules.py does.
"""

from __future__ import annotations

import pytest

from omni_stream import protocol
from omni_stream.protocol.client_messages import MAX_DEADLINE_S

from .test_rules import ANN, BOB, connect, generate, pausing_rules, said


def test_a_queued_request_expires_at_its_deadline_without_running_and_a_running_one_is_cancelled() -> None:
    rules, engine, started, now = pausing_rules(max_active=1)
    ann, bob = connect(rules, ANN), connect(rules, BOB)
    assert generate(rules, ann, "running", deadline_s=30)["type"] == "accepted"
    assert generate(rules, bob, "queued", deadline_s=10)["type"] == "accepted"
    assert generate(rules, bob, "patient")["type"] == "accepted"  # no deadline: never ended by one
    assert started == ["running"] and rules.expire_deadlines() == 10
    now[0] = 9.5
    assert rules.expire_deadlines() == pytest.approx(0.5)
    now[0] = 10.0
    assert rules.expire_deadlines() == pytest.approx(20.0)
    assert said(bob)[-1] == {"type": "cancelled", "id": "queued", "reason": "expired"}
    assert "queued" not in engine.submitted  # it never ran
    now[0] = 30.0
    assert rules.expire_deadlines() is None
    # A running request is cancelled through the engine: its consumer ends it with the reason.
    assert engine.cancelled == ["running"]
    record = rules.registry.get("running")
    assert record is not None and record.cancel_reason == "deadline"
    metrics = rules.metrics.render().decode()
    assert 'omni_stream_deadlines_total{model="synthetic",reason="expired"} 1.0' in metrics
    assert 'omni_stream_deadlines_total{model="synthetic",reason="deadline"} 1.0' in metrics


def test_a_deadline_is_checked_like_every_field() -> None:
    rules, _, _, _ = pausing_rules()
    client = connect(rules, ANN)
    for bad in (0, -1, MAX_DEADLINE_S + 1, "10", True):
        reply = generate(rules, client, "d", deadline_s=bad)
        assert (reply["type"], reply["code"], reply["field"]) == ("error", "invalid_field", "deadline_s"), bad
    assert protocol.parse_duration("1h30m") == 5400 and protocol.parse_duration("500ms") == 0.5
    with pytest.raises(protocol.MessageError) as info:
        protocol.parse_duration("soon")
    assert info.value.field == "Cancel-After"


def test_a_request_that_ended_first_is_forgotten_by_the_timer() -> None:
    rules, _, _, now = pausing_rules()
    client = connect(rules, ANN)
    generate(rules, client, "quick", deadline_s=5)
    record = rules.registry.get("quick")
    assert record is not None
    rules.stop(record, "client")
    rules.consumer_done(record, protocol.Cancelled.build("quick", reason="client"))
    now[0] = 6.0
    assert rules.expire_deadlines() is None and record.cancel_reason == "client"
