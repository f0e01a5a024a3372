"""producer.py: the step producer, one thread that owns the accelerator.

No engine and no event loop: the producer's methods are plain synchronous
code, driven here on the test's own thread (and on a second thread where
the producer must wait on the table). The copier is a recorder that keeps
what is submitted and posted; the device is the CPU's; the model is a
small counting one whose states say how often each was stepped. A test
knows the producer is parked because the table's condition tells it (see
``parked``): no sleeps, no timing.

Covered elsewhere and not repeated here: the same promises end to end
through an engine (test_failures.py, test_cancellation.py, test_output.py,
test_pause.py), the producer's torch threads (test_host_frames.py), the
scheduling policies themselves (test_scheduler.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import omni_stream as om
from omni_stream.device import PoolClosedError
from omni_stream.device.cpu import CpuDevice
from omni_stream.engine.copier import CopyTicket
from omni_stream.engine.delivery import Delivery
from omni_stream.engine.producer import Producer
from omni_stream.engine.request import Request, Status
from omni_stream.engine.table import Limits, RequestTable
from omni_stream.errors import OmniStreamError, ParamsError, StepFailedError, StepTimeoutError


class State:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.steps = 0


class Counting(om.StepModel):
    """Each state counts its steps; a frame is ``full((2,), steps)``. Knobs make it misbehave."""

    name = "counting"

    def __init__(self, *, max_batch_size: int = 64) -> None:
        self.max_batch_size = max_batch_size
        self.events: list[tuple[str, Any]] = []
        self.fail_on: set[str] = set()  # step raises whenever one of these is in the batch
        self.fail_start: set[str] = set()
        self.outputs: Callable[[list[torch.Tensor]], Any] | None = None
        self.during_step: Callable[[], None] | None = None
        self.can_snapshot_now = True

    def total_steps(self, params: Any) -> int:
        return int(params.get("steps", 3))

    def start(self, params: Any, device: torch.device) -> State:
        request_id = params["id"]
        if request_id in self.fail_start:
            raise ValueError(f"cannot start {request_id}")
        self.events.append(("start", request_id))
        return State(request_id)

    def step(self, states: Sequence[State]) -> Any:
        ids = [s.request_id for s in states]
        self.events.append(("step", ids))
        if self.during_step is not None:
            self.during_step()
        if self.fail_on & set(ids):
            # The contract: a raising step leaves its states untouched.
            raise RuntimeError(f"bad batch {ids}")
        for s in states:
            s.steps += 1
        outs = [torch.full((2,), float(s.steps)) for s in states]
        return self.outputs(outs) if self.outputs is not None else outs

    def close(self, state: State | None) -> None:
        self.events.append(("close", getattr(state, "request_id", state)))

    def snapshot(self, state: State) -> Any:
        if not self.can_snapshot_now:
            raise RuntimeError("no snapshot here")
        self.events.append(("snapshot", state.request_id))
        return ("checkpoint", state.request_id, state.steps)

    def restore(self, checkpoint: Any, device: torch.device) -> State:
        _, request_id, steps = checkpoint
        self.events.append(("restore", request_id))
        s = State(request_id)
        s.steps = steps
        return s

    def decode(self, state: State, frame: torch.Tensor) -> torch.Tensor:
        return torch.zeros((3, 4, 4), dtype=torch.uint8)

    def decode_preview(self, state: State, frame: torch.Tensor) -> torch.Tensor | None:
        return torch.ones((3, 2, 2), dtype=torch.uint8)

    def of(self, kind: str) -> list[Any]:
        return [what for k, what in self.events if k == kind]


class Copier:
    """Records submits and posts; a submitted ticket holds its frame as the CPU path's does."""

    def __init__(self) -> None:
        self.submitted: list[CopyTicket] = []
        self.posted: list[list[CopyTicket]] = []

    def submit(self, request: Request, step: int, out: torch.Tensor, **fields: Any) -> CopyTicket:
        t = CopyTicket(request=request, step=step, data=out.clone(), **fields)
        self.submitted.append(t)
        return t

    def post(self, tickets: list[CopyTicket]) -> None:
        self.posted.append(list(tickets))

    def frames(self) -> list[tuple[str, int, str]]:
        """Every posted ticket: (request id, step, "frame" or the error's type)."""
        return [
            (t.request.id, t.step, "frame" if t.error is None else type(t.error).__name__)
            for batch in self.posted
            for t in batch
        ]


_tables: list[RequestTable] = []


@pytest.fixture(autouse=True)
def _stop_every_table() -> Any:
    """A producer thread a failed test left waiting is told to stop (else pytest never exits)."""
    yield
    for table in _tables:
        with table.cond:
            table.stopping = True
            table.cond.notify_all()
    _tables.clear()


