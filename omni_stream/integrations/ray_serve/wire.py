"""What crosses Ray between a replica and a RemoteStream, one item per yield (pure, no Ray).

A RemoteStream calls a replica's ``stream(params, Submit)``, which yields, in order::

    Header                     once: the replica, the request's id and its real step count
    WireFrame * n              seq 1, 2, ...: a step's frame (the final one last)
    WireError                  instead of the rest: how the request ended badly

and then returns. Frames carry their tensor as is (Ray's serializer copies
its bytes once into the object store), or, when the reader sent a
RenderRequest (a server in front), the encoded preview or result and no
tensor at all (``encoded``; see omni_stream/preview/remote.py); ``seq``
numbers what was sent, so
the reader acknowledges ``seq`` and the replica knows how many frames are
in transit whatever steps coalescing skipped.

Errors travel pickled by ``pickle`` itself rather than raised through Ray:
this project's errors keep their ``__cause__`` chain only through their own
``__reduce__`` (errors.py), and a request that ends with an error is not a
failure of the replica, so Serve's logs need not show a traceback for it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from ...errors import OmniStreamError
from ...frame import Frame, StepTimings
from ...preview.encode import EncodedImage
from ...preview.remote import RenderRequest

__all__ = ["Header", "Item", "Submit", "WireError", "WireFrame"]


@dataclass(frozen=True, slots=True)
class Submit:
    """A request's options, as ``Engine.stream`` takes them, and its flow control.

    ``key`` names the stream on the board (unique per RemoteStream, unlike
    a request id a caller may reuse); ``window`` is how many frames may be
    in transit, sent and not yet taken by the reader. ``render``, when set,
    asks the replica to send previews and the result encoded, not tensors.
    """

    key: str
    request_id: str
    policy: str
    timeout: float | None
    preview_every: int | None
    priority: int
    window: int
    render: RenderRequest | None = None


@dataclass(frozen=True, slots=True)
class Header:
    """The first item: who runs the request, and its step count from the real model."""

    replica: str
    request_id: str
    total: int


@dataclass(frozen=True, slots=True)
class WireFrame:
    """One frame as sent: ``seq`` counts frames sent for this request (1-based).

    ``encoded``: the frame rendered on the replica (``data`` is then empty).
    """

    seq: int
    step: int
    total: int
    data: torch.Tensor
    timings: tuple[float, float, float, int, float]
    decoded: bool
    encoded: EncodedImage | None = None

    @classmethod
    def of(cls, frame: Frame, seq: int) -> WireFrame:
        t = frame.timings
        return cls(
            seq=seq,
            step=frame.step,
            total=frame.total,
            data=frame.data,
            timings=(t.queued_s, t.compute_s, t.copy_s, t.batch_size, t.decode_s),
            decoded=frame.decoded,
            encoded=frame.encoded,
        )

    def frame(self, request_id: str) -> Frame:
        """The Frame the reader gets; its tensor is the one Ray rebuilt, owned by the reader."""
        return Frame(
            request_id=request_id,
            step=self.step,
            total=self.total,
            data=self.data,
            timings=StepTimings(*self.timings),
            decoded=self.decoded,
            encoded=self.encoded,
        )

    @property
    def final(self) -> bool:
        return self.step == self.total


@dataclass(frozen=True, slots=True)
class WireError:
    """The request's ending error, pickled with its cause chain."""

    pickled: bytes

    @classmethod
    def of(cls, exc: OmniStreamError) -> WireError:
        return cls(pickle.dumps(exc))

    def error(self) -> OmniStreamError:
        exc = pickle.loads(self.pickled)
        assert isinstance(exc, OmniStreamError), type(exc)
        return exc


#: Anything a replica's ``stream`` yields.
Item = Header | WireFrame | WireError
