"""Save a JPEG preview of every step of one generation to a folder.

    python examples/save_previews.py                       # "red circle" -> previews/
    python examples/save_previews.py "blue stripes" out/   # your prompt and folder

Uses the default model (Mixture: a real sampler over built-in images, no
weights to download). Each step's frame is decoded, shrunk and encoded in a
preview thread while the engine computes the next step.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import omni_stream as om
from omni_stream.preview import PreviewSpec, Previewer, should_preview


async def save_previews(prompt: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model = om.models.Mixture()
    # The model says how its frames decode ("rgb" for Mixture; a latent
    # model would say "sd15", "sdxl", "sd3" or "flux").
    spec = PreviewSpec(every=1, format="jpeg", max_size=256, decoder=model.preview_decoder)
    previewer = Previewer()
    params = {"prompt": prompt, "steps": 20, "size": 128, "seed": 7}
    async with om.Engine(model) as engine:
        async with engine.stream(params) as stream:
            async for frame in stream:
                if not should_preview(frame.step, frame.total, spec.every):
                    continue
                # Off the event loop and off the producer thread: the engine
                # runs ahead on the next steps while this one renders.
                image = await previewer.render(frame, spec)
                path = folder / f"step_{frame.step:03d}.jpg"
                path.write_bytes(image.data)
                print(
                    f"step {frame.step:>2}/{frame.total}: {path} "
                    f"({image.width}x{image.height}, {len(image.data)} bytes; "
                    f"step computed in {frame.timings.compute_s * 1000:.1f} ms)"
                )


def main() -> None:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "red circle"
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else "previews")
    try:
        asyncio.run(save_previews(prompt, folder))
    except om.OmniStreamError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
