"""The stress tools' server, in a process of its own: ``python -m benchmarks._server_proc [--limits JSON]``.

Runs ``omni_stream.server.Server(Synthetic(), host="127.0.0.1", port=0,
device="cpu", **limits)`` the way ``omni-stream serve`` does (its own
interpreter, ``omni_stream.config.run``: uvloop where installed,
``serve_forever`` until SIGINT / SIGTERM, then a graceful shutdown), and
prints one JSON line on stdout once it listens::

    {"event": "listening", "url": "ws://127.0.0.1:PORT/ws", "http_url": "http://127.0.0.1:PORT", "pid": PID}

Nothing else is written to stdout (the log goes to stderr, errors only
unless ``--verbose``). Exit status: 0 after a clean shutdown, 3 when the
engine died, 4 when the server failed (as ``omni-stream serve``).
``--profile PATH`` runs the event loop's thread under cProfile and writes
its stats to PATH at exit (``python -m pstats PATH``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks._server_proc", description=__doc__.split("\n")[0])
    ap.add_argument("--limits", default="{}", help="Server keyword arguments as a JSON object")
    ap.add_argument("--verbose", action="store_true", help="the server's log at INFO, not only errors")
    ap.add_argument("--profile", metavar="PATH", help="cProfile the event loop thread; stats to PATH at exit")
    args = ap.parse_args(argv)
    limits: dict[str, Any] = json.loads(args.limits)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr,
                        format="server %(asctime)s %(levelname)s %(name)s: %(message)s")

    from omni_stream.config import run
    from omni_stream.errors import EngineDeadError
    from omni_stream.models import Synthetic
    from omni_stream.server import Server

    servers: list[Server] = []

    async def serve() -> None:
        server = Server(Synthetic(), host="127.0.0.1", port=0, device="cpu", **limits)
        servers.append(server)
        async with server:
            print(json.dumps({"event": "listening", "url": server.url, "http_url": server.http_url,
                              "pid": os.getpid()}), flush=True)
            await server.serve_forever()

    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            run(serve)
        finally:
            profiler.disable()
            profiler.dump_stats(args.profile)
    else:
        run(serve)
    fatal = servers[0].fatal if servers else None
    if fatal is not None:
        print(f"server process: exiting: {fatal!r}", file=sys.stderr)
        return 3 if isinstance(fatal, EngineDeadError) else 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
