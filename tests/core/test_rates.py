"""Messages a second per principal (core/rates.py): the clock is passed in, nothing sleeps."""

from __future__ import annotations

from omni_stream.core.rates import COST_BYTES, RateBook, TokenBucket, message_cost


def test_a_burst_of_the_rate_passes_then_each_message_waits_its_share() -> None:
    bucket = TokenBucket(10.0, now=0.0)
    assert [bucket.take(1, now=0.0) for _ in range(10)] == [0.0] * 10
    assert bucket.take(1, now=0.0) == 0.1  # one message over: a tenth of a second
    assert bucket.take(1, now=0.0) == 0.2
    assert bucket.take(1, now=1.0) == 0.0  # refilled (at most one second's worth)


def test_a_large_message_costs_more() -> None:
    assert message_cost(10) == 1.0 and message_cost(COST_BYTES) == 2.0
    bucket = TokenBucket(4.0, now=0.0)
    assert bucket.take(message_cost(3 * COST_BYTES), now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == 0.25


def test_a_principal_shares_one_bucket_across_its_clients_and_is_forgotten_when_full() -> None:
    book = RateBook(2.0)
    assert book.take("p", 1, 0.0) == 0.0 and book.take("p", 1, 0.0) == 0.0
    assert book.take("p", 1, 0.0) > 0.0  # a second connection of p would wait just the same
    assert book.take("q", 1, 0.0) == 0.0  # others are not affected
    book.forget("p", 0.1)
    assert len(book) == 2  # not full yet: remembered (leaving must not reset a rate)
    book.sweep(5.0)
    assert len(book) == 0
