"""One consumer per request: engine frames in, progress and previews out to the record.

The consumer iterates ``engine.stream(..., policy="latest")``: the engine
never waits for the server, and when a preview takes longer to render than a
step, the frames in between are replaced in the engine's single slot (the
final frame never is). Each preview is rendered once, here, and shared by
every client watching the request through its :class:`RequestRecord`.

The final frame is not a preview: it is the request's result, encoded at
full size in the request's ``output`` format (PNG by default, with the
params in its metadata), never shrunk by ``preview.max_size``.

Frames that arrive rendered (``Frame.encoded``: an engine that renders
where it makes frames, such as a Ray replica, asked with a RenderRequest)
are published as they are: the replica rendered the same preview or result
this module would have, and no tensor crossed the network.

A model router's stream whose model is unloaded mid-run to make room for
another (engine/router.py, residency) says so, and the record publishes
``loading`` again until the request's next step.

A stream whose request can go on elsewhere mid-run (a Ray replica's,
``RemoteStream``: its replica died and another resumes it) calls the
consumer back as it happens, and the record publishes ``restarted``
(``replica_lost``, from the step resumed after) to the request's watchers
then, not at the new replica's first frame, which may be long in coming.
Its progress goes on where it was: the frames made again are dropped there.

A frame with NaN or infinite values has no picture in it (a model that
diverged): such a preview is skipped (one warning per request), and such a
final frame fails its request (``step_failed``, saying so) rather than
ending ``done`` with a garbage result. The check runs where the frame is
rendered, in a preview thread.

Memory: the request's :class:`~omni_stream.core.memory.MemoryReservation`
(made at admission, ``admission.reserve_memory``) counts what it holds
outside the outboxes against ``max_memory_bytes``. Each frame's size is
checked against the estimate (the reservation grows when frames are
larger); the reservation is released once the result is encoded, before it
is published (then the result itself is counted, in the outboxes and the
record), and in any case when the request ends.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import anyio

from .. import protocol
from ..core.admission import OutputSpec
from ..core.metrics import ServerMetrics
from ..core.outbox import MemoryReservation
from ..core.records import RequestRecord, Terminal
from ..engine.like import FrameStreamLike
from ..errors import (
    CheckpointError,
    EngineError,
    ParamsError,
    RenderFailedError,
    RequestCancelledError,
    StepFailedError,
    StepTimeoutError,
)
from ..frame import Frame
from ..preview import (
    EncodedImage,
    NonFiniteFrameError,
    Previewer,
    PreviewSpec,
    check_finite,
    encode_output,
    should_preview,
)

__all__ = ["UNREAD_PACE_S", "stream_request"]

logger = logging.getLogger("omni_stream.server")

#: The longest a consumer waits before taking the next frame of a request
#: no client is reading (see ``RequestRecord.has_reader``): at most 20
#: steps a second reach such a request's record, and its result arrives at
#: most this late.
UNREAD_PACE_S = 0.05


@runtime_checkable
class _HandsOver(Protocol):
    """A stream that calls ``on_handover(from_step)`` when its request goes on elsewhere,
    resumed after ``from_step`` (0: from the start): a Ray replica's (see the module docstring)."""

    on_handover: Callable[[int], None] | None


@runtime_checkable
class _ResumesLater(Protocol):
    """A stream that learns only once it runs that its checkpoint was refused (a Ray replica's):
    with ``on_resume_refused`` set it starts again from step 0 and calls it."""

    on_resume_refused: Callable[[CheckpointError], None] | None


@runtime_checkable
class _Reloads(Protocol):
    """A stream whose request may wait for its ``model`` again mid-run (a model router's: its
    model unloaded to make room, the request handed over to the host): ``on_loading()`` says so."""

    on_loading: Callable[[], None] | None
    model: str


class _PreviewFailed(Exception):
    """Rendering a frame failed; ``__cause__`` says why."""


class _NonFiniteResult(Exception):
    """The final frame holds NaN or infinite values; ``__cause__`` says how many."""


