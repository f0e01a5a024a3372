"""Several models over Ray Serve (issue #20): each request runs on the model it names, on a
replica that holds that model (Serve's model multiplexing), and a server in front serves both.

One module-scoped cluster (``ray.init(num_cpus=2)``, Serve without its HTTP
proxy) runs one application, ``models``: two replicas serving ``small``
(Synthetic) and ``wide`` (frames twice as wide), each replica holding at
most one of them on its device (``max_models_per_replica=1``).
"""

from __future__ import annotations

import signal
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from .cluster import start_local_ray  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream import cli  # noqa: E402
from omni_stream.integrations import ray_serve  # noqa: E402
from omni_stream.integrations.ray_serve import ModelCard, RemoteEngine, build_app, deploy  # noqa: E402
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.server import Server  # noqa: E402

from ..server.test_models import Wide  # noqa: E402

from ..server.conftest import check_stream, send, until_end  # noqa: E402

pytestmark = pytest.mark.ray

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])

APP = "models"
P: dict[str, Any] = {"steps": 3, "shape": [3, 8, 8], "work": 0, "seed": 5}


@pytest.fixture(scope="module")
def models() -> Any:
    # ray.init installs a SIGTERM handler and ray.shutdown leaves it: put
    # back what the rest of the suite expects.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = not ray.is_initialized()
    if started:
        # The replicas unpickle Wide by reference: Ray puts the driver's working
        # directory (the checkout, where pytest runs) on their path.
        start_local_ray()
    serve.start(proxy_location="Disabled")
    deploy(
        {"small": Synthetic(), "wide": Wide()},
        max_models_per_replica=1,
        name=APP,
        replicas=2,
        num_cpus=0,
        engine_kwargs={"device": "cpu"},
    )
    yield APP
    if started:
        ray.shutdown()
    else:
        serve.delete(APP)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


async def wait_for(cond: Callable[[], Any], *, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.05)


def holders(engine: RemoteEngine) -> dict[str, tuple[str, ...]]:
    """Each live replica's models on its device, from its latest report."""
    return {v.replica: v.report.loaded or () for v in engine.replicas() if not v.lost}


async def run(engine: RemoteEngine, model: str | None) -> tuple[om.Frame, str, bool]:
    """One request on ``model``: its final frame, its replica, and whether it said it was loading."""
    stream = engine.stream(P, model=model)
    loading = stream.loading
    frames = [f async for f in stream]
    assert stream.replica is not None
    return frames[-1], stream.replica, loading


@ASYNCIO
async def test_each_request_runs_on_the_model_it_names_and_unknown_names_are_refused(models: str) -> None:
    async with RemoteEngine(models) as engine:
        cards = engine.models
        wide, replica, loading = await run(engine, "wide")
        small, _, _ = await run(engine, "small")
        default, _, _ = await run(engine, None)
        # Which replica holds which is up to Serve's routing (test below); that they report it:
        await wait_for(lambda: engine.loaded, what="a replica reporting a model loaded")
        loaded = engine.loaded
        with pytest.raises(om.ParamsError) as err:
            engine.stream(P, request_id="nope", model="nope")
    assert list(cards) == ["small", "wide"] and engine.default == "small"
    assert all(isinstance(c, ModelCard) for c in cards.values()) and engine.model is cards["small"]
    assert cards["wide"].name == "wide" and cards["small"].params == Synthetic.params
    assert bool(wide.data.eq(Wide().expected_frames(P)[-1]).all())
    assert wide.data.shape == torch.Size([3, 8, 16]) and small.data.shape == torch.Size([3, 8, 8])
    assert bool(default.data.eq(small.data).all())  # the first model is the default
    assert loading  # nothing held "wide" yet: its first request waited for the load
    assert loaded and set(loaded) <= {"small", "wide"}
    assert (err.value.field, err.value.request_id) == ("model", "nope")
    assert "small, wide" in str(err.value)


