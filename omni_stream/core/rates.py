"""Messages a second per principal: one token bucket each (pure; the clock is passed in).

A principal may send ``rate`` messages a second on average, in bursts of
as many; a message costs 1 plus 1 for every :data:`COST_BYTES` it carries
(parsing is what a message costs the event loop, and it grows with the
bytes). Past that, its next message waits (``take`` says how long): a
websocket door reads it later, an HTTP door answers it later. Nothing is
refused for rate alone: every message still gets its reply, so one client
sending as fast as it is answered cannot take the event loop from the
others, yet a burst of honest work is never lost.

Buckets are per principal, not per connection: a client that opens more
connections (or, over HTTP, makes each call a connection of its own)
shares one bucket across all of them.
"""

from __future__ import annotations

from typing import Final

__all__ = ["COST_BYTES", "RateBook", "TokenBucket", "message_cost"]

#: A message counts as one more for every this many bytes.
COST_BYTES: Final = 64 << 10


def message_cost(nbytes: int) -> float:
    """What a message of ``nbytes`` counts against the rate: 1, plus 1 per ``COST_BYTES``."""
    return 1.0 + nbytes // COST_BYTES


class TokenBucket:
    """``rate`` tokens a second, at most ``rate`` held (a second's worth to start with)."""

    __slots__ = ("rate", "_tokens", "_at")

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._at = now

    def take(self, cost: float, now: float) -> float:
        """Spend ``cost`` tokens; the seconds to wait before acting (0 when within the rate)."""
        self._refill(now)
        self._tokens -= cost
        return 0.0 if self._tokens >= 0.0 else -self._tokens / self.rate

    def full(self, now: float) -> bool:
        """Whether it holds its whole burst (nothing to remember about its owner)."""
        self._refill(now)
        return self._tokens >= self.rate

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
            self._at = now


class RateBook:
    """One :class:`TokenBucket` per principal key, forgotten once full and unused."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, key: str, cost: float, now: float) -> float:
        """Spend ``cost`` of ``key``'s bucket; the seconds to wait (see :meth:`TokenBucket.take`)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, now)
        return bucket.take(cost, now)

    def forget(self, key: str, now: float) -> None:
        """Drop ``key``'s bucket if it is full again (its owner left; nothing to remember)."""
        bucket = self._buckets.get(key)
        if bucket is not None and bucket.full(now):
            del self._buckets[key]

    def sweep(self, now: float) -> None:
        """Drop every full bucket (bounds the book by the principals still over their rate)."""
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)
