"""The loop thread's Python calls per frame: the engine against the peer, counted by cProfile.

Instructions (``handover_instructions``) say how much the loop does a
frame; this says where: every Python function (and C function called
from Python) the event loop's thread runs while one request streams,
with its calls per frame. Each step sleeps ``--pace`` milliseconds first,
so the loop drains every frame before the next is made (one wake-up a
frame for both, as at the step times of ``benchmarks/handover.py``).

Variants, on the backend chosen (``--backend asyncio|uvloop|trio``):

* ``engine``: ``Engine.stream`` over a Synthetic model (``work=0``, a
  4x8x8 frame), read to its end;
* ``peer``: the hand-written streaming of ``benchmarks/handover.py``, a
  worker thread calling ``call_soon_threadsafe(queue.put_nowait,
  x.clone())`` (on trio ``run_sync_soon(send_nowait, ...)`` and a memory
  channel) after each step.

cProfile slows every call, so its times are not the loop's times; the
counts are exact. ``python -m benchmarks.handover_calls [--backend B]
[--frames N] [--pace MS] [--top K]``
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

import omni_stream as om
from omni_stream._backend import current_backend

__all__ = ["Counted", "count", "main"]

PARAMS = {"work": 0, "shape": [4, 8, 8]}


class Counted:
    """One variant's profile: calls a frame in all, and per function."""

    def __init__(self, profile: cProfile.Profile, frames: int) -> None:
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        self.frames = frames
        self.per_function: list[tuple[float, str]] = sorted(
            ((calls / frames, f"{path.rsplit('/', 1)[-1]}:{line} {name}")
             for (path, line, name), (_, calls, *_rest) in stats.items()),
            reverse=True,
        )
        self.calls = sum(n for n, _ in self.per_function)


def _paced(pace_s: float) -> om.models.Synthetic:
    class Paced(om.models.Synthetic):
        def step(self, states: Sequence[Any]) -> list[torch.Tensor]:
            time.sleep(pace_s)
            return super().step(states)

    return Paced()


async def _engine(frames: int, pace_s: float) -> Counted:
    async with om.Engine(_paced(pace_s), device="cpu") as engine:
        await engine.generate(dict(PARAMS, steps=2))  # the producer up, the model loaded
        profile = cProfile.Profile()
        profile.enable()
        async for _ in engine.stream(dict(PARAMS, steps=frames)):
            pass
        profile.disable()
    return Counted(profile, frames)


async def _peer(frames: int, pace_s: float) -> Counted:
    model = _paced(pace_s)
    cpu = torch.device("cpu")
    params = model.validate(dict(PARAMS, steps=frames))
    call: Callable[..., object]
    put: Callable[[torch.Tensor], object]
    get: Callable[[], Awaitable[torch.Tensor]]
    if current_backend() == "trio":
        import trio

        send, receive = trio.open_memory_channel[torch.Tensor](math.inf)
        call, put, get = trio.lowlevel.current_trio_token().run_sync_soon, send.send_nowait, receive.receive
    else:
        import asyncio

        queue = asyncio.Queue[torch.Tensor]()
        call, put, get = asyncio.get_running_loop().call_soon_threadsafe, queue.put_nowait, queue.get

    def denoise() -> None:
        model.load(cpu)
        states = [model.start(params, cpu)]
        for _ in range(frames):
            for x in model.step(states):
                call(put, x.clone())

    thread = threading.Thread(target=denoise, name="handover-calls-peer", daemon=True)
    profile = cProfile.Profile()
    profile.enable()
    thread.start()
    for _ in range(frames):
        await get()
    profile.disable()
    await anyio.to_thread.run_sync(thread.join)
    return Counted(profile, frames)


def count(variant: str, backend: str, frames: int, pace_s: float) -> Counted:
    """Run ``variant`` ("engine" or "peer") under ``backend`` and count its loop's calls a frame."""
    run = _engine if variant == "engine" else _peer
    name, options = ("trio", {}) if backend == "trio" else ("asyncio", {"use_uvloop": backend == "uvloop"})
    result: Counted = anyio.run(run, frames, pace_s, backend=name, backend_options=options)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--pace", type=float, default=2.0, help="milliseconds slept before each step")
    parser.add_argument("--top", type=int, default=0, help="also list the K functions called most a frame")
    args = parser.parse_args(argv)
    for variant in ("engine", "peer"):
        counted = count(variant, args.backend, args.frames, args.pace / 1000)
        print(f"{args.backend} {variant}: {counted.calls:.1f} Python calls a frame on the loop thread")
        for n, where in counted.per_function[: args.top]:
            print(f"    {n:6.2f}  {where}")


if __name__ == "__main__":
    main()
