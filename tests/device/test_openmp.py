"""release_idle_team: the calling thread's OpenMP helpers exit; results and other threads are untouched."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from omni_stream.device.openmp import release_idle_team, supported

gnu_openmp = pytest.mark.skipif(
    not supported()
    or not os.path.isdir("/proc/self/task")
    or (os.cpu_count() or 1) < 2,
    reason="needs torch on GNU libgomp, Linux and 2+ CPUs",
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> torch.Tensor:
    # Far above torch's grain size: runs as an OpenMP parallel region.
    x = torch.arange(1 << 20, dtype=torch.float32)
    return (x * 2 + 1).sum()


def _settle(expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


@gnu_openmp
def test_release_frees_the_calling_threads_helpers_and_they_come_back_on_demand():
    result: dict[str, object] = {}

    def body() -> None:
        # A fresh thread, so the team we count is this thread's own.
        torch.set_num_threads(2)
        before = _threads()
        expected = _parallel_op()
        with_team = _threads()
        result["grew"] = with_team - before
        result["released"] = release_idle_team()
        result["after_release"] = _settle(before)
        result["before"] = before
        result["same"] = torch.equal(_parallel_op(), expected)  # the team is rebuilt
        result["rebuilt"] = _threads() - before
        release_idle_team()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert result["grew"] == 1  # one helper beside the thread itself
    assert result["released"] is True
    assert result["after_release"] == result["before"]
    assert result["same"] is True
    assert result["rebuilt"] == 1


@gnu_openmp
def test_release_leaves_other_threads_teams_alone():
    ready, done = threading.Event(), threading.Event()
    counts: dict[str, int] = {}

    def other() -> None:
        torch.set_num_threads(2)
        _parallel_op()
        ready.set()
        done.wait(10)
        release_idle_team()

    t = threading.Thread(target=other)
    t.start()
    assert ready.wait(10)
    counts["with_other_team"] = _threads()

    def releaser() -> None:
        counts["released"] = int(release_idle_team())  # this thread has no team

    r = threading.Thread(target=releaser)
    r.start()
    r.join()
    counts["after"] = _settle(counts["with_other_team"])
    done.set()
    t.join()
    assert counts["after"] == counts["with_other_team"]


def test_release_is_safe_to_call_anywhere():
    # Without a team, or without GNU libgomp at all, it is a no-op that returns a bool.
    assert isinstance(release_idle_team(), bool)
    assert isinstance(release_idle_team(), bool)
