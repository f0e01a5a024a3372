"""The protocol's shared codes and bounds (docs/protocol.md), for the server and the client alike.

``error`` codes (which reject one message, which end a request), the
reasons of ``cancelled``, ``generate``'s priority range, the websocket
close codes, and how much of a client's input an error may echo back.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CANCEL_REASONS",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TRY_AGAIN_LATER",
    "MAX_ECHO",
    "MAX_ERROR_MESSAGE",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "PAUSE_REASONS",
    "REJECTION_CODES",
    "REQUEST_ENDING_CODES",
    "RESTART_REASONS",
    "RESUME_REASONS",
]

#: ``error`` codes that reject one client message; nothing was started or changed.
REJECTION_CODES: Final = frozenset(
    {
        "bad_json",
        "bad_message",
        "invalid_field",
        "unknown_type",
        "bad_params",
        "limit_exceeded",
        "duplicate_id",
        "too_many_requests",
        "not_found",
        "already_attached",
        "shutting_down",
        "engine_unavailable",
        "busy",
    }
)
#: ``error`` codes that end an accepted request (terminal, sent to every watcher).
REQUEST_ENDING_CODES: Final = frozenset(
    {"step_failed", "step_timeout", "engine_error", "preview_failed", "internal"}
)
#: ``expired``: its ``deadline_s`` came before it started (it never ran); ``deadline``: it came
#: while it ran.
CANCEL_REASONS: Final = frozenset({"client", "disconnect", "shutdown", "engine", "expired", "deadline"})
#: Why a request the server brought back after a restart starts where it does
#: (``restarted``): from its last ``checkpoint``; from step 0 because none was
#: written yet (``no_checkpoint``), the one written could not be used (torn,
#: tampered, of an older format, refused by the model: ``checkpoint_unusable``),
#: or its model cannot snapshot a request, or its engine resume one (``cannot_resume``).
#: And ``replica_lost``: not the server, the Ray replica running the request died,
#: and another goes on from the last checkpoint the server received (or step 0).
RESTART_REASONS: Final = frozenset(
    {"checkpoint", "no_checkpoint", "checkpoint_unusable", "cannot_resume", "replica_lost"}
)
#: ``paused``'s ``reason``: a client's ``pause``, or the gate's preemption (core/preemption.py).
PAUSE_REASONS: Final = frozenset({"client", "preempted"})
#: ``resumed``'s ``reason``: a client's ``resume``; the request's pauses reached
#: ``max_pause_s`` (core/limits.py); or a preempted request let in again.
RESUME_REASONS: Final = frozenset({"client", "max_pause", "preempted"})
#: ``generate``'s ``priority`` range (the engine scheduler's, restated: the
#: protocol must not import the engine).
MIN_PRIORITY: Final = -10
MAX_PRIORITY: Final = 10

CLOSE_GOING_AWAY: Final = 1001
#: Sent by the client when the server breaks the protocol.
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_MESSAGE_TOO_BIG: Final = 1009
CLOSE_INTERNAL_ERROR: Final = 1011
CLOSE_TRY_AGAIN_LATER: Final = 1013

#: Most characters of client input an error echoes (in ``field`` and in the
#: message): a reply must not grow with what the client sent.
MAX_ECHO: Final = 64
#: Most characters of an error's ``message``: a backstop for messages built
#: outside the protocol (model params, admission) that echo client input.
MAX_ERROR_MESSAGE: Final = 512
