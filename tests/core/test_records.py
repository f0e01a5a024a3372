"""RequestRecord fan-out and replay; RequestRegistry visibility and retention."""

from __future__ import annotations

import dataclasses
import json

import pytest

from omni_stream import protocol
from omni_stream.protocol import MessageError
from omni_stream.core.outbox import Outbox
from omni_stream.core.records import RequestRecord, RequestRegistry, error_view


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(rid: str = "r", *, owner: str = "c1", detach: bool = False) -> RequestRecord:
    return RequestRecord(
        rid, owner=owner, detach=detach, total=3, preview={"every": 1}, created_at=0.0
    )


def drain(box: Outbox) -> list[protocol.ServerMessage | protocol.Preview]:
    out = []
    while (item := box.get_nowait()) is not None:
        out.append(item.message)
    return out


def kinds(messages: list[protocol.ServerMessage | protocol.Preview]) -> list[str]:
    """Each message's type; a preview is ``preview``, a final one (a result) ``result``."""
    return [
        ("result" if m.final else "preview") if isinstance(m, protocol.Preview) else m.kind for m in messages
    ]


def progress(rec: RequestRecord, step: int) -> None:
    rec.publish_progress(protocol.Progress.build(rec.id, step=step, total=rec.total, eta_s=0))


def frame(rec: RequestRecord, image: bytes, *, final: bool, step: int | None = None) -> protocol.Preview:
    """A preview (a result when ``final``) of ``rec`` whose encoded image is ``image``."""
    step = rec.total if step is None else step
    header = protocol.PreviewHeader(rec.id, step, rec.total, final, "jpeg", 1, 1, "image/jpeg")
    return protocol.Preview.build(header, image)


def test_fan_out_to_every_watcher() -> None:
    rec = record()
    a, b = Outbox(max_pending=8), Outbox(max_pending=8)
    rec.watch("c1", a, attached=False)
    rec.watch("c2", b, attached=True)
    progress(rec, 1)
    rec.publish_preview(frame(rec, b"img1", final=False, step=1))
    got_a, got_b = drain(a), drain(b)
    assert kinds(got_a) == kinds(got_b) == ["accepted", "progress", "preview"]
    # One object each, shared by every watcher (encoded once), not a copy per watcher.
    assert all(x is y for x, y in zip(got_a[1:], got_b[1:], strict=True))
    assert got_a[0].attached is False and got_b[0].attached is True


def test_attach_replays_latest_then_live() -> None:
    rec = record()
    progress(rec, 1)
    rec.publish_preview(frame(rec, b"img1", final=False, step=1))
    progress(rec, 2)
    box = Outbox(max_pending=8)
    rec.watch("c2", box, attached=True)
    progress(rec, 3)
    result = frame(rec, b"img3", final=True)
    rec.publish_preview(result)
    rec.finish(protocol.Done.build(rec.id, total=3, elapsed_s=1.0), now=1.0)
    got = drain(box)
    first = json.loads(got[0].wire)
    assert first["type"] == "accepted" and first["attached"] is True
    # Latest progress (2) was replaced by 3 while unsent; the old preview was
    # discarded in favour of the final one.
    assert [m.wire for m in got[1:]] == [
        protocol.Progress.build("r", step=3, total=3, eta_s=0).wire,
        result.wire,
        protocol.Done.build("r", total=3, elapsed_s=1.0).wire,
    ]
    assert got[2] is result and bytes(got[2].image) == b"img3"


def test_attach_after_end_replays_result() -> None:
    rec = record()
    progress(rec, 3)
    rec.publish_preview(frame(rec, b"final", final=True))
    done = protocol.Done.build("r", total=3, elapsed_s=1.0)
    rec.finish(done, now=1.0)
    box = Outbox(max_pending=8)
    rec.watch("c9", box, attached=True)
    got = drain(box)
    assert kinds(got) == ["accepted", "progress", "result", "done"]
    assert bytes(got[2].image) == b"final"
    assert rec.terminal_message() is done and got[3] is done
    assert rec.latest_preview() is got[2] and rec.result(0) is got[2]
    assert not rec.watchers  # nothing more will come


