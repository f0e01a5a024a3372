"""Webhooks, the decisions (core/webhooks.py) and the field's shape (protocol), with no socket.

The sending is tests/server/test_webhooks.py's; here: which URLs a server
may call, what a request's webhook sends and when, what it keeps, and how
admission (core/rules.py) refuses a webhook it may not call.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import pytest

from omni_stream import protocol
from omni_stream.core.limits import ServerLimits
from omni_stream.core.principal import Principal
from omni_stream.core.records import RequestRecord
from omni_stream.core.rules import Rules
from omni_stream.core.webhooks import (
    LIMITS_ENV,
    Delivery,
    DeliveryQueue,
    WebhookBook,
    WebhookConfig,
    WebhookState,
    backoff_s,
    new_secret,
    resolve_webhooks,
    sent_form,
)
from omni_stream.errors import MessageError, ParamsError
from omni_stream.protocol.client_messages import Generate

from .shell import RecordingShell
from .test_rules import StandIn, connect, generate

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
HOOK = "https://hooks.example.com/omni/1"


def config(**changes: Any) -> WebhookConfig:
    made = WebhookConfig(secret=SECRET, allow=("https://hooks.example.com/*",))
    return dataclasses.replace(made, **changes)


# -- the field's shape (protocol/client_messages.py) ------------------------------------------


def parse(**fields: Any) -> Generate:
    text = json.dumps({"type": "generate", "id": "r1", "params": {}, **fields})
    message = protocol.parse_client_message(text)
    assert isinstance(message, Generate)
    return message


def test_a_webhook_without_events_gets_the_three_ends() -> None:
    default = ["completed", "failed", "cancelled"]
    assert parse(webhook={"url": HOOK}).webhook == {"url": HOOK, "events": default}
    assert parse().webhook is None
    assert parse(webhook={"url": HOOK, "events": ["progress", "failed"]}).webhook == {
        "url": HOOK, "events": ["progress", "failed"],
    }


@pytest.mark.parametrize(
    ("webhook", "field"),
    [
        ("https://x/", "webhook"),
        ({"url": HOOK, "secret": "x"}, "webhook"),
        ({}, "webhook.url"),
        ({"url": 3}, "webhook.url"),
        ({"url": ""}, "webhook.url"),
        ({"url": "https://x/" + "a" * 3000}, "webhook.url"),
        ({"url": HOOK, "events": "completed"}, "webhook.events"),
        ({"url": HOOK, "events": []}, "webhook.events"),
        ({"url": HOOK, "events": ["done"]}, "webhook.events"),
        ({"url": HOOK, "events": ["failed", "failed"]}, "webhook.events"),
        ({"url": HOOK, "events": [1]}, "webhook.events"),
    ],
)
def test_a_malformed_webhook_is_an_invalid_field_naming_its_part(webhook: Any, field: str) -> None:
    with pytest.raises(MessageError) as caught:
        parse(webhook=webhook)
    assert (caught.value.code, caught.value.field, caught.value.request_id) == ("invalid_field", field, "r1")


def test_the_client_builds_and_sends_a_webhook_as_the_server_reads_it() -> None:
    built = Generate.build("r1", {"steps": 2}, webhook={"url": HOOK, "events": ["completed"]})
    assert protocol.parse_client_message(built.serialize()) == built
    with pytest.raises(ParamsError) as caught:
        Generate.build("r1", webhook={"url": HOOK, "events": ["nope"]})
    assert caught.value.field == "webhook.events"


# -- the server's settings ---------------------------------------------------------------------


def test_no_allow_list_means_no_webhooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_STREAM_WEBHOOK_ALLOW", raising=False)
    monkeypatch.delenv("OMNI_STREAM_WEBHOOK_SECRET", raising=False)
    assert resolve_webhooks() is None
    assert resolve_webhooks(SECRET) is None  # a secret alone allows nothing


def test_the_settings_come_from_the_options_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_WEBHOOK_ALLOW", "https://a.example/*, https://b.example/hook")
    monkeypatch.setenv("OMNI_STREAM_WEBHOOK_SECRET", SECRET)
    from_env = resolve_webhooks()
    assert from_env is not None
    assert from_env.allow == ("https://a.example/*", "https://b.example/hook")
    assert (from_env.secret, from_env.generated_secret) == (SECRET, False)
    given = resolve_webhooks(None, ["http://127.0.0.1:9/*"])
    assert given is not None and given.allow == ("http://127.0.0.1:9/*",) and given.secret == SECRET


def test_without_a_secret_one_is_made_up_in_the_specs_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_STREAM_WEBHOOK_SECRET", raising=False)
    made = resolve_webhooks(allow="https://a.example/*")
    assert made is not None and made.generated_secret
    assert made.secret.startswith("whsec_") and len(base64.b64decode(made.secret[6:])) == 32
    assert new_secret() != new_secret()


@pytest.mark.parametrize(
    "secret", ["s3cret", "whsec_not base64!", "whsec_" + base64.b64encode(b"short").decode()]
)
def test_a_malformed_secret_is_refused_without_echoing_it(secret: str) -> None:
    with pytest.raises(ParamsError) as caught:
        resolve_webhooks(secret, "https://a.example/*")
    assert caught.value.field == "webhook_secret" and secret not in str(caught.value)


@pytest.mark.parametrize(
    "pattern",
    [
        "https://hooks.example.com*",  # would match https://hooks.example.com.evil.net/
        "https://*.example.com/*",
        "ftp://hooks.example.com/*",
        "https://user:pw@hooks.example.com/*",
        "https://HOOKS.example.com/*",
        "hooks.example.com/*",
        "https://hooks.example.com/a/../*",
        "https://hooks.example.com/a/%2e%2e/*",
        "https://hooks.example.com:443/*",
    ],
)
def test_a_pattern_that_could_match_more_than_it_says_is_refused(pattern: str) -> None:
    with pytest.raises(ParamsError) as caught:
        resolve_webhooks(SECRET, [pattern])
    assert caught.value.field == "webhook_allow"


# -- admission of one webhook ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com.evil.net/x",
        "https://hooks.example.com:8443/x",
        "http://hooks.example.com/x",
        "https://hooks.example.com@10.0.0.1/x",
        "https://user:pw@hooks.example.com/x",
        "https://hooks.example.com/a b",
        "https://hooks.example.com/\\@evil",
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data/",
    ],
)
def test_a_url_outside_the_allow_list_is_bad_params_naming_webhook(url: str) -> None:
    with pytest.raises(MessageError) as caught:
        config().check({"url": url}, request_id="r7")
    assert (caught.value.code, caught.value.field, caught.value.request_id) == ("bad_params", "webhook", "r7")
    assert "hooks.example.com/*" not in str(caught.value)  # the allow-list is not told


def test_a_url_matching_a_pattern_is_admitted() -> None:
    config().check({"url": HOOK}, request_id="r1")
    config(allow=("http://127.0.0.1:9000/hook",)).check({"url": "http://127.0.0.1:9000/hook"}, request_id="r")
    literal = config(allow=("http://127.0.0.1:9000/hook",))
    with pytest.raises(MessageError):  # a literal pattern is the whole URL
        literal.check({"url": "http://127.0.0.1:9000/hook2"}, request_id="r")


def make_rules(webhooks: WebhookConfig | None) -> tuple[Rules, list[Delivery]]:
    rules = Rules(StandIn(), limits=ServerLimits.from_env({}), webhooks=webhooks)  # type: ignore[arg-type]
    shell = RecordingShell(webhooks=webhooks is not None)
    rules.bind(shell)
    rules.started = True
    sent: list[Delivery] = shell.sent
    return rules, sent


def test_admission_refuses_every_webhook_when_none_are_allowed() -> None:
    rules, _ = make_rules(None)
    client = connect(rules, Principal.of_connection("c"))
    reply = generate(rules, client, "r1", webhook={"url": HOOK})
    assert (reply["type"], reply["code"], reply["field"]) == ("error", "bad_params", "webhook")
    assert reply["id"] == "r1"
    assert "r1" not in rules.registry


def test_admission_keeps_the_webhook_on_the_record_and_counts_it_until_its_end_is_delivered() -> None:
    rules, sent = make_rules(config())
    client = connect(rules, Principal.of_connection("c"))
    assert generate(rules, client, "r1", webhook={"url": HOOK}, detach=True)["type"] == "accepted"
    record = rules.registry.get("r1")
    assert record is not None and record.webhook is not None and rules.webhook_book.held == 1
    rules.consumer_done(record, protocol.Done.build("r1", total=4, elapsed_s=0.1))
    [delivery] = sent
    assert delivery.event == "completed" and rules.webhook_book.held == 1
    delivery.settle("delivered")
    assert rules.webhook_book.held == 0


def test_a_full_book_answers_busy_and_a_bad_url_bad_params() -> None:
    rules, _ = make_rules(config(max_held=1))
    client = connect(rules, Principal.of_connection("c"))
    assert generate(rules, client, "r1", webhook={"url": HOOK})["type"] == "accepted"
    busy = generate(rules, client, "r2", webhook={"url": HOOK})
    assert (busy["code"], busy["id"]) == ("busy", "r2") and busy["retry_after_s"] > 0
    bad = generate(rules, client, "r3", webhook={"url": "http://10.0.0.1/"})
    assert (bad["code"], bad["field"]) == ("bad_params", "webhook")
    assert generate(rules, client, "r4")["type"] == "accepted"  # no webhook: not counted


# -- what a request's webhook sends ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record_of(rid: str = "r1", **kwargs: Any) -> RequestRecord:
    return RequestRecord(rid, owner="c", detach=True, total=4, preview={}, created_at=0.0, seed=7, **kwargs)


def state(
    events: list[str] | None = None, **changes: Any
) -> tuple[WebhookState, list[Delivery], WebhookBook, Clock]:
    sent: list[Delivery] = []
    book = WebhookBook(8)
    clock = Clock()
    hook = {"url": HOOK, **({"events": events} if events is not None else {})}
    made = WebhookState("r1", hook, config=config(**changes), emit=sent.append, book=book, principal="p",
                        clock=clock, wall=lambda: 1_767_225_600.0)
    made.hold()
    return made, sent, book, clock


def test_the_completed_payload_says_what_the_status_says() -> None:
    hook, sent, _, _ = state()
    record = record_of()
    record.webhook = hook
    record.publish_progress(protocol.Progress.build("r1", step=4, total=4, eta_s=0.0))
    record.finish(protocol.Done.build("r1", total=4, elapsed_s=0.5), now=1.0)
    [delivery] = sent
    payload = json.loads(delivery.body)
    assert payload == {
        "type": "generation.completed",
        "timestamp": "2026-01-01T00:00:00Z",
        "data": {
            "id": "r1", "status": "done", "step": 4, "total": 4, "seed": 7, "model": None, "images": 0,
            "urls": {"self": "/v1/generations/r1", "output": "/v1/generations/r1/output"}, "error": None,
        },
    }
    assert delivery.webhook_id.startswith("msg_") and delivery.max_attempts == 5 and delivery.terminal


def test_failed_and_cancelled_carry_the_error_and_an_unasked_end_sends_nothing() -> None:
    hook, sent, _, _ = state()
    hook.ended(record_of(), protocol.ErrorMessage.build("step_failed", "boom", request_id="r1"))
    assert json.loads(sent[0].body)["data"]["error"] == {"code": "step_failed", "message": "boom"}
    assert json.loads(sent[0].body)["type"] == "generation.failed"
    hook, sent, _, _ = state()
    hook.ended(record_of(), protocol.Cancelled.build("r1", reason="client"))
    assert json.loads(sent[0].body)["data"]["error"] == {"reason": "client"}
    hook, sent, book, _ = state(["completed"])
    hook.ended(record_of(), protocol.Cancelled.build("r1", reason="client"))
    assert sent == [] and book.held == 0  # nothing to deliver: released at once


def test_progress_is_sent_only_when_asked_and_at_most_once_per_interval() -> None:
    hook, sent, _, _ = state()
    hook.progressed(1, 4, None)
    assert sent == []
    hook, sent, _, clock = state(["progress", "completed"], progress_every_s=5.0)
    for step in (1, 2, 3):
        hook.progressed(step, 10, 1.0)
        clock.now += 1.0
    assert [json.loads(d.body)["data"]["step"] for d in sent] == [1]
    clock.now += 5.0
    hook.progressed(5, 10, 0.5)
    hook.progressed(10, 10, 0.0)  # the last step's news is the end's
    assert [json.loads(d.body)["data"]["step"] for d in sent] == [1, 5]
    assert sent[0].status == "dropped" and sent[0].max_attempts == 1  # superseded, unsent
    assert json.loads(sent[1].body)["type"] == "generation.progress"


def test_the_view_holds_the_latest_progress_and_the_end_only() -> None:
    hook, sent, _, clock = state(["progress", "completed"], progress_every_s=1.0)
    for step in range(1, 50):
        hook.progressed(step, 100, None)
        clock.now += 2.0
    hook.ended(record_of(), protocol.Done.build("r1", total=100, elapsed_s=1.0))
    view = hook.view()
    assert view["url"] == HOOK and view["events"] == ["progress", "completed"]
    assert [d["event"] for d in view["deliveries"]] == ["progress", "completed"]
    assert view["deliveries"][1] == {
        "event": "completed", "webhook_id": sent[-1].webhook_id, "attempts": 0, "status": "pending",
        "response_status": None, "last_error": None,
    }


def test_a_delivery_settles_once_and_releases_its_request_once() -> None:
    hook, sent, book, _ = state()
    hook.ended(record_of(), protocol.Done.build("r1", total=4, elapsed_s=0.1))
    sent[0].settle("failed", "HTTP 500")
    sent[0].settle("delivered")
    assert (sent[0].status, sent[0].last_error, book.held) == ("failed", "HTTP 500", 0)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, first_s=1.0, max_s=5.0) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


# -- the form a URL is sent in (issue #39, attack 8) --------------------------------------------


@pytest.mark.parametrize(
    ("url", "sent"),
    [
        ("https://hooks.example.com/hooks/a/../b/steal", "https://hooks.example.com/hooks/b/steal"),
        ("https://hooks.example.com/hooks/a/../../admin/delete", "https://hooks.example.com/admin/delete"),
        ("https://hooks.example.com/hooks/a/%2e%2e/b", "https://hooks.example.com/hooks/b"),
        ("https://hooks.example.com/hooks/a/.%2E/b", "https://hooks.example.com/hooks/b"),
        ("https://hooks.example.com/a/./b/.", "https://hooks.example.com/a/b/"),
        ("https://hooks.example.com/a/..", "https://hooks.example.com/"),
        ("https://hooks.example.com/%7Eu/%41", "https://hooks.example.com/~u/A"),
        ("HTTPS://Hooks.Example.COM/x", "https://hooks.example.com/x"),
        ("https://hooks.example.com:443/x", "https://hooks.example.com/x"),
        ("http://hooks.example.com:80", "http://hooks.example.com/"),
        ("https://hooks.example.com:8443/x?a=/../b", "https://hooks.example.com:8443/x?a=/../b"),
        ("http://[::1]:9000/x;v=1/%C3%A9", "http://[::1]:9000/x;v=1/%C3%A9"),
    ],
)
def test_the_sent_form_is_the_normalised_url_and_httpx_sends_it_as_it_is(url: str, sent: str) -> None:
    # (httpx itself removes dot segments but keeps %2e, which a receiver may decode.)
    httpx = pytest.importorskip("httpx")
    assert sent_form(url) == sent
    assert str(httpx.URL(sent)) == sent
    assert sent_form(sent) == sent


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/omni/../admin",
        "https://hooks.example.com/omni/%2e%2e/admin",
        "https://hooks.example.com/omni/.%2e/admin",
        "https://hooks.example.com/omni/..;/admin",
        "https://hooks.example.com/omni/..%2fadmin",
        "https://hooks.example.com/omni/..%5Cadmin",
        "https://hooks.example.com/omni/%zz",
        "https://hooks.example.com/omni/1#frag",
        "https://hooks.example.com/omni/\u00e9",
        "https://hooks.example.com/omni/a|b",
        "HTTPS://hooks.example.com/omni/1",
        "https://Hooks.example.com/omni/1",
        "https://hooks.example.com:443/omni/1",
    ],
)
def test_a_url_that_would_be_sent_in_another_form_is_refused(url: str) -> None:
    # Each matches the pattern as a string; sent, it would go elsewhere or be another string.
    with pytest.raises(MessageError) as caught:
        config(allow=("https://hooks.example.com/omni/*", "https://Hooks.example.com/omni/*")).check(
            {"url": url}, request_id="r8"
        )
    assert (caught.value.code, caught.value.field, caught.value.request_id) == ("bad_params", "webhook", "r8")


def test_the_refusal_names_the_form_to_send() -> None:
    with pytest.raises(MessageError) as caught:
        config().check({"url": "https://hooks.example.com/omni/../admin"}, request_id="r")
    assert "'https://hooks.example.com/admin'" in str(caught.value)


# -- the book's shares, the send slots, a receiver's time (issue #39, attack 3) -------------------


def test_a_principal_holds_at_most_its_share_of_the_book_and_leaves_one_for_another() -> None:
    book = WebhookBook(8)
    for _ in range(4):  # alone: half the book
        assert book.has_room("a")
        book.hold("a")
    assert "its share" in (book.refusal("a") or "")
    assert book.has_room("b")  # a share is left for one more
    book.hold("b")
    assert book.share("b") == 8 // 3 and book.has_room("b")
    book.hold("b")
    assert not book.has_room("b") and not book.has_room("a")
    assert book.has_room("c")  # the rest of the book is c's
    book.release("a")
    book.release("a")
    assert (book.held, book.held_by("a"), book.held_by("b")) == (4, 2, 2)
    for _ in range(2):
        book.release("b")
        book.release("a")
    assert book.held == 0 and book.share("a") == 4


def test_a_full_book_refuses_everyone() -> None:
    book = WebhookBook(2)
    book.hold("a")
    book.hold("b")
    assert "max_held" in (book.refusal("c") or "")


def test_one_principals_shares_across_requests_and_doors_at_admission() -> None:
    rules, _ = make_rules(config(max_held=4))
    ann = connect(rules, Principal.of_connection("ann"))
    bob = connect(rules, Principal.of_connection("bob"))
    answers = [generate(rules, ann, f"a{i}", webhook={"url": HOOK}) for i in range(3)]
    assert [a["type"] for a in answers] == ["accepted", "accepted", "error"]
    assert (answers[2]["code"], answers[2]["id"]) == ("busy", "a2")
    assert generate(rules, bob, "b0", webhook={"url": HOOK})["type"] == "accepted"


def delivery(principal: str, rid: str = "r", event: str = "completed", attempts: int = 5) -> Delivery:
    return Delivery(rid, event, HOOK, b"{}", f"msg_{rid}", attempts, principal=principal)


def test_a_free_slot_goes_round_robin_and_the_last_to_a_principal_with_none_in_flight() -> None:
    queue = DeliveryQueue(concurrency=4, max_progress_pending=8)
    for i in range(10):
        queue.put(delivery("a", f"a{i}"))
    taken = [queue.take(0.0) for _ in range(4)]
    assert [d.request_id for d in taken if d] == ["a0", "a1", "a2"]  # the 4th slot is kept
    assert queue.in_flight_of("a") == 3
    queue.put(delivery("b", "b0"))
    queue.put(delivery("b", "b1"))
    got = queue.take(0.0)
    assert got is not None and got.request_id == "b0"  # at once, beside a's three
    assert queue.take(0.0) is None  # every slot taken
    queue.finished(taken[0])
    assert queue.take(0.0) is None  # the last free slot is kept for a principal with none in flight
    queue.finished(taken[1])  # another of a's ends: one each in flight, and it is a's turn
    got = queue.take(0.0)
    assert got is not None and got.request_id == "a3"
    queue.finished(taken[2])
    queue.finished(got)  # a has none in flight, b one: a slot for each, the fewest first
    assert [d.request_id for d in (queue.take(0.0), queue.take(0.0)) if d] == ["a4", "b1"]
    assert (queue.in_flight_of("a"), queue.in_flight_of("b"), queue.pending) == (1, 2, 3 + 5)


def test_progress_over_its_bound_drops_the_fullest_principals_oldest() -> None:
    queue = DeliveryQueue(concurrency=1, max_progress_pending=3)
    first = delivery("a", "a0", "progress", 1)
    assert queue.put(first) is None
    assert queue.put(delivery("a", "a1", "progress", 1)) is None
    assert queue.put(delivery("b", "b0", "progress", 1)) is None
    assert queue.put(delivery("b", "b1", "progress", 1)) is first  # a has as many, and older
    assert queue.put(delivery("c", "c0", "completed")) is None  # terminal: never dropped


def test_a_retry_waits_for_its_time_in_its_principals_lane() -> None:
    queue = DeliveryQueue(concurrency=2, max_progress_pending=8)
    late = delivery("a", "a0")
    queue.retry_at(late, 10.0)
    assert queue.take(5.0) is None and queue.wait_s(5.0) == 5.0
    assert queue.take(10.0) is late
    assert queue.wait_s(10.0) is None
    assert queue.clear() == []


def test_a_receivers_time_per_delivery_is_capped_across_its_tries() -> None:
    cap = config(attempt_timeout_s=30.0, max_delivery_s=45.0, first_retry_s=1.0)
    hung = delivery("a")
    assert cap.try_timeout_s(hung) == 30.0
    hung.attempts, hung.spent_s = 1, 30.0
    assert cap.retry_due(hung, 100.0) == 101.0 and cap.try_timeout_s(hung) == 15.0
    hung.attempts, hung.spent_s = 2, 45.0
    assert cap.retry_due(hung, 200.0) is None  # 2 of 5 tries, and the receiver had its 45 s
    # A sliver left (under a tenth of a try's bound) starts no try: a receiver that needed
    # longer than that before gets nothing from it (a loaded machine once began a third try
    # with 75 microseconds left).
    hung.spent_s = 45.0 - 2.9
    assert cap.retry_due(hung, 200.0) is None
    hung.spent_s = 45.0 - 3.1
    assert cap.retry_due(hung, 200.0) == 202.0
    assert "45 s" in cap.given_up(hung, "no answer within 15 s")
    hung.attempts, hung.spent_s = 5, 1.0
    assert cap.retry_due(hung, 0.0) is None and cap.given_up(hung, "HTTP 500") == "HTTP 500"


def test_the_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"max_held": "16", "concurrency": "3", "attempt_timeout_s": "2.5", "max_delivery_s": "4"}
    for name, value in values.items():
        monkeypatch.setenv(LIMITS_ENV[name][0], value)
    made = resolve_webhooks(SECRET, ["https://hooks.example.com/*"])
    assert made is not None
    assert (made.max_held, made.concurrency, made.attempt_timeout_s, made.max_delivery_s) == (16, 3, 2.5, 4.0)
    monkeypatch.setenv(LIMITS_ENV["max_held"][0], "lots")
    made = resolve_webhooks(SECRET, ["https://hooks.example.com/*"])
    assert made is not None and made.max_held == 1024  # a malformed value warns and the default holds
