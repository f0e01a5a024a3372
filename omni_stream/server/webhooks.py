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
only ever queues one. Send slots are shared across principals
(core/webhooks.DeliveryQueue: round robin, the last free slot kept for a
principal with none in flight), and a receiver's time per delivery is
capped (``max_delivery_s``, its tries together), so one tenant's receivers
that never answer do not hold up another's. Memory is bounded: terminal
deliveries by admission (core/webhooks.WebhookBook: at most ``max_held``
requests with a webhook, each principal its share), progress deliveries
by a queue of ``max_progress_pending`` that drops the oldest of the
principal with the most waiting when full (a newer progress of the same
request replaces an unsent one anyway); a receiver's answer is never read
past its status. Redirects are not followed (a 3xx is a failed try): the
allow-list names where the server may call, not where a receiver may send
it. The URL sent is the one the allow-list matched, byte for byte: a URL
httpx would send in another form is not sent (the core admits only URLs
in their sent form; this is the check that the two agree).

Retries: a terminal delivery that fails (a network error, a timeout, any
answer but 2xx) is tried again after ``backoff_s`` (1, 2, 4, 8 s by
default), ``max_attempts`` tries in all, while it has some of its
``max_delivery_s`` left; a progress delivery is tried once (the next one,
or the terminal one, says more). At shutdown, what is still pending gets a
short grace (:meth:`WebhookSender.drain`), then is dropped with one log
line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Final

import anyio
import anyio.abc
import httpx
from standardwebhooks import Webhook

from .. import __version__
from ..core.webhooks import Delivery, DeliveryQueue, WebhookConfig

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
        #: Who waits for a send slot, and who goes next (core/webhooks.py).
        self._queue = DeliveryQueue(
            concurrency=config.concurrency, max_progress_pending=config.max_progress_pending
        )
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
        pushed_out = self._queue.put(delivery)
        if pushed_out is not None:
            self._drop(pushed_out, "the progress queue was full (max_progress_pending)")
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wakeup.set()

    @property
    def pending(self) -> int:
        """Deliveries not yet settled: ready, waiting for a retry, or being tried."""
        return self._queue.pending

    # -- the task --------------------------------------------------------------------

    async def run(self) -> None:
        """Send deliveries until cancelled (the service's task group runs it); then drop what is left."""
        config = self.config
        timeout = httpx.Timeout(config.io_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(
            max_connections=config.concurrency, max_keepalive_connections=config.concurrency
        )
        try:
            async with (
                httpx.AsyncClient(
                    timeout=timeout,
                    limits=limits,
                    follow_redirects=False,
                    transport=self._transport,
                    headers={"user-agent": _USER_AGENT},
                    trust_env=False,
                ) as client,
                anyio.create_task_group() as tg,
            ):
                while True:
                    # No await between take() and start_soon: a delivery taken is
                    # always in a try, never lost to a cancellation in between.
                    delivery = self._queue.take(self._clock())
                    if delivery is None:
                        await self._wait(self._queue.wait_s(self._clock()))
                        continue
                    tg.start_soon(self._try, client, delivery)
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
        left = [d for d in self._queue.clear() if not d.settled]
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

    async def _wait(self, seconds: float | None) -> None:
        """Until a delivery is submitted or a try ends (``_wakeup``), or ``seconds`` pass."""
        self._wakeup = anyio.Event()
        with anyio.move_on_after(seconds if seconds is not None else float("inf")):
            await self._wakeup.wait()

    async def _try(self, client: httpx.AsyncClient, delivery: Delivery) -> None:
        """One try of ``delivery``; then settle it, or schedule its next try."""
        config = self.config
        url = _sent_url(delivery.url)
        if delivery.settled or isinstance(url, str):
            # Superseded since it was taken (a progress delivery), or a URL
            # httpx would send in another form: never sent, and no try would do better.
            self._queue.finished(delivery)
            self._wakeup.set()
            if isinstance(url, str) and not delivery.settled:
                self.failed += 1
                delivery.settle("failed", url)
                logger.warning(
                    "webhook for request %s (%s) to %s not sent: httpx would send its URL in another "
                    "form than the one the allow-list matched",
                    delivery.request_id,
                    delivery.event,
                    _origin(delivery.url),
                )
            self._check_idle()
            return
        delivery.attempts += 1
        delivery.status = "sending"
        started = self._clock()
        try:
            error = await self._post(client, delivery, url, config.try_timeout_s(delivery))
        except BaseException:
            # Cancelled (the service is closing): it is in no queue now, so
            # settle it here, or its request would be held for good.
            self._drop(delivery, "the server shut down during a try")
            self._cut.append(delivery)
            raise
        finally:
            delivery.spent_s += max(0.0, self._clock() - started)
            self._queue.finished(delivery)
            self._wakeup.set()  # a slot is free
        due = None if error is None or self._closed else config.retry_due(delivery, self._clock())
        if error is None:
            self.delivered += 1
            delivery.last_error = None
            delivery.settle("delivered")
        elif due is not None:
            delivery.status = "pending"
            delivery.last_error = error
            self._queue.retry_at(delivery, due)
            logger.info(
                "webhook for request %s (%s) failed try %d of %d: %s; trying again",
                delivery.request_id,
                delivery.event,
                delivery.attempts,
                delivery.max_attempts,
                error,
            )
        else:
            self.failed += 1
            delivery.settle("failed", config.given_up(delivery, error))
            log = logger.warning if delivery.terminal else logger.info
            log(
                "webhook for request %s (%s) to %s failed after %d tries: %s",
                delivery.request_id,
                delivery.event,
                _origin(delivery.url),
                delivery.attempts,
                delivery.last_error,
            )
        self._check_idle()

    async def _post(
        self, client: httpx.AsyncClient, delivery: Delivery, url: httpx.URL, timeout_s: float
    ) -> str | None:
        """POST it to ``url`` once, signed, within ``timeout_s``; None on a 2xx, else why not
        (an HTTP status, a network error)."""
        body = delivery.body.decode()
        now = datetime.now(tz=timezone.utc)
        headers = {
            "content-type": "application/json",
            "webhook-id": delivery.webhook_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signer.sign(delivery.webhook_id, now, body),
        }
        try:
            with anyio.fail_after(timeout_s):
                # Streamed and closed unread: only the status matters, and a
                # receiver's body (any size) is never held here.
                sent = client.stream("POST", url, content=delivery.body, headers=headers)
                async with sent as reply:
                    delivery.response_status = reply.status_code
                    if 200 <= reply.status_code < 300:
                        return None
                    return f"HTTP {reply.status_code}"
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
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


def _sent_url(text: str) -> httpx.URL | str:
    """``text`` as httpx sends it, or why it is not sent: httpx normalises a URL (dot
    segments, case, default ports) after the allow-list matched it, and another string is
    another place (issue #39, attack 8). The core admits only URLs already in the form
    they are sent in (core/webhooks.sent_form); this checks that httpx agrees."""
    try:
        url = httpx.URL(text)
    except Exception as exc:  # noqa: BLE001 - httpx.InvalidURL and the like are no HTTPError
        return f"not sent: httpx refuses the URL ({type(exc).__name__}: {exc})"
    if str(url) != text:
        return f"not sent: httpx would send it as {str(url)[:80]!r}, not the URL the allow-list matched"
    return url


def _origin(url: str) -> str:
    """Where ``url`` goes, without its path (which may hold a receiver's secret) for logs."""
    try:
        parts = httpx.URL(url)
        return f"{parts.scheme}://{parts.netloc.decode()}"
    except Exception:  # noqa: BLE001 - only for a log line
        return "an unparsable URL"