class _Parking(threading.Condition):
    """The table's condition, with an event set each time the producer is about to wait on it."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.parked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.parked.set()
        return super().wait(timeout)


def parked(table: RequestTable) -> threading.Event:
    """Set once the producer waits on ``table`` (clear it to see the next wait).

    Set with the lock held, which only the wait gives up: once the test holds
    the lock the producer is parked, and the test's notify cannot be lost.
    """
    assert isinstance(table.cond, _Parking)
    return table.cond.parked


def thread(target: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def setup(
    model: om.StepModel | None = None, *, max_batch_size: int = 8, max_run_ahead: int = 2, queue_size: int = 8
) -> tuple[Producer, RequestTable, Copier, Any]:
    model = model or Counting()
    table = RequestTable(
        Limits(max_batch_size=max_batch_size, max_run_ahead=max_run_ahead, queue_size=queue_size)
    )
    table.cond = _Parking(table.lock)
    _tables.append(table)
    copier = Copier()
    producer = Producer(model, CpuDevice(), copier, table)  # type: ignore[arg-type]
    # A producer that never retired an ended request would go round its choosing loop for
    # ever, on the test's thread: stopped after many more rounds than any test makes.
    offload, rounds = producer._offload, itertools.count()

    def counted() -> None:
        if next(rounds) > 100:
            table.stopping = True
        offload()

    producer._offload = counted  # type: ignore[method-assign]
    return producer, table, copier, model


def add(table: RequestTable, request_id: str, *, total: int = 3, policy: str = "all", **kw: Any) -> Request:
    params = dict(kw.pop("params", {}), id=request_id)
    table.arrivals += 1
    r = Request(
        request_id=request_id,
        params=params,
        total=total,
        batch_key="same",
        policy=policy,
        timeout=kw.pop("timeout", None),
        arrival=table.arrivals,
        delivery=Delivery(policy),
        **kw,
    )
    table.live[r.arrival] = r
    return r


def step_once(producer: Producer) -> list[Request]:
    """One round as ``run`` makes it: choose a batch, run it."""
    batch = producer._next_batch()
    assert batch is not None
    producer._run_batch(batch)
    return batch


def deliver_and_read(table: RequestTable, *requests: Request) -> None:
    """What the loop does once a posted frame reached its reader: delivered, then consumed."""
    with table.cond:
        for r in requests:
            r.delivered = r.consumed = r.issued
        table.wake_producer()


def refuse_copies(copier: Copier, request_id: str, exc: BaseException) -> None:
    """Make ``copier.submit`` raise ``exc`` for ``request_id``'s frames."""
    submit = copier.submit

    def refusing(request: Request, step: int, out: torch.Tensor, **fields: Any) -> CopyTicket:
        if request.id == request_id:
            raise exc
        return submit(request, step, out, **fields)

    copier.submit = refusing  # type: ignore[method-assign]


# -- construction ------------------------------------------------------------------


def test_it_takes_a_model_or_a_build_function_never_both_or_neither() -> None:
    table = RequestTable(Limits(max_batch_size=8, max_run_ahead=2, queue_size=8))
    with pytest.raises(TypeError, match="not both or neither"):
        Producer(None, CpuDevice(), Copier(), table)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both or neither"):
        Producer(Counting(), CpuDevice(), Copier(), table, build=Counting)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine_limit", "model_limit", "whole", "expected"),
    [(8, 64, False, 8), (8, 3, False, 3), (8, 0, False, 1), (8, 64, True, 1)],
)
def test_a_batch_is_no_larger_than_the_engine_or_the_model_allows(
    engine_limit: int, model_limit: int, whole: bool, expected: int
) -> None:
    model = Counting(max_batch_size=model_limit)
    model.runs_whole_requests = whole
    producer, table, _, _ = setup(model, max_batch_size=engine_limit)
    for i in range(10):
        add(table, f"r{i}")
    assert len(producer._next_batch() or []) == expected


# -- choosing ---------------------------------------------------------------------


def test_a_chosen_batch_is_running_and_stamped_with_the_tables_clock() -> None:
    producer, table, _, _ = setup()
    table.clock = lambda: 1234.5
    a, b = add(table, "a"), add(table, "b")
    assert producer._next_batch() == [a, b]
    assert (a.status, b.status) == (Status.RUNNING, Status.RUNNING)
    assert (a.handed_at, b.handed_at) == (1234.5, 1234.5)


