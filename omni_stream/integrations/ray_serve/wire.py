"""What crosses Ray between a replica and a RemoteStream, one item per yield (pure, no Ray).

(And, once per front door, the replica's :class:`Description`.)

A RemoteStream calls a replica's ``stream(params, Submit)``, which yields, in order::

    Header                     once: the replica, the request's id, its real step count, whether it
                               loads, the window it grants
    (WireFrame | WireBatch)*   seq 1, 2, ...: a step's frame, or the frames that were ready together
                               (the final one last)
    WireCheckpoint*            between them, when asked (``Submit.checkpoint_every``): the request's
                               newest checkpoint, after the frame of its step (handover.py)
    WireError                  instead of the rest: how the request ended badly

and then returns. A batch exists because each item through Serve's
streaming path costs about 2 ms of CPU, whatever it carries: frames that
are ready at once share one (for a ``latest`` reader only the newest and
the final cross; the others would be dropped on arrival).

Frames carry their tensor as is (Ray's serializer copies its bytes once
into the object store), or, when the reader sent a RenderRequest (a server
in front), the encoded preview or result and no tensor at all
(``encoded``; see omni_stream/preview/remote.py); ``seq`` numbers each
frame sent, batched or not, so the reader acknowledges ``seq`` and the
replica knows how many frames are in transit whatever steps coalescing
skipped.

Errors travel pickled by ``pickle`` itself rather than raised through Ray:
this project's errors keep their ``__cause__`` chain only through their own
``__reduce__`` (errors.py), and a request that ends with an error is not a
failure of the replica, so Serve's logs need not show a traceback for it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import OmniStreamError
from ...frame import Frame, StepTimings
from ...preview.encode import EncodedImage
from ...preview.remote import RenderRequest
from .card import ModelCard

__all__ = [
    "CANCELLED_SEQ",
    "Description",
    "Header",
    "Item",
    "Submit",
    "WireBatch",
    "WireCheckpoint",
    "WireError",
    "WireFrame",
]

#: An acknowledgement of this seq (through the board) says the reader cancelled the stream.
#: Serve's own cancel is best effort while it is still assigning the request to a replica
#: (a cancel just after a submit, as during a hand-over: it cancels the assignment task,
#: which may have sent the request already): the replica, out of credit, sees this one
#: and ends the request itself.
CANCELLED_SEQ = 1 << 62


@dataclass(frozen=True, slots=True)
class Description:
    """What a replica says of itself to a front door that connects (``describe()``).

    ``cards``: the served models' cards by name, the default first (one
    model: under its own name); ``board``: the ReplicaBoard's actor handle;
    ``routed``: the replicas load models on demand, so a front door sends
    each request with ``multiplexed_model_id`` set to its model's name.
    """

    cards: dict[str, ModelCard]
    board: Any
    replica: str
    routed: bool = False


@dataclass(frozen=True, slots=True)
class Submit:
    """A request's options, as ``Engine.stream`` takes them, and its flow control.

    ``key`` names the stream on the board (unique per RemoteStream, unlike
    a request id a caller may reuse); ``window`` is how many frames may be
    in transit, sent and not yet taken by the reader. ``render``, when set,
    asks the replica to send previews and the result encoded, not tensors.
    ``model``: the served model that runs it, for a replica of several
    (None: the default; the front door also routes by it, deploy.py).
    ``checkpoint_every``: send a checkpoint every N steps, where the model
    can snapshot the request; ``resume``: a checkpoint's bytes to go on
    from (a hand-over: its frames start after its step; handover.py).
    """

    key: str
    request_id: str
    policy: str
    timeout: float | None
    preview_every: int | None
    priority: int
    window: int
    render: RenderRequest | None = None
    model: str | None = None
    checkpoint_every: int | None = None
    resume: bytes | None = None


@dataclass(frozen=True, slots=True)
class Header:
    """The first item: who runs the request, and its step count from the real model.

    ``loading``: its model was not on the replica's device when it started
    (its first frame waits for the load). ``window``: the frames the
    replica lets be in transit (the reader's ask, capped by the replica);
    the reader paces its acknowledgements by it. ``checkpoints``: the
    replica will send the request's checkpoints (asked, and its model can
    snapshot it); ``step``: the step it resumes after (0: from the start).
    """

    replica: str
    request_id: str
    total: int
    loading: bool = False
    window: int = 1
    checkpoints: bool = False
    step: int = 0


@dataclass(frozen=True, slots=True)
class WireFrame:
    """One frame as sent: ``seq`` counts frames sent for this request (1-based).

    ``encoded``: the frame rendered on the replica (``data`` is then empty).
    """

    seq: int
    step: int
    total: int
    data: torch.Tensor
    timings: tuple[float, float, float, int, float, bool]
    decoded: bool
    encoded: EncodedImage | None = None
    images: int = 1

    @classmethod
    def of(cls, frame: Frame, seq: int) -> WireFrame:
        t = frame.timings
        return cls(
            seq=seq,
            step=frame.step,
            total=frame.total,
            data=frame.data,
            timings=(t.queued_s, t.compute_s, t.copy_s, t.batch_size, t.decode_s, t.cached),
            decoded=frame.decoded,
            encoded=frame.encoded,
            images=frame.image_count,
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
            image_count=self.images,
        )

    @property
    def final(self) -> bool:
        return self.step == self.total


@dataclass(frozen=True, slots=True)
class WireBatch:
    """Frames the replica found ready together, in step order, sent as one item.

    Each keeps its own ``seq`` (consecutive), so the window counts frames,
    not items: a batch never holds more than the window has room for.
    """

    frames: tuple[WireFrame, ...]


@dataclass(frozen=True, slots=True)
class WireCheckpoint:
    """The request's checkpoint after ``step``, as ``Checkpoint.to_bytes()`` wrote it.

    Sent only after the frame of ``step`` (or a later one): the front door
    never holds a checkpoint ahead of what its reader received. It takes no
    window credit: at most one follows each frame item, so the window
    bounds them too (and only the newest waits on the replica).
    """

    step: int
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


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
Item = Header | WireFrame | WireBatch | WireCheckpoint | WireError
