"""Rendering where the frames are made: what a server asks of a remote frame source.

A server in front of a Ray replica would otherwise receive every step as a
raw tensor (12 MiB for a 1024-px decoded image) only to shrink it to a
preview of a few KiB. Instead it sends a :class:`RenderRequest` with the
request (its preview settings and its output format); the replica renders
each previewed step and the result itself (:func:`render_frame`, in its own
``Previewer`` threads) and sends the encoded bytes, so what crosses the
network is what the clients get.

A RenderRequest is plain data (it pickles): a preview decoder can travel
only by name, so a server configured with a decoder callable renders
locally (``RenderRequest.of`` returns None).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..frame import Frame
from .encode import EncodedImage
from .render import Previewer, PreviewSpec, should_preview
from .save import encode_output

__all__ = ["RenderRequest", "render_frame"]

#: What a rendered frame carries as ``data``: nothing (the pixels stay where they were made).
_NO_DATA = torch.empty(0)


@dataclass(frozen=True, slots=True)
class RenderRequest:
    """A request's previews (every, format, max_size, quality, decoder, video: as
    :class:`PreviewSpec`) and its result's encoding (``output_format``,
    ``output_quality``), for a frame source that renders them itself."""

    every: int
    format: str
    max_size: int | None
    quality: int | None
    decoder: str
    video: str
    output_format: str
    output_quality: int | None = None

    @classmethod
    def of(
        cls, spec: PreviewSpec, output_format: str, output_quality: int | None = None
    ) -> RenderRequest | None:
        """The request for ``spec`` and the output settings; None when ``spec``'s decoder is a callable."""
        if not isinstance(spec.decoder, str):
            return None
        return cls(
            every=spec.every,
            format=spec.format,
            max_size=spec.max_size,
            quality=spec.quality,
            decoder=spec.decoder,
            video=spec.video,
            output_format=output_format,
            output_quality=output_quality,
        )

    def spec(self) -> PreviewSpec:
        """The PreviewSpec it stands for; raises ParamsError naming a bad field (as PreviewSpec does)."""
        return PreviewSpec(
            every=self.every,
            format=self.format,
            max_size=self.max_size,
            quality=self.quality,
            decoder=self.decoder,
            video=self.video,
        )


async def render_frame(
    frame: Frame,
    request: RenderRequest,
    *,
    spec: PreviewSpec,
    previewer: Previewer,
    params: Mapping[str, Any] | None = None,
) -> Frame:
    """``frame`` as it should cross: ``encoded`` set, ``data`` empty.

    The final frame becomes the result at full size in the request's output
    format (``params`` in its metadata, as the server writes them); a step
    due for a preview (``should_preview`` with ``spec.every``) its preview;
    any other step carries no image (its progress is all a server sends).
    A final frame of several images crosses as it is (pixels).
    ``spec`` is ``request.spec()``, built once per request. Runs in one of
    ``previewer``'s threads; raises what the encoders raise (ParamsError
    for a frame that does not fit the decoder).
    """
    image: EncodedImage | None = None
    if frame.final and frame.image_count > 1:
        # Several images (num_images): each is a result of its own, which
        # one encoded image cannot carry; they cross as pixels and the
        # server encodes each.
        return frame
    if frame.final:
        encode = functools.partial(
            encode_output,
            frame,
            request.output_format,
            request.output_quality,
            dict(params) if params is not None else None,
            decoder=spec.decoder,
        )
        image = await previewer.run_sync(encode)
    elif should_preview(frame.step, frame.total, spec.every):
        image = await previewer.render(frame, spec)
    return dataclasses.replace(frame, data=_NO_DATA, encoded=image)