def test_a_stopping_table_returns_none_and_posts_what_was_computed() -> None:
    producer, table, copier, _ = setup()
    r = add(table, "a")
    step_once(producer)
    assert copier.posted == []  # held until the next step starts (see the next test)
    table.stopping = True
    assert producer._next_batch() is None
    assert copier.frames() == [("a", 1, "frame")] and r.issued == 1


def test_tickets_are_posted_when_the_next_step_starts_not_when_their_batch_ends() -> None:
    producer, table, copier, model = setup()
    r = add(table, "a")
    posted_at_step: list[int] = []
    model.during_step = lambda: posted_at_step.append(len(copier.frames()))
    step_once(producer)
    assert copier.posted == [] and r.issued == 1 and r.ready_at > 0  # counted at once, posted later
    step_once(producer)
    # The first frame went out before the second step's model code ran, in one post.
    assert posted_at_step == [0, 1] and copier.frames() == [("a", 1, "frame")]


def test_what_was_computed_is_posted_before_any_model_code_runs_not_only_a_step() -> None:
    posted_at_start: list[int] = []

    class Starting(Counting):
        def start(self, params: Any, device: torch.device) -> State:
            posted_at_start.append(len(copier.frames()))
            return super().start(params, device)

    producer, table, copier, _ = setup(Starting())
    add(table, "a")
    step_once(producer)
    add(table, "b")  # its start is model code too, and may run long
    step_once(producer)
    assert posted_at_start == [0, 1]


def test_a_reader_that_lags_holds_back_its_own_request_and_nobody_elses() -> None:
    producer, table, _, _ = setup(max_run_ahead=8, queue_size=2)
    slow, fast = add(table, "slow"), add(table, "fast")
    latest = add(table, "latest", policy="latest")  # newer frames replace unread ones: never waits
    for _ in range(2):
        step_once(producer)
        with table.cond:
            for r in (slow, fast, latest):
                r.delivered = r.issued
            fast.consumed = fast.issued
    # slow's reader holds queue_size frames it has not taken: slow waits, alone.
    assert producer._next_batch() == [fast, latest]
    deliver_and_read(table, slow)
    assert slow in (producer._next_batch() or [])


def test_run_streak_counts_consecutive_rounds_and_starts_again_after_a_missed_one() -> None:
    # The preemptive policy's quantum reads it (scheduler.py).
    producer, table, _, _ = setup(max_run_ahead=8)
    a, b = add(table, "a", total=8), add(table, "b", total=8)
    streaks = []
    for b_paused in (False, False, True, False):
        b.paused = b_paused
        step_once(producer)
        streaks.append((a.run_streak, b.run_streak))
    assert streaks == [(1, 1), (2, 2), (3, 2), (4, 1)]
    assert (a.last_scheduled, b.last_scheduled) == (4, 4)


def test_with_nothing_runnable_it_posts_then_waits_until_a_reader_frees_a_place() -> None:
    producer, table, copier, _ = setup(max_run_ahead=1)
    r = add(table, "a")
    step_once(producer)  # one step in flight: max_run_ahead reached
    chosen: list[Any] = []
    waiting = thread(lambda: chosen.append(producer._next_batch()))
    assert parked(table).wait(5) and table.producer_waiting
    # Waiting, and what it computed is on its way (else nobody could ever free the place).
    assert copier.frames() == [("a", 1, "frame")] and chosen == []
    deliver_and_read(table, r)
    waiting.join(5)
    assert chosen == [[r]] and not table.producer_waiting


def test_a_waiting_producer_returns_when_the_table_stops() -> None:
    producer, table, _, _ = setup()
    chosen: list[Any] = []
    waiting = thread(lambda: chosen.append(producer._next_batch()))
    assert parked(table).wait(5)
    with table.cond:
        table.stopping = True
        table.wake_producer()
    waiting.join(5)
    assert chosen == [None]


def test_an_ended_request_is_closed_once_and_dropped_before_the_next_batch() -> None:
    producer, table, _, model = setup()
    a, b = add(table, "a"), add(table, "b")
    step_once(producer)  # a and b started
    never_started = add(table, "c")
    never_started.status = Status.CANCELLED  # ended before it ran
    a.status = Status.CANCELLED
    assert producer._next_batch() == [b]
    assert model.of("close") == ["a"]  # c had no state: nothing to close
    assert list(table.live.values()) == [b] and a.state is None and a.closed
    producer._close(a)
    assert model.of("close") == ["a"]


# -- running ------------------------------------------------------------------------


