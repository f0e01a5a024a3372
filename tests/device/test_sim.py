"""SimDevice behaves like a CUDA copy stream: bytes land only when the event completes."""

from __future__ import annotations

import time

import pytest
import torch

import omni_stream as om
from omni_stream.device import SimDevice, resolve_device


def test_a_copy_lands_only_when_its_event_completes():
    dev = SimDevice(compute_s=0.05, copy_s=0.05)
    dev.prepare_thread()
    try:
        src = torch.arange(6, dtype=torch.float32)
        dst = dev.host_buffer((6,), torch.float32)
        dst.fill_(-1)
        dev.after_step()
        event = dev.copy_to_host(src, dst)
        assert not event.query()
        assert torch.equal(dst, torch.full((6,), -1.0))  # stale until the event
        t0 = time.monotonic()
        event.synchronize()
        # Waited for the queued compute and then the copy.
        assert time.monotonic() - t0 >= 0.08
        assert event.query() and torch.equal(dst, src)
    finally:
        dev.close()


def test_copies_complete_in_issue_order():
    dev = SimDevice(copy_s=0.01)
    dev.prepare_thread()
    try:
        events = []
        for i in range(5):
            dst = dev.host_buffer((1,), torch.float32)
            events.append(dev.copy_to_host(torch.tensor([float(i)]), dst))
        events[-1].synchronize()
        assert all(e.query() for e in events)
    finally:
        dev.close()


def test_copies_only_into_pool_buffers():
    dev = SimDevice()
    dev.prepare_thread()
    try:
        with pytest.raises(RuntimeError, match="host_buffer"):
            dev.copy_to_host(torch.zeros(2), torch.empty(2))
    finally:
        dev.close()


def test_resolve_device_names():
    assert resolve_device("cpu").kind == "cpu"
    assert resolve_device("sim").kind == "sim"
    assert resolve_device("auto").kind == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(torch.device("cpu")).kind == "cpu"
    with pytest.raises(om.ParamsError, match="cuda:N"):
        resolve_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(om.ParamsError, match="cuda"):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        SimDevice(copy_s=-1)
