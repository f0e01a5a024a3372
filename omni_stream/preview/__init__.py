"""Previews: decode a step's frame to RGB, encode it, and do both off the event loop.

>>> from omni_stream.preview import PreviewSpec, Previewer
>>> spec = PreviewSpec.from_dict({"every": 2, "format": "jpeg", "max_size": 512})
>>> image = await Previewer().render(frame, spec)       # doctest: +SKIP
"""

from __future__ import annotations

from .decode import (
    DECODERS,
    LATENT_FACTORS,
    Decoder,
    decode_flux,
    decode_rgb,
    decode_sd3,
    decode_sd15,
    decode_sdxl,
    decoder_for,
    tensor_to_numpy,
    unpack_flux,
)
from .encode import DEFAULT_QUALITY, FORMATS, EncodedImage, check_options, encode, fit_size
from .render import PreviewSpec, Previewer, render_sync, should_preview

__all__ = [
    "Decoder",
    "DECODERS",
    "LATENT_FACTORS",
    "decoder_for",
    "decode_rgb",
    "decode_sd15",
    "decode_sdxl",
    "decode_sd3",
    "decode_flux",
    "unpack_flux",
    "tensor_to_numpy",
    "FORMATS",
    "DEFAULT_QUALITY",
    "EncodedImage",
    "encode",
    "check_options",
    "fit_size",
    "PreviewSpec",
    "Previewer",
    "render_sync",
    "should_preview",
]
