"""A model with an input image, for the attacks on image params (issue #19, findings 6 and 7).

The default model (Mixture) takes no image, so ``benchmarks/doors.py``
serves this one: ``omni-stream serve --model benchmarks.image_model:ImageSynthetic``.
It is :class:`~omni_stream.models.Synthetic` plus an ``image`` param, the
way an image-to-image pipeline takes one: its ``validate`` reads the image
with :func:`omni_stream.models.inputs.load_image` (a ``data:`` URL is
decoded there; the server hands it the image it decoded off the event
loop), and it renders at the input's size (frames ``[3, height, width]``,
the image as a float32 tensor in each request's state), as an img2img
pipeline does. Synthetic's bound on a frame's values does not apply to
frames an image sets: the server's ``max_image_size`` and memory bound are
what refuse a large one.

:func:`png_data_url` makes the attack's images: ``blank`` (one colour: a
4096x4096 PNG of ~50 KB that decodes to 48 MiB) or ``pattern`` (a
gradient with stripes, a real decode).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Mapping
from typing import Any

import torch

from omni_stream.errors import ParamsError
from omni_stream.models import Synthetic
from omni_stream.models.inputs import load_image
from omni_stream.params import Param

__all__ = ["ImageSynthetic", "png_data_url"]


class ImageSynthetic(Synthetic):
    """Synthetic with an input ``image`` (see the module docstring)."""

    name = "image_synthetic"
    params = (
        *Synthetic.params,
        Param("image", "str", None, "input image: a PNG or JPEG data: URL; frames take its size"),
    )

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params; raises ParamsError naming the field."""
        rest = dict(params or {})
        image = rest.pop("image", None)
        if image is None:
            out = super().validate(rest)
            out["image"] = None
            return out
        # Synthetic's own checks on a small frame; the image sets the real one.
        out = super().validate({**rest, "shape": [3, 1, 1]})
        picture = load_image(image, field="image", allow_paths=False)
        out["shape"] = [3, picture.height, picture.width]
        out["image"] = picture
        return out

    def start(self, params: Mapping[str, Any], device: torch.device) -> Any:
        picture = params.get("image")
        state = super().start(params, device)
        if picture is None:
            return state
        try:
            import numpy as np

            pixels = torch.from_numpy(np.asarray(picture, dtype=np.uint8).copy())
        except Exception as exc:  # noqa: BLE001 - a model's own error: the request fails
            raise ParamsError(f"image: {exc}", field="image") from None
        base = pixels.permute(2, 0, 1).to(torch.float32).div_(127.5).sub_(1.0)
        return dataclasses.replace(state, base=base.to(device=device, dtype=self.dtype))


def png_data_url(side: int, kind: str = "pattern") -> str:
    """A ``data:image/png;base64`` URL of a ``side`` x ``side`` RGB picture (see the module docstring)."""
    from PIL import Image

    if kind == "blank":
        picture = Image.new("RGB", (side, side), (200, 30, 30))
    else:
        ramp = torch.linspace(0, 255, side).to(torch.uint8)
        red = ramp.view(1, -1).expand(side, side)
        green = ramp.view(-1, 1).expand(side, side)
        blue = ((torch.arange(side).view(-1, 1) // 16 + torch.arange(side).view(1, -1) // 16) % 2 * 255).to(
            torch.uint8
        )
        picture = Image.fromarray(torch.stack([red, green, blue], dim=-1).contiguous().numpy(), "RGB")
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", optimize=kind == "blank", compress_level=9)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
