"""Webhooks, the decisions (pure): which URLs may be called, what is sent when, what is kept.

A request may carry ``"webhook": {"url", "events"}`` (docs/webhooks.md).
This module decides everything about it that needs no socket:

- :class:`WebhookConfig` (:func:`resolve_webhooks`): the server's secret, in
  the Standard Webhooks ``whsec_`` base64 form, and its allow-list of URL
  patterns; no allow-list, no webhooks: a client must not be able to make
  the server call into its own network (SSRF), so the default refuses all.
- :meth:`WebhookConfig.check`: admission of one request's webhook
  (MessageError ``bad_params``, field ``webhook``, carrying the request id).
  A URL is matched in the one form it is sent in (:func:`sent_form`,
  ``core/webhook_urls.py``): one
  that is not already in that form is refused, so the string matched is
  the string sent (issue #39, attack 8: ``/hooks/tenant-a/../tenant-b``
  matched ``/hooks/tenant-a/*`` and httpx then sent ``/hooks/tenant-b``).
- :class:`WebhookState`: a request's webhook as its record holds it; it
  turns the request's progress and its end into :class:`Delivery` objects
  (the JSON payload, its ``webhook-id``), at most one ``progress`` per
  ``progress_every_s``, and keeps the view ``GET /v1/generations/{id}``
  shows (the latest progress delivery and the terminal one: two at most).
- :class:`WebhookBook` (``core/webhook_deliveries.py``): how many requests with a webhook the server holds
  (running, or their terminal delivery not yet settled), so that terminal
  deliveries, which are never dropped, are bounded by admission instead;
  each principal holds at most its share, so that one tenant's receivers
  that never answer cannot fill it for the others.
- :class:`DeliveryQueue` (``core/webhook_deliveries.py``): which delivery takes the next send slot: round
  robin across principals, the last free slot kept for a principal with
  none in flight; and :meth:`WebhookConfig.try_timeout_s` /
  :meth:`WebhookConfig.retry_due`: a delivery's tries together take at most
  ``max_delivery_s`` of a receiver's time.
- :func:`backoff_s`: the wait before each retry.

The sending (httpx, signing with ``standardwebhooks``, retries on a clock)
is ``omni_stream/server/webhooks.py``'s.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

from ..config import (
    WEBHOOK_ALLOW_ENV,
    WEBHOOK_SECRET_ENV,
    env_float,
    env_int,
    webhook_allow as env_webhook_allow,
    webhook_secret as env_webhook_secret,
)
from ..errors import MessageError, ParamsError, ServerBusyError
from ..protocol.client_messages import DEFAULT_WEBHOOK_EVENTS
from .records import error_view
from .webhook_deliveries import LIMITS_ENV, Delivery, DeliveryQueue, WebhookBook
from .webhook_urls import (
    check_pattern as _check_pattern,
    clip as _clip,
    matches as _matches,
    sent_form,
    url_problem,
)

if TYPE_CHECKING:
    from .records import RequestRecord, Terminal

__all__ = [
    "EVENT_OF_OUTCOME",
    "LIMITS_ENV",
    "Delivery",
    "DeliveryQueue",
    "WebhookBook",
    "WebhookConfig",
    "check_webhook",
    "WebhookState",
    "backoff_s",
    "new_secret",
    "resolve_webhooks",
    "sent_form",
    "url_problem",
]

#: A request's terminal message type -> the webhook event it is.
EVENT_OF_OUTCOME: Final[Mapping[str, str]] = {
    "done": "completed",
    "error": "failed",
    "cancelled": "cancelled",
}
#: The event -> the ``status`` docs/http.md gives the request then.
_STATUS_OF_EVENT: Final[Mapping[str, str]] = {
    "completed": "done",
    "failed": "failed",
    "cancelled": "cancelled",
    "progress": "running",
}
#: Secret sizes the Standard Webhooks spec asks for (decoded bytes).
_SECRET_BYTES: Final = (24, 64)
#: The generated secret's size.
_NEW_SECRET_BYTES: Final = 32

_WHERE_ALLOW = f"webhook_allow (--webhook-allow, {WEBHOOK_ALLOW_ENV})"


def new_secret() -> str:
    """A fresh random secret in the spec's ``whsec_`` base64 form."""
    import secrets

    return "whsec_" + base64.b64encode(secrets.token_bytes(_NEW_SECRET_BYTES)).decode("ascii")


