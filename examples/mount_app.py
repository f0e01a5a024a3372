"""omni_stream inside your own ASGI application, mounted under a prefix.

    python examples/mount_app.py                 # http://127.0.0.1:8000
    curl -s -X POST 'http://127.0.0.1:8000/omni/v1/generations?wait=true' \
         -d '{"params": {"steps": 20}}' -o out.png
    open http://127.0.0.1:8000/omni/             # the live page, under the prefix

Your own routes live beside it (here ``/`` and ``/hello``). Starlette does
not run a mounted application's lifespan, so the host's runs it: here the
app was given a model, so ``omni.lifespan`` runs its engine too and is the
whole host lifespan; FastAPI is the same (``app =
FastAPI(lifespan=omni.lifespan); app.mount("/omni", omni)``). With an engine
of your own, enter both in the host's: ``async with engine,
omni.lifespan(app): yield``. docs/http.md, "Mounting", says what each part
guarantees.
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse
from starlette.routing import Mount, Route

import omni_stream as om
from omni_stream.models import load_model
from omni_stream.server import LingeringWSProtocol, create_app


def build(model: str = "mixture", device: str = "auto", token: str | None = None) -> Starlette:
    """The host application with omni_stream mounted at ``/omni``."""
    omni = create_app(load_model(model), device=device, token=token)
    engine: om.EngineLike = omni.engine  # the one omni.lifespan runs

    async def hello(request: Request) -> JSONResponse:
        # Your own code can use the engine directly too.
        return JSONResponse({"hello": "from the host app", "engine": engine.health().to_dict()["status"]})

    async def home(request: Request) -> RedirectResponse:
        return RedirectResponse("/omni/")

    return Starlette(
        routes=[Route("/", home), Route("/hello", hello), Mount("/omni", app=omni)],
        lifespan=omni.lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixture")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    # proxy_headers=False: uvicorn would otherwise take any loopback peer's
    # X-Forwarded-For as the client's address, and each address is a principal.
    uvicorn.run(build(args.model, args.device, args.token), host="127.0.0.1", port=args.port,
                ws=LingeringWSProtocol, proxy_headers=False)


if __name__ == "__main__":
    main()
