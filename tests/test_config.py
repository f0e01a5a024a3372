"""om.timeout(): the default, overrides, re-reading, and every malformed form."""

from __future__ import annotations

import logging

import pytest

import omni_stream as om
from omni_stream import config
from omni_stream.config import STEP_TIMEOUT_ENV


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.delenv(STEP_TIMEOUT_ENV, raising=False)


def test_default_is_600_seconds():
    assert om.timeout() == 600.0


@pytest.mark.parametrize("raw, value", [("45", 45.0), ("2.5", 2.5), (" 90 ", 90.0), ("1e3", 1000.0)])
def test_integer_and_float_overrides(monkeypatch, raw, value):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, raw)
    assert om.timeout() == value


def test_value_is_read_on_every_call(monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "10")
    assert om.timeout() == 10.0
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "20")
    assert om.timeout() == 20.0
    monkeypatch.delenv(STEP_TIMEOUT_ENV)
    assert om.timeout() == 600.0


@pytest.mark.parametrize("raw", ["abc", "", "   ", "nan", "inf", "-inf", "0", "-5", "0.0", "30s"])
def test_malformed_values_fall_back_with_one_warning(monkeypatch, caplog, raw):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, raw)
    with caplog.at_level(logging.WARNING, logger="omni_stream"):
        assert om.timeout() == 600.0
        assert om.timeout() == 600.0  # read again: no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert STEP_TIMEOUT_ENV in warnings[0].getMessage()
    assert "600" in warnings[0].getMessage()


def test_env_int_validates(monkeypatch, caplog):
    monkeypatch.setenv("OMNI_STREAM_TEST_INT", "x")
    assert config.env_int("OMNI_STREAM_TEST_INT", 7) == 7
    monkeypatch.setenv("OMNI_STREAM_TEST_INT", "0")
    assert config.env_int("OMNI_STREAM_TEST_INT", 7, minimum=1) == 7
    monkeypatch.setenv("OMNI_STREAM_TEST_INT", "12")
    assert config.env_int("OMNI_STREAM_TEST_INT", 7) == 12
    assert sum("OMNI_STREAM_TEST_INT" in r.getMessage() for r in caplog.records) == 2