def test_a_request_of_several_images_replays_every_result_in_order_and_serves_each() -> None:
    # num_images: one final frame per image; an attach after the end gets them all, in
    # order; result(i) is image i; the last preview is not kept beside them.
    rec = record()
    progress(rec, 3)
    rec.publish_preview(frame(rec, b"grid", final=False))
    header = protocol.PreviewHeader("r", 3, 3, True, "png", 1, 1, "image/png")
    finals = [
        protocol.Preview.build(dataclasses.replace(header, index=i, images=3), b"img%d" % i) for i in range(3)
    ]
    for result in finals:
        rec.publish_preview(result)
    assert rec.result_count == 0  # not done yet
    rec.finish(protocol.Done.build("r", total=3, elapsed_s=1.0), now=1.0)
    box = Outbox(max_pending=8)
    rec.watch("c9", box, attached=True)
    got = drain(box)
    assert [m.wire for m in got[2:5]] == [f.wire for f in finals] and kinds(got)[-1] == "done"
    assert rec.result_count == 3
    assert [bytes(rec.result(i).image) for i in range(3)] == [b"img0", b"img1", b"img2"]  # type: ignore[union-attr]
    assert [rec.result(i).header.index for i in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert rec.result(3) is None and rec.result(-1) is None
    assert rec.retained_bytes() >= sum(len(f.wire) for f in finals)
    assert b"grid" not in b"".join(m.wire for m in got if isinstance(m, protocol.Preview))


def test_loading_takes_the_place_of_progress_until_the_first_one() -> None:
    rec = record()
    box = Outbox(max_pending=8)
    rec.watch("c1", box, attached=False)
    rec.publish_loading("sd")
    assert rec.loading
    late = Outbox(max_pending=8)
    rec.watch("c2", late, attached=True)
    assert json.loads(drain(late)[1].wire) == {"type": "loading", "id": "r", "model": "sd"}
    progress(rec, 1)
    assert not rec.loading
    assert kinds(drain(box)) == ["accepted", "progress"]  # the unsent loading was replaced


def test_finish_is_idempotent_and_stops_fan_out() -> None:
    rec = record()
    box = Outbox(max_pending=8)
    rec.watch("c1", box, attached=False)
    rec.finish(protocol.Cancelled.build("r", reason="client"), now=1.0)
    rec.finish(protocol.Done.build("r", total=3, elapsed_s=1.0), now=2.0)
    assert rec.outcome == "cancelled" and rec.ended_at == 1.0
    assert kinds(drain(box)) == ["accepted", "cancelled"]
    assert rec.terminal_message() == protocol.Cancelled.build("r", reason="client")


def test_error_view_says_why_a_request_did_not_succeed() -> None:
    failed = protocol.ErrorMessage.build("step_failed", "boom", request_id="r", field="steps")
    assert error_view(failed) == {"code": "step_failed", "message": "boom"}
    assert error_view(protocol.Cancelled.build("r", reason="client")) == {"reason": "client"}
    assert error_view(protocol.Done.build("r", total=3, elapsed_s=1.0)) is None
    assert error_view(None) is None


def test_a_restored_record_replays_what_it_ended_with() -> None:
    # The state directory rebuilds an ended request from its accepted, its terminal message
    # and its results (server/state.py): an attach replays them as for one that ended here.
    accepted = {"id": "r", "total": 3, "preview": {"every": 1}, "seed": 5}
    header = protocol.PreviewHeader("r", 3, 3, True, "png", 1, 1, "image/png")
    results = [protocol.Preview.build(dataclasses.replace(header, index=i, images=2), b"img%d" % i)
               for i in range(2)]
    done = protocol.Done.build("r", total=3, elapsed_s=2.0)
    reason = sorted(protocol.RESTART_REASONS)[0]
    rec = RequestRecord.restored(
        accepted, owner="gone", principal="token:ann", created_at=1.0, ended_at=3.0,
        terminal=done, results=results, restarted=(2, reason),
    )
    assert rec.outcome == "done" and rec.terminal_message() is done and rec.result_count == 2
    assert rec.restarted == protocol.Restarted.build("r", from_step=2, reason=reason)
    assert rec.restart_view() == {"from_step": 2, "reason": reason}
    assert [bytes(rec.result(i).image) for i in range(2)] == [b"img0", b"img1"]  # type: ignore[union-attr]
    box = Outbox(max_pending=8)
    rec.watch("c9", box, attached=True)
    got = drain(box)
    assert kinds(got) == ["accepted", "restarted", "result", "result", "done"]
    assert got[0].seed == 5 and got[0].attached is True
    assert [m.wire for m in got[2:4]] == [r.wire for r in results] and got[-1] is done
    failed = protocol.ErrorMessage.build("step_failed", "boom", request_id="f")
    lost = RequestRecord.restored(
        {"id": "f", "total": 3}, owner="gone", principal="token:ann", created_at=1.0, ended_at=3.0,
        terminal=failed, results=results,
    )
    # Results are kept for a request that is done only.
    assert lost.outcome == "error" and lost.result_count == 0 and lost.result(0) is None
    assert error_view(lost.terminal_message()) == {"code": "step_failed", "message": "boom"}


def test_registry_duplicate_and_lookup_rules() -> None:
    reg = RequestRegistry(retention_s=10, max_retained=4)
    reg.add(record("mine", owner="c1"))
    reg.add(record("kept", owner="c1", detach=True))
    with pytest.raises(MessageError) as info:
        reg.add(record("mine", owner="c2"))
    assert info.value.code == "duplicate_id"
    assert reg.lookup("mine", "c1").id == "mine"
    # Another connection cannot see a request that was not detached...
    with pytest.raises(MessageError) as info:
        reg.lookup("mine", "c2")
    assert info.value.code == "not_found"
    # ...the same answer as for an id that does not exist...
    with pytest.raises(MessageError) as unknown:
        reg.lookup("nope", "c2")
    assert unknown.value.code == "not_found"
    # ...but can see a detached one, and a client of the proved principal
    # (a token's) sees its principal's requests, and no other's.
    assert reg.lookup("kept", "c2").id == "kept"
    assert reg.lookup("mine", "c2", principal="connection:c1").id == "mine"
    with pytest.raises(MessageError):
        reg.lookup("mine", "c2", principal="token:other")


def test_disconnect_returns_only_undetached_running_requests() -> None:
    reg = RequestRegistry(retention_s=10, max_retained=4)
    a, b = record("a", owner="c1"), record("b", owner="c1", detach=True)
    c = record("c", owner="c2")
    for r in (a, b, c):
        reg.add(r)
    box = Outbox(max_pending=8)
    c.watch("c1", box, attached=True)
    assert reg.disconnect("c1") == [a]
    assert not c.is_watched_by("c1")
    assert reg.running_owned_by("c1") == 2


def test_ended_forgets_undetached_at_once_and_detached_after_retention() -> None:
    clock = Clock()
    reg = RequestRegistry(retention_s=5, max_retained=4, clock=clock)
    a, b = record("a"), record("b", detach=True)
    reg.add(a)
    reg.add(b)
    for r in (a, b):
        r.finish(protocol.Done.build(r.id, total=3, elapsed_s=1), now=clock())
        reg.ended(r)
    assert "a" not in reg and "b" in reg
    clock.now += 4.9
    assert reg.prune() == [] and "b" in reg
    clock.now += 0.2
    assert reg.prune() == [b] and "b" not in reg


def test_max_retained_evicts_oldest_ended_then_refuses() -> None:
    clock = Clock()
    reg = RequestRegistry(retention_s=100, max_retained=2, clock=clock)
    old, new = record("old", detach=True), record("new", detach=True)
    reg.add(old)
    reg.add(new)
    old.finish(protocol.Done.build("old", total=3, elapsed_s=1), now=1.0)
    new.finish(protocol.Done.build("new", total=3, elapsed_s=1), now=2.0)
    reg.add(record("third", detach=True))
    assert "old" not in reg and "new" in reg and "third" in reg
    # Undetached requests do not count against max_retained.
    reg.add(record("plain"))
    with pytest.raises(MessageError) as info:
        # "new" is evictable, so this succeeds; then everything held runs.
        reg.add(record("fourth", detach=True))
        reg.add(record("fifth", detach=True))
    assert info.value.code == "too_many_requests"
    assert "new" not in reg and "fourth" in reg and "fifth" not in reg


def test_a_caller_waiting_for_the_end_counts_as_a_reader() -> None:
    # HTTP ?wait=true watches no steps but reads the result at once: pacing the request as
    # unread held its result back by up to UNREAD_PACE_S (0.05 s on a 0.03 s request).
    rec = record()
    assert not rec.has_reader()
    rec.waiters += 1
    assert rec.has_reader()
    rec.waiters -= 1
    assert not rec.has_reader()


def owned(rid: str, principal: str, *, owner: str = "c1") -> RequestRecord:
    return RequestRecord(
        rid, owner=owner, detach=True, total=3, preview={"every": 1}, created_at=0.0, principal=principal
    )


def test_a_tenants_request_is_invisible_to_every_other_principal_whoever_knows_its_id() -> None:
    # Issue #39, attack 9: tenant B with A's id read its status, paused it and DELETEd it.
    reg = RequestRegistry(retention_s=10, max_retained=8)
    reg.add(owned("anns", "token:ann"))
    reg.add(owned("anonymous", "address:10.0.0.1"))
    assert reg.lookup("anns", "c2", principal="token:ann").id == "anns"
    for principal in ("token:bob", None):
        with pytest.raises(MessageError) as info:
            reg.lookup("anns", "c2", principal=principal)
        assert info.value.code == "not_found" and info.value.request_id == "anns"
    assert reg.lookup("anns", "c1").id == "anns"  # the connection that made it
    # Without tokens nobody proves who they are: a detached id stays its capability there,
    # and a tenant sees none of it.
    assert reg.lookup("anonymous", "c2").id == "anonymous"
    with pytest.raises(MessageError):
        reg.lookup("anonymous", "c2", principal="token:bob")


def ended(rec: RequestRecord, at: float, reg: RequestRegistry) -> RequestRecord:
    rec.finish(protocol.Done.build(rec.id, total=3, elapsed_s=1), now=at)
    reg.ended(rec)
    return rec


def test_one_principals_flood_of_results_evicts_its_own_never_anothers() -> None:
    # Issue #39, attack 4: 300 one-step results of tenant A made B's finished results 404
    # two seconds later: max_retained was one pool, the oldest ended forgotten first.
    reg = RequestRegistry(retention_s=600, max_retained=4, clock=Clock())
    bobs = owned("bobs", "token:bob")
    reg.add(bobs)
    ended(bobs, 1.0, reg)
    for i in range(20):
        rec = owned(f"a{i}", "token:ann")
        reg.add(rec)
        ended(rec, 2.0 + i, reg)
    assert reg.lookup("bobs", "x", principal="token:bob") is bobs
    assert sorted(r.id for r in reg.retained()) == ["a17", "a18", "a19", "bobs"]
    # B's own make room from A's while A holds more, then (as many each) from B's own.
    for i in range(3):
        rec = owned(f"b{i}", "token:bob")
        reg.add(rec)
        ended(rec, 30.0 + i, reg)
    assert sorted(r.id for r in reg.retained()) == ["a18", "a19", "b1", "b2"]


def test_the_memory_budget_evicts_from_the_principal_holding_the_most_bytes() -> None:
    reg = RequestRegistry(retention_s=600, max_retained=8, clock=Clock())
    small = owned("small", "token:bob")
    for i, rec in enumerate((small, owned("big1", "token:ann"), owned("big2", "token:ann"))):
        reg.add(rec)
        rec.publish_preview(frame(rec, b"x" * (10 if rec is small else 1000), final=True))
        ended(rec, float(i), reg)
    assert reg.evict_oldest_retained()
    assert "small" in reg and "big1" not in reg and "big2" in reg
