"""release_idle_team: the calling thread's OpenMP helpers exit; results and other threads are untouched.

The thread counting runs in a fresh interpreter: in the test process, idle
worker threads of earlier tests come and go and would blur the count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from omni_stream.device.openmp import release_idle_team, supported

gnu_openmp = pytest.mark.skipif(
    not supported() or not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
    reason="needs torch on GNU libgomp, Linux and 2+ CPUs",
)

_PRELUDE = """
import json, os, threading, time
import torch
from omni_stream.device.openmp import release_idle_team

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    # Far above torch's grain size: an OpenMP parallel region.
    x = torch.arange(1 << 20, dtype=torch.float32)
    return (x * 2 + 1).sum()

def settle(expected, timeout=5.0):
    deadline = time.monotonic() + timeout
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
"""


def _run(body: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@gnu_openmp
def test_release_frees_the_calling_threads_helpers_and_they_come_back_on_demand():
    result = _run(
        """
        torch.set_num_threads(2)
        before = threads()
        expected = parallel_op()
        grew = threads() - before
        released = release_idle_team()
        after = settle(before)
        same = bool(torch.equal(parallel_op(), expected))  # the team is rebuilt
        print(json.dumps({"grew": grew, "released": released, "after": after,
                          "before": before, "same": same, "rebuilt": threads() - before}))
        """
    )
    assert result["grew"] == 1  # one helper beside the thread itself
    assert result["released"] is True
    assert result["after"] == result["before"]
    assert result["same"] is True
    assert result["rebuilt"] == 1


@gnu_openmp
def test_release_leaves_other_threads_teams_alone():
    result = _run(
        """
        torch.set_num_threads(2)
        ready, done = threading.Event(), threading.Event()

        def other():
            torch.set_num_threads(2)
            parallel_op()
            ready.set()
            done.wait(10)

        t = threading.Thread(target=other)
        t.start()
        ready.wait(10)
        with_team = threads()
        release_idle_team()  # the main thread has no team: nothing to free
        after = settle(with_team - 1, timeout=0.5)
        done.set()
        t.join()
        print(json.dumps({"with_team": with_team, "after": after}))
        """
    )
    assert result["after"] == result["with_team"]


def test_release_is_safe_to_call_anywhere():
    # Without a team, or without GNU libgomp at all, it is a no-op that returns a bool.
    assert isinstance(release_idle_team(), bool)
    assert isinstance(release_idle_team(), bool)
