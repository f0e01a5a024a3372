"""A Shell for the core's tests (core/effects.py): it records what the core asks for."""

from __future__ import annotations

from typing import Any


class RecordingShell:
    """The core's effects, written down: consumers started (request ids), webhook deliveries
    sent, and how often it heard of a timer or of idleness."""

    def __init__(self, *, webhooks: bool = True) -> None:
        self.started: list[str] = []
        self.sent: list[Any] = []
        self.timers = 0
        self.requests_idled = 0
        self.clients_idled = 0
        self._webhooks = webhooks

    def start_consumer(self, admitted: Any, stream: Any) -> None:
        self.started.append(admitted.record.id)

    def send_webhook(self, delivery: Any) -> None:
        assert self._webhooks, "the core sent a webhook on a server without them"
        self.sent.append(delivery)

    def timers_changed(self) -> None:
        self.timers += 1

    def requests_idle(self) -> None:
        self.requests_idled += 1

    def clients_idle(self) -> None:
        self.clients_idled += 1
