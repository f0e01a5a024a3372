"""Exact repeats served from the results already made, not computed again (issue #35).

A request identical to one that finished (the same served model, every
checked param, the seed it ran with included, and the same output format
and quality) gets that request's results: it is admitted and watched as
any request, then, without a step on the device, it says ``progress``
(the last step, ``cached``), its results and ``done`` with ``repeat``.

What counts as identical is the model's to say (``repeatable(params)``):
a model declares which of its requests give the same result every time.
The native diffusers loops say so unless the request's sampler draws noise
outside its generator (``dpmpp_sde``: samplers.UNCAPTURED_NOISE) or its
``cache`` param says ``results: false``; a model without the method is
never answered from here. A request that asked for a random seed ran with
the one drawn for it, so only a request naming that seed repeats it. The
LoRAs and their scales are params, and so are the sampler and every knob.

A principal repeats only its own requests: an answer that came at once
would tell one tenant that another had asked for that very picture. Its
*scope* (:func:`repeat_scope`) is its token's tenant; without a token, the
browser session it came with (server/sessions.py), which outlives a
websocket connection and is narrower than an address; else its connection
or address.

The results are kept here, by a key over all of that, least recently used
out first, within ``repeat_cache_bytes`` (a server limit; 0 keeps none),
in memory. Pure bookkeeping:
the rules ask :meth:`RepeatBook.find` at admission and call
:meth:`RepeatBook.keep` when a request ends done; after a restart with
``--state-dir`` the requests brought back done are kept again
(:func:`restored_key`), so a repeat survives the restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from .. import protocol
from ..checkpoint import plain_params
from ..errors import CheckpointError

__all__ = ["Kept", "RepeatBook", "repeat_key", "repeat_scope", "restored_key"]


def repeat_scope(principal: str, session: str | None) -> str:
    """Whose repeats a request of ``principal`` (its key) in browser ``session`` shares: the
    token's tenant, else the session (a digest: the state dir writes scopes down, and a session
    is a credential), else the principal."""
    if principal.startswith("token:") or session is None:
        return principal
    return "session:" + hashlib.sha256(session.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, slots=True)
class Kept:
    """A finished request's results: its step count and each result's header and bytes."""

    total: int
    results: tuple[tuple[protocol.PreviewHeader, bytes], ...]
    nbytes: int

    def previews(self, request_id: str) -> list[protocol.Preview]:
        """The results as ``request_id``'s."""
        return [
            protocol.Preview.build(dataclasses.replace(header, id=request_id), image)
            for header, image in self.results
        ]


def repeat_key(
    scope: str, model_name: str, model: Any, checked: Mapping[str, Any], output: Any
) -> str | None:
    """The key of a request in repeat ``scope`` (:func:`repeat_scope`) of ``checked`` params to
    ``model`` (served as ``model_name``) with ``output`` settings; None when its model does not
    say it repeats (see the module docstring)."""
    repeatable = getattr(model, "repeatable", None)
    if not callable(repeatable) or not repeatable(checked):
        return None
    # The model served under that name stands for its weights (its LoRAs are params); after a
    # restart, the one served then (restored_key).
    identity = type(model).__qualname__
    try:
        # (Less the engine's "output", which the server sets from the output settings below.)
        params = {k: v for k, v in plain_params(checked).items() if k != "output"}
    except CheckpointError:
        # A value JSON cannot hold (a decoded input image): no key that would ever match again
        # (a repr would name the object's address) is better than one kept for nothing.
        return None
    text = json.dumps(
        {
            "principal": scope,
            "model": model_name,
            "weights": identity,
            "params": params,
            "output": output,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def restored_key(
    scope: str,
    models: Mapping[str, Any],
    generate: Mapping[str, Any],
    accepted: Mapping[str, Any],
) -> str | None:
    """The key of a request the state directory brought back done (server/state_restore.py), in
    the repeat ``scope`` it had (:func:`repeat_scope`), from what it stored: its ``generate``
    message's params, checked again by the model now served under its name, with the seed it
    ran with (``accepted``'s); None where that model
    is gone, refuses them now or does not say it repeats. The model now served stands for the
    one that made the results, as it does for a request resumed from its checkpoint."""
    if not models:
        return None
    name = accepted.get("model") or next(iter(models))
    model = models.get(name)
    params = generate.get("params")
    if model is None or not isinstance(params, Mapping):
        return None
    params = dict(params)
    if isinstance(accepted.get("seed"), int):
        params["seed"] = accepted["seed"]
    try:
        checked = model.validate(params)
    except Exception:  # noqa: BLE001 - refused now: it is simply not a repeat any more
        return None
    return repeat_key(scope, name, model, checked, accepted.get("output"))


class RepeatBook:
    """Finished results by :func:`repeat_key`, bounded by ``max_bytes`` (0: none kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        #: Requests answered from here, and requests that looked and found nothing.
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._kept)

    def find(self, key: str | None) -> Kept | None:
        """The results kept under ``key`` (now the most recently used), or None."""
        if key is None or not self.max_bytes:
            return None
        kept = self._kept.get(key)
        if kept is None:
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return kept

    def keep(self, key: str, total: int, results: Sequence[protocol.Preview]) -> None:
        """Keep a done request's ``results`` under ``key``; the least recently used go to make
        room, and a set larger than the whole bound is not kept."""
        if not self.max_bytes or not results:
            return
        kept = Kept(
            total, tuple((r.header, bytes(r.image)) for r in results), sum(len(r.image) for r in results)
        )
        if kept.nbytes > self.max_bytes:
            return
        old = self._kept.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._kept[key] = kept
        self.nbytes += kept.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self.nbytes -= dropped.nbytes
