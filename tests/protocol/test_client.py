"""protocol/client.py: what an ``error`` means to a caller, and the client's older names."""

from __future__ import annotations

import json

import pytest

import omni_stream as om
from omni_stream.errors import (
    BusyError,
    ParamsRejectedError,
    RequestFailedError,
    RequestRejectedError,
)
from omni_stream.protocol import client as wire
from omni_stream.protocol.client_messages import Attach, Cancel, Generate
from omni_stream.protocol.server_messages import Done


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


def test_the_older_builders_send_what_the_classes_serialize() -> None:
    assert wire.generate_message("r", {"steps": 2}, {"every": 1}, detach=True, priority=3) == (
        Generate.build("r", {"steps": 2}, {"every": 1}, detach=True, priority=3).serialize()
    )
    assert wire.attach_message("r") == Attach.build("r").serialize()
    assert wire.cancel_message("r") == Cancel.build("r").serialize()
    with pytest.raises(om.ParamsError):
        wire.cancel_message("..")


def test_parse_message_reads_into_the_shared_classes() -> None:
    text = json.dumps({"type": "done", "id": "r", "total": 3, "elapsed_s": 1.5})
    assert wire.parse_message(text) == Done("r", 3, 1.5)
    assert wire.Done is Done
