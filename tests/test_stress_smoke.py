"""Short runs of the stress tools (benchmarks/chaos.py, benchmarks/fuzz.py): no violations.

The long runs and their figures are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos import main as chaos_main
from benchmarks.chaos import run_chaos
from benchmarks.fuzz import run_fuzz


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
    s = run_fuzz(messages=120, seed=5, connections=3, max_key_bytes=32 * 1024, honest_requests=2)
    assert s["violations"] == []
    assert s["health"] == "ok"
    assert sum(s["replies"].values()) >= 120 - s["sent"].get("cancel_own", 0)
