"""options.py: stream()'s keywords, written once, read by inspect as if spelled out."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import omni_stream as om
from omni_stream.engine import options
from omni_stream.engine.options import (
    STREAM_DEFAULTS,
    CheckpointOptions,
    ModelOptions,
    RemoteOptions,
    RequestOptions,
    RoutedOptions,
    keywords_of,
    pick,
    stream_keywords,
)
from omni_stream.engine.router import ModelRouter
from omni_stream.integrations.ray_serve.remote import RemoteEngine

REQUEST = ["request_id", "policy", "timeout", "preview_every", "priority"]
CHECKPOINTS = ["resume", "checkpoint_every", "on_checkpoint"]


def _keywords(method: object) -> list[tuple[str, object]]:
    """The keyword-only parameters of ``method``'s signature, with their defaults."""
    return [
        (p.name, p.default)
        for p in inspect.signature(method).parameters.values()  # type: ignore[arg-type]
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def test_every_keyword_has_one_default() -> None:
    typed_dicts = [td for td in vars(options).values() if hasattr(td, "__optional_keys__")]
    assert {name for td in typed_dicts for name in keywords_of(td)} == set(STREAM_DEFAULTS)


@pytest.mark.parametrize(
    "method, names",
    [
        # (group and rank since issue #38: a server's client orders its own requests.)
        (om.Engine.stream, REQUEST + CHECKPOINTS + ["group", "rank"]),
        (om.Engine.generate, REQUEST),
        (om.EngineGroup.stream, REQUEST),
        (om.EngineGroup.generate, REQUEST),
        (ModelRouter.stream, [*REQUEST, "model", *CHECKPOINTS, "group", "rank"]),
        (ModelRouter.generate, [*REQUEST, "model"]),
        # The order a RemoteEngine's stream always had.
        (RemoteEngine.stream, [*REQUEST, "render", "model", *CHECKPOINTS]),
        (RemoteEngine.generate, [*REQUEST, "model"]),
    ],
    ids=lambda v: getattr(v, "__qualname__", ""),
)
def test_each_facade_shows_the_signature_it_always_had(method, names) -> None:
    params = list(inspect.signature(method).parameters.values())
    assert [(p.name, p.default) for p in params[:2]] == [("self", inspect.Parameter.empty), ("params", None)]
    policy = "latest" if method.__name__ == "generate" else "all"
    assert _keywords(method) == [(n, policy if n == "policy" else STREAM_DEFAULTS[n]) for n in names]


def test_a_keyword_a_facade_does_not_take_is_a_type_error() -> None:
    group = om.EngineGroup(lambda: om.models.Synthetic(), devices="cpu")
    unexpected = r"EngineGroup.stream\(\) got an unexpected keyword argument 'resume'"
    with pytest.raises(TypeError, match=unexpected):
        group.stream({}, resume=None)
    with pytest.raises(TypeError, match="positional"):
        group.stream({}, "an id")  # type: ignore[misc]


class _Echo:
    @stream_keywords(ModelOptions)
    def stream(self, params: object = None, **options: object) -> dict[str, object]:
        return {"params": params, **options}

    @stream_keywords(RequestOptions, policy="latest")
    async def generate(self, params: object = None, **options: object) -> dict[str, object]:
        return {"params": params, **options}


async def _generate() -> dict[str, object]:
    return await _Echo().generate(priority=2)


def test_the_body_gets_every_keyword_with_its_default() -> None:
    assert _Echo().stream({"a": 1}, model="m") == {
        "params": {"a": 1}, "request_id": None, "policy": "all", "timeout": None, "preview_every": None,
        "priority": 0, "model": "m",
    }
    assert inspect.iscoroutinefunction(_Echo.generate)
    assert asyncio.run(_generate())["policy"] == "latest"


def test_pick_passes_on_only_the_keywords_named() -> None:
    given = {"request_id": "a", "policy": "all", "model": None, "resume": None}
    assert pick(given, RequestOptions) == {"request_id": "a", "policy": "all"}
    assert keywords_of(CheckpointOptions) == (*REQUEST, *CHECKPOINTS, "group", "rank")
    assert keywords_of(RoutedOptions) == (*REQUEST, "model", *CHECKPOINTS, "group", "rank")
    assert keywords_of(RemoteOptions) == (*REQUEST, "render", "model", *CHECKPOINTS)