def backoff_s(attempt: int, *, first_s: float, max_s: float) -> float:
    """Seconds to wait after failed try ``attempt`` (from 1): ``first_s``, doubled each time, <= ``max_s``."""
    return float(min(max_s, first_s * (2 ** max(0, attempt - 1))))


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookConfig:
    """The server's webhook settings (see the module docstring); :func:`resolve_webhooks` builds one.

    The bounds are documented in docs/webhooks.md, "Limits"; tests shorten
    the waits with :func:`dataclasses.replace`.
    """

    #: The signing secret, ``whsec_`` + base64 of 24 to 64 bytes.
    secret: str
    #: URL patterns a webhook may match: a literal URL, or a prefix ending in ``*``.
    allow: tuple[str, ...]
    #: The secret was made up at start (none was configured): the server logs it once.
    generated_secret: bool = False
    #: Tries of a terminal delivery (the first included); a progress delivery gets one.
    max_attempts: int = 5
    #: The wait after the first failed try, doubled after each (backoff_s), at most max_retry_s.
    first_retry_s: float = 1.0
    max_retry_s: float = 30.0
    #: At most one progress delivery per request this often.
    progress_every_s: float = 5.0
    #: Requests with a webhook held at once (running, or their terminal delivery unsettled);
    #: past it, or past its principal's share of it (WebhookBook), a generate with a webhook
    #: gets ``busy``.
    max_held: int = 1024
    #: Progress deliveries waiting to be sent; past it the oldest of the principal with the
    #: most waiting is dropped.
    max_progress_pending: int = 256
    #: Deliveries in flight at once, shared across principals (DeliveryQueue).
    concurrency: int = 8
    #: Seconds to connect, per read or write, and for a whole try.
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 10.0
    attempt_timeout_s: float = 30.0
    #: Seconds of a receiver's time one delivery may take, its tries together: a receiver
    #: that never answers holds a send slot this long per delivery, not attempts x tries.
    max_delivery_s: float = 60.0

    def check(self, webhook: Mapping[str, Any], *, request_id: str) -> None:
        """Admit ``webhook`` (a ``generate``'s, its shape already parsed) or raise MessageError.

        ``bad_params`` (field ``webhook``) for a URL that is not http(s), has
        credentials, spaces or control characters, no host, is not in the
        form it is sent in (:func:`sent_form`), or matches none of the
        patterns (which are not echoed: they may name private hosts).
        """
        url = str(webhook.get("url", ""))
        # url_problem refuses a URL not in the form it is sent in: the string
        # matched here is the one the sender sends (sent_form).
        problem = url_problem(url)
        if problem is None and not any(_matches(pattern, url) for pattern in self.allow):
            problem = "is not one this server may call (it matches none of its webhook_allow patterns)"
        if problem is not None:
            raise MessageError(
                "bad_params", f"webhook URL {_clip(url)!r} {problem}", field="webhook", request_id=request_id
            )

    def try_timeout_s(self, delivery: Delivery) -> float:
        """The bound on ``delivery``'s next try: ``attempt_timeout_s``, or what is left of
        its ``max_delivery_s``."""
        return max(0.0, min(self.attempt_timeout_s, self.max_delivery_s - delivery.spent_s))

    def retry_due(self, delivery: Delivery, now: float) -> float | None:
        """When ``delivery``, whose try just failed, is tried again; None: give it up (its
        tries are spent, or the receiver has had its ``max_delivery_s``: what is left of it is
        under a tenth of a try's bound, too short for a receiver that already needed longer)."""
        if delivery.attempts >= delivery.max_attempts:
            return None
        if self.try_timeout_s(delivery) < self.attempt_timeout_s / 10:
            return None
        return now + backoff_s(delivery.attempts, first_s=self.first_retry_s, max_s=self.max_retry_s)

    def given_up(self, delivery: Delivery, error: str) -> str:
        """``last_error`` for a delivery given up after ``error``: it says when the cap was why."""
        if delivery.attempts < delivery.max_attempts:
            cap = f"{self.max_delivery_s:g} s"
            return f"{error} (the receiver had the {cap} a delivery may take: max_delivery_s)"
        return error


