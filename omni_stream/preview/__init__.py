"""Previews: decode a step's frame to RGB, encode it, and do both off the event loop.

>>> from omni_stream.preview import PreviewSpec, Previewer
>>> spec = PreviewSpec.from_dict({"every": 2, "format": "jpeg", "max_size": 512})
>>> image = await Previewer().render(frame, spec)       # doctest: +SKIP

Outputs at full size (files, the server's final message) are in ``save``:
``save_image``, ``save_video``, ``encode_output``, ``PreviewWriter``.
"""

from __future__ import annotations

from .decode import (
    DECODERS,
    LATENT_FACTORS,
    Decoder,
    check_decoder,
    decode_auto,
    decode_flux,
    decode_frame,
    decode_rgb,
    decode_sd3,
    decode_sd15,
    decode_sdxl,
    decode_taesd,
    decoder_for,
    default_decoder,
    is_video,
    tensor_to_numpy,
    unpack_flux,
)
from .encode import (
    DEFAULT_FPS,
    DEFAULT_QUALITY,
    FORMATS,
    EncodedImage,
    check_fps,
    check_options,
    encode,
    encode_animation,
    fit_size,
    image_grid,
    video_strip,
)
from .remote import RenderRequest, render_frame
from .render import (
    VIDEO_MODES,
    NonFiniteFrameError,
    Previewer,
    PreviewSpec,
    check_finite,
    render_sync,
    should_preview,
)
from .save import (
    IMAGE_OUTPUTS,
    IMAGE_SUFFIXES,
    OUTPUT_QUALITY,
    PREVIEW_SUFFIXES,
    VIDEO_OUTPUTS,
    VIDEO_SUFFIXES,
    PreviewWriter,
    check_output,
    check_output_path,
    encode_output,
    has_video_encoder,
    parameters_text,
    save_image,
    save_video,
)

__all__ = [
    "RenderRequest",
    "render_frame",
    "Decoder",
    "check_decoder",
    "DECODERS",
    "LATENT_FACTORS",
    "decoder_for",
    "default_decoder",
    "decode_frame",
    "is_video",
    "decode_auto",
    "decode_rgb",
    "decode_sd15",
    "decode_sdxl",
    "decode_taesd",
    "decode_sd3",
    "decode_flux",
    "unpack_flux",
    "tensor_to_numpy",
    "FORMATS",
    "DEFAULT_QUALITY",
    "DEFAULT_FPS",
    "EncodedImage",
    "encode",
    "encode_animation",
    "image_grid",
    "video_strip",
    "check_options",
    "check_fps",
    "fit_size",
    "VIDEO_MODES",
    "PreviewSpec",
    "Previewer",
    "render_sync",
    "NonFiniteFrameError",
    "check_finite",
    "should_preview",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "IMAGE_OUTPUTS",
    "VIDEO_OUTPUTS",
    "OUTPUT_QUALITY",
    "PREVIEW_SUFFIXES",
    "PreviewWriter",
    "check_output",
    "check_output_path",
    "encode_output",
    "has_video_encoder",
    "parameters_text",
    "save_image",
    "save_video",
]