def test_each_step_advances_every_state_once_and_issues_the_next_frame_in_order() -> None:
    producer, table, copier, model = setup()
    a, b = add(table, "a", total=2), add(table, "b", total=2)
    step_once(producer)
    deliver_and_read(table, a, b)
    step_once(producer)
    producer._flush()
    assert model.of("step") == [["a", "b"], ["a", "b"]]
    assert [(t.request.id, t.step, t.data.tolist()) for t in copier.submitted] == [
        ("a", 1, [1.0, 1.0]),
        ("b", 1, [1.0, 1.0]),
        ("a", 2, [2.0, 2.0]),
        ("b", 2, [2.0, 2.0]),
    ]
    assert (a.issued, b.issued) == (2, 2) and producer.steps == 4 and producer.batch_sizes == {2: 2}
    assert all(t.batch_size == 2 for t in copier.submitted)


def test_busy_marks_the_model_call_for_health_and_clears_after() -> None:
    producer, table, _, model = setup()
    add(table, "a"), add(table, "b")
    seen: list[tuple[Any, ...]] = []
    model.during_step = lambda: seen.append((producer.busy_since is not None, producer.busy_with))
    step_once(producer)
    assert seen == [(True, ("a", "b"))] and producer.busy_since is None


def test_the_devices_after_step_follows_each_step_and_each_decode_before_any_copy_reads() -> None:
    log: list[str] = []

    class Recording(CpuDevice):
        def after_step(self) -> None:
            log.append("after_step")

    copier = Copier()
    submit = copier.submit

    def logged(request: Request, step: int, out: torch.Tensor, **fields: Any) -> CopyTicket:
        log.append(f"copy {request.id}")
        return submit(request, step, out, **fields)

    copier.submit = logged  # type: ignore[method-assign]
    model = Counting()
    model.during_step = lambda: log.append("step")
    table = RequestTable(Limits(max_batch_size=8, max_run_ahead=2, queue_size=8))
    producer = Producer(model, Recording(), copier, table)  # type: ignore[arg-type]
    add(table, "a", total=1, params={"output": "image"}), add(table, "b", total=2)
    step_once(producer)
    # A copy is ordered after the compute queued before it (sim, CUDA): the hook comes first.
    assert log == ["step", "after_step", "after_step", "copy a", "copy b"]


def test_a_batched_step_that_raises_is_retried_alone_and_fails_only_the_request_at_fault() -> None:
    producer, table, copier, model = setup()
    add(table, "a"), add(table, "bad"), add(table, "c")
    model.fail_on = {"bad"}
    step_once(producer)
    producer._flush()
    assert model.of("step") == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    assert copier.frames() == [("a", 1, "frame"), ("bad", 1, "StepFailedError"), ("c", 1, "frame")]
    err = copier.posted[0][1].error
    assert isinstance(err, StepFailedError) and err.request_id == "bad" and err.step == 1
    assert isinstance(err.__cause__, RuntimeError) and "counting raised at step 1/3" in str(err)
    assert table.live[2].status is Status.FAILED and table.live[1].status is Status.RUNNING


def test_a_step_that_returns_the_wrong_number_of_frames_fails_its_batch_without_stepping_again() -> None:
    producer, table, copier, model = setup()
    add(table, "a"), add(table, "b")
    model.outputs = lambda outs: outs[:1]
    step_once(producer)
    producer._flush()
    assert model.of("step") == [["a", "b"]]  # the states advanced: never stepped twice
    assert copier.frames() == [("a", 1, "StepFailedError"), ("b", 1, "StepFailedError")]
    assert "returned 1 frames for 2 states" in str(copier.posted[0][0].error)


def test_an_output_that_is_not_a_tensor_fails_its_own_request_only() -> None:
    producer, table, copier, model = setup()
    add(table, "a"), add(table, "b")
    model.outputs = lambda outs: [outs[0], "not a tensor"]
    step_once(producer)
    producer._flush()
    assert copier.frames() == [("a", 1, "frame"), ("b", 1, "StepFailedError")]
    assert "must return tensors, got str" in str(copier.posted[0][1].error)


def test_a_frame_that_cannot_be_copied_fails_its_own_request_and_the_producer_carries_on() -> None:
    producer, table, copier, model = setup()
    a, _ = add(table, "a"), add(table, "bad")
    refuse_copies(copier, "bad", ValueError("sparse tensors cannot be copied"))
    step_once(producer)
    producer._flush()
    assert copier.frames() == [("a", 1, "frame"), ("bad", 1, "StepFailedError")]
    assert isinstance(copier.posted[0][1].error.__cause__, ValueError)
    deliver_and_read(table, a)
    # The next round closes the failed state and steps the others on.
    assert step_once(producer) == [a]
    assert model.of("close") == ["bad"] and a.issued == 2


