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


# -- torch threads --------------------------------------------------------------


@pytest.fixture
def cores(monkeypatch):
    """Pretend the machine has ``n`` usable cores: ``cores(n)``."""
    monkeypatch.delenv(config.TORCH_THREADS_ENV, raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(config, "usable_cores", lambda: n)

    return set_cores


@pytest.mark.parametrize(
    "n, members, threads",
    [
        (1, 1, 1),
        (2, 1, 1),  # this machine: one core left to the loop and the previews, as before
        (2, 2, 1),
        (3, 1, 1),
        (4, 1, 2),
        (8, 1, 6),
        (16, 1, 14),
        (16, 2, 7),  # a group of two cpu members splits what is left
        (16, 3, 4),
        (16, 20, 1),  # never below one
        (64, 4, 15),
    ],
)
def test_the_default_follows_the_cores_and_the_members(cores, n, members, threads):
    cores(n)
    assert config.torch_threads(members) == threads
    assert config.default_torch_threads(members, cores=n) == threads


def test_the_variable_overrides_the_default_for_each_member(cores, monkeypatch):
    cores(16)
    monkeypatch.setenv(config.TORCH_THREADS_ENV, "3")
    assert config.torch_threads() == 3
    assert config.torch_threads(members=4) == 3  # per producer, as given: not split


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5", ""])
def test_a_malformed_variable_warns_once_and_the_default_applies(cores, monkeypatch, caplog, raw):
    cores(8)
    monkeypatch.setenv(config.TORCH_THREADS_ENV, raw)
    with caplog.at_level(logging.WARNING, logger="omni_stream"):
        assert config.torch_threads() == 6
        assert config.torch_threads() == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and config.TORCH_THREADS_ENV in warnings[0] and "6" in warnings[0]


@pytest.mark.parametrize("members", [0, -1, True, 1.0])
def test_members_must_be_a_positive_int(members):
    with pytest.raises(ValueError, match="members"):
        config.torch_threads(members)


def test_usable_cores_is_the_affinity_capped_by_the_cgroup_quota(monkeypatch):
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity here")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: None)
    assert config.usable_cores() == 12
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: 4.5)  # docker --cpus 4.5
    assert config.usable_cores() == 4
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: 0.2)
    assert config.usable_cores() == 1


def test_the_cgroup_quota_is_read_from_v2_then_v1(monkeypatch, tmp_path):
    files: dict[str, str] = {}
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path in files:
            target = tmp_path / "f"
            target.write_text(files[path])
            return real_open(target, *args, **kwargs)
        if str(path).startswith("/sys/fs/cgroup"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert config._cgroup_cpu_quota() is None
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    assert config._cgroup_cpu_quota() is None
    files["/sys/fs/cgroup/cpu.max"] = "250000 100000\n"
    assert config._cgroup_cpu_quota() == 2.5
    del files["/sys/fs/cgroup/cpu.max"]
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "-1\n"
    files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "100000\n"
    assert config._cgroup_cpu_quota() is None
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "300000\n"
    assert config._cgroup_cpu_quota() == 3.0


def test_an_engine_takes_the_default_when_it_is_built(cores, monkeypatch):
    cores(16)
    engine = om.Engine(om.models.Synthetic(), device="cpu")
    assert engine._producer._torch_threads == 14
    monkeypatch.setenv(config.TORCH_THREADS_ENV, "2")
    assert om.Engine(om.models.Synthetic(), device="cpu")._producer._torch_threads == 2
    assert om.Engine(om.models.Synthetic(), device="cpu", torch_threads=5)._producer._torch_threads == 5


# -- the token, and the event loop ------------------------------------------------


def test_the_token_is_read_from_one_variable_everywhere(monkeypatch):
    from omni_stream import cli
    from omni_stream.core import limits

    assert cli.TOKEN_ENV is config.TOKEN_ENV and limits.TOKEN_ENV is config.TOKEN_ENV
    monkeypatch.setenv(config.TOKEN_ENV, " s3cret ")
    assert config.token() == limits.resolve_token(None) == "s3cret"
    monkeypatch.setenv(config.TOKEN_ENV, " ")
    assert config.token() is None


def test_run_picks_uvloop_where_it_is_installed():
    import asyncio

    async def loop_module(x: int) -> tuple[str, int]:
        return type(asyncio.get_running_loop()).__module__, x

    module, x = config.run(loop_module, 7)
    assert x == 7
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        assert module.startswith("asyncio")
    else:
        assert module.startswith("uvloop")


def test_every_server_limit_variable_is_documented() -> None:
    from pathlib import Path

    from omni_stream.core.limits import _ENV

    text = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    missing = [env for env, _ in _ENV.values() if f"`{env}`" not in text]
    assert missing == [], f"docs/configuration.md lacks {missing}"


def test_the_step_timeout_parses_the_value_it_read_and_follows_a_replaced_environ(monkeypatch) -> None:
    import os
    from unittest import mock

    from omni_stream import config

    monkeypatch.setenv("OMNI_STREAM_STEP_TIMEOUT", "7")

    def racing_read(*_: object, **__: object) -> float:
        # Another thread sets the variable between two reads: a second read here would be
        # cached under the first value's key, and kept while that value stands.
        os.environ["OMNI_STREAM_STEP_TIMEOUT"] = "6"
        return 6.0

    monkeypatch.setattr(config, "env_float", racing_read)
    assert config.timeout() == 7.0  # what it read, not a second read
    monkeypatch.undo()
    monkeypatch.setenv("OMNI_STREAM_STEP_TIMEOUT", "6")
    assert config.timeout() == 6.0
    with mock.patch("os.environ", {"OMNI_STREAM_STEP_TIMEOUT": "5"}):
        assert config.timeout() == 5.0  # a test's replaced os.environ is read, not the store