def _check_secret(secret: str, where: str) -> str:
    """``secret`` if it is ``whsec_`` + base64 of 24 to 64 bytes; raises ParamsError (never echoing it)."""
    text = secret.strip()
    low, high = _SECRET_BYTES
    why: str | None = None
    if not text.startswith("whsec_"):
        why = "it must start with 'whsec_'"
    else:
        try:
            raw = base64.b64decode(text.removeprefix("whsec_"), validate=True)
        except (binascii.Error, ValueError):
            why = "what follows 'whsec_' is not base64"
        else:
            if not low <= len(raw) <= high:
                why = f"it holds {len(raw)} bytes; the Standard Webhooks spec asks for {low} to {high}"
    if why is not None:
        raise ParamsError(
            f"{where} is not a webhook secret: {why} (make one with "
            "python3 -c 'import omni_stream.core.webhooks as w; print(w.new_secret())')",
            field="webhook_secret",
        )
    return text


def resolve_webhooks(
    secret: str | None = None, allow: str | Sequence[str] | None = None
) -> WebhookConfig | None:
    """The server's webhook settings: ``allow`` (patterns), else ``OMNI_STREAM_WEBHOOK_ALLOW``
    (commas or spaces); ``secret``, else ``OMNI_STREAM_WEBHOOK_SECRET``, else a new one; the
    limits of :data:`LIMITS_ENV` from their variables, else the defaults.

    None when no pattern is given: the server sends no webhooks and refuses
    every request that asks for one. Raises ParamsError naming the option
    (or the variable) for a malformed pattern or secret.
    """
    if allow is None or (not isinstance(allow, str) and len(allow) == 0):
        raw = env_webhook_allow() or ""
        entries = raw.replace(",", " ").split()
        where = WEBHOOK_ALLOW_ENV
    elif isinstance(allow, str):
        entries, where = [allow], "webhook_allow"
    else:
        entries, where = list(allow), "webhook_allow"
    patterns = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise ParamsError(
                f"{where}: patterns must be non-empty strings, got {entry!r}", field="webhook_allow"
            )
        patterns.append(_check_pattern(entry, where))
    if secret is not None and not isinstance(secret, str):
        raise ParamsError(
            f"webhook_secret must be a string, got {type(secret).__name__}", field="webhook_secret"
        )
    given, where_secret = (secret, "webhook_secret") if secret else (env_webhook_secret(), WEBHOOK_SECRET_ENV)
    checked = _check_secret(given, where_secret) if given else None
    if not patterns:
        return None
    limits = _limits_from_env()
    if checked is None:
        return WebhookConfig(secret=new_secret(), allow=tuple(patterns), generated_secret=True, **limits)
    return WebhookConfig(secret=checked, allow=tuple(patterns), **limits)


def _limits_from_env() -> dict[str, Any]:
    """WebhookConfig's limits from LIMITS_ENV's variables, the default where one is unset (or
    malformed: it warns once, naming the variable)."""
    defaults = WebhookConfig(secret="", allow=())
    out: dict[str, Any] = {}
    for name, (env, kind) in LIMITS_ENV.items():
        default = getattr(defaults, name)
        out[name] = env_int(env, default, minimum=1) if kind is int else env_float(env, default)
    return out