def test_a_start_that_raises_fails_that_request_and_the_others_step() -> None:
    producer, table, copier, model = setup()
    add(table, "a"), add(table, "b")
    model.fail_start = {"a"}
    step_once(producer)
    producer._flush()
    assert model.of("step") == [["b"]]
    assert copier.frames() == [("a", 1, "StepFailedError"), ("b", 1, "frame")]


def test_an_error_that_already_names_its_request_is_passed_on_as_it_is() -> None:
    producer, table, copier, model = setup()
    r = add(table, "a")
    own = OmniStreamError("the prompt is too long", request_id="a")
    other = OmniStreamError("someone else's", request_id="b")
    assert producer._failure(r, own).error is own
    wrapped = producer._failure(r, other).error
    assert isinstance(wrapped, StepFailedError) and wrapped.request_id == "a" and wrapped.__cause__ is other


def test_previews_and_the_final_image_are_decoded_on_the_producer_and_marked() -> None:
    producer, table, copier, _ = setup()
    r = add(table, "a", total=3, preview_every=1, params={"output": "image"})
    for _ in range(3):
        step_once(producer)
        deliver_and_read(table, r)
    producer._flush()
    shapes = [(t.step, tuple(t.data.shape), t.decoded) for t in copier.submitted]
    # Steps 1-2: previews (never the final one); step 3: the full image.
    assert shapes == [(1, (3, 2, 2), True), (2, (3, 2, 2), True), (3, (3, 4, 4), True)]


def test_a_decoder_that_returns_the_frame_itself_sends_it_undecoded() -> None:
    class Pictures(Counting):
        def decode_preview(self, state: State, frame: torch.Tensor) -> torch.Tensor | None:
            return frame  # its frames are pictures already

    producer, table, copier, _ = setup(Pictures())
    add(table, "a", preview_every=1)
    step_once(producer)
    t = copier.submitted[0]
    assert tuple(t.data.shape) == (2,) and not t.decoded


def test_a_decoder_that_returns_no_tensor_fails_its_request() -> None:
    class Wrong(Counting):
        def decode_preview(self, state: State, frame: torch.Tensor) -> Any:
            return [1, 2]

    producer, table, copier, _ = setup(Wrong())
    add(table, "a", preview_every=1)
    step_once(producer)
    producer._flush()
    assert copier.frames() == [("a", 1, "StepFailedError")]
    assert "decode_preview must return a tensor, got list" in str(copier.posted[0][0].error)


# -- checkpoints and pauses -----------------------------------------------------------


def test_a_checkpoint_is_handed_off_every_n_steps_but_never_after_the_final_one(caplog) -> None:
    producer, table, _, model = setup()
    got: list[tuple[str, Any]] = []
    r = add(table, "a", total=4, checkpoint_every=2, on_checkpoint=lambda rid, c: got.append((rid, c)))
    for _ in range(4):
        step_once(producer)
        deliver_and_read(table, r)
    assert got == [("a", ("checkpoint", "a", 2))]  # step 4 is the final frame: nothing to resume
    model.can_snapshot_now = False
    s = add(table, "b", total=2, checkpoint_every=1, on_checkpoint=lambda rid, c: got.append((rid, c)))
    table.live.pop(r.arrival)
    with caplog.at_level(logging.WARNING, logger="omni_stream.engine"):
        step_once(producer)
    assert s.issued == 1 and s.status is Status.RUNNING  # insurance failed, the request did not
    assert "request b: no checkpoint at step 1" in caplog.text


def test_a_request_paused_to_the_host_leaves_the_device_and_comes_back_from_its_checkpoint() -> None:
    producer, table, copier, model = setup()
    r = add(table, "a", total=3)
    step_once(producer)
    deliver_and_read(table, r)
    r.paused, r.to_host = True, True
    waiting = thread(producer._next_batch)
    assert parked(table).wait(5)  # moved first, then nothing to run: it waits
    assert model.of("snapshot") == ["a"] and model.of("close") == ["a"]
    assert r.state is None and not r.started and not r.to_host and r.resume_from == ("checkpoint", "a", 1)
    with table.cond:
        table.stopping = True
        table.wake_producer()
    waiting.join(5)
    table.stopping = False
    r.paused = False
    step_once(producer)
    producer._flush()
    assert model.of("restore") == ["a"] and r.resume_from is None
    assert [t.data.tolist() for t in copier.submitted] == [[1.0, 1.0], [2.0, 2.0]]  # continued, not restarted


