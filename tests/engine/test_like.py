"""EngineLike and FrameStreamLike: Engine and EngineGroup satisfy them, at run time and to mypy."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import omni_stream as om
from omni_stream.engine import EngineLike, FrameStreamLike, GroupStream
from omni_stream.engine.like import OPTIONAL_STREAM_KEYWORDS, looks_like_engine, server_stream_keywords

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"shape": [4, 8, 8], "work": 0, "steps": 2}


def _members(protocol: type) -> dict[str, object]:
    return {
        name: value
        for name, value in vars(protocol).items()
        if (callable(value) or isinstance(value, property))
        and (not name.startswith("_") or name in ("__aenter__", "__aexit__", "__aiter__", "__anext__"))
    }


def _shape(fn: object) -> list[tuple[str, object, object]]:
    """A signature without annotations: what must match for a call to work the same."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(
    "protocol, implementation",
    [
        (EngineLike, om.Engine),
        (EngineLike, om.EngineGroup),
        (FrameStreamLike, om.FrameStream),
        (FrameStreamLike, GroupStream),
    ],
    ids=["Engine", "EngineGroup", "FrameStream", "GroupStream"],
)
def test_every_member_has_the_protocols_signature(protocol, implementation):
    members = _members(protocol)
    if protocol is EngineLike:  # the collection found what the server calls
        assert {"stream", "generate", "cancel", "health", "check_health", "statistics", "model"} <= set(members)
    for name, spec in members.items():
        if isinstance(spec, property):
            if name == "model" and implementation is om.Engine:
                continue  # a plain attribute, set in __init__: checked on an instance below
            assert isinstance(getattr(implementation, name), property), name
            continue
        impl = getattr(implementation, name)
        # The protocol's parameters, in order; an implementation may take more,
        # as optional keywords only (Engine.stream's resume and checkpoints).
        shape, wanted = _shape(impl), _shape(spec)
        assert shape[: len(wanted)] == wanted, name
        assert all(kind is inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
                   for _, kind, default in shape[len(wanted):]), name
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(spec), name


@pytest.mark.asyncio
async def test_instances_pass_isinstance():
    engine = om.Engine(om.models.Synthetic(), device="cpu")
    group = om.EngineGroup(om.models.Synthetic, devices="cpu,sim")
    assert isinstance(engine, EngineLike) and isinstance(group, EngineLike)
    assert not isinstance(om.models.Synthetic(), EngineLike)
    async with engine, group:
        for e in (engine, group):
            async with e.stream(SMALL) as frames:
                assert isinstance(frames, FrameStreamLike)
                assert [f.step async for f in frames] == [1, 2]


PROBE = textwrap.dedent(
    """
    from omni_stream import Engine, EngineGroup, EngineLike, FrameStream, FrameStreamLike
    from omni_stream.engine import GroupStream

    def engine_is_like(e: Engine) -> EngineLike:
        return e

    def group_is_like(g: EngineGroup) -> EngineLike:
        return g

    def streams_are_like(a: FrameStream, b: GroupStream) -> tuple[FrameStreamLike, FrameStreamLike]:
        return a, b

    async def used_as_documented(e: EngineLike) -> int:
        async with e:
            async with e.stream({"steps": 2}, request_id="a", policy="latest", timeout=1.0) as s:
                n = s.total
                async for frame in s:
                    n += frame.step
            final = await e.generate(None, priority=1)
        return n + final.step + e.max_batch_size + len(e.model.name) + e.statistics().active

    def a_model_is_not(m: "object") -> EngineLike:
        return m  # E: the one error expected
    """
)


def test_mypy_agrees(tmp_path):
    pytest.importorskip("mypy")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    # A cache shared across runs: the first check reads torch's stubs (~40 s), later ones ~2 s.
    cache = os.path.join(tempfile.gettempdir(), "omni_stream-mypy-cache")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--cache-dir", cache, str(probe)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    expected = next(i for i, line in enumerate(PROBE.splitlines(), 1) if "# E:" in line)
    assert len(errors) == 1 and f"probe.py:{expected}:" in errors[0], out.stdout


# -- what a server needs of an engine (server_stream_keywords, looks_like_engine) ----------------


class _Minimal:
    """docs/configuration.md's stream, and the rest of SERVER_NEEDS."""

    model = om.models.Synthetic()
    max_batch_size = 1

    def stream(self, params=None, request_id=None, policy="all", timeout=None): ...

    def cancel(self, request_id): ...

    def health(self): ...


class _TakesAnything(_Minimal):
    def stream(self, params=None, **options): ...


class _Proxy:
    """Forwards everything it does not define, as a wrapper of one's own may."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_the_keywords_a_server_may_pass_are_read_from_stream():
    engine = om.Engine(om.models.Synthetic(), device="cpu")
    takes = {"policy", "preview_every", "priority", "resume", "checkpoint_every", "on_checkpoint", "group", "rank"}
    assert server_stream_keywords(engine) == takes
    assert server_stream_keywords(_Minimal()) == {"policy"}
    assert server_stream_keywords(_TakesAnything()) == set(OPTIONAL_STREAM_KEYWORDS)
    assert server_stream_keywords(_Proxy(engine)) == takes


def test_what_a_server_cannot_run_is_named():
    class NoCancel(_Minimal):
        cancel = None

    class PositionalOnly(_Minimal):
        def stream(self, params, /): ...

    class NotAnEngine:
        pass

    for engine, named in [
        (NoCancel(), "lacks cancel"),
        (NotAnEngine(), "lacks model, max_batch_size, stream, cancel, health"),
        (PositionalOnly(), "cannot be called as stream(params, request_id=...)"),
    ]:
        with pytest.raises(TypeError, match=re.escape(named)):
            server_stream_keywords(engine)


def test_an_engine_is_told_from_a_model_or_factory_without_touching_it():
    class Unconnected(_Minimal):
        @property
        def model(self):
            raise AssertionError("a property was read")

    assert looks_like_engine(om.Engine(om.models.Synthetic(), device="cpu"))
    assert looks_like_engine(Unconnected()) and looks_like_engine(_Proxy(_Minimal()))
    assert not looks_like_engine(om.models.Synthetic())
    assert not looks_like_engine(om.models.Synthetic)  # a factory (a class)
    assert not looks_like_engine(lambda: om.models.Synthetic())
    assert server_stream_keywords(Unconnected()) == {"policy"}


def test_an_engine_says_it_resumes_from_bytes_only_with_true() -> None:
    from omni_stream.engine.like import resumes_from_bytes
    from omni_stream.integrations.ray_serve.remote import RemoteEngine

    class Says:
        resume_as_bytes = True

    class Truthy:
        resume_as_bytes = "yes"  # not the True it must be

    assert resumes_from_bytes(Says()) and resumes_from_bytes(RemoteEngine)
    assert not resumes_from_bytes(Truthy()) and not resumes_from_bytes(object())
    assert not resumes_from_bytes(om.Engine)
