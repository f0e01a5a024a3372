"""The server's memory bound counts a request's step cache (issue #35): TaylorSeer's series is
the largest state a request holds, and a request whose cache would not fit is refused saying so,
where the same request without it runs."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("diffusers")

import httpx  # noqa: E402

from omni_stream.core.estimate import estimate_memory  # noqa: E402

from ..models.test_step_cache import FLUX, flux_model  # noqa: E402
from .conftest import running  # noqa: E402

pytestmark = [
    pytest.mark.one_loop,  # the core's bookkeeping, the same under every loop
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


@pytest.mark.asyncio
async def test_a_request_whose_cache_would_not_fit_is_refused_and_the_same_without_it_runs() -> None:
    model = flux_model()
    taylor = dict(FLUX, cache={"method": "taylorseer", "order": 3})
    plain, cached = (estimate_memory(model, model.validate(p)).alone for p in (FLUX, taylor))
    assert cached > plain  # the series is counted
    limit = plain + cached  # each request may hold half the bound: the cached one does not fit
    async with running(model, max_memory_bytes=limit) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
            refused = await http.post("/v1/generations?wait=true", json={"params": taylor})
            ran = await http.post("/v1/generations?wait=true", json={"params": FLUX})
    assert refused.status_code == 422, refused.text
    body: dict[str, Any] = refused.json()
    assert body["error"] == "limit_exceeded" and "max_memory_bytes" in body["message"]
    assert "the model's state for it" in body["message"]  # what made it large is said
    assert ran.status_code == 200
