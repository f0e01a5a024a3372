"""RenderRequest and render_frame: what a replica renders for a server in front of it."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from PIL import Image

from omni_stream import Frame, ParamsError
from omni_stream.preview import (
    Previewer,
    PreviewSpec,
    RenderRequest,
    encode_output,
    render_frame,
    render_sync,
)


def frame(step: int, total: int = 4, shape: tuple[int, ...] = (3, 40, 60)) -> Frame:
    g = torch.Generator().manual_seed(step)
    return Frame(request_id="r", step=step, total=total, data=torch.rand(shape, generator=g) * 2 - 1)


def request(**kw: object) -> RenderRequest:
    spec = PreviewSpec(**{"every": 2, "format": "jpeg", "max_size": 32, **kw})  # type: ignore[arg-type]
    made = RenderRequest.of(spec, "png")
    assert made is not None
    return made


def test_a_request_pickles_and_stands_for_its_spec() -> None:
    spec = PreviewSpec(every=3, format="webp", max_size=64, quality=70, decoder="rgb", video="first")
    made = RenderRequest.of(spec, "jpeg", 90)
    assert made is not None
    back = pickle.loads(pickle.dumps(made))
    assert back == made
    assert back.spec() == spec
    assert (back.output_format, back.output_quality) == ("jpeg", 90)


def test_a_decoder_callable_cannot_travel_so_the_server_renders() -> None:
    spec = PreviewSpec(decoder=lambda t: t[:3])
    assert RenderRequest.of(spec, "png") is None


def test_a_bad_request_is_refused_naming_the_field() -> None:
    bad = RenderRequest(every=1, format="bmp", max_size=8, quality=None, decoder="auto", video="strip",
                        output_format="png")
    with pytest.raises(ParamsError) as info:
        bad.spec()
    assert info.value.field == "format"


@pytest.mark.asyncio
async def test_steps_render_as_the_server_would_and_no_pixels_cross() -> None:
    req = request()
    spec = req.spec()
    previewer = Previewer()
    quiet = await render_frame(frame(1), req, spec=spec, previewer=previewer)
    due = await render_frame(frame(2), req, spec=spec, previewer=previewer)
    assert quiet.encoded is None and quiet.data.numel() == 0 and quiet.step == 1
    assert due.data.numel() == 0 and due.encoded is not None
    # The same bytes as the server's own renderer makes of the same frame.
    assert due.encoded == render_sync(frame(2), spec)
    assert (due.encoded.format, max(due.encoded.width, due.encoded.height)) == ("jpeg", 32)


@pytest.mark.asyncio
async def test_the_final_frame_is_the_full_size_result_with_its_params() -> None:
    req = request()
    params = {"model": "synthetic", "seed": 7, "steps": 4}
    final = await render_frame(frame(4), req, spec=req.spec(), previewer=Previewer(), params=params)
    assert final.final and final.data.numel() == 0 and final.encoded is not None
    assert final.encoded == encode_output(frame(4), "png", None, params)
    image = Image.open(io.BytesIO(final.encoded.data))
    assert image.size == (60, 40)  # never shrunk to the preview's max_size
    assert "Seed: 7" in image.info["parameters"] and '"seed": 7' in image.info["omni_stream"]


@pytest.mark.asyncio
async def test_a_frame_that_does_not_fit_the_decoder_raises() -> None:
    req = request(decoder="rgb", every=1)
    with pytest.raises(ParamsError):
        await render_frame(frame(1, shape=(5, 8, 8)), req, spec=req.spec(), previewer=Previewer())