def test_a_paused_request_is_left_out_and_its_state_stays_on_the_device_unless_sent_to_the_host() -> None:
    producer, table, copier, model = setup()
    a, b = add(table, "a"), add(table, "b")
    step_once(producer)
    deliver_and_read(table, a, b)
    a.paused = True
    assert step_once(producer) == [b]
    assert model.of("snapshot") == [] and model.of("close") == [] and a.state.steps == 1
    a.paused = False
    deliver_and_read(table, a, b)
    assert step_once(producer) == [a, b]
    assert [t.data.tolist() for t in copier.submitted if t.request is a] == [[1.0, 1.0], [2.0, 2.0]]


def test_a_paused_request_whose_model_cannot_snapshot_keeps_its_state(caplog) -> None:
    producer, table, _, model = setup()
    model.can_snapshot_now = False
    r = add(table, "a")
    step_once(producer)
    state = r.state
    r.paused, r.to_host = True, True
    with caplog.at_level(logging.WARNING, logger="omni_stream.engine"):
        producer._offload()
    assert r.state is state and r.started and not r.to_host and model.of("close") == []
    assert "request a: its paused state stays on the device" in caplog.text


def test_a_state_moved_to_the_host_whose_close_raises_is_closed_once_and_goes_on_from_its_checkpoint(
    caplog,
) -> None:
    class BadClose(Counting):
        def close(self, state: State | None) -> None:
            super().close(state)
            raise RuntimeError("close failed")

    producer, table, copier, model = setup(BadClose())
    r = add(table, "a", total=3)
    step_once(producer)
    deliver_and_read(table, r)
    r.paused, r.to_host = True, True
    with caplog.at_level(logging.WARNING, logger="omni_stream.engine"):
        producer._offload()
    # Its checkpoint holds it: the closed state is gone, not kept to be closed (or stepped) again.
    assert r.state is None and not r.started and not r.to_host and r.resume_from == ("checkpoint", "a", 1)
    assert "request a: model.close() raised as its state moved to the host" in caplog.text
    r.paused = False
    step_once(producer)
    table.stopping = True
    producer.run()
    # One close of the moved state, one of the state restored from its checkpoint.
    assert model.of("restore") == ["a"] and model.of("close") == ["a", "a"]
    assert [t.data.tolist() for t in copier.submitted] == [[1.0, 1.0], [2.0, 2.0]]


# -- the thread's life ---------------------------------------------------------------


def test_run_builds_the_model_on_its_thread_then_loads_it_then_says_ready() -> None:
    table = RequestTable(Limits(max_batch_size=8, max_run_ahead=2, queue_size=8))
    order: list[tuple[str, int]] = []

    class Built(Counting):
        def load(self, device: torch.device) -> None:
            order.append(("load", threading.get_ident()))

    def build() -> Counting:
        order.append(("build", threading.get_ident()))
        return Built(max_batch_size=2)

    ready: list[om.StepModel] = []
    producer = Producer(
        None,
        CpuDevice(),
        Copier(),  # type: ignore[arg-type]
        table,
        build=build,
        on_ready=lambda m: (order.append(("ready", threading.get_ident())), ready.append(m)),
    )
    table.stopping = True
    runner = thread(producer.run)
    runner.join(5)
    assert [what for what, _ in order] == ["build", "load", "ready"]
    assert {ident for _, ident in order} == {runner.ident}
    assert isinstance(ready[0], Built) and producer._batch_limits.max_batch_size == 2


def test_a_factory_that_returns_no_step_model_is_a_params_error_naming_the_field() -> None:
    table = RequestTable(Limits(max_batch_size=8, max_run_ahead=2, queue_size=8))
    producer = Producer(None, CpuDevice(), Copier(), table, build=lambda: "a model")  # type: ignore[arg-type,return-value]
    with pytest.raises(ParamsError, match="returned str, not an omni_stream.StepModel") as raised:
        producer.run()
    assert raised.value.field == "model"


def test_when_run_ends_it_posts_what_was_computed_and_closes_every_started_state_once() -> None:
    producer, table, copier, model = setup()
    a, _ = add(table, "a"), add(table, "b")
    model.fail_start = {"b"}

    def stop_after_the_first_step() -> None:
        table.stopping = True

    model.during_step = stop_after_the_first_step
    thread(producer.run).join(5)
    assert copier.frames() == [("b", 1, "StepFailedError"), ("a", 1, "frame")]
    assert model.of("close") == ["a"] and table.live == {} and a.closed and a.state is None


def test_a_pool_closed_under_a_batch_stops_the_producer_and_what_was_issued_still_goes_out() -> None:
    producer, table, copier, model = setup()
    add(table, "a"), add(table, "b")
    refuse_copies(copier, "b", PoolClosedError("the pool is closed"))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            producer.run()
        except BaseException as exc:
            raised.append(exc)

    # (On a thread: a producer that took it for b's failure would go on, then wait forever.)
    thread(run).join(5)
    assert [type(exc) for exc in raised] == [PoolClosedError]
    # a's copy was issued: the copier must get it, to free its buffer and deliver it.
    assert copier.frames() == [("a", 1, "frame")]
    assert sorted(model.of("close")) == ["a", "b"]


