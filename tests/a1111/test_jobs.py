"""The A1111 calls running per principal, and /progress (a1111/jobs.py)."""

from __future__ import annotations

import pytest

from omni_stream.a1111.jobs import Job, JobBook, idle_progress, progress_payload


def test_the_latest_call_of_each_principal_is_the_one_progress_and_interrupt_see() -> None:
    book = JobBook()
    first, second, other = Job("txt2img", 1), Job("img2img", 2), Job("txt2img", 1)
    book.add("token:a", first)
    book.add("token:a", second)
    book.add("token:b", other)
    assert book.latest("token:a") is second and book.latest("token:b") is other
    book.remove("token:a", second)
    book.remove("token:a", second)  # twice: nothing
    assert book.latest("token:a") is first and book.latest("token:c") is None
    assert list(book) == [first, other]
    assert len(first.timestamp) == 14 and first.timestamp.isdigit()


def test_progress_is_the_share_of_the_whole_call_and_its_eta_counts_the_iterations_left() -> None:
    # The second of two requests, a quarter done, 3 s in: each request took 2.4 s so far.
    payload = progress_payload(kind="txt2img", count=2, number=1, step=5, steps=20, elapsed_s=3.0, eta_s=1.5,
                               timestamp="20260101000000", image="AAAA")
    assert payload["progress"] == pytest.approx(0.625)
    assert payload["eta_relative"] == pytest.approx(1.5)  # the last request: its own estimate
    assert payload["state"]["job_no"] == 1 and payload["state"]["job_count"] == 2
    assert (payload["state"]["sampling_step"], payload["state"]["sampling_steps"]) == (5, 20)
    first = progress_payload(kind="txt2img", count=2, number=0, step=10, steps=20, elapsed_s=2.0, eta_s=2.0,
                             timestamp="t", image=None)
    assert first["eta_relative"] == pytest.approx(2.0 + 4.0)  # + one more request at 4 s each
    unknown = progress_payload(kind="txt2img", count=1, number=0, step=5, steps=10, elapsed_s=2.0, eta_s=None,
                               timestamp="t", image=None)
    assert unknown["eta_relative"] == pytest.approx(2.0)  # A1111's own: elapsed / progress - elapsed
    idle = idle_progress()
    assert (idle["progress"], idle["state"]["job_count"], idle["current_image"]) == (0.0, 0, None)


def test_progress_counts_each_image_of_a_batch_as_a_request() -> None:
    # Image 1 of 2 of the second of 2 iterations, half done, 7 s in: 3.5 requests took 7 s.
    payload = progress_payload(kind="txt2img", count=2, number=1, step=5, steps=10, elapsed_s=7.0, eta_s=1.0,
                               timestamp="t", image=None, batch_size=2, index=1)
    assert payload["progress"] == pytest.approx(3.5 / 4)
    assert payload["eta_relative"] == pytest.approx(1.0)  # the last request: its own estimate
    assert (payload["state"]["job_no"], payload["state"]["job_count"]) == (1, 2)  # iterations, as A1111's
    first = progress_payload(kind="txt2img", count=2, number=0, step=5, steps=10, elapsed_s=1.0, eta_s=1.0,
                             timestamp="t", image=None, batch_size=2, index=0)
    assert first["progress"] == pytest.approx(0.125)
    assert first["eta_relative"] == pytest.approx(1.0 + 3 * 2.0)  # three more requests at 2 s each
