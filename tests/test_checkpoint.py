"""checkpoint.py: a Checkpoint's bytes round-trip, and torn, tampered or unknown bytes raise CheckpointError."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from omni_stream import checkpoint as ckpt_module
from omni_stream.checkpoint import Checkpoint, plain_params
from omni_stream.errors import CheckpointError
from omni_stream.models import Synthetic

CPU = torch.device("cpu")


def synthetic_checkpoint() -> Checkpoint:
    model = Synthetic()
    state = model.start(model.validate(dict(steps=4, shape=[2, 2], seed=1)), CPU)
    model.step([state])
    return model.snapshot(state)


def test_bytes_round_trip_every_field() -> None:
    checkpoint = Checkpoint(
        model="m", format=3, step=2, total=5, params={"prompt": "a", "shape": [1, 2]},
        tensors={"x": torch.arange(6, dtype=torch.float16).view(2, 3)[:, 1:], "g": torch.zeros(3, dtype=torch.uint8)},
        values={"n": 1, "f": float("inf"), "nested": {"l": [None, True, "s"]}},
    )
    back = Checkpoint.from_bytes(checkpoint.to_bytes())
    assert (back.model, back.format, back.step, back.total) == ("m", 3, 2, 5)
    assert back.params == checkpoint.params and back.values == checkpoint.values
    assert back.tensors.keys() == checkpoint.tensors.keys()
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(back.tensors[name], tensor) and back.tensors[name].dtype == tensor.dtype
    assert checkpoint.nbytes == 4 * 2 + 3


def test_a_checkpoint_read_from_bytes_gives_those_bytes_back_without_encoding_again(monkeypatch) -> None:
    # A server over Ray resuming after a restart reads each checkpoint from its folder and sends
    # its bytes on from the event loop: encoding them again there would stall the loop.
    data = synthetic_checkpoint().to_bytes()
    read = Checkpoint.from_bytes(bytearray(data))

    def no_encoding(*_: object) -> bytes:
        raise AssertionError("encoded again")

    monkeypatch.setattr(ckpt_module, "_encode", no_encoding)
    assert read.to_bytes() == data
    assert read == read and "_source" not in repr(read)
    made = synthetic_checkpoint()  # one made by a model is encoded, as before
    with pytest.raises(AssertionError, match="encoded again"):
        made.to_bytes()


def test_a_checkpoint_is_read_from_any_buffer_whatever_its_item_size_or_layout() -> None:
    # Bytes are counted as bytes: a view that is not contiguous is read as the bytes it
    # holds (it raised BufferError where a view was used as it came), and a view of 4-byte
    # items is checked byte for byte (its length counted items: "not a checkpoint").
    original = synthetic_checkpoint()
    data = original.to_bytes()
    doubled = bytes(b for pair in zip(data, data, strict=True) for b in pair)
    strided = memoryview(doubled)[::2]
    assert not strided.c_contiguous
    assert Checkpoint.from_bytes(strided, keep_bytes=False).step == original.step
    # Padded to whole items: the padding is not the checkpoint's, and the checksum says so.
    wide = memoryview(data + b"\0" * (4 - len(data) % 4)).cast("I")
    with pytest.raises(CheckpointError, match="checksum"):
        Checkpoint.from_bytes(wide, keep_bytes=False)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_a_checkpoint_read_without_its_bytes_holds_only_its_tensors(kind: type) -> None:
    # A restarted server over a local engine never sends a checkpoint on: keeping the file's
    # bytes beside the tensors held each unfinished request's state twice until it resumed.
    original = synthetic_checkpoint()
    data = original.to_bytes()
    read = Checkpoint.from_bytes(kind(data), keep_bytes=False)
    assert "_source" not in read.__dict__
    assert read.step == original.step and read.params == original.params
    assert all(torch.equal(read.tensors[k], original.tensors[k]) for k in original.tensors)
    again = read.to_bytes()  # encoded again, and as good
    assert Checkpoint.from_bytes(again).tensors.keys() == original.tensors.keys()


def test_reading_a_checkpoint_makes_no_copy_of_its_bytes() -> None:
    # The checksum was taken over a concatenation of two slices and torch.load read a third
    # slice: three transient copies of the payload (bytes slices copy), on top of the bytes
    # and the tensors, for every unfinished request a restarted server reads. tracemalloc
    # sees Python's allocations (the copies), not torch's storage (the tensors).
    import tracemalloc

    big = Checkpoint(
        model="m", format=1, step=1, total=2, params={},
        tensors={"x": torch.arange(2_000_000, dtype=torch.float32)},
    )
    data = big.to_bytes()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        read = Checkpoint.from_bytes(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(read.tensors["x"], big.tensors["x"])
    assert peak < len(data) // 4, f"{peak} bytes allocated reading {len(data)}"


def test_a_torn_or_tampered_checkpoint_raises() -> None:
    data = synthetic_checkpoint().to_bytes()
    for cut in (0, 10, len(ckpt_module.MAGIC) + 20, len(data) // 2, len(data) - 1):
        with pytest.raises(CheckpointError):
            Checkpoint.from_bytes(data[:cut])
    for at in (len(data) // 2, len(data) - 1, len(ckpt_module.MAGIC) + 4 + 3):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        with pytest.raises(CheckpointError, match="torn or was modified"):
            Checkpoint.from_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="not an omni_stream checkpoint"):
        Checkpoint.from_bytes(b"x" * 100)


def test_an_unknown_format_version_raises() -> None:
    data = ckpt_module._encode(synthetic_checkpoint(), ckpt_module.FILE_VERSION + 1)
    with pytest.raises(CheckpointError, match="version 2"):
        Checkpoint.from_bytes(data)


def test_a_well_summed_payload_of_the_wrong_shape_raises() -> None:
    buffer = io.BytesIO()
    torch.save({"meta": "{}", "tensors": {}}, buffer)
    head = ckpt_module._VERSION.pack(ckpt_module.FILE_VERSION)
    data = ckpt_module.MAGIC + head + hashlib.sha256(head + buffer.getvalue()).digest() + buffer.getvalue()
    with pytest.raises(CheckpointError, match="payload"):
        Checkpoint.from_bytes(data)


def test_a_checkpoint_holds_only_host_tensors_and_json() -> None:
    with pytest.raises(TypeError, match="tuples"):
        Checkpoint(model="m", format=1, step=0, total=1, params={"shape": (1, 2)})
    with pytest.raises(TypeError, match="step"):
        Checkpoint(model="m", format=1, step=2, total=1, params={})
    with pytest.raises(TypeError):
        Checkpoint(model="m", format=1, step=0, total=1, params={}, tensors={"x": [1.0]})  # type: ignore[dict-item]
    assert plain_params({"shape": (1, 2), "loras": (("ink", 0.5),)}) == {"shape": [1, 2], "loras": [["ink", 0.5]]}
    with pytest.raises(CheckpointError, match="Tensor"):
        plain_params({"image": torch.zeros(1)})