def test_a_close_that_raises_is_logged_and_every_other_state_is_still_closed(caplog) -> None:
    class BadClose(Counting):
        def close(self, state: State | None) -> None:
            super().close(state)
            if getattr(state, "request_id", None) == "a":
                raise RuntimeError("close failed")

    producer, table, _, model = setup(BadClose())
    a, _ = add(table, "a"), add(table, "b")
    step_once(producer)
    table.stopping = True
    producer.run()
    assert model.of("close") == ["a", "b"] and a.closed and a.state is None
    assert "request a: model.close() raised; ignored" in caplog.text


def test_a_machinery_error_with_no_state_left_to_close_still_posts_what_was_computed() -> None:
    producer, table, copier, model = setup()
    model.fail_start = {"a"}
    a, b = add(table, "a", total=1), add(table, "b")
    a.batch_key = b.batch_key = None  # one at a time: a first, as the shortest
    stamps = [1.0]

    def clock() -> float:
        if not stamps:
            raise RuntimeError("the clock broke")  # as the second batch is stamped
        return stamps.pop()

    table.clock = clock
    with pytest.raises(RuntimeError, match="the clock broke"):
        producer.run()
    # No model code ran after a's failure (b never started, nothing to close): run's own flush sent it.
    assert copier.frames() == [("a", 1, "StepFailedError")] and model.of("start") == []


def test_a_model_error_outside_any_request_propagates_and_still_closes_the_states() -> None:
    producer, table, _, model = setup()
    add(table, "a")

    def device_gone() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    step_once(producer)
    producer._after_step = device_gone  # a device error after a step is the machinery's
    with pytest.raises(RuntimeError, match="illegal memory access"):
        producer.run()
    assert model.of("close") == ["a"]


def test_a_post_that_raises_as_the_producer_dies_masks_nothing_and_every_state_is_still_closed(caplog) -> None:
    stamps = [1.0]

    def clock() -> float:
        if not stamps:
            raise RuntimeError("the clock broke")  # as the second batch is stamped, before any post
        return stamps.pop()

    def post(tickets: list[CopyTicket]) -> None:
        raise RuntimeError("the loop is closed")

    class Breaking(Counting):
        def load(self, device: torch.device) -> None:
            table.clock = clock
            copier.post = post  # type: ignore[method-assign]

    producer, table, copier, model = setup(Breaking())
    add(table, "a"), add(table, "b")
    with caplog.at_level(logging.ERROR, logger="omni_stream.engine"):
        with pytest.raises(RuntimeError, match="the clock broke"):
            producer.run()
    assert model.of("close") == ["a", "b"] and table.live == {}
    assert "its last frames could not be posted either" in caplog.text and "the loop is closed" in caplog.text


# -- whole-request models -------------------------------------------------------------


