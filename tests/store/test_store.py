"""store/: requests, checkpoints and results written down, read back, repaired after a crash, bounded."""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
import struct
import threading
from pathlib import Path

import pytest
import torch

from omni_stream import checkpoint as ckpt_module
from omni_stream.checkpoint import Checkpoint
from omni_stream.errors import LifecycleError, StoreError
from omni_stream.models import Synthetic
from omni_stream.store import (
    CHECKPOINTS,
    DATABASE,
    RESULTS,
    SCHEMA_VERSION,
    RequestEntry,
    Store,
    StoredResult,
    files as store_files,
)

CPU = torch.device("cpu")
MiB = 1024 * 1024


def checkpoint_at(step: int, *, total: int = 6, seed: int = 1) -> Checkpoint:
    """A real Synthetic checkpoint after ``step`` steps."""
    model = Synthetic()
    state = model.start(model.validate(dict(steps=total, shape=[8, 8], seed=seed)), CPU)
    for _ in range(step):
        model.step([state])
    return model.snapshot(state)


def entry(request_id: str, *, created_at: float = 1000.0, message: dict | None = None) -> RequestEntry:
    return RequestEntry(
        request_id=request_id,
        principal="token:alice",
        model="default",
        message=message
        if message is not None
        else {"type": "generate", "id": request_id, "params": {"prompt": "red circle", "steps": 6},
              "preview": {"every": 1}, "output": "png", "priority": 0, "detach": True, "webhook": None},
        created_at=created_at,
        total=6,
        seed=42,
    )


def result(index: int = 0, images: int = 1, *, data: bytes = b"\x89PNG fake image bytes") -> StoredResult:
    return StoredResult(step=6, format="png", mime="image/png", width=64, height=48, data=data,
                        index=index, images=images)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def open_store(path: Path, *, max_bytes: int = 64 * MiB, retention_s: float = 3600.0) -> Store:
    return Store.open(path, max_bytes=max_bytes, retention_s=retention_s)


def on_disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for sub in (CHECKPOINTS, RESULTS) for p in (path / sub).iterdir())


def message_bytes(store: Store) -> int:
    return store.usage_bytes() - on_disk_bytes(store.path)


# -- round trips -------------------------------------------------------------


def test_a_recorded_request_reads_back_with_every_field(tmp_path):
    with open_store(tmp_path / "state") as store:
        assert store.record_request(entry("a")).stored
        got = store.get("a")
    assert got == entry("a")  # status running, no end, no checkpoint, no results
    assert got.message["params"] == {"prompt": "red circle", "steps": 6} and got.seed == 42
    assert not got.ended


