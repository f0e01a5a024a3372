"""Server limits from keywords and the environment; request limit checks."""

from __future__ import annotations

import logging

import pytest

from omni_stream.errors import ParamsError
from omni_stream.models import Synthetic
from omni_stream.protocol import MessageError
from omni_stream.core.limits import (
    ServerLimits,
    check_request_limits,
    resolve_origins,
    resolve_token,
)


def test_defaults_allow_big_requests() -> None:
    limits = ServerLimits.from_env({})
    assert limits.max_steps >= 10_000 and limits.max_image_size >= 2048
    assert limits.max_message_bytes == 1 << 20


def test_keywords_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_MAX_STEPS", "77")
    monkeypatch.setenv("OMNI_STREAM_SEND_TIMEOUT", "2.5")
    limits = ServerLimits.from_env({"max_steps": 5})
    assert limits.max_steps == 5 and limits.send_timeout_s == 2.5
    assert ServerLimits.from_env({}).max_steps == 77


def test_bad_environment_warns_and_uses_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMNI_STREAM_MAX_PENDING", "lots")
    with caplog.at_level(logging.WARNING, logger="omni_stream.config"):
        assert ServerLimits.from_env({}).max_pending == ServerLimits().max_pending
    assert "OMNI_STREAM_MAX_PENDING" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"max_connections": True}, "max_connections"),
        ({"retention_s": -1}, "retention_s"),
        ({"send_timeout_s": float("inf")}, "send_timeout_s"),
        ({"max_stepz": 3}, "max_stepz"),
    ],
)
def test_bad_keywords_name_the_keyword(kwargs: dict, field: str) -> None:
    with pytest.raises(ParamsError) as info:
        ServerLimits.from_env(kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_token_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_STREAM_TOKEN", raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv("OMNI_STREAM_TOKEN", "from-env")
    assert resolve_token(None) == "from-env"
    assert resolve_token("kw") == "kw"
    with pytest.raises(ParamsError):
        resolve_token("  ")


def test_origin_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_ALLOW_ORIGINS", "https://A.example/, http://b.example:8080")
    assert resolve_origins(()) == ("https://a.example", "http://b.example:8080")
    assert resolve_origins(["*"]) == ("*",)
    assert resolve_origins("http://c.example") == ("http://c.example",)
    with pytest.raises(ParamsError):
        resolve_origins(["c.example"])


def test_request_limits_name_param_and_variable() -> None:
    model = Synthetic()
    limits = ServerLimits(max_steps=100, max_image_size=64)
    ok = model.validate({"steps": 100, "shape": [64, 64, 64]})
    assert check_request_limits(model, ok, limits) == 100
    with pytest.raises(MessageError) as info:
        check_request_limits(model, model.validate({"steps": 101}), limits)
    assert info.value.code == "limit_exceeded" and info.value.field == "steps"
    assert "OMNI_STREAM_MAX_STEPS" in info.value.message
    with pytest.raises(MessageError) as info:
        check_request_limits(model, model.validate({"shape": [3, 65, 8]}), limits)
    assert info.value.field == "shape"
    assert "OMNI_STREAM_MAX_IMAGE_SIZE" in info.value.message


def test_byte_bounds_from_keywords_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = ServerLimits()
    assert defaults.max_pending_bytes == 64 << 20 and defaults.max_memory_bytes == 1 << 30
    # Above what admission lets run (max_active + max_queued): every HTTP generation
    # is detached, and a full server must answer busy before too_many_requests.
    assert defaults.max_retained >= defaults.max_queued + 64
    monkeypatch.setenv("OMNI_STREAM_MAX_PENDING_BYTES", "12345")
    monkeypatch.setenv("OMNI_STREAM_MAX_MEMORY_BYTES", "67890")
    limits = ServerLimits.from_env({})
    assert limits.max_pending_bytes == 12345 and limits.max_memory_bytes == 67890
    assert ServerLimits.from_env({"max_memory_bytes": 5}).max_memory_bytes == 5
    assert ServerLimits.env_name("max_pending_bytes") == "OMNI_STREAM_MAX_PENDING_BYTES"
    assert ServerLimits.env_name("max_memory_bytes") == "OMNI_STREAM_MAX_MEMORY_BYTES"


@pytest.mark.parametrize("name", ["max_pending_bytes", "max_memory_bytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "64MB"])
def test_bad_byte_bounds_name_the_keyword(name: str, value: object) -> None:
    with pytest.raises(ParamsError) as info:
        ServerLimits.from_env({name: value})
    assert info.value.field == name


@pytest.mark.asyncio
async def test_a_connection_over_max_messages_per_s_is_read_later_and_every_message_answered() -> None:
    import json

    from websockets.asyncio.client import connect

    from ..server.conftest import running

    async with running(max_messages_per_s=20.0) as server, connect(server.url) as ws:
        n = 60  # 20 in the first burst, the other 40 paced
        for i in range(n):
            await ws.send(json.dumps({"type": "cancel", "id": f"nope-{i}"}))
        replies = [json.loads(await ws.recv()) for _ in range(n)]
        paced = server.metrics.reads_paced._value.get()
    assert [(r["type"], r["code"], r["id"]) for r in replies] == [
        ("error", "not_found", f"nope-{i}") for i in range(n)
    ]
    assert paced >= n - 20 - 2  # the bucket refills a little while the burst is read


def test_max_messages_per_s_must_be_positive() -> None:
    with pytest.raises(ParamsError) as info:
        ServerLimits.from_env({"max_messages_per_s": 0})
    assert info.value.field == "max_messages_per_s"


def test_a_message_costs_one_more_for_every_64_kib() -> None:
    from omni_stream.core.rates import COST_BYTES, message_cost

    assert message_cost(2) == 1.0
    assert message_cost(COST_BYTES - 1) == 1.0
    assert message_cost(COST_BYTES) == 2.0
    assert message_cost(1 << 20) == 17.0  # a 1 MiB image: 17 of a connection's 100 a second
