"""A request's state as data: :class:`Checkpoint`, and its bytes.

A model that can snapshot (``StepModel.can_snapshot``) turns a request's
state, between two steps, into a :class:`Checkpoint`: host tensors and
plain values, nothing that lives on a device or in a library object. Its
``restore`` turns one back into a state on any device, and the steps after
it give the frames the uninterrupted request would have given, bit for bit
(same device, same torch thread count).

The bytes (``to_bytes`` / ``from_bytes``)::

    MAGIC (16 bytes) | version (uint32, little-endian) | sha256 (32 bytes) | payload

The payload is ``torch.save({"meta": JSON text, "tensors": {name: tensor}})``,
read back with ``torch.load(weights_only=True)``: no pickled objects, so a
checkpoint file cannot run code. The checksum covers the version and the
payload, so a torn write or a flipped byte is a :class:`CheckpointError`,
never a state that is silently wrong. ``version`` is the layout of these
bytes (:data:`FILE_VERSION`); ``Checkpoint.format`` is the layout of one
model's state inside them, which that model's ``restore`` checks.

Values and params are JSON (str keys; lists, not tuples): what a model
needs to rebuild Python objects from them (tuples, numpy scalars) it tags
itself. :func:`plain_params` turns a request's checked params into that
form.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch

from .errors import CheckpointError

__all__ = ["FILE_VERSION", "MAGIC", "Checkpoint", "CheckpointLike", "plain_params"]

#: The first bytes of every checkpoint.
MAGIC: Final = b"omni-stream-ckpt"
#: The layout of the bytes this module writes and reads.
FILE_VERSION: Final = 1
_VERSION = struct.Struct("<I")
_DIGEST = 32  # sha256
_HEADER = len(MAGIC) + _VERSION.size + _DIGEST


class CheckpointLike(Protocol):
    """What keeping a checkpoint needs of it: its step and its bytes.

    A :class:`Checkpoint`, or one already in bytes (a Ray replica's, as
    the front door receives it: integrations/ray_serve/handover.py), which
    is written as it came without being read.
    """

    @property
    def step(self) -> int: ...

    def to_bytes(self) -> bytes: ...


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One request's state between two steps: CPU tensors and JSON values.

    ``model``: the kind of model that wrote it (restore refuses another's);
    ``format``: that model's state layout version; ``step``: steps done;
    ``total``: the request's steps; ``params``: its checked params as JSON
    (:func:`plain_params`); ``tensors``: CPU tensors by name (latents,
    generator state, scheduler buffers, conditioning); ``values``: JSON
    values by name (counters, flags). Raises TypeError when a field holds
    something else (a device tensor, a tuple, a non-str key).
    """

    model: str
    format: int
    step: int
    total: int
    params: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, kind in (("model", str), ("format", int), ("step", int), ("total", int)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TypeError(f"Checkpoint.{name} must be {kind.__name__}, got {type(value).__name__}")
        if not 0 <= self.step <= self.total:
            raise TypeError(f"Checkpoint.step {self.step} is outside 0..total ({self.total})")
        for name in ("params", "values"):
            if type(getattr(self, name)) is not dict:
                raise TypeError(f"Checkpoint.{name} must be a dict, got {type(getattr(self, name)).__name__}")
            _check_json(getattr(self, name), name)
        if not isinstance(self.tensors, dict):
            raise TypeError(f"Checkpoint.tensors must be a dict, got {type(self.tensors).__name__}")
        for name, tensor in self.tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(f"Checkpoint.tensors[{name!r}] must be a tensor under a str name")
            if tensor.device.type != "cpu":
                # A checkpoint outlives the device it came from (a restart, another replica).
                raise TypeError(f"Checkpoint.tensors[{name!r}] is on {tensor.device}; it must be on the CPU")

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (what holding it in memory costs, give or take the values)."""
        return sum(t.nbytes for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """The checkpoint as bytes (see the module docstring); :meth:`from_bytes` reads them.

        A checkpoint read by :meth:`from_bytes` gives back the bytes it was read from, not an
        encoding made again: a server over Ray that resumes its requests after a restart reads
        each from its folder (in a worker thread) and sends the bytes on, from the event loop.
        """
        source: bytes | None = self.__dict__.get("_source")
        if source is not None:
            return source
        return _encode(self, FILE_VERSION)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, keep_bytes: bool = True) -> Checkpoint:
        """The checkpoint ``to_bytes`` wrote.

        ``keep_bytes``: keep ``data`` for :meth:`to_bytes` to give back (a
        checkpoint that will be sent on as bytes: no encoding again). Without
        it the checkpoint holds only its tensors, half the memory, and
        ``to_bytes`` encodes them again. Raises CheckpointError for bytes that
        are not a checkpoint, are torn (truncated) or tampered with
        (checksum), or are of a version this omni_stream does not read.
        """
        # No copy of the payload on the way (a video model's state can be large, and a
        # restarted server reads every unfinished request's): the checksum is fed views,
        # and torch.load reads the payload in place (_Window). Slices of bytes are copies.
        # bytes(data) copies only a buffer that is not bytes already: what is checked and
        # what is loaded must be one snapshot (a bytearray written to meanwhile could get
        # a payload loaded that the checksum never saw), and bytes are counted in bytes
        # whatever the view's item size or layout.
        data = bytes(data)
        if len(data) < _HEADER or not data.startswith(MAGIC):
            what = "too short" if len(data) < _HEADER else "without the checkpoint marker"
            raise CheckpointError(f"not an omni_stream checkpoint ({len(data)} bytes, {what})")
        (version,) = _VERSION.unpack_from(data, len(MAGIC))
        if version != FILE_VERSION:
            raise CheckpointError(
                f"checkpoint format version {version} is not one this omni_stream reads ({FILE_VERSION})"
            )
        view = memoryview(data)
        digest = view[len(MAGIC) + _VERSION.size : _HEADER]
        summed = hashlib.sha256(view[len(MAGIC) : len(MAGIC) + _VERSION.size])
        summed.update(view[_HEADER:])
        if summed.digest() != digest:
            raise CheckpointError(
                f"checkpoint checksum mismatch ({len(data)} bytes): the file is torn or was modified"
            )
        try:
            payload = io.BufferedReader(_Window(view[_HEADER:]))
            loaded = torch.load(payload, map_location="cpu", weights_only=True)
            meta = json.loads(loaded["meta"])
            tensors = loaded["tensors"]
            checkpoint = cls(
                model=meta["model"],
                format=meta["format"],
                step=meta["step"],
                total=meta["total"],
                params=meta["params"],
                values=meta["values"],
                tensors=tensors,
            )
        except Exception as exc:  # noqa: BLE001 - a well-summed payload of the wrong shape: still ours to name
            raise CheckpointError(f"checkpoint payload cannot be read: {exc!r:.200}") from exc
        if keep_bytes:
            # Its own bytes, for to_bytes (not a field: equality, repr and fields() are the data's).
            object.__setattr__(checkpoint, "_source", data)
        return checkpoint


class _Window(io.RawIOBase):
    """A read-only, seekable file over a memoryview, read in place (no copy of the whole)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            base = 0
        elif whence == io.SEEK_CUR:
            base = self._pos
        elif whence == io.SEEK_END:
            base = len(self._view)
        else:
            raise ValueError(f"invalid whence ({whence!r})")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _encode(checkpoint: Checkpoint, version: int) -> bytes:
    meta = {
        "model": checkpoint.model,
        "format": checkpoint.format,
        "step": checkpoint.step,
        "total": checkpoint.total,
        "params": checkpoint.params,
        "values": checkpoint.values,
    }
    # torch.save writes a view's whole storage: compact the ones that share a larger one.
    tensors = {
        name: t if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes else t.clone()
        for name, t in checkpoint.tensors.items()
    }
    buffer = io.BytesIO()
    torch.save({"meta": json.dumps(meta, allow_nan=True), "tensors": tensors}, buffer)
    payload = buffer.getvalue()
    head = _VERSION.pack(version)
    return MAGIC + head + hashlib.sha256(head + payload).digest() + payload


def plain_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A request's checked params as JSON values (tuples become lists), for ``Checkpoint.params``.

    Raises CheckpointError for a value JSON cannot hold (a decoded image, a
    tensor): such a request cannot be written down.
    """
    out = _plain(params, "params")
    assert isinstance(out, dict)
    return out


def _plain(value: Any, where: str) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where}: key {key!r} is not a string")
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise CheckpointError(f"{where} holds a {type(value).__name__}, which a checkpoint cannot write down")


def _check_json(value: Any, where: str) -> None:
    """Raise TypeError unless ``value`` survives a JSON round trip unchanged (str keys, lists)."""
    if value is None or type(value) in (bool, int, float, str):
        return  # json writes NaN and the infinities too, and reads them back
    if type(value) is dict:
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"Checkpoint.{where}: key {key!r} is not a string")
            _check_json(item, f"{where}.{key}")
        return
    if type(value) is list:
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    raise TypeError(f"Checkpoint.{where} holds a {type(value).__name__}; only JSON values (lists, no tuples)")
