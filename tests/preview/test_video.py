"""Video frames ([C, T, h, w] latents, [T, 3, H, W] pixels): a strip, a frame, an animation."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omni_stream.errors import ParamsError
from omni_stream.frame import Frame
from omni_stream.preview import (
    VIDEO_MODES,
    EncodedImage,
    PreviewSpec,
    Previewer,
    decode_auto,
    decode_frame,
    decode_rgb,
    decode_sd3,
    decode_sd15,
    encode_animation,
    is_video,
    render_sync,
    video_strip,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _frame(data: torch.Tensor, *, decoded: bool = False) -> Frame:
    return Frame(request_id="r", step=1, total=2, data=data, decoded=decoded)


def _pixels(image: EncodedImage) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB"))


# -- which frames are videos -------------------------------------------------------


@pytest.mark.parametrize(
    "shape, video",
    [
        ((3, 8, 8), False),
        ((8, 8), False),
        ((1, 4, 8, 8), False),  # a batch of one image
        ((4, 5, 8, 8), True),
        ((5, 3, 8, 8), True),
        ((1, 4, 5, 8, 8), True),
        ((1, 1, 4, 8, 8), False),
    ],
)
def test_is_video(shape, video):
    assert is_video(torch.zeros(shape)) is video
    assert _frame(torch.zeros(shape)).is_video is video


def test_latent_video_decodes_each_frame_with_the_family_decoder():
    latent = torch.randn(4, 5, 6, 7, generator=_gen())
    got = decode_frame(_frame(latent), "sd15")
    assert got.shape == (5, 6, 7, 3)
    for i in range(5):
        np.testing.assert_array_equal(got[i], decode_sd15(latent[:, i]))
    # auto picks sd15 for 4 channels, frame by frame too.
    np.testing.assert_array_equal(decode_frame(_frame(latent)), got)


def test_decoded_video_is_t_3_h_w_pixels():
    video = torch.rand(4, 3, 6, 7, generator=_gen()) * 2 - 1
    got = decode_frame(_frame(video, decoded=True))
    assert got.shape == (4, 6, 7, 3)
    for i in range(4):
        np.testing.assert_array_equal(got[i], decode_rgb(video[i]))


def test_the_decoded_flag_decides_the_layout_of_a_4d_frame():
    data = torch.randn(16, 3, 6, 7, generator=_gen())
    # Not decoded: a 16-channel latent of 3 frames.
    latent = decode_frame(_frame(data))
    assert latent.shape == (3, 6, 7, 3)
    np.testing.assert_array_equal(latent[1], decode_sd3(data[:, 1]))
    # Decoded: 16 frames of pixels.
    pixels = decode_frame(_frame(data, decoded=True))
    assert pixels.shape == (16, 6, 7, 3)
    np.testing.assert_array_equal(pixels[1], decode_rgb(data[1]))


def test_a_bare_4d_tensor_with_a_second_dimension_of_3_is_pixels_for_auto():
    data = torch.randn(16, 3, 6, 7, generator=_gen())
    assert decode_frame(data).shape == (16, 6, 7, 3)
    # ... and a latent for a latent decoder, a latent for auto otherwise.
    assert decode_frame(data, "sd3").shape == (3, 6, 7, 3)
    assert decode_frame(torch.randn(4, 5, 6, 7)).shape == (5, 6, 7, 3)


def test_rgb_reads_a_pixel_video_of_a_pixel_space_model():
    # decoded=False but the model works in pixels and declares "rgb".
    video = torch.rand(5, 3, 6, 7) * 2 - 1
    got = decode_frame(_frame(video), "rgb")
    assert got.shape == (5, 6, 7, 3)
    np.testing.assert_array_equal(got[2], decode_rgb(video[2]))
    # [3, T, H, W] too.
    np.testing.assert_array_equal(decode_frame(_frame(video.transpose(0, 1)), "rgb"), got)


def test_projected_latent_video_is_normalised_as_a_whole():
    # With per-frame statistics the dim frame would look as bright as the
    # other: one normalisation over the video keeps them apart.
    base = torch.randn(5, 1, 8, 8, generator=_gen())
    latent = torch.cat([base, base * 0.1], dim=1)
    got = decode_frame(_frame(latent)).astype(int)
    assert got.shape == (2, 8, 8, 3)
    assert got[0].std() > 3 * got[1].std()


def test_five_d_with_a_batch_of_one():
    latent = torch.randn(1, 16, 2, 6, 7, generator=_gen())
    np.testing.assert_array_equal(decode_frame(latent), decode_frame(latent[0]))


def test_a_callable_decoder_gets_the_whole_video_and_may_return_frames():
    seen = []

    def video_vae(t: torch.Tensor) -> np.ndarray:
        seen.append(tuple(t.shape))
        return np.full((t.shape[1], 4, 5, 3), 9, dtype=np.uint8)

    got = decode_frame(_frame(torch.zeros(16, 3, 2, 2)), video_vae)
    assert seen == [(16, 3, 2, 2)] and got.shape == (3, 4, 5, 3)
    spec = PreviewSpec(decoder=video_vae, format="raw")
    out = render_sync(_frame(torch.zeros(16, 3, 2, 2)), spec)
    assert (out.width, out.height) == (15, 4)


# -- the strip ----------------------------------------------------------------------


def test_strip_is_all_frames_side_by_side():
    latent = torch.randn(4, 5, 6, 7, generator=_gen())
    image = render_sync(_frame(latent), PreviewSpec(format="raw", max_size=None))
    assert (image.width, image.height, image.frames) == (35, 6, 1)
    rgb = np.frombuffer(image.data, np.uint8).reshape(6, 35, 3)
    for i in range(5):
        np.testing.assert_array_equal(rgb[:, 7 * i : 7 * (i + 1)], decode_sd15(latent[:, i]))
    np.testing.assert_array_equal(decode_auto(latent), rgb)


@pytest.mark.parametrize(
    "frames, height, width, max_size, size",
    [
        (6, 48, 64, 100, (96, 12)),  # each frame 16 px wide: floor(64 * 100 / 384)
        (6, 48, 64, 384, (384, 48)),  # fits already
        (3, 400, 50, 100, (36, 100)),  # the height is the longer side: 3 x floor(12.5)
        (40, 8, 8, 16, (16, 1)),  # more frames than pixels: shrunk once more
    ],
)
def test_strip_size_is_bounded_by_max_size(frames, height, width, max_size, size):
    video = torch.rand(frames, 3, height, width, generator=_gen()) * 2 - 1
    image = render_sync(_frame(video, decoded=True), PreviewSpec(format="png", max_size=max_size))
    assert (image.width, image.height) == size
    assert max(image.width, image.height) <= max_size
    assert Image.open(io.BytesIO(image.data)).size == size


def test_video_strip_directly():
    frames = np.zeros((3, 4, 5, 3), np.uint8)
    frames[1] = 100
    strip = video_strip(frames)
    assert strip.shape == (4, 15, 3) and strip.flags.c_contiguous
    assert (strip[:, 5:10] == 100).all() and (strip[:, :5] == 0).all()
    assert video_strip(list(frames), max_size=6).shape == (2, 6, 3)  # 15 -> 6: x 0.4
    with pytest.raises(ParamsError) as info:
        video_strip([])
    assert info.value.field == "frames"
    with pytest.raises(ParamsError) as info:
        video_strip([np.zeros((2, 2, 3), np.uint8), np.zeros((3, 2, 3), np.uint8)])
    assert info.value.field == "frames"
    with pytest.raises(ParamsError) as info:
        video_strip(frames, max_size=0)
    assert info.value.field == "max_size"


# -- first ------------------------------------------------------------------------


def test_first_previews_the_first_frame_only():
    latent = torch.randn(16, 4, 6, 7, generator=_gen())
    image = render_sync(_frame(latent), PreviewSpec(format="raw", video="first", decoder="sd3"))
    assert (image.width, image.height) == (7, 6)
    assert image.data == decode_sd3(latent[:, 0]).tobytes()


# -- animated -----------------------------------------------------------------------


def test_animated_is_an_animated_webp_whatever_the_format():
    video = torch.rand(4, 3, 40, 60, generator=_gen()) * 2 - 1
    image = render_sync(_frame(video, decoded=True), PreviewSpec(video="animated", max_size=30))
    assert (image.format, image.mime, image.frames) == ("webp", "image/webp", 4)
    assert (image.width, image.height) == (30, 20)  # max_size bounds each frame
    with Image.open(io.BytesIO(image.data)) as anim:
        assert anim.format == "WEBP" and anim.is_animated and anim.n_frames == 4
        assert anim.size == (30, 20)


def test_animated_on_an_image_frame_uses_the_format():
    image = render_sync(_frame(torch.zeros(3, 8, 8)), PreviewSpec(video="animated"))
    assert (image.format, image.frames) == ("jpeg", 1)


def test_encode_animation_frames_and_timing():
    frames = np.stack([np.full((6, 8, 3), 40 * i, np.uint8) for i in range(5)])
    image = encode_animation(frames, fps=4, quality=90)
    assert (image.width, image.height, image.frames) == (8, 6, 5)
    with Image.open(io.BytesIO(image.data)) as anim:
        assert anim.n_frames == 5
        means = []
        for i in range(5):
            anim.seek(i)
            anim.load()  # Pillow fills the frame's info when it loads it
            assert anim.info["duration"] == 250
            means.append(float(np.asarray(anim.convert("RGB")).mean()))
    assert means == sorted(means) and means[-1] > means[0] + 100
    for bad, field in [({"fps": 0}, "fps"), ({"fps": True}, "fps"), ({"quality": 0}, "quality")]:
        with pytest.raises(ParamsError) as info:
            encode_animation(frames, **bad)
        assert info.value.field == field


# -- the wire -----------------------------------------------------------------------


def test_video_is_a_wire_key():
    assert VIDEO_MODES == ("strip", "first", "animated")
    assert PreviewSpec().video == "strip"
    for mode in VIDEO_MODES:
        assert PreviewSpec.from_dict({"video": mode}).video == mode


@pytest.mark.parametrize("bad", ["gif", "", None, 1, ["strip"]])
def test_bad_video_modes_raise_naming_video(bad):
    with pytest.raises(ParamsError, match="video") as info:
        PreviewSpec.from_dict({"video": bad})
    assert info.value.field == "video"
    with pytest.raises(ParamsError) as info:
        PreviewSpec(video=bad)
    assert info.value.field == "video"


def test_unknown_keys_list_video_among_the_known():
    with pytest.raises(ParamsError, match="every, format, max_size, quality, decoder, video"):
        PreviewSpec.from_dict({"fps": 3})


@pytest.mark.asyncio
async def test_previewer_renders_video_frames():
    latent = torch.randn(16, 3, 12, 10, generator=_gen())
    spec = PreviewSpec(format="png", max_size=None)
    image = await Previewer().render(_frame(latent), spec)
    assert (image.width, image.height) == (30, 12)
    np.testing.assert_array_equal(_pixels(image), np.concatenate(decode_frame(_frame(latent)), 1))