def test_an_annotation_is_kept_in_the_message_and_counted(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        before = message_bytes(store)
        assert store.annotate("a", "restarted", {"from_step": 10, "reason": "checkpoint"})
        assert not store.annotate("nobody", "restarted", {})
        assert message_bytes(store) > before
        store.mark_ended("a", "done", 2000.0, terminal={"type": "done", "id": "a"})
    with open_store(tmp_path) as store:  # kept through the end and a reopening
        got = store.get("a")
        assert got is not None and got.message["restarted"] == {"from_step": 10, "reason": "checkpoint"}
        assert got.message["params"] == entry("a").message["params"]
        with pytest.raises(ValueError, match="not JSON"):
            store.annotate("a", "bad", float("nan"))


def test_a_checkpoint_round_trips_and_only_the_latest_is_kept(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        first, second = checkpoint_at(2), checkpoint_at(4)
        assert store.save_checkpoint("a", 2, first.to_bytes()).stored
        assert len(names(tmp_path / CHECKPOINTS)) == 1
        assert store.save_checkpoint("a", 4, second.to_bytes()).stored
        assert len(names(tmp_path / CHECKPOINTS)) == 1  # the step-2 file is gone
        loaded = store.load_checkpoint("a")
        assert loaded is not None and loaded.step == 4 and loaded.total == 6
        for name, tensor in second.tensors.items():
            assert torch.equal(loaded.tensors[name], tensor)
        assert store.unfinished()[0].checkpoint_step == 4
        # The same step again (a resumed request re-saving) replaces it; an earlier one is refused.
        assert store.save_checkpoint("a", 4, second.to_bytes()).stored
        refused = store.save_checkpoint("a", 3, checkpoint_at(3).to_bytes())
        assert not refused.stored and "later step (4)" in refused.reason
        assert len(names(tmp_path / CHECKPOINTS)) == 1
        assert store.usage_bytes() == on_disk_bytes(tmp_path) + message_bytes(store)


def test_results_round_trip_and_end_the_request(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 3, checkpoint_at(3).to_bytes())
        two = [result(1, 2, data=b"second image"), result(0, 2, data=b"first image")]
        assert store.save_results("a", two, ended_at=2000.0, terminal={"type": "done", "id": "a"}).stored
        back = store.load_results("a")
        assert back is not None and [r.data for r in back] == [b"first image", b"second image"]
        assert back[1] == StoredResult(6, "png", "image/png", 64, 48, b"second image", 1, 2)
        got = store.get("a")
        assert got.status == "done" and got.ended_at == 2000.0 and got.result_count == 2
        assert got.terminal == {"type": "done", "id": "a"} and got.checkpoint_step is None
        assert names(tmp_path / CHECKPOINTS) == []  # nothing will resume it
        assert store.load_checkpoint("a") is None
        assert store.unfinished() == [] and [e.request_id for e in store.finished(2001.0)] == ["a"]
        # Results once: a second save is refused, and so is one for a request that failed.
        assert not store.save_results("a", [result()], ended_at=2001.0).stored
        store.record_request(entry("b"))
        store.mark_ended("b", "failed", 2002.0, {"type": "error", "code": "step_failed"})
        assert store.save_results("b", [result()], ended_at=2003.0).reason == "the request has ended (failed)"


def test_a_memoryview_result_is_written_as_its_bytes(tmp_path):
    # The server holds its results as packed frames; unpack_preview gives a view of the image.
    frame = b"header" + b"the image"
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_results("a", [result(data=memoryview(frame)[6:])], ended_at=1.0)
        assert store.load_results("a")[0].data == b"the image"


def test_mark_ended_records_the_end_and_deletes_the_checkpoint(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())
        assert store.mark_ended("a", "cancelled", 1500.0, {"type": "cancelled", "reason": "client"})
        assert not store.mark_ended("a", "failed", 1600.0)  # already ended
        assert not store.mark_ended("nobody", "failed", 1600.0)
        got = store.get("a")
        assert (got.status, got.ended_at, got.terminal) == ("cancelled", 1500.0, {"type": "cancelled", "reason": "client"})
        assert names(tmp_path / CHECKPOINTS) == []
        late = store.save_checkpoint("a", 3, checkpoint_at(3).to_bytes())
        assert not late.stored and late.reason == "the request has ended (cancelled)"
        assert names(tmp_path / CHECKPOINTS) == []
        with pytest.raises(ValueError, match="not an ended status"):
            store.mark_ended("a", "running", 1.0)


def test_a_request_that_ends_while_its_checkpoint_is_written_keeps_none(tmp_path, monkeypatch):
    from omni_stream.store import checkpoints as store_module

    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        write = store_module.write_atomic

        def ending_meanwhile(folder, name, chunks):
            store.mark_ended("a", "cancelled", 5.0)  # another worker thread, as the file is written
            return write(folder, name, chunks)

        monkeypatch.setattr(store_module, "write_atomic", ending_meanwhile)
        saved = store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())
        assert not saved.stored and saved.reason == "the request has ended (cancelled)"
        assert names(tmp_path / CHECKPOINTS) == [] and store.statistics().reserved_bytes == 0
        assert store.usage_bytes() == message_bytes(store)


def test_unfinished_lists_running_requests_oldest_first(tmp_path):
    with open_store(tmp_path) as store:
        for request_id, created in [("late", 30.0), ("early", 10.0), ("done", 5.0), ("middle", 20.0)]:
            store.record_request(entry(request_id, created_at=created))
        store.mark_ended("done", "done", 40.0)
        assert [e.request_id for e in store.unfinished()] == ["early", "middle", "late"]


def test_reopening_after_close_sees_everything(tmp_path):
    data = checkpoint_at(3).to_bytes()
    with open_store(tmp_path) as store:
        store.record_request(entry("running", created_at=1.0))
        store.save_checkpoint("running", 3, data)
        store.record_request(entry("finished", created_at=2.0))
        store.save_results("finished", [result(data=b"pixels")], ended_at=50.0, terminal={"type": "done"})
        store.record_request(entry("failed", created_at=3.0))
        store.mark_ended("failed", "failed", 60.0, {"type": "error", "code": "internal"})
        usage = store.usage_bytes()
    with open_store(tmp_path) as store:
        assert store.reconciliation.clean
        assert store.usage_bytes() == usage
        assert [(e.request_id, e.checkpoint_step) for e in store.unfinished()] == [("running", 3)]
        assert store.load_checkpoint("running").step == 3
        assert [(e.request_id, e.status, e.result_count) for e in store.finished(61.0)] == [
            ("finished", "done", 1), ("failed", "failed", 0),
        ]
        assert store.load_results("finished")[0].data == b"pixels"
        assert store.get("failed").terminal == {"type": "error", "code": "internal"}


def test_a_reused_id_replaces_an_ended_request_but_not_a_running_one(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        with pytest.raises(StoreError, match="already recorded and running") as raised:
            store.record_request(entry("a"))
        assert raised.value.request_id == "a"
        store.save_results("a", [result(data=b"old result")], ended_at=10.0)
        assert store.record_request(entry("a", created_at=20.0)).stored
        got = store.get("a")
        assert (got.status, got.created_at, got.result_count) == ("running", 20.0, 0)
        assert store.load_results("a") is None and names(tmp_path / RESULTS) == []


def test_delete_removes_the_request_and_its_files(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 1, checkpoint_at(1).to_bytes())
        store.record_request(entry("b"))
        store.save_results("b", [result()], ended_at=1.0)
        assert store.delete("a") and store.delete("b") and not store.delete("a")
        assert store.get("a") is None and names(tmp_path / CHECKPOINTS) == names(tmp_path / RESULTS) == []
        assert store.usage_bytes() == 0


# -- a crash at any point, and a hand in the folder --------------------------


def test_a_crash_between_the_temporary_file_and_the_rename_is_repaired_on_open(tmp_path):
    kept = checkpoint_at(2)
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, kept.to_bytes())
        store.record_request(entry("b"))
        store.save_results("b", [result(data=b"kept result")], ended_at=5.0)
        usage = store.usage_bytes()
    # What a process killed mid-write leaves: half-written temporary files, and a file renamed
    # into place whose row never committed.
    half = checkpoint_at(4).to_bytes()
    (tmp_path / CHECKPOINTS / f"{store_files.TEMP_PREFIX}0123456789abcdef").write_bytes(half[: len(half) // 2])
    (tmp_path / RESULTS / f"{store_files.TEMP_PREFIX}fedcba9876543210").write_bytes(b"half a png")
    (tmp_path / CHECKPOINTS / "1-s4-00000000deadbeef.ckpt").write_bytes(half)
    with open_store(tmp_path) as store:
        assert store.reconciliation.temporary_files == 2
        assert store.reconciliation.orphan_files == 1
        assert store.reconciliation.missing_checkpoints == store.reconciliation.missing_results == ()
        assert store.usage_bytes() == usage == on_disk_bytes(tmp_path) + message_bytes(store)
        assert len(names(tmp_path / CHECKPOINTS)) == 1 and len(names(tmp_path / RESULTS)) == 1
        assert store.load_checkpoint("a").step == 2
        assert store.load_results("b")[0].data == b"kept result"


def test_a_failed_rename_leaves_no_temporary_file_and_the_previous_checkpoint(tmp_path, monkeypatch):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())

        def full_disk(src, dst):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store_files.os, "replace", full_disk)
        with pytest.raises(StoreError, match="No space left") as raised:
            store.save_checkpoint("a", 4, checkpoint_at(4).to_bytes())
        assert raised.value.request_id == "a" and isinstance(raised.value.__cause__, OSError)
        monkeypatch.undo()
        assert len(names(tmp_path / CHECKPOINTS)) == 1  # no temporary file, the old one kept
        assert store.load_checkpoint("a").step == 2
        assert store.statistics().reserved_bytes == 0
        assert store.usage_bytes() == on_disk_bytes(tmp_path) + message_bytes(store)


def test_rows_whose_files_were_deleted_by_hand_are_cleared_on_open(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())
        store.record_request(entry("b"))
        store.save_results("b", [result(0, 2, data=b"one"), result(1, 2, data=b"two")], ended_at=5.0)
    for path in [*(tmp_path / CHECKPOINTS).iterdir(), next((tmp_path / RESULTS).iterdir())]:
        path.unlink()
    with open_store(tmp_path) as store:
        assert store.reconciliation.missing_checkpoints == ("a",)
        assert store.reconciliation.missing_results == ("b",)
        assert store.reconciliation.orphan_files == 1  # the other image: all of a request's results or none
        assert names(tmp_path / RESULTS) == []
        assert store.unfinished()[0].checkpoint_step is None and store.load_checkpoint("a") is None
        assert store.get("b").status == "done" and store.load_results("b") is None
        assert store.usage_bytes() == message_bytes(store) == on_disk_bytes(tmp_path) + store.usage_bytes()


def test_deleting_the_folder_while_closed_gives_an_empty_store(tmp_path):
    path = tmp_path / "state"
    with open_store(path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())
    for sub in (path / CHECKPOINTS, path / RESULTS):
        for item in sub.iterdir():
            item.unlink()
        sub.rmdir()
    for item in path.iterdir():
        item.unlink()
    path.rmdir()
    with open_store(path) as store:
        assert store.unfinished() == [] and store.finished(0.0) == [] and store.usage_bytes() == 0
        assert store.reconciliation.clean
        assert store.record_request(entry("a")).stored


def test_only_the_checkpoints_and_results_folders_deleted_is_tolerated(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 2, checkpoint_at(2).to_bytes())
    for item in (tmp_path / CHECKPOINTS).iterdir():
        item.unlink()
    (tmp_path / CHECKPOINTS).rmdir()
    with open_store(tmp_path) as store:
        assert store.reconciliation.missing_checkpoints == ("a",)
        assert store.save_checkpoint("a", 1, checkpoint_at(1).to_bytes()).stored


# -- bad bytes: one warning, never an error ----------------------------------


def store_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omni_stream.store" and r.levelno == logging.WARNING]


def test_a_torn_checkpoint_loads_as_none_with_one_warning(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 4, checkpoint_at(4).to_bytes())
        (path,) = (tmp_path / CHECKPOINTS).iterdir()
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        caplog.clear()
        assert store.load_checkpoint("a") is None
        (warning,) = store_warnings(caplog)
        assert "request a" in warning.getMessage() and "step 0" in warning.getMessage()
        assert "torn" in warning.getMessage()
        # Forgotten: no second warning, and the restarted request's early checkpoints are taken.
        assert store.load_checkpoint("a") is None and len(store_warnings(caplog)) == 1
        assert names(tmp_path / CHECKPOINTS) == [] and store.unfinished()[0].checkpoint_step is None
        assert store.save_checkpoint("a", 1, checkpoint_at(1).to_bytes()).stored
        assert store.load_checkpoint("a").step == 1


def test_a_checkpoint_of_an_older_format_loads_as_none_with_one_warning(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 4, checkpoint_at(4).to_bytes())
    (path,) = (tmp_path / CHECKPOINTS).iterdir()
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, len(ckpt_module.MAGIC), ckpt_module.FILE_VERSION - 1)
    path.write_bytes(bytes(data))
    with open_store(tmp_path) as store:
        assert store.reconciliation.clean  # open does not read checkpoints: the load judges them
        caplog.clear()
        assert store.load_checkpoint("a") is None
        (warning,) = store_warnings(caplog)
        assert f"version {ckpt_module.FILE_VERSION - 1}" in warning.getMessage()
        assert store.get("a").status == "running"  # it starts again; the server keeps running