class WebhookState:
    """A request's webhook, as its record holds it (see the module docstring).

    ``emit`` hands a new delivery to the sender (synchronous, never waits);
    ``book`` counts the request, under ``principal`` (its Principal.key),
    until its terminal delivery settles.
    ``clock`` paces progress deliveries; ``wall`` stamps payloads.
    """

    def __init__(
        self,
        request_id: str,
        webhook: Mapping[str, Any],
        *,
        config: WebhookConfig,
        emit: Callable[[Delivery], None],
        book: WebhookBook,
        principal: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.request_id = request_id
        #: Whose request it is (Principal.key): the book's share and the send slots are per principal.
        self.principal = principal
        self.url = str(webhook["url"])
        self.events: tuple[str, ...] = tuple(webhook.get("events") or DEFAULT_WEBHOOK_EVENTS)
        self._config = config
        self._emit = emit
        self._book = book
        self._clock = clock
        self._wall = wall
        self._last_progress: float | None = None
        self._held = False
        self._ended = False
        #: The latest progress delivery (a newer one replaces it here), then the terminal one.
        self._progress: Delivery | None = None
        self._terminal: Delivery | None = None

    def hold(self) -> None:
        """The request was registered: count it in the book until its terminal delivery settles."""
        if not self._held:
            self._held = True
            self._book.hold(self.principal)

    def _release(self, _: Delivery | None = None) -> None:
        if self._held:
            self._held = False
            self._book.release(self.principal)

    def progressed(self, step: int, total: int, eta_s: float | None) -> None:
        """The request made step ``step``: a ``progress`` delivery if asked for and due."""
        if self._ended or "progress" not in self.events or step >= total:
            return  # (the last step's news is the terminal delivery)
        now = self._clock()
        if self._last_progress is not None and now - self._last_progress < self._config.progress_every_s:
            return
        self._last_progress = now
        data = {"id": self.request_id, "status": "running", "step": step, "total": total, "eta_s": eta_s}
        delivery = self._delivery("progress", data, max_attempts=1)
        if self._progress is not None and self._progress.status == "pending":
            # Superseded: the sender skips it if it has not gone yet (latest wins).
            self._progress.settle("dropped", "superseded by a newer progress delivery")
        self._progress = delivery
        self._emit(delivery)

    def ended(self, record: RequestRecord, message: Terminal) -> None:
        """The request ended with its terminal ``message``: its terminal delivery, if asked for."""
        if self._ended:
            return
        self._ended = True
        if self._progress is not None and self._progress.status == "pending":
            self._progress.settle("dropped", "the request ended first")
        event = EVENT_OF_OUTCOME.get(message.kind, "failed")
        if event not in self.events:
            self._release()
            return
        error = error_view(message)
        base = f"/v1/generations/{self.request_id}"
        data = {
            "id": self.request_id,
            "status": _STATUS_OF_EVENT[event],
            "step": record.latest_step,
            "total": record.total,
            "seed": record.seed,
            "model": record.model,
            "images": record.result_count,
            "urls": {"self": base, "output": base + "/output"},
            "error": error,
        }
        delivery = self._delivery(event, data, max_attempts=self._config.max_attempts)
        delivery.on_settled = self._release
        self._terminal = delivery
        self._emit(delivery)

    def _delivery(self, event: str, data: dict[str, Any], *, max_attempts: int) -> Delivery:
        stamp = datetime.fromtimestamp(self._wall(), tz=timezone.utc).isoformat().replace("+00:00", "Z")
        payload = {"type": f"generation.{event}", "timestamp": stamp, "data": data}
        body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        return Delivery(
            request_id=self.request_id,
            event=event,
            url=self.url,
            body=body,
            webhook_id=f"msg_{uuid.uuid4().hex}",
            max_attempts=max_attempts,
            principal=self.principal,
        )

    def view(self) -> dict[str, Any]:
        """``GET /v1/generations/{id}``'s ``webhook``: the URL, the events, the deliveries so far."""
        deliveries = [d.view() for d in (self._progress, self._terminal) if d is not None]
        return {"url": self.url, "events": list(self.events), "deliveries": deliveries}


def check_webhook(
    config: WebhookConfig | None,
    book: WebhookBook,
    webhook: Mapping[str, Any],
    *,
    request_id: str,
    principal: str,
) -> None:
    """Refuse a request's ``webhook`` unless this server may call it and has room for one more.

    ``bad_params`` (field ``webhook``) on a server that sends none (``config`` None) or for a URL
    outside its allow-list, ``busy`` when ``max_held`` requests with a webhook are held, or
    ``principal``'s share of them (their terminal deliveries are never dropped).
    """
    if config is None:
        raise MessageError(
            "bad_params",
            "this server sends no webhooks: it allows no webhook URL "
            "(webhook_allow, --webhook-allow, OMNI_STREAM_WEBHOOK_ALLOW)",
            field="webhook",
            request_id=request_id,
        )
    config.check(webhook, request_id=request_id)
    why = book.refusal(principal)
    if why is not None:
        raise ServerBusyError(
            f"{why}; try again shortly", retry_after_s=config.max_retry_s, request_id=request_id
        )
