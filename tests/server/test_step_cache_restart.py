"""A restart mid-run with a step cache (issue #35): each method's state is in the request's
checkpoint on disk, and the resumed run ends with the uninterrupted run's result."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("diffusers")

from websockets.asyncio.client import connect  # noqa: E402

from ..models.test_step_cache import FLUX, flux_model  # noqa: E402
from .conftest import running, send, until_end, wait_for  # noqa: E402
from .test_state_dir import _result  # noqa: E402

pytestmark = [
    pytest.mark.one_loop,  # the state dir's bookkeeping, the same under every loop
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

CACHES = {
    "fb": {"method": "fbcache", "threshold": 0.5},
    "tea": {"method": "teacache", "rel_l1": 0.6},
    "taylor": {"method": "taylorseer", "interval": 2, "warmup": 2},
}
STEPS = 16


def _params(rid: str) -> dict[str, Any]:
    return dict(FLUX, steps=STEPS, seed=len(rid), cache=CACHES[rid])


def _alone(step_s: float = 0.0) -> Any:
    """The tiny Flux model, one request a step (a result the same whatever ran beside it);
    ``step_s``: each transformer call that much slower, so a run is still going when we stop it."""
    model = flux_model(max_batch_size=1)
    if step_s:
        model._denoiser.register_forward_pre_hook(lambda m, a: time.sleep(step_s))
    return model


@pytest.mark.asyncio
@pytest.mark.parametrize("rid", list(CACHES))
async def test_a_restart_mid_run_resumes_the_cache_to_the_same_result(rid: str, tmp_path: Any) -> None:
    async with running(_alone()) as server, connect(server.url, max_size=None) as ws:
        await send(ws, type="generate", id=rid, params=_params(rid))
        expected = await _result(await until_end(ws, rid))
    options = {"state_dir": str(tmp_path), "checkpoint_every": 3}
    async with running(_alone(0.04), shutdown_timeout_s=0.01, **options) as server, connect(server.url) as ws:
        await send(ws, type="generate", id=rid, params=_params(rid), detach=True)
        keeper = server.service.state
        await wait_for(lambda: keeper.checkpoint_steps.get(rid, 0) >= 3, what="a checkpoint")
    async with running(_alone(), **options) as server, connect(server.url, max_size=None) as ws:
        await send(ws, type="attach", id=rid)
        msgs = await until_end(ws, rid)
    restarted = [m for m in msgs if m["type"] == "restarted"]
    assert msgs[-1]["type"] == "done", msgs[-3:]
    # Resumed from its checkpoint (its cache state with it), not run again from step 0.
    assert restarted and restarted[0]["reason"] == "checkpoint" and restarted[0]["from_step"] >= 3
    assert await _result(msgs) == expected
