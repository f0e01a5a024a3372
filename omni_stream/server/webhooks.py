"""Webhook deliveries, the I/O: signed POSTs, retried with backoff, in the service's task group.

What is sent and when is decided in :mod:`omni_stream.core.webhooks`
(pure); :class:`WebhookSender` sends it. ``submit`` (synchronous, from the
event loop: a record calls it through its webhook when a request makes
progress or ends) queues a :class:`~omni_stream.core.webhooks.Delivery`;
:meth:`WebhookSender.run`, one task of the service's task group, sends
them at most ``concurrency`` at a time, each try bounded (connect, each
read and write, the whole try), signed per the Standard Webhooks spec with
the ``standardwebhooks`` package: ``webhook-id`` (the same on every try of
a delivery, so a receiver can de-duplicate), ``webhook-timestamp`` (this
try's), ``webhook-signature`` (``v1,`` + HMAC-SHA256 of
``id.timestamp.body``).

Who waits on whom: nothing waits on a receiver but its own delivery's
task. The engine and the requests never wait on a webhook; the event loop
only ever queues one. Memory is bounded: terminal deliveries by admission
(core/webhooks.WebhookBook: at most ``max_held`` requests with a webhook),
progress deliveries by a queue of ``max_progress_pending`` that drops its
oldest when full (a newer progress of the same request replaces an
unsent one anyway); a receiver's answer is never read past its status.
Redirects are not followed (a 3xx is a failed try): the allow-list names
where the server may call, not where a receiver may send it.

Retries: a terminal delivery that fails (a network error, a timeout, any
answer but 2xx) is tried again after ``backoff_s`` (1, 2, 4, 8 s by
default), ``max_attempts`` tries in all; a progress delivery is tried once
(the next one, or the terminal one, says more). At shutdown, what is still
pending gets a short grace (:meth:`WebhookSender.drain`), then is dropped
with one log line.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Final

import anyio
import anyio.abc
import httpx
from standardwebhooks import Webhook

from .. import __version__
from ..core.webhooks import Delivery, WebhookConfig, backoff_s

__all__ = ["WebhookSender"]

logger = logging.getLogger("omni_stream.server")

_USER_AGENT: Final = f"omni-stream/{__version__} (webhooks)"
#: How many request ids a shutdown's "dropped" line names.
_NAMED_IN_LOG: Final = 5


class WebhookSender:
    """Sends webhook deliveries (see the module docstring).

    ``config``: the server's webhook settings (its secret, timeouts, bounds).
    ``transport``: an httpx transport to send through (tests; None: the
    network). ``clock``: seconds, for retries.
    """

    def __init__(
        self,
        config: WebhookConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._signer = Webhook(config.secret)
        self._transport = transport
        self._clock = clock
        #: Terminal deliveries ready to try (bounded by the WebhookBook at admission).
        self._ready: deque[Delivery] = deque()
        #: Progress deliveries ready to try; the oldest goes when full.
        self._progress: deque[Delivery] = deque()
        #: Deliveries waiting for their next try: (due, order, delivery).
        self._retries: list[tuple[float, int, Delivery]] = []
        self._order = itertools.count()
        self._in_flight = 0
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False
        #: Tries cut short by the shutdown (the task group cancelled them): close() names them.
        self._cut: list[Delivery] = []
        #: Counts for /metrics-like inspection and tests.
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    # -- from the event loop (synchronous, never waits) ------------------------------

    def submit(self, delivery: Delivery) -> None:
        """Queue ``delivery`` for sending; a progress one may push the oldest progress out."""
        if self._closed:
            self._drop(delivery, "the server is shutting down")
            return
        if delivery.terminal:
            self._ready.append(delivery)
        else:
            if len(self._progress) >= self.config.max_progress_pending:
                self._drop(self._progress.popleft(), "the progress queue was full (max_progress_pending)")
            self._progress.append(delivery)
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wakeup.set()

    @property
    def pending(self) -> int:
        """Deliveries not yet settled: ready, waiting for a retry, or being tried."""
        return len(self._ready) + len(self._progress) + len(self._retries) + self._in_flight

    # -- the task --------------------------------------------------------------------

    async def run(self) -> None:
        """Send deliveries until cancelled (the service's task group runs it); then drop what is left."""
        config = self.config
        timeout = httpx.Timeout(config.io_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(
            max_connections=config.concurrency, max_keepalive_connections=config.concurrency
        )
        slots = anyio.Semaphore(config.concurrency)
        try:
            async with (
                httpx.AsyncClient(
                    timeout=timeout, limits=limits, follow_redirects=False, transport=self._transport,
                    headers={"user-agent": _USER_AGENT}, trust_env=False,
                ) as client,
                anyio.create_task_group() as tg,
            ):
                while True:
                    delivery = await self._next_due()
                    try:
                        await slots.acquire()
                    except BaseException:
                        # Cancelled while it waited for a slot: in no queue now.
                        self._in_flight -= 1
                        self._drop(delivery, "the server shut down")
                        self._cut.append(delivery)
                        raise
                    if delivery.settled:  # superseded while it waited for a slot
                        slots.release()
                        self._in_flight -= 1
                        self._check_idle()
                        continue
                    tg.start_soon(self._try, client, delivery, slots)
        finally:
            self.close("the server shut down")

    async def drain(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for every pending delivery to settle, then drop the rest (logged)."""
        with anyio.move_on_after(grace_s):
            while self.pending:
                await self._idle.wait()
        self.close(f"still pending {grace_s:g} s into the shutdown")

    def close(self, why: str) -> None:
        """Refuse new deliveries and drop the pending ones, with one log line. Idempotent."""
        self._closed = True
        left = [*self._ready, *self._progress, *(d for _, _, d in self._retries)]
        self._ready.clear()
        self._progress.clear()
        self._retries.clear()
        left = [d for d in left if not d.settled]
        for delivery in left:
            self._drop(delivery, why)
        left += self._cut
        self._cut = []
        terminal = [d for d in left if d.terminal]
        if terminal:
            named = ", ".join(sorted({d.request_id for d in terminal})[:_NAMED_IN_LOG])
            more = f" and {len(terminal) - _NAMED_IN_LOG} more" if len(terminal) > _NAMED_IN_LOG else ""
            logger.warning(
                "dropped %d webhook deliveries (%s): requests %s%s", len(terminal), why, named, more
            )
        self._check_idle()

    # -- inside -------------------------------------------------------------------------

    async def _next_due(self) -> Delivery:
        """The next delivery to try (counted in flight), waiting for one or for a retry's time."""
        while True:
            self._wakeup = anyio.Event()
            now = self._clock()
            if self._retries and self._retries[0][0] <= now:
                delivery = heapq.heappop(self._retries)[2]
            elif self._ready:
                delivery = self._ready.popleft()
            elif self._progress:
                delivery = self._progress.popleft()
            else:
                wait = self._retries[0][0] - now if self._retries else None
                with anyio.move_on_after(wait if wait is not None else float("inf")):
                    await self._wakeup.wait()
                continue
            if delivery.settled:  # a superseded progress delivery
                continue
            self._in_flight += 1
            return delivery

    async def _try(self, client: httpx.AsyncClient, delivery: Delivery, slots: anyio.Semaphore) -> None:
        """One try of ``delivery``; then settle it, or schedule its next try."""
        delivery.attempts += 1
        delivery.status = "sending"
        try:
            error = await self._post(client, delivery)
        except BaseException:
            # Cancelled (the service is closing): it is in no queue now, so
            # settle it here, or its request would be held for good.
            self._drop(delivery, "the server shut down during a try")
            self._cut.append(delivery)
            raise
        finally:
            slots.release()
            self._in_flight -= 1
        if error is None:
            self.delivered += 1
            delivery.last_error = None
            delivery.settle("delivered")
        elif delivery.attempts < delivery.max_attempts and not self._closed:
            delivery.status = "pending"
            delivery.last_error = error
            due = self._clock() + backoff_s(
                delivery.attempts, first_s=self.config.first_retry_s, max_s=self.config.max_retry_s
            )
            heapq.heappush(self._retries, (due, next(self._order), delivery))
            self._wakeup.set()
            logger.info(
                "webhook for request %s (%s) failed try %d of %d: %s; trying again",
                delivery.request_id, delivery.event, delivery.attempts, delivery.max_attempts, error,
            )
        else:
            self.failed += 1
            delivery.settle("failed", error)
            log = logger.warning if delivery.terminal else logger.info
            log(
                "webhook for request %s (%s) to %s failed after %d tries: %s",
                delivery.request_id, delivery.event, _origin(delivery.url), delivery.attempts, error,
            )
        self._check_idle()

    async def _post(self, client: httpx.AsyncClient, delivery: Delivery) -> str | None:
        """POST it once, signed; None on a 2xx, else why not (an HTTP status, a network error)."""
        body = delivery.body.decode()
        now = datetime.now(tz=timezone.utc)
        headers = {
            "content-type": "application/json",
            "webhook-id": delivery.webhook_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signer.sign(delivery.webhook_id, now, body),
        }
        try:
            with anyio.fail_after(self.config.attempt_timeout_s):
                # Streamed and closed unread: only the status matters, and a
                # receiver's body (any size) is never held here.
                sent = client.stream("POST", delivery.url, content=delivery.body, headers=headers)
                async with sent as reply:
                    delivery.response_status = reply.status_code
                    if 200 <= reply.status_code < 300:
                        return None
                    return f"HTTP {reply.status_code}"
        except TimeoutError:
            return f"no answer within {self.config.attempt_timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a client's URL must never take the server down
            # (httpx.InvalidURL and the like are no HTTPError.) Logged with its
            # traceback, in case it is our bug rather than the URL.
            logger.error("webhook for request %s: sending failed", delivery.request_id, exc_info=True)
            return f"{type(exc).__name__}: {exc}"

    def _drop(self, delivery: Delivery, why: str) -> None:
        if not delivery.settled:
            self.dropped += 1
            delivery.settle("dropped", why)

    def _check_idle(self) -> None:
        if not self.pending:
            self._idle.set()


def _origin(url: str) -> str:
    """Where ``url`` goes, without its path (which may hold a receiver's secret) for logs."""
    try:
        parts = httpx.URL(url)
        return f"{parts.scheme}://{parts.netloc.decode()}"
    except Exception:  # noqa: BLE001 - only for a log line
        return "an unparsable URL"
