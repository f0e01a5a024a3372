"""A1111's basic auth read as the bearer token (a1111/auth.py), and its error shape (a1111/errors.py)."""

from __future__ import annotations

import base64

from omni_stream.a1111.auth import bearer_of_basic
from omni_stream.a1111.errors import error_body, status_of


def basic(credentials: str) -> str:
    return "Basic " + base64.b64encode(credentials.encode()).decode()


def test_the_password_of_basic_auth_is_the_token() -> None:
    assert bearer_of_basic(basic("alice:s3cret:with:colons")) == "Bearer s3cret:with:colons"
    assert bearer_of_basic(basic("alice:")) is None and bearer_of_basic(basic("alice")) is None
    assert bearer_of_basic("Bearer s3cret") is None and bearer_of_basic("Basic !!!") is None


def test_a_refusal_is_a1111s_httpexception_shape_and_a_failure_its_runtimeerror() -> None:
    assert error_body(422, "bad_params", "steps: must be at least 1", field="steps") == {
        "error": "HTTPException", "detail": "steps: must be at least 1", "body": "",
        "errors": "422: steps: must be at least 1", "code": "bad_params", "field": "steps",
    }
    assert error_body(500, "step_failed", "boom")["error"] == "RuntimeError"
    assert [status_of(c) for c in ("bad_params", "not_found", "busy", "forbidden_host", "nope")] == [
        422, 404, 429, 421, 500]