def test_a_checkpoint_the_model_refuses_can_be_discarded(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 4, checkpoint_at(4).to_bytes())
        assert store.discard_checkpoint("a") and not store.discard_checkpoint("a")
        assert store.save_checkpoint("a", 1, checkpoint_at(1).to_bytes()).stored


def test_a_result_file_of_other_bytes_drops_the_results_with_one_warning(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.record_request(entry("a"))
        store.save_results("a", [result(data=b"the real pixels")], ended_at=1.0)
        (path,) = (tmp_path / RESULTS).iterdir()
        path.write_bytes(b"the fake pixels")  # same size: only the checksum tells
        caplog.clear()
        assert store.load_results("a") is None
        assert len(store_warnings(caplog)) == 1
        assert store.get("a").result_count == 0 and names(tmp_path / RESULTS) == []
        assert store.load_results("a") is None and len(store_warnings(caplog)) == 1


# -- the bound ---------------------------------------------------------------


def test_the_bound_evicts_the_longest_ended_first_and_never_a_running_checkpoint(tmp_path):
    blob = 1000
    data = checkpoint_at(2).to_bytes()
    bound = len(data) + 10_000
    with open_store(tmp_path, max_bytes=bound) as store:
        store.record_request(entry("running", created_at=0.0))
        assert store.save_checkpoint("running", 2, data).stored
        for request_id, ended in [("second", 20.0), ("first", 10.0), ("third", 30.0)]:
            store.record_request(entry(request_id))
            store.save_results(request_id, [result(data=bytes(blob))], ended_at=ended)
        room = bound - store.usage_bytes()
        store.record_request(entry("new"))
        # Needs the room of one and a half results: the two that ended first go, in that order.
        saved = store.save_results("new", [result(data=bytes(room + blob + blob // 2))], ended_at=40.0)
        assert saved.stored and saved.evicted == ("first", "second")
        assert store.get("first") is None and store.get("second") is None
        assert store.load_results("third") is not None
        assert store.load_checkpoint("running").step == 2
        assert store.usage_bytes() <= bound
        assert store.usage_bytes() == on_disk_bytes(tmp_path) + message_bytes(store)


def test_what_does_not_fit_even_then_is_not_written_and_evicts_nothing(tmp_path, caplog):
    data = checkpoint_at(2).to_bytes()
    bound = 2 * len(data) + 8_000  # two checkpoints and a little
    with open_store(tmp_path, max_bytes=bound) as store:
        store.record_request(entry("running"))
        store.save_checkpoint("running", 2, data)
        store.record_request(entry("kept"))
        store.save_results("kept", [result(data=bytes(500))], ended_at=1.0)
        store.record_request(entry("huge"))
        store.save_checkpoint("huge", 1, checkpoint_at(1).to_bytes())
        caplog.clear()
        saved = store.save_results("huge", [result(data=bytes(len(data) + 9_000))], ended_at=2.0)
        assert not saved.stored and saved.evicted == () and "do not fit" in saved.reason
        assert len(store_warnings(caplog)) == 1
        # Done all the same (nothing will resume it), without results; its checkpoint freed.
        assert store.get("huge").status == "done" and store.load_results("huge") is None
        assert store.load_results("kept") is not None
        assert store.load_checkpoint("running").step == 2
        # A checkpoint too large for what is left keeps the one stored.
        store.record_request(entry("other"))
        too_big = store.save_checkpoint("running", 3, bytes(2 * len(data) + 8_000))
        assert not too_big.stored and store.load_checkpoint("running").step == 2
        assert len(names(tmp_path / RESULTS)) == 1 and len(names(tmp_path / CHECKPOINTS)) == 1
        assert store.usage_bytes() == on_disk_bytes(tmp_path) + message_bytes(store) <= bound


def test_messages_count_against_the_bound(tmp_path):
    # An input image travels in the generate message as a data URL: it costs its bytes.
    image = "data:image/png;base64," + "A" * 5_000
    with open_store(tmp_path, max_bytes=5_100) as store:  # one image message, not two
        store.record_request(entry("old"))
        store.mark_ended("old", "failed", 1.0)
        saved = store.record_request(entry("img2img", message={"params": {"image": image}}))
        assert saved.stored and saved.evicted == ("old",)
        refused = store.record_request(entry("another", message={"params": {"image": image}}))
        assert not refused.stored and store.get("another") is None


def test_a_smaller_bound_on_reopening_evicts_down_to_it(tmp_path):
    with open_store(tmp_path) as store:
        for i, request_id in enumerate(["a", "b", "c"]):
            store.record_request(entry(request_id))
            store.save_results(request_id, [result(data=bytes(2_000))], ended_at=float(i))
        per_request = store.usage_bytes() // 3
    with open_store(tmp_path, max_bytes=per_request * 2) as store:
        assert store.reconciliation.evicted == ("a",)
        assert [e.request_id for e in store.finished(0.0)] == ["b", "c"]
        assert len(names(tmp_path / RESULTS)) == 2


def test_running_checkpoints_over_a_smaller_bound_leave_nothing_ended_on_reopening(tmp_path):
    with open_store(tmp_path) as store:
        store.record_request(entry("ended"))
        store.save_results("ended", [result(data=bytes(2_000))], ended_at=1.0)
        store.record_request(entry("running"))
        store.save_checkpoint("running", 2, checkpoint_at(2).to_bytes())
    with open_store(tmp_path, max_bytes=1_000) as store:
        assert store.reconciliation.evicted == ("ended",)
        assert store.load_checkpoint("running").step == 2  # over the bound, but never evicted


def test_statistics_count_what_is_stored(tmp_path):
    with open_store(tmp_path, max_bytes=MiB) as store:
        store.record_request(entry("a"))
        store.save_checkpoint("a", 1, checkpoint_at(1).to_bytes())
        store.record_request(entry("b"))
        store.save_results("b", [result(0, 2), result(1, 2)], ended_at=1.0)
        stats = store.statistics()
    assert (stats.running, stats.finished, stats.checkpoints, stats.results) == (1, 1, 1, 2)
    assert stats.max_bytes == MiB and stats.reserved_bytes == 0 and stats.usage_bytes > 0


# -- retention ---------------------------------------------------------------


def test_prune_deletes_what_retention_no_longer_keeps(tmp_path):
    with open_store(tmp_path, retention_s=100.0) as store:
        store.record_request(entry("running"))
        for request_id, ended in [("early", 1000.0), ("late", 1050.0)]:
            store.record_request(entry(request_id))
            store.save_results(request_id, [result()], ended_at=ended)
        assert [e.request_id for e in store.finished(1099.0)] == ["early", "late"]
        assert [e.request_id for e in store.finished(1100.0)] == ["late"]
        assert store.prune(1100.0) == ["early"]
        assert store.get("early") is None and len(names(tmp_path / RESULTS)) == 1
        assert store.prune(10_000.0) == ["late"]
        assert names(tmp_path / RESULTS) == [] and store.get("running") is not None  # never pruned


# -- the folder and the database ---------------------------------------------


def test_a_newer_schema_version_is_refused_naming_the_folder(tmp_path):
    open_store(tmp_path).close()
    db = sqlite3.connect(tmp_path / DATABASE)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer omni_stream") as raised:
        open_store(tmp_path)
    assert str(tmp_path) in str(raised.value) and f"version {SCHEMA_VERSION + 1}" in str(raised.value)
    open_store(tmp_path / "other").close()  # the refusal let the lock go: nothing held


def test_a_damaged_database_is_refused_naming_the_folder(tmp_path):
    (tmp_path / DATABASE).write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot be read") as raised:
        open_store(tmp_path)
    assert str(tmp_path) in str(raised.value) and "delete it" in str(raised.value)


def test_a_folder_in_use_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(StoreError, match="in use by another process"):
            open_store(tmp_path)
    open_store(tmp_path).close()  # closing let it go


def test_a_closed_store_refuses_every_call(tmp_path):
    store = open_store(tmp_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(LifecycleError, match="closed"):
        store.record_request(entry("a"))
    with pytest.raises(LifecycleError):
        store.unfinished()


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        open_store(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="retention_s"):
        open_store(tmp_path, retention_s=float("nan"))
    with pytest.raises(ValueError, match="format"):
        StoredResult(6, "../png", "image/png", 1, 1, b"")
    with pytest.raises(ValueError, match="index 2 of 2"):
        StoredResult(6, "png", "image/png", 1, 1, b"", index=2, images=2)
    with open_store(tmp_path) as store:
        with pytest.raises(ValueError, match="not a valid request id"):
            store.record_request(entry("../escape"))
        with pytest.raises(ValueError, match="not JSON"):
            store.record_request(entry("a", message={"params": {"x": float("nan")}}))
        store.record_request(entry("a"))
        with pytest.raises(ValueError, match="0..n-1 of n images"):
            store.save_results("a", [result(0, 2)], ended_at=1.0)
        with pytest.raises(ValueError, match="no bytes"):
            store.save_checkpoint("a", 1, b"")
        assert store.save_checkpoint("nobody", 1, b"x").reason == "the request is not recorded"
        assert names(tmp_path / CHECKPOINTS) == []


def test_checkpoints_of_several_requests_are_written_from_several_threads(tmp_path):
    datas = {f"r{i}": checkpoint_at(i % 5, seed=i).to_bytes() for i in range(8)}
    with open_store(tmp_path) as store:
        for request_id in datas:
            store.record_request(entry(request_id))
        start = threading.Barrier(len(datas))
        outcomes: dict[str, bool] = {}

        def save(request_id: str) -> None:
            start.wait()
            for _ in range(3):
                outcomes[request_id] = store.save_checkpoint(request_id, 4, datas[request_id]).stored

        threads = [threading.Thread(target=save, args=(request_id,)) for request_id in datas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(outcomes.values()) and len(outcomes) == len(datas)
        assert len(names(tmp_path / CHECKPOINTS)) == len(datas)
        assert store.statistics().reserved_bytes == 0
        assert store.usage_bytes() == on_disk_bytes(tmp_path) + message_bytes(store)
        for request_id, data in datas.items():
            assert store.load_checkpoint(request_id).to_bytes() == Checkpoint.from_bytes(data).to_bytes()


def test_files_are_named_by_row_not_by_request_id(tmp_path):
    # Ids that differ in case would share a file on a case-insensitive file system.
    with open_store(tmp_path) as store:
        for request_id in ("Abc", "abc"):
            store.record_request(entry(request_id))
            store.save_results(request_id, [result(data=request_id.encode())], ended_at=1.0)
        assert store.load_results("Abc")[0].data == b"Abc" and store.load_results("abc")[0].data == b"abc"
    # Row number, image index, a random part: never the id (a random hex part may hold "bc").
    names = os.listdir(tmp_path / RESULTS)
    assert len(names) == 2 and all(re.fullmatch(r"\d+-\d+-[0-9a-f]{16}\.png", name) for name in names), names