class WholeCounting(Counting):
    runs_whole_requests = True

    def __init__(self, frames: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.frames = frames

    def run(self, state: State, emit: om.Emit) -> None:
        total = self.frames if self.frames is not None else state.steps_wanted  # type: ignore[attr-defined]
        for n in range(1, total + 1):
            emit(torch.full((2,), float(n)))

    def start(self, params: Any, device: torch.device) -> State:
        s = super().start(params, device)
        s.steps_wanted = int(params.get("steps", 3))  # type: ignore[attr-defined]
        return s


def test_a_whole_run_posts_its_final_frame_only_once_run_returns() -> None:
    producer, table, copier, _ = setup(WholeCounting(), max_run_ahead=8)
    r = add(table, "a", total=3, params={"steps": 3})
    step_once(producer)
    assert copier.frames() == [("a", 1, "frame"), ("a", 2, "frame"), ("a", 3, "frame")]
    assert r.issued == 3 and producer.batch_sizes == {1: 3}


@pytest.mark.parametrize(("frames", "error"), [(2, "returned after 2 of 3 frames"), (4, "emitted frame 4")])
def test_a_whole_run_that_emits_too_few_or_too_many_frames_fails_its_request(frames: int, error: str) -> None:
    producer, table, copier, _ = setup(WholeCounting(frames), max_run_ahead=8)
    r = add(table, "a", total=3, timeout=0.5)  # (a fourth frame let through would wait for a reader)
    step_once(producer)
    assert copier.frames()[-1] == ("a", 3, "StepFailedError")  # the step it failed to make, or the held final
    assert error in str(copier.posted[-1][-1].error) and r.status is Status.FAILED
    # The final frame was held, never delivered as a last word the model took back.
    assert ("a", 3, "frame") not in copier.frames()


def test_a_whole_run_whose_reader_stalls_fails_with_a_step_timeout_and_stops_the_model() -> None:
    producer, table, copier, _ = setup(WholeCounting(), max_run_ahead=8, queue_size=1)
    r = add(table, "a", total=3, timeout=0.01, params={"steps": 3})
    step_once(producer)  # frame 1 out, never read: queue_size reached, the bound runs out
    assert copier.frames() == [("a", 1, "frame"), ("a", 2, "StepTimeoutError")]
    err = copier.posted[-1][0].error
    assert isinstance(err, StepTimeoutError) and err.request_id == "a" and err.bound_s == 0.01
    assert r.status is Status.FAILED and producer.busy_since is None


def test_a_whole_run_waiting_for_its_reader_is_not_busy_and_a_cancel_stops_it_within_a_step() -> None:
    producer, table, copier, _ = setup(WholeCounting(), max_run_ahead=8, queue_size=1)
    r = add(table, "a", total=3, timeout=30.0, params={"steps": 3})
    running = thread(lambda: step_once(producer))
    assert parked(table).wait(5)
    # Waiting on the reader inside model.run: health must not see a stalled step.
    assert producer.busy_since is None and copier.frames() == [("a", 1, "frame")]
    with table.cond:
        r.status = Status.CANCELLED
        table.wake_producer()
    running.join(5)
    assert not running.is_alive() and copier.frames() == [("a", 1, "frame")]


def test_a_whole_run_waiting_for_its_reader_stops_when_the_engine_stops() -> None:
    producer, table, copier, model = setup(WholeCounting(), max_run_ahead=8, queue_size=1)
    r = add(table, "a", total=3, timeout=30.0, params={"steps": 3})
    running = thread(producer.run)
    assert parked(table).wait(5)  # in emit(1): its reader took nothing
    with table.cond:
        table.stopping = True
        table.wake_producer()
    running.join(5)
    # Stopped, not failed: no timeout for a reader that was never going to be served.
    assert not running.is_alive() and copier.frames() == [("a", 1, "frame")]
    assert r.status is Status.RUNNING and model.of("close") == ["a"]


def test_a_pool_closed_under_a_whole_run_stops_the_producer_and_fails_no_request() -> None:
    producer, table, copier, _ = setup(WholeCounting(), max_run_ahead=8)
    refuse_copies(copier, "a", PoolClosedError("the pool is closed"))
    r = add(table, "a", params={"steps": 3})
    with pytest.raises(PoolClosedError):
        step_once(producer)
    assert r.status is Status.RUNNING and copier.posted == [] and producer._unposted == []


def test_a_whole_run_marked_paused_goes_on_rather_than_fail_with_a_timeout_blaming_its_reader() -> None:
    # A whole run cannot stop between steps: Engine.pause refuses it (test_pause.py). One
    # marked paused anyway used to park the producer (and every other request) until the
    # step bound ran out, then fail with "the reader took no frame".
    class PausedAfterOne(WholeCounting):
        def run(self, state: State, emit: om.Emit) -> None:
            emit(torch.full((2,), 1.0))
            with table.cond:
                r.paused = True
            emit(torch.full((2,), 2.0))
            emit(torch.full((2,), 3.0))

    producer, table, copier, _ = setup(PausedAfterOne(), max_run_ahead=8)
    r = add(table, "a", total=3, timeout=0.05, params={"steps": 3})
    step_once(producer)
    assert copier.frames() == [("a", 1, "frame"), ("a", 2, "frame"), ("a", 3, "frame")]
    assert r.status is Status.RUNNING


def test_a_whole_runs_wait_for_its_reader_is_bounded_on_the_tables_clock() -> None:
    # Every step bound is measured on RequestTable.clock (the reader's wait included); the
    # producer's side measured on time.monotonic would disagree with it under a clock that
    # is not the machine's (here: one that runs 100 s a reading, so 30 s have passed at once).
    producer, table, copier, _ = setup(WholeCounting(), max_run_ahead=8, queue_size=1)
    ticks = itertools.count(step=100.0)
    table.clock = lambda: next(ticks)
    r = add(table, "a", total=3, timeout=30.0, params={"steps": 3})
    running = thread(lambda: step_once(producer))
    running.join(5)
    assert not running.is_alive()
    assert copier.frames() == [("a", 1, "frame"), ("a", 2, "StepTimeoutError")] and r.status is Status.FAILED