async def stream_request(
    record: RequestRecord,
    stream: FrameStreamLike,
    spec: PreviewSpec,
    *,
    output: OutputSpec,
    params: dict[str, Any] | None = None,
    previewer: Previewer,
    metrics: ServerMetrics,
    memory: MemoryReservation | None = None,
    paced: bool = True,
    on_resume_refused: Callable[[RequestRecord, CheckpointError], None] | None = None,
    on_handed_over: Callable[[RequestRecord, int], None] | None = None,
) -> Terminal:
    """Publish the request's steps into ``record``; return its terminal message.

    ``paced``: take the frames of a request nobody reads at most every
    :data:`UNREAD_PACE_S` (for a stream opened with ``policy="latest"``).
    ``on_resume_refused(record, error)``: told when a stream that resumes
    from a checkpoint learns only as it runs that the checkpoint is refused
    (a Ray replica's: it then starts again from step 0); the rules' hook.
    ``on_handed_over(record, from_step)``: told when a hand-over to another
    replica was said to the watchers (the state directory writes it down).

    Returns ``done``, ``cancelled`` (reason from ``record.cancel_reason``,
    else ``engine``) or a request-ending ``error`` for the request's own
    failures. Raises only for bugs (the caller reports ``internal``) and
    for its own cancellation. Leaving cancels the engine request if it is
    unfinished, and releases ``memory`` (see the module docstring).
    """
    rid = record.id
    if isinstance(stream, _HandsOver):
        stream.on_handover = functools.partial(_handed_over, record, metrics, on_handed_over)
    if on_resume_refused is not None and isinstance(stream, _ResumesLater):
        stream.on_resume_refused = functools.partial(on_resume_refused, record)
    if isinstance(stream, _Reloads):
        # Its watchers hear ``loading`` again, and its status says so, until its next step.
        stream.on_loading = functools.partial(record.publish_loading, stream.model)
    try:
        async with stream:
            async for frame in stream:
                if memory is not None:
                    memory.observe_frame(_nbytes(frame))
                result: Frame | None = frame
                if not frame.final:
                    # A preview may poll the result ahead of it: then that comes next.
                    result = await _publish(
                        record,
                        frame,
                        spec,
                        stream=stream,
                        previewer=previewer,
                        metrics=metrics,
                        memory=memory,
                    )
                if result is not None:
                    await _publish_result(
                        record,
                        result,
                        output,
                        decoder=spec.decoder,
                        params=params,
                        previewer=previewer,
                        metrics=metrics,
                        memory=memory,
                    )
                elif paced and not record.has_reader():
                    # Nobody would receive the next step's progress (no
                    # watcher, or none reading): take steps at a bounded
                    # pace rather than every one the engine makes (it
                    # coalesces them; the final is never dropped), so that
                    # requests nobody reads cost the event loop little.
                    await anyio.sleep(UNREAD_PACE_S)
    except RequestCancelledError:
        return protocol.Cancelled.build(rid, reason=record.cancel_reason or "engine")
    except StepFailedError as exc:
        cause = f": {exc.__cause__!r}" if exc.__cause__ is not None else ""
        return protocol.ErrorMessage.build("step_failed", f"{exc.message}{cause}", request_id=rid)
    except ParamsError as exc:
        # A remote engine's model may refuse params only it can check (a
        # value its card does not declare) after the request was accepted:
        # the request ends, with the model's words and the field.
        return protocol.ErrorMessage.build(
            "step_failed",
            f"the model refused the params: {exc.message}",
            request_id=rid,
            field=exc.field,
        )
    except StepTimeoutError as exc:
        return protocol.ErrorMessage.build("step_timeout", exc.message, request_id=rid)
    except RenderFailedError as exc:
        return protocol.ErrorMessage.build("preview_failed", exc.message, request_id=rid)
    except EngineError as exc:
        return protocol.ErrorMessage.build("engine_error", exc.message, request_id=rid)
    except _PreviewFailed as exc:
        return protocol.ErrorMessage.build(
            "preview_failed", f"could not render a preview: {exc.__cause__}", request_id=rid
        )
    except _NonFiniteResult as exc:
        logger.warning("request %s: its final frame has no picture: %s", rid, exc.__cause__)
        return protocol.ErrorMessage.build(
            "step_failed",
            f"the model's final frame holds non-finite values ({exc.__cause__}): the model diverged, "
            "and there is no result (try another seed, fewer steps or a lower guidance)",
            request_id=rid,
        )
    finally:
        if memory is not None:
            memory.release()
    return protocol.Done.build(rid, total=record.total, elapsed_s=time.monotonic() - record.created_at)


def _handed_over(
    record: RequestRecord,
    metrics: ServerMetrics,
    noted: Callable[[RequestRecord, int], None] | None,
    from_step: int,
) -> None:
    # Counted each time, said only when it changed (two hand-overs from one checkpoint read alike).
    metrics.restarts.labels("replica_lost").inc()
    # Not rewound: the new replica's frames up to the step the watchers have are dropped.
    if record.publish_restarted(from_step, "replica_lost", rewind=False) and noted is not None:
        noted(record, from_step)


def _nbytes(frame: Frame) -> int:
    if frame.encoded is not None:
        return len(frame.encoded.data)
    data = frame.data
    try:
        return int(data.numel()) * int(data.element_size())
    except (AttributeError, TypeError):
        return 0


