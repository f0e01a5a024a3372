"""omni_stream inside your own ASGI application, mounted under a prefix.

    python examples/mount_app.py                 # http://127.0.0.1:8000
    curl -s -X POST 'http://127.0.0.1:8000/omni/v1/generations?wait=true' \
         -d '{"params": {"steps": 20}}' -o out.png
    open http://127.0.0.1:8000/omni/             # the live page, under the prefix

Your own routes live beside it (here ``/`` and ``/hello``). Starlette does
not run a mounted application's lifespan, so the host's lifespan runs the
engine and omni_stream's service; FastAPI is the same (``app =
FastAPI(lifespan=lifespan); app.mount("/omni", omni)``). docs/http.md,
"Mounting", says what each part guarantees.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse
from starlette.routing import Mount, Route

import omni_stream as om
from omni_stream.models import load_model
from omni_stream.server import create_app


def build(model: str = "mixture", device: str = "auto", token: str | None = None) -> Starlette:
    """The host application with omni_stream mounted at ``/omni``."""
    engine = om.Engine(load_model(model), device=device)
    omni = create_app(engine, token=token)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine, omni.state.omni_stream.running():
            yield

    async def hello(request: Request) -> JSONResponse:
        # Your own code can use the engine directly too.
        return JSONResponse({"hello": "from the host app", "engine": engine.health().to_dict()["status"]})

    async def home(request: Request) -> RedirectResponse:
        return RedirectResponse("/omni/")

    return Starlette(
        routes=[Route("/", home), Route("/hello", hello), Mount("/omni", app=omni)],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixture")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    uvicorn.run(build(args.model, args.device, args.token), host="127.0.0.1", port=args.port,
                ws="websockets-sansio")


if __name__ == "__main__":
    main()
