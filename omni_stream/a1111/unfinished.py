"""The picture of an image that ``/interrupt`` or ``/skip`` stopped: its latest preview (pure).

AUTOMATIC1111's samplers, interrupted or skipped, return the latents they
had reached, and the call decodes those: the answer holds the half-done
image. Our engine hands a cancelled request no frame; what the door has is
the last live preview the request's stream delivered (what ``/progress``
showed as ``current_image``: a preview every ``show_progress_every_n_steps``,
PNG, one pixel per latent pixel for a latent model unless the server
previews through a tiny VAE, ``--preview-vae``). :func:`unfinished_png`
makes of it the image's picture at the image's size (Lanczos), with the
infotext its result would have carried (the request's params, its seed),
so a client reads it as any other image of the answer. A request stopped
before its first preview has no picture.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..preview.save import encode_output

__all__ = ["unfinished_png"]


def unfinished_png(preview: bytes, size: tuple[int, int], params: Mapping[str, Any]) -> bytes:
    """The encoded ``preview`` (PNG, JPEG or WebP, the server's own) as a PNG of ``size``
    (width, height) carrying ``params`` as a result's PNG does (``parameters``: A1111's
    infotext, ``omni_stream``: the params). For a worker thread.

    Raises OSError (Pillow's) for bytes that are no image.
    """
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(preview)) as opened:
        image = opened.convert("RGB")
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    # Channels first: the layout the decoder reads first, whatever the sides (``[3, H, 3]``).
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
    return encode_output(pixels, "png", params=params).data