async def _publish(
    record: RequestRecord,
    frame: Frame,
    spec: PreviewSpec,
    *,
    stream: FrameStreamLike,
    previewer: Previewer,
    metrics: ServerMetrics,
    memory: MemoryReservation | None = None,
) -> Frame | None:
    """Publish a step's progress and, if due, its preview; return a result polled meanwhile."""
    _progress(record, frame, metrics)
    if frame.encoded is not None:
        _publish_image(record, frame, frame.encoded, final=False, metrics=metrics)
        return None
    if frame.data.numel() == 0 or not should_preview(frame.step, frame.total, spec.every):
        # Not due, or rendered remotely and not due there (no pixels came).
        return None
    if not record.wants_preview():
        # Every watcher still holds the previous one unsent: skip the render
        # (latest-wins, decided before the work instead of after it).
        metrics.previews_skipped.inc()
        return None
    started = time.perf_counter()
    async with previewer.reserve() as render:
        if spec.every == 1:
            # While this request queued for a preview thread (under load,
            # behind every other request's preview), newer steps may have
            # arrived: render the newest, so the preview a client gets is as
            # fresh as the thread allows; their progress goes out first.
            # (With every > 1 only some steps are previewed, and skipping
            # ahead could miss them.)
            while (newer := stream.poll()) is not None:
                if memory is not None:
                    memory.observe_frame(_nbytes(newer))
                if newer.final:
                    # The result is here: a preview of an older step would
                    # only delay it. (It is never rendered as a preview.)
                    return newer
                frame = newer
                _progress(record, frame, metrics)
        try:
            image = await render(frame, spec, finite=True)
        except NonFiniteFrameError as exc:
            # No picture in it; the next step may have one again. Said once a request.
            if not record.warned_non_finite:
                record.warned_non_finite = True
                logger.warning(
                    "request %s: skipping previews of non-finite frames (step %d: %s)",
                    record.id,
                    frame.step,
                    exc,
                )
            return None
        except Exception as exc:
            raise _PreviewFailed() from exc
    metrics.preview_encode.observe(time.perf_counter() - started)
    _publish_image(record, frame, image, final=False, metrics=metrics)
    return None


def _publish_image(
    record: RequestRecord,
    frame: Frame,
    image: EncodedImage,
    *,
    final: bool,
    metrics: ServerMetrics,
    index: int = 0,
    images: int = 1,
) -> None:
    if record.previews_sent == 0:  # its first picture (a preview, or the result of one without)
        metrics.first_preview.labels(metrics.model(record.model)).observe(
            time.monotonic() - record.created_at
        )
    header = protocol.PreviewHeader(
        id=record.id,
        step=frame.step,
        total=frame.total,
        final=final,
        format=image.format,
        width=image.width,
        height=image.height,
        mime=image.mime,
        index=index,
        images=images,
    )
    # Packed once, shared by every watcher (and kept for attach replays).
    record.publish_preview(protocol.Preview.build(header, image.data, cells=image.cells))


async def _publish_result(
    record: RequestRecord,
    frame: Frame,
    output: OutputSpec,
    *,
    decoder: Any,
    params: dict[str, Any] | None,
    previewer: Previewer,
    metrics: ServerMetrics,
    memory: MemoryReservation | None = None,
) -> None:
    _progress(record, frame, metrics)
    if frame.encoded is not None:
        if memory is not None:
            memory.release()
        _publish_image(record, frame, frame.encoded, final=True, metrics=metrics)
        return
    started = time.perf_counter()
    try:
        # Full size, in the request's format; a latent result (output:
        # "latent") is drawn by the request's preview decoder.
        encode = functools.partial(
            _encode_finite, frame, output.format, output.quality, params, decoder=decoder
        )
        encoded = await previewer.run_sync(encode)
    except NonFiniteFrameError as exc:
        raise _NonFiniteResult() from exc
    except Exception as exc:
        raise _PreviewFailed() from exc
    metrics.preview_encode.observe(time.perf_counter() - started)
    if memory is not None:
        # The engine is done with the request and the frame is encoded: from
        # here on what it holds is its result, counted where it is queued.
        memory.release()
    # One result per image (num_images), each its own final frame, in order.
    for index, image in enumerate(encoded):
        _publish_image(record, frame, image, final=True, metrics=metrics, index=index, images=len(encoded))


def _encode_finite(frame: Frame, *args: Any, **kwargs: Any) -> list[EncodedImage]:
    # In the preview thread: the check is one pass over the frame; then each
    # image (one, or num_images of them) is encoded on its own.
    check_finite(frame)
    return [encode_output(part, *args, **kwargs) for part in frame.split()]


def _progress(record: RequestRecord, frame: Frame, metrics: ServerMetrics) -> None:
    metrics.observe_timings(frame.timings, record.model)
    settled = record.restart_settled()
    if settled is not None:  # the first frame since a restart was said: how long it took
        metrics.restart_first_frame.labels(settled[0]).observe(settled[1])
    # From its own recent steps (core/eta.py; the rules' clock is this monotonic one), else,
    # where it never entered through the rules, from its admission.
    now = time.monotonic()
    record.rate.observe(now, frame.step)
    eta = record.rate.eta(frame.step, frame.total)
    if eta is None:
        eta = (now - record.created_at) / frame.step * (frame.total - frame.step)
    record.publish_progress(
        protocol.Progress.build(
            record.id, step=frame.step, total=frame.total, eta_s=eta, cached=frame.timings.cached
        )
    )
