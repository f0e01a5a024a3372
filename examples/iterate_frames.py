"""Iterate over every step of a generation, then generate a few more at once.

    python examples/iterate_frames.py                  # "red circle"
    python examples/iterate_frames.py "blue stripes"   # your prompt

Uses the default model (Mixture: a real diffusion sampler over built-in
images, no weights to download). Each frame is the model's current guess of
the finished image (its x0 prediction): a float32 RGB tensor [3, H, W] in
[-1, 1] that the caller owns.
"""

from __future__ import annotations

import asyncio
import sys
import time

import omni_stream as om


async def iterate(prompt: str) -> None:
    async with om.Engine(om.models.Mixture()) as engine:
        params = {"prompt": prompt, "steps": 20, "size": 128, "seed": 7}
        started = time.perf_counter()
        async for frame in engine.stream(params):
            t = frame.timings
            print(
                f"step {frame.step:>2}/{frame.total} {tuple(frame.data.shape)} "
                f"range [{float(frame.data.min()):+.2f}, {float(frame.data.max()):+.2f}]  "
                f"queued {t.queued_s * 1e3:6.2f} ms  compute {t.compute_s * 1e3:6.2f} ms  "
                f"copy {t.copy_s * 1e3:5.2f} ms  batch {t.batch_size}"
                + ("  (final)" if frame.final else "")
            )
        print(f"stream: {time.perf_counter() - started:.2f} s")

        # Concurrent requests share each step's model call (same size).
        started = time.perf_counter()
        finals = await asyncio.gather(
            *(engine.generate({"prompt": prompt, "steps": 20, "size": 128, "seed": s}) for s in range(4))
        )
        elapsed = time.perf_counter() - started
        for f in finals:
            print(f"generate: request {f.request_id} -> {tuple(f.data.shape)}, "
                  f"last step batched with {f.timings.batch_size - 1} other(s)")
        print(f"generate x{len(finals)}: {elapsed:.2f} s; statistics: {engine.statistics().to_dict()}")


def main() -> None:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "red circle"
    try:
        asyncio.run(iterate(prompt))
    except om.OmniStreamError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
