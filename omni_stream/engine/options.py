"""The keywords of ``stream()`` and ``generate()``, written once.

Every engine facade (Engine, EngineGroup, ModelRouter, RemoteEngine) and
the EngineLike protocol take ``stream(params, *, request_id=None,
policy="all", ...)``; they differ only in which groups of keywords they
take beyond the first::

    RequestOptions     request_id policy timeout preview_every priority    every facade, every generate()
    ModelOptions       + model              a request names its model     ModelRouter, RemoteEngine
    RenderOptions      + render             rendered where it is made     RemoteEngine (RendersFrames)
    CheckpointOptions  + resume checkpoint_every on_checkpoint            Engine
    RoutedOptions      + model resume checkpoint_every on_checkpoint      ModelRouter
    RemoteOptions      + render model resume checkpoint_every on_checkpoint   RemoteEngine

and Engine and ModelRouter also take ``group`` and ``rank`` (Ordering: the
order of one client's requests among themselves, scheduler.py).

A facade declares ``stream(self, params=None, **options: Unpack[X])``
(``Unpack``: typing's from Python 3.11, typing_extensions' before), so a
type checker reads the keywords (and refuses the others) from the
TypedDict, under ``@stream_keywords(X)``, which gives the method what a
plain ``def`` with the keywords spelled out would have at run time: the
explicit signature ``inspect`` and ``help()`` show (a server reads it to
learn which keywords to pass: like.server_stream_keywords), and a
TypeError for a keyword it does not take. It also fills in the defaults
(:data:`STREAM_DEFAULTS`), so the body reads ``options["policy"]``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, cast

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # a generic TypedDict (Checkpointing) needs 3.11's, or typing_extensions' (torch requires it)
    from typing_extensions import TypedDict

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint  # noqa: F401 - named in the TypedDicts' annotations
    from ..preview.remote import RenderRequest  # noqa: F401 - likewise

__all__ = [
    "STREAM_DEFAULTS",
    "CheckpointOptions",
    "Checkpointing",
    "Ordering",
    "ModelOptions",
    "RemoteOptions",
    "RenderOptions",
    "RequestOptions",
    "RoutedOptions",
    "keywords_of",
    "pick",
    "stream_keywords",
]

#: What a checkpoint reaches ``on_checkpoint`` as: a Checkpoint from an
#: Engine, its bytes kept at a RemoteEngine's front door (KeptCheckpoint).
CheckpointT = TypeVar("CheckpointT")
_Method = TypeVar("_Method", bound=Callable[..., Any])
_Keywords = TypeVar("_Keywords", bound=Mapping[str, object])


class RequestOptions(TypedDict, total=False):
    """What every ``stream()`` and ``generate()`` takes; engine/intake.py checks each."""

    request_id: str | None
    policy: str
    timeout: float | None
    preview_every: int | None
    priority: int


class ModelOptions(RequestOptions, total=False):
    """A facade of several models: ``model`` names the one to run (None: the default)."""

    model: str | None


class RenderOptions(RequestOptions, total=False):
    """A facade that renders frames where they are made (like.RendersFrames)."""

    render: RenderRequest | None


class Checkpointing(TypedDict, Generic[CheckpointT], total=False):
    """Resume a request from a checkpoint, or checkpoint it every N steps (Engine.stream says how)."""

    resume: Checkpoint | None
    checkpoint_every: int | None
    on_checkpoint: Callable[[str, CheckpointT], None] | None


class Ordering(TypedDict, total=False):
    """The order of one client's requests among themselves (engine/scheduler.py): the requests of
    one ``group`` (a server passes the principal) take the places the policy gives the group,
    highest ``rank`` (a server passes the request's own priority) first. None: no group."""

    group: Hashable | None
    rank: int


class CheckpointOptions(
    RequestOptions, Checkpointing[CheckpointT], Ordering, Generic[CheckpointT], total=False
):
    """An Engine's ``stream()``."""


class RoutedOptions(ModelOptions, Checkpointing[CheckpointT], Ordering, Generic[CheckpointT], total=False):
    """A ModelRouter's ``stream()``."""


class RemoteOptions(
    RenderOptions, ModelOptions, Checkpointing[CheckpointT], Generic[CheckpointT], total=False
):
    """A RemoteEngine's ``stream()`` (a replica's engine orders its requests by priority alone)."""


#: Every keyword's default; ``generate()`` reads ``policy="latest"`` instead.
STREAM_DEFAULTS: Final[Mapping[str, object]] = {
    "request_id": None,
    "policy": "all",
    "timeout": None,
    "preview_every": None,
    "priority": 0,
    "model": None,
    "render": None,
    "resume": None,
    "checkpoint_every": None,
    "on_checkpoint": None,
    "group": None,
    "rank": 0,
}


def stream_keywords(
    keywords: type[Mapping[str, object]], *, policy: str = "all"
) -> Callable[[_Method], _Method]:
    """Give ``def m(self, params=None, **options)`` the keyword-only ``keywords`` (a TypedDict above).

    The method gets the signature it would have with them spelled out (their
    defaults from STREAM_DEFAULTS, ``policy``'s from this call); a call with
    another keyword raises TypeError as Python's would; the body gets every
    keyword, the defaults filled in. A coroutine function stays one.
    """
    names = keywords_of(keywords)
    defaults = {name: policy if name == "policy" else STREAM_DEFAULTS[name] for name in names}

    def decorate(method: _Method) -> _Method:
        signature = inspect.signature(method)
        signature = signature.replace(
            parameters=[
                *list(signature.parameters.values())[:2],  # self, params
                *(
                    inspect.Parameter(
                        name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=defaults[name],
                        annotation=_annotation(keywords, name),
                    )
                    for name in names
                ),
            ]
        )

        def filled(given: dict[str, Any]) -> dict[str, Any]:
            for name in given:
                if name not in defaults:
                    raise TypeError(f"{method.__qualname__}() got an unexpected keyword argument {name!r}")
            return defaults | given

        async def call_async(self: object, params: object = None, **given: Any) -> Any:
            return await method(self, params, **filled(given))

        def call(self: object, params: object = None, **given: Any) -> Any:
            return method(self, params, **filled(given))

        wrapper: Any = functools.update_wrapper(
            call_async if inspect.iscoroutinefunction(method) else call, method
        )
        # inspect reads this before it follows __wrapped__ to the **options it hides.
        wrapper.__signature__ = signature
        return cast(_Method, wrapper)

    return decorate


def keywords_of(keywords: type[Mapping[str, object]]) -> tuple[str, ...]:
    """The keywords ``keywords`` (a TypedDict above) names, in order."""
    return tuple(keywords.__annotations__)


def pick(options: Mapping[str, object], keywords: type[_Keywords]) -> _Keywords:
    """Those of ``options`` that ``keywords`` (a TypedDict above) names: what to pass on to a call
    that takes only them (``check_request`` takes RequestOptions, ``Engine.submit`` Checkpointing)."""
    return cast(_Keywords, {name: options[name] for name in keywords_of(keywords) if name in options})


def _annotation(keywords: type[Mapping[str, object]], name: str) -> object:
    # Under ``from __future__ import annotations`` a TypedDict keeps each as a ForwardRef: its text.
    annotation = keywords.__annotations__[name]
    return getattr(annotation, "__forward_arg__", annotation)
