"""SimDevice: CudaDevice's own copy path on the simulated GPU, with a step's and a copy's device time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import omni_stream as om
from omni_stream.device import SimDevice, resolve_device, simcuda
from omni_stream.device.cuda import CudaDevice


def test_it_is_the_cuda_devices_code_on_the_simulated_gpu():
    dev = SimDevice()
    assert isinstance(dev, CudaDevice) and dev.cuda is simcuda
    assert type(dev).copy_to_host is not CudaDevice.copy_to_host  # only the destination check on top
    assert dev.asynchronous_copies and dev.kind == "sim"


def test_a_copy_lands_only_when_its_event_completes():
    dev = SimDevice(compute_s=0.05, copy_s=0.05)
    dev.prepare_thread()
    try:
        src = torch.arange(6, dtype=torch.float32)
        dst = dev.host_buffer((6,), torch.float32)
        dst.fill_(-1)
        dev.after_step()
        event = dev.copy_to_host(src, dst)
        assert isinstance(event, simcuda.Event)
        assert not event.query()
        assert torch.equal(dst, torch.full((6,), -1.0))  # stale until the event
        t0 = time.monotonic()
        event.synchronize()
        # Waited for the queued compute and then the copy.
        assert time.monotonic() - t0 >= 0.08
        assert event.query() and torch.equal(dst, src)
        assert dev.copied_bytes == 24 and dev.copies == 1
    finally:
        dev.close()


def test_copies_complete_in_issue_order():
    dev = SimDevice(copy_s=0.01)
    dev.prepare_thread()
    try:
        events = []
        srcs = [torch.tensor([float(i)]) for i in range(5)]
        for src in srcs:
            dst = dev.host_buffer((1,), torch.float32)
            events.append(dev.copy_to_host(src, dst))
        events[-1].synchronize()
        assert all(e.query() for e in events)
    finally:
        dev.close()


def test_an_event_given_back_is_recorded_again_for_the_next_copy():
    dev = SimDevice(copy_s=0.02)
    dev.prepare_thread()
    try:
        src = torch.ones(3)
        dst = dev.host_buffer((3,), torch.float32)
        first = dev.copy_to_host(src, dst)
        first.synchronize()
        doubled = src * 2  # kept until the copy landed, as the copier keeps its sources
        again = dev.copy_to_host(doubled, dst, first)
        assert again is first and not again.query()  # pending again, for the new copy
        again.synchronize()
        assert torch.equal(dst, doubled)
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


def test_two_simulated_devices_compute_side_by_side():
    # Each producer thread's compute stream is its device's own, as two GPUs' are.
    ends: list[float] = []

    def producer() -> None:
        dev = SimDevice(compute_s=0.2)
        dev.prepare_thread()
        dev.after_step()
        dst = dev.host_buffer((1,), torch.float32)
        src = torch.zeros(1)
        dev.copy_to_host(src, dst).synchronize()
        ends.append(time.monotonic())
        dev.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=producer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(ends) - t0 < 0.35, "the two devices' steps ran one after the other"


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


def test_a_simulated_device_pickles_as_what_it_names():
    # It travels to Ray replicas (device=SimDevice(...)): the API module by name, no streams.
    import pickle

    dev = SimDevice(compute_s=0.01, copy_s=0.02)
    dev.prepare_thread()
    try:
        copy = pickle.loads(pickle.dumps(dev))
    finally:
        dev.close()
    assert copy.cuda is simcuda and (copy.compute_s, copy.copy_s) == (0.01, 0.02)
    assert copy._copy_stream is None and copy._compute is None
    copy.prepare_thread()
    try:
        src = torch.ones(3)
        dst = copy.host_buffer((3,), torch.float32)
        copy.copy_to_host(src, dst).synchronize()
        assert torch.equal(dst, src)
    finally:
        copy.close()
