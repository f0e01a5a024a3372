"""Short runs of the stress tools (benchmarks/chaos.py, benchmarks/fuzz.py): no violations.

The long runs and their figures are in docs/reliability.md.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.chaos import main as chaos_main, run_chaos
from benchmarks.fuzz import Conn, Tally, run_fuzz


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_chaos_short_run_finds_nothing(device):
    s = run_chaos(device=device, requests=40, seed=7, concurrency=6, max_seconds=20)
    assert s["violations"] == []
    assert s["corrupt"] == 0 and s["leaked_buffers"] == 0
    assert s["frames_checked"] > 0 and s["health"] == "ok"


def test_chaos_main_exits_zero(capsys):
    assert chaos_main(["--requests", "10", "--seed", "1"]) == 0
    assert "violations: none" in capsys.readouterr().out


def test_fuzz_short_run_finds_nothing():
    # The server, the honest client and two fuzzing processes, each a process of its own.
    s = run_fuzz(messages=120, seed=5, connections=3, max_key_bytes=32 * 1024, honest_requests=2, workers=2)
    assert s["violations"] == []
    assert s["health"] == "ok"
    # Every message's reply counted in a worker reached this process.
    assert sum(s["replies"].values()) >= 120 - s["sent"].get("cancel_own", 0)
    assert sum(v for k, v in s["sent"].items() if k != "cancel_own") == 120
    assert s["server"]["exit"] == 0 and s["server"]["peak_rss_mib"] > 0
    assert s["honest"]["quiet_steps"] > 0


def test_fuzz_checks_flag_violations():
    # What a worker counts as a violation (and run_fuzz reports): internal, oversized errors,
    # an ending for a request not running here, a failure without fail_at.
    tally = Tally(1024)
    conn = Conn(tally, 0, random.Random(0))
    conn._check_error({"type": "error", "code": "internal", "message": "boom"})
    conn._check_error({"type": "error", "code": "bad_message", "message": "x" * 5000})
    assert conn._stream_msg({"type": "done", "id": "nobody"})
    conn.running.add("r1")
    assert conn._stream_msg({"type": "error", "code": "step_failed", "id": "r1"})
    assert len(tally.violations) == 4, tally.violations
    assert tally.to_json()["violations"] == tally.violations
