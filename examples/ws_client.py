"""Watch a generation live over the websocket API, then save the result.

Start a server in one terminal, then run this in another:

    omni-stream serve                                  # ws://127.0.0.1:8765/ws
    python examples/ws_client.py                       # default URL and params
    python examples/ws_client.py ws://127.0.0.1:8765/ws -p prompt='"blue stripes"' -p steps=30
    python examples/ws_client.py --token SECRET -o result.png   # a server started with --token

``-p KEY=VALUE`` sets one model param (VALUE is JSON when it parses as JSON,
else a plain string); ``GET /models`` on the server lists them. With none
given, the server's defaults apply. The token defaults to $OMNI_STREAM_TOKEN.
Exits 1 with the server's message when it refuses or fails the request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import omni_stream as om
from omni_stream import client as omc
from omni_stream.preview import check_output_path


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


async def watch(args: argparse.Namespace) -> omc.PreviewFrame:
    params = dict(args.param or [])
    preview = {"format": args.format, "every": args.every}
    # The result comes full size in the format the output file's suffix names.
    output = {"format": check_output_path(args.output)}
    async with omc.connect(args.url, token=args.token) as client:
        stream = client.generate(params, preview=preview, output=output, progress=True)
        started = time.perf_counter()
        final = None
        async for item in stream:
            if isinstance(item, omc.Progress):
                bar = "#" * round(30 * item.step / item.total)
                print(f"\r[{bar:<30}] step {item.step}/{item.total}  ETA {item.eta_s:5.1f} s",
                      end="", flush=True)
            elif item.final:
                final = item
        print(f"\ndone: {stream.total} steps in {time.perf_counter() - started:.2f} s "
              f"(server: {stream.elapsed_s:.2f} s), "
              f"{stream.dropped} intermediate items skipped by this client")
    assert final is not None  # the client raises ProtocolError for a 'done' without one
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="ws://127.0.0.1:8765/ws")
    parser.add_argument("-p", "--param", type=_param, action="append", metavar="KEY=VALUE")
    parser.add_argument("--token", default=os.environ.get("OMNI_STREAM_TOKEN") or None)
    parser.add_argument("--format", default="jpeg", choices=["jpeg", "png", "webp", "raw"],
                        help="preview encoding")
    parser.add_argument("--every", type=int, default=1, help="preview every Nth step")
    parser.add_argument("-o", "--output", default="ws_result.png",
                        help="where to save the result (format from the extension)")
    args = parser.parse_args(argv)
    try:
        check_output_path(args.output)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        final = asyncio.run(watch(args))
    except om.ParamsError as exc:  # includes the server's bad_params / invalid_field
        print(f"\nrejected: {exc}", file=sys.stderr)
        return 1
    except omc.ClientError as exc:
        print(f"\nfailed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the iteration cancels the request on the server
        print("\ninterrupted", file=sys.stderr)
        return 130
    final.save(args.output)
    print(f"saved {final.width}x{final.height} {final.format} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
