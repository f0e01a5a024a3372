"""The step producer: the one thread that owns the accelerator.

It loops on its own: pick a batch, run ``model.step`` on it, issue the
copies, post the tickets to the loop, repeat. The event loop is never on
the path between two steps; the producer waits only when no request may
advance, because each is either done, ``max_run_ahead`` steps ahead of its
copies, or (policy "all") ``queue_size`` frames ahead of its reader. Those
bounds are what backpressure means here: a slow reader slows its own
request and nobody else's.

Model errors fail only the requests they belong to: a batched ``step`` that
raises is retried one state at a time (the model contract says a raising
step leaves its states untouched), so one bad request in a batch cannot
take its neighbours down. Anything else raised here is a bug in the
machinery; it propagates, and the engine declares itself dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..device import Device
from ..errors import StepFailedError
from ..model import StepModel
from .copier import Copier, CopyTicket
from .request import Request, Status
from .scheduler import BatchLimits, pick_batch
from .table import RequestTable

__all__ = ["Producer"]

logger = logging.getLogger("omni_stream.engine")


class Producer:
    """Runs on its own thread; see the module docstring."""

    def __init__(self, model: StepModel, device: Device, copier: Copier, table: RequestTable) -> None:
        self._model = model
        self._device = device
        self._copier = copier
        self._table = table
        limit = min(table.limits.max_batch_size, max(1, int(model.max_batch_size)))
        self._batch_limits = BatchLimits(limit)
        self._seq = 0
        #: monotonic time the running step began, None between steps (read by health).
        self.busy_since: float | None = None
        self.busy_with: tuple[str, ...] = ()
        self.steps = 0
        self.batches = 0
        self.batch_sizes: dict[int, int] = {}

    def run(self) -> None:
        """The thread's body; returns when the table says stop."""
        self._device.prepare_thread()
        self._model.load(self._device.torch_device)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run_batch(batch)

    # -- choosing ------------------------------------------------------------

    def _next_batch(self) -> list[Request] | None:
        table = self._table
        limits = table.limits
        while True:
            self._retire()
            with table.cond:
                while True:
                    if table.stopping:
                        return None
                    if any(r.status.ended for r in table.live.values()):
                        break  # close and retire ended requests first
                    runnable = [
                        r
                        for r in table.live.values()
                        if r.runnable(max_run_ahead=limits.max_run_ahead, queue_size=limits.queue_size)
                    ]
                    batch = list(pick_batch(runnable, self._batch_limits))
                    if batch:
                        self._seq += 1
                        for r in batch:
                            r.last_scheduled = self._seq
                            r.status = Status.RUNNING
                        return batch
                    table.producer_waiting = True
                    try:
                        table.cond.wait()
                    finally:
                        table.producer_waiting = False

    def _retire(self) -> None:
        """Close the model state of ended requests and drop them from the table."""
        table = self._table
        with table.cond:
            ended = [r for r in table.live.values() if r.status.ended]
            for r in ended:
                del table.live[r.arrival]
        for r in ended:
            self._close(r)

    def _close(self, r: Request) -> None:
        if r.started and not r.closed:
            r.closed = True
            try:
                self._model.close(r.state)
            except Exception:
                logger.exception("request %s: model.close() raised; ignored", r.id)
            r.state = None

    # -- running -------------------------------------------------------------

    def _run_batch(self, batch: list[Request]) -> None:
        started_at = time.monotonic()
        tickets: list[CopyTicket] = []
        ready: list[Request] = []
        for r in batch:
            if not r.started:
                try:
                    r.state = self._model.start(r.params, self._device.torch_device)
                    r.started = True
                except Exception as exc:
                    tickets.append(self._failure(r, exc))
                    continue
            ready.append(r)
        queued = {r.id: started_at - r.ready_at for r in ready}
        if ready:
            for r, out, exc, compute_s in self._step(ready):
                if exc is not None:
                    tickets.append(self._failure(r, exc))
                    continue
                n = r.issued + 1
                tickets.append(
                    self._copier.submit(
                        r, n, out, queued_s=queued[r.id], compute_s=compute_s, batch_size=len(ready)
                    )
                )
                with self._table.cond:
                    r.issued = n
                    r.ready_at = time.monotonic()
        if tickets:
            self._copier.post(tickets)

    def _step(
        self, batch: list[Request]
    ) -> list[tuple[Request, Any, BaseException | None, float]]:
        t0 = time.monotonic()
        self.busy_with = tuple(r.id for r in batch)
        self.busy_since = t0
        try:
            outs = self._model.step([r.state for r in batch])
            self._check_outputs(outs, len(batch))
            self._device.after_step()
        except Exception as exc:
            self.busy_since = None
            if len(batch) == 1:
                return [(batch[0], None, exc, 0.0)]
            logger.warning(
                "a batched step of %d requests raised %r; retrying each alone", len(batch), exc
            )
            results = []
            for r in batch:
                results.extend(self._step([r]))
            return results
        finally:
            self.busy_since = None
        compute_s = time.monotonic() - t0
        self.steps += len(batch)
        self.batches += 1
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        return [(r, out, None, compute_s) for r, out in zip(batch, outs)]

    @staticmethod
    def _check_outputs(outs: Sequence[Any], n: int) -> None:
        if len(outs) != n:
            raise TypeError(f"model.step returned {len(outs)} frames for {n} states")
        for out in outs:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"model.step must return tensors, got {type(out).__name__}")

    def _failure(self, r: Request, exc: BaseException) -> CopyTicket:
        n = r.issued + 1
        err = StepFailedError(
            f"{self._model.name} raised at step {n}/{r.total}: {type(exc).__name__}: {exc}",
            request_id=r.id,
            step=n,
        )
        err.__cause__ = exc
        with self._table.cond:
            if not r.status.ended:
                r.status = Status.FAILED
        # INFO: the caller gets the error itself; this is for the operator's trail.
        logger.info("request %s failed at step %d: %r", r.id, n, exc)
        return CopyTicket(request=r, step=n, error=err)