@ASYNCIO
async def test_a_request_lands_on_a_replica_that_holds_its_model(models: str) -> None:
    async with RemoteEngine(models) as engine:
        # Until each replica holds one model (each a different one): Serve sends a model
        # that no replica holds to the replica holding the fewest.
        for _ in range(6):
            for name in ("small", "wide"):
                await run(engine, name)
            await anyio.sleep(1.0)  # the replicas' reports, and Serve's routers learning who holds what
            held = holders(engine)
            if sorted(held.values()) == [("small",), ("wide",)]:
                break
        owner = {models[0]: replica for replica, models in holders(engine).items()}
        assert set(owner) == {"small", "wide"}, holders(engine)
        landed = [(name, (await run(engine, name))[1]) for name in ("small", "wide") * 4]
        await anyio.sleep(0.5)
        held_after = holders(engine)
    # Without routing by model, each request would pick either replica (and reload it).
    assert landed == [(name, owner[name]) for name, _ in landed]
    assert held_after == {owner["small"]: ("small",), owner["wide"]: ("wide",)}


@ASYNCIO
async def test_a_server_in_front_serves_each_model_by_name(models: str) -> None:
    async with RemoteEngine(models) as engine:
        server = Server(engine, host="127.0.0.1", port=0, shutdown_timeout_s=0.5, close_timeout_s=1.0)
        async with server:
            async with connect(server.url) as ws:
                await send(ws, type="generate", id="w", params=P, model="wide")
                wide = await until_end(ws, "w")
                await send(ws, type="generate", id="s", params=P, model="small")
                small = await until_end(ws, "s")
            async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
                card = (await http.get("/models")).json()
                unknown = await http.post("/v1/generations", json={"params": P, "model": "nope"})
    for msgs, rid, width in ((wide, "w", 16), (small, "s", 8)):
        check_stream([m for m in msgs if m["type"] != "loading"], rid, 3)
        final = [m for m in msgs if m["type"] == "preview"][-1]
        assert (final["width"], final["height"]) == (width, 8)
    assert wide[0]["model"] == "wide" and small[0]["model"] == "small"
    assert card["default"] == "small" and [m["name"] for m in card["models"]] == ["small", "wide"]
    assert [m["model"] for m in card["models"]] == ["synthetic", "wide"]
    assert unknown.status_code == 422 and unknown.json()["field"] == "model"


# -- no cluster ----------------------------------------------------------------------------------


def test_build_app_checks_the_models_and_their_bound() -> None:
    with pytest.raises(om.ParamsError) as err:
        build_app("synthetic", max_models_per_replica=1)
    assert err.value.field == "max_models_per_replica"
    with pytest.raises(om.ParamsError) as err:
        build_app({}, max_models_per_replica=1)
    assert err.value.field == "model"
    with pytest.raises(om.ParamsError) as err:
        build_app({"a b": "synthetic"})
    assert err.value.field == "model"
    with pytest.raises(om.ParamsError) as err:
        build_app({"a": "synthetic", "b": "synthetic"}, max_models_per_replica=0)
    assert err.value.field == "max_models_per_replica"


def test_serve_ray_deploys_several_named_models_with_max_loaded_per_replica(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    served: list[dict[str, Any]] = []
    deployed: list[tuple[Any, dict[str, Any]]] = []
    server = types.ModuleType("omni_stream.server")

    async def fake_serve(**kwargs: Any) -> None:
        served.append(kwargs)

    server.serve = fake_serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", server)
    monkeypatch.setattr(ray_serve, "deploy", lambda model, **kw: deployed.append((model, kw)) or "remote")
    code = cli.main(["serve", "--model", "a=synthetic", "--model", "b=synthetic", "--ray",
                     "--max-loaded", "1", "--replicas", "2", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    ((model, kw),) = deployed
    assert list(model) == ["a", "b"] and all(isinstance(f(), Synthetic) for f in model.values())
    assert (kw["max_models_per_replica"], kw["replicas"], kw["engine_kwargs"]) == (1, 2, {"device": "cpu"})
    assert served[0]["model"] == "remote"
