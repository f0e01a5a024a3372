"""protocol/client.py: what an ``error`` means to a caller, and the names a client reads."""

from __future__ import annotations

import pytest

import omni_stream as om
from omni_stream.errors import (
    BusyError,
    ParamsRejectedError,
    RequestFailedError,
    RequestRejectedError,
)
from omni_stream.protocol import client as wire
from omni_stream.protocol.frames import PreviewFrame
from omni_stream.protocol.server_messages import Done, ErrorMessage


@pytest.mark.parametrize(
    ("code", "accepted", "kind"),
    [
        ("bad_params", False, ParamsRejectedError),
        ("invalid_field", False, ParamsRejectedError),
        ("limit_exceeded", False, ParamsRejectedError),
        ("duplicate_id", False, RequestRejectedError),
        ("busy", False, BusyError),
        ("step_failed", True, RequestFailedError),
        ("bad_params", True, RequestFailedError),  # after accepted, any error ends the request
        ("brand_new_code", False, RequestRejectedError),
    ],
)
def test_server_error_maps_a_code_to_the_callers_exception(code: str, accepted: bool, kind: type) -> None:
    err = wire.server_error(code, "m", field="f", request_id="r", accepted=accepted, retry_after_s=3.0)
    assert type(err) is kind and err.request_id == "r" and err.code == code
    if kind is ParamsRejectedError:
        assert isinstance(err, om.ParamsError) and err.field == "f"
    if kind is BusyError:
        assert err.retry_after_s == 3.0  # type: ignore[attr-defined]


def test_the_names_the_client_reads_are_the_shared_classes() -> None:
    assert (wire.Done, wire.ErrorMessage, wire.PreviewFrame) == (Done, ErrorMessage, PreviewFrame)
