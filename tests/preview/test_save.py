"""Outputs: images and videos written to files and read back, encode_output, PreviewWriter."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from omni_stream.errors import ParamsError
from omni_stream.frame import Frame
from omni_stream.preview import (
    EncodedImage,
    PreviewSpec,
    PreviewWriter,
    check_output,
    encode,
    encode_output,
    parameters_text,
    render_sync,
    save_image,
    save_video,
)

try:
    import av
except ImportError:  # pragma: no cover - the video extra is optional
    av = None

needs_av = pytest.mark.skipif(av is None, reason="PyAV (the video extra) is not installed")

PARAMS = {
    "prompt": "a red circle",
    "negative_prompt": "blurry",
    "steps": 20,
    "sampler": "euler",
    "guidance_scale": 7.5,
    "seed": 42,
    "model": "sd15",
    "output": "image",
}
A1111 = (
    "a red circle\n"
    "Negative prompt: blurry\n"
    "Steps: 20, Sampler: euler, CFG scale: 7.5, Seed: 42, Size: 7x5, Model: sd15"
)


def _rgb(h: int = 5, w: int = 7, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _video(t: int = 4, h: int = 16, w: int = 24) -> np.ndarray:
    # Flat frames of rising brightness: survive lossy codecs and GIF palettes.
    return np.stack([np.full((h, w, 3), 30 + 50 * i, np.uint8) for i in range(t)])


def _read_mp4(data_or_path):
    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else str(data_or_path)
    with av.open(src) as container:
        stream = container.streams.video[0]
        info = (stream.codec_context.name, stream.codec_context.pix_fmt, stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return info, frames


# -- metadata --------------------------------------------------------------------


def test_parameters_text_is_automatic1111s():
    assert parameters_text(PARAMS, width=7, height=5) == A1111


def test_parameters_text_has_only_what_is_present():
    assert parameters_text({}, width=8, height=4) == "Size: 8x4"
    assert parameters_text({"prompt": "x", "num_inference_steps": 4, "scheduler": "ddim",
                            "cfg": 2, "negative_prompt": ""}, width=1, height=2) == (
        # A1111's keys, and the params' own names, which give them back (test_infotext.py).
        "x\nSteps: 4, Sampler: ddim, CFG scale: 2, Size: 1x2, num_inference_steps: 4, scheduler: ddim, cfg: 2"
    )
    assert parameters_text({"seed": 0}, width=1, height=1) == "Seed: 0, Size: 1x1"


# -- images -----------------------------------------------------------------------


def test_png_round_trips_pixels_and_carries_params(tmp_path):
    rgb = _rgb()
    path = save_image(rgb, tmp_path / "sub" / "out.png", params=PARAMS)
    assert path == tmp_path / "sub" / "out.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (7, 5)
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), rgb)
        assert image.text["parameters"] == A1111
        assert json.loads(image.text["omni_stream"]) == PARAMS


def test_png_params_that_json_cannot_hold_are_written_as_text(tmp_path):
    params = {"prompt": "é", "latent": torch.zeros(1)}
    path = save_image(_rgb(), tmp_path / "out.png", params=params)
    with Image.open(path) as image:
        data = json.loads(image.text["omni_stream"])
    assert data["prompt"] == "é" and "tensor" in data["latent"]
    # An input image (img2img) is described, not dumped as a repr with an address.
    path = save_image(_rgb(), tmp_path / "img.png", params={"image": Image.new("RGB", (5, 3))})
    with Image.open(path) as image:
        assert json.loads(image.text["omni_stream"])["image"] == "<RGB image 5x3>"


def test_png_without_params_has_no_text(tmp_path):
    with Image.open(save_image(_rgb(), tmp_path / "out.png")) as image:
        assert "parameters" not in image.text


@pytest.mark.parametrize("suffix, kind", [(".jpg", "JPEG"), (".JPEG", "JPEG"), (".webp", "WEBP")])
def test_lossy_images(tmp_path, suffix, kind):
    rgb = np.zeros((32, 48, 3), np.uint8)
    rgb[:, 24:] = 200
    path = save_image(rgb, tmp_path / f"out{suffix}", params=PARAMS)
    with Image.open(path) as image:
        assert image.format == kind and image.size == (48, 32)
        assert np.abs(np.asarray(image.convert("RGB")).astype(int) - rgb).mean() < 3
    small = save_image(_rgb(64, 64), tmp_path / f"small{suffix}", quality=5)
    large = save_image(_rgb(64, 64), tmp_path / f"large{suffix}", quality=100)
    assert small.stat().st_size < large.stat().st_size


@pytest.mark.parametrize("name", ["out.bmp", "out.tiff", "out", "out.png.bak"])
def test_unknown_suffix_raises_naming_it_and_the_known(tmp_path, name):
    with pytest.raises(ValueError, match=r"\.png, \.jpg, \.jpeg, \.webp") as info:
        save_image(_rgb(), tmp_path / name)
    suffix = name[name.rfind("."):] if "." in name else "(none)"
    assert suffix in str(info.value)
    assert not (tmp_path / name).exists()


def test_video_suffix_for_an_image_says_which_fit(tmp_path):
    with pytest.raises(ValueError, match=r"cannot save an image as '\.mp4'.*\.png"):
        save_image(_rgb(), tmp_path / "out.mp4")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"quality": 50}, "quality"), ({"params": ["prompt"]}, "params")],
)
def test_png_options_are_checked(tmp_path, kwargs, field):
    with pytest.raises(ParamsError) as info:
        save_image(_rgb(), tmp_path / "out.png", **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.uint8), np.zeros((4, 4, 3), np.float32)])
def test_save_image_checks_the_array(tmp_path, bad):
    with pytest.raises(ParamsError) as info:
        save_image(bad, tmp_path / "out.png")
    assert info.value.field == "rgb"


# -- videos ------------------------------------------------------------------------


def test_gif(tmp_path):
    path = save_video(_video(), tmp_path / "out.gif", fps=5)
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.n_frames == 4 and gif.size == (24, 16)
        assert gif.info["loop"] == 0 and gif.info["duration"] == 200
        gif.seek(3)
        assert abs(np.asarray(gif.convert("RGB")).mean() - 180) < 3


def test_animated_webp(tmp_path):
    path = save_video(list(_video()), tmp_path / "out.webp", fps=8)
    with Image.open(path) as webp:
        assert webp.format == "WEBP" and webp.is_animated and webp.n_frames == 4
        webp.seek(2)
        webp.load()
        assert webp.info["duration"] == 125
        assert abs(np.asarray(webp.convert("RGB")).mean() - 130) < 3


@needs_av
@pytest.mark.parametrize("h, w", [(16, 24), (17, 33)])
def test_mp4_is_h264_yuv420p_with_even_sides(tmp_path, h, w):
    video = _video(5, h, w)
    path = save_video(video, tmp_path / "out.mp4", fps=12)
    (codec, pix_fmt, rate), frames = _read_mp4(path)
    assert codec == "h264" and pix_fmt == "yuv420p" and rate == 12
    assert len(frames) == 5
    assert frames[0].shape == (h + h % 2, w + w % 2, 3)
    for got, want in zip(frames, video):
        assert np.abs(got[:h, :w].astype(int) - want).mean() < 4


@needs_av
def test_mp4_quality_changes_the_size(tmp_path):
    video = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    low = save_video(video, tmp_path / "low.mp4", quality=10)
    high = save_video(video, tmp_path / "high.mp4", quality=95)
    assert low.stat().st_size < high.stat().st_size


def test_video_suffixes_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"cannot save a video as '\.png'.*\.mp4, \.webp, \.gif"):
        save_video(_video(), tmp_path / "out.png")
    with pytest.raises(ValueError, match=r"unknown file suffix '\.avi'"):
        save_video(_video(), tmp_path / "out.avi")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"fps": 0}, "fps"), ({"fps": "24"}, "fps"), ({"quality": 101}, "quality")],
)
def test_video_options_are_checked(tmp_path, kwargs, field):
    with pytest.raises(ParamsError) as info:
        save_video(_video(), tmp_path / "out.webp", **kwargs)
    assert info.value.field == field
    with pytest.raises(ParamsError) as info:
        save_video(_video(), tmp_path / "out.gif", quality=50)
    assert info.value.field == "quality"


@pytest.fixture
def no_av(monkeypatch):
    # A None entry makes `import av` raise ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "av", None)


def test_mp4_without_pyav_names_the_extra(tmp_path, no_av):
    with pytest.raises(ImportError, match=r'pip install "omni-stream\[video\]"'):
        save_video(_video(), tmp_path / "out.mp4")
    assert not (tmp_path / "out.mp4").exists()
    with pytest.raises(ImportError, match=r"omni-stream\[video\]"):
        PreviewWriter(tmp_path / "previews.mp4")
    with pytest.raises(ParamsError, match=r"omni-stream\[video\]") as info:
        check_output("mp4")
    assert info.value.field == "format"


# -- encode_output -------------------------------------------------------------------


def _image_frame(h: int = 600, w: int = 700) -> Frame:
    data = torch.rand(3, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return Frame(request_id="r", step=4, total=4, data=data, decoded=True)


def _video_frame(t: int = 3, h: int = 16, w: int = 24) -> Frame:
    data = torch.from_numpy(_video(t, h, w)).permute(0, 3, 1, 2).contiguous()
    return Frame(request_id="r", step=4, total=4, data=data, decoded=True)


def test_encode_output_image_defaults_to_full_size_png_with_params():
    out = encode_output(_image_frame(), params={"prompt": "p", "seed": 1})
    assert (out.format, out.mime, out.width, out.height, out.frames) == (
        "png", "image/png", 700, 600, 1
    )
    with Image.open(io.BytesIO(out.data)) as image:
        assert image.size == (700, 600)  # never shrunk (previews stop at 512)
        assert image.text["parameters"] == "p\nSeed: 1, Size: 700x600"
        assert json.loads(image.text["omni_stream"]) == {"prompt": "p", "seed": 1}


@pytest.mark.parametrize("format, kind", [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")])
def test_encode_output_image_formats(format, kind):
    out = encode_output(_image_frame(40, 50), format)
    assert out.format == format and (out.width, out.height) == (50, 40)
    with Image.open(io.BytesIO(out.data)) as image:
        assert image.format == kind and image.size == (50, 40)


def test_encode_output_raw_and_latents():
    frame = _image_frame(6, 5)
    out = encode_output(frame, "raw")
    assert out.mime == "application/octet-stream" and len(out.data) == 6 * 5 * 3
    latent = Frame(request_id="r", step=1, total=1, data=torch.randn(5, 8, 9))
    assert (encode_output(latent, "raw").width, encode_output(latent, "raw").height) == (9, 8)
    assert encode_output(latent.data, "raw").height == 8  # a bare tensor too


def test_encode_output_video_gif_and_webp():
    for format, kind, mime in [("gif", "GIF", "image/gif"), ("webp", "WEBP", "image/webp")]:
        out = encode_output(_video_frame(), format, fps=10)
        got = (out.format, out.mime, out.frames, out.width, out.height)
        assert got == (format, mime, 3, 24, 16)
        with Image.open(io.BytesIO(out.data)) as anim:
            assert anim.format == kind and anim.n_frames == 3 and anim.size == (24, 16)


@needs_av
def test_encode_output_video_defaults_to_mp4():
    out = encode_output(_video_frame(3, 15, 24))
    assert (out.format, out.mime, out.frames, out.width, out.height) == (
        "mp4", "video/mp4", 3, 24, 16
    )
    (codec, pix_fmt, _), frames = _read_mp4(out.data)
    assert codec == "h264" and pix_fmt == "yuv420p" and len(frames) == 3


def test_encode_output_video_default_without_pyav_is_webp(no_av):
    assert encode_output(_video_frame()).format == "webp"
    with pytest.raises(ImportError, match=r"omni-stream\[video\]"):
        encode_output(_video_frame(), "mp4")


@pytest.mark.parametrize(
    "frame, format, quality, field",
    [
        (_image_frame(4, 4), "bmp", None, "format"),
        (_video_frame(), "png", None, "format"),
        (_video_frame(), "raw", None, "format"),
        (_image_frame(4, 4), "png", 80, "quality"),
        (_image_frame(4, 4), "jpeg", 0, "quality"),
        (_video_frame(), "gif", 80, "quality"),
    ],
)
def test_encode_output_checks_its_options(frame, format, quality, field):
    with pytest.raises(ParamsError) as info:
        encode_output(frame, format, quality)
    assert info.value.field == field


def test_check_output():
    for format in ("png", "jpeg", "webp", "raw", "gif", None):
        check_output(format)
    check_output("jpeg", 90)
    for format, quality, field in [
        ("bmp", None, "format"), (3, None, "format"), ("png", 9, "quality"),
        ("jpeg", 101, "quality"), (None, 80, "quality"),
    ]:
        with pytest.raises(ParamsError) as info:
            check_output(format, quality)
        assert info.value.field == field


@needs_av
def test_check_output_mp4_with_pyav():
    check_output("mp4", 80)


# -- PreviewWriter ---------------------------------------------------------------------


def _preview(step: int, size: int = 32, format: str = "raw") -> EncodedImage:
    data = torch.full((3, size, size), -1 + step / 5)
    return render_sync(data, PreviewSpec(format=format, max_size=None))


def test_writer_folder_of_numbered_pngs(tmp_path):
    writer = PreviewWriter(tmp_path / "previews", total=12345)
    assert writer.format == "png" and (tmp_path / "previews").is_dir()
    for step in (1, 2, 10):
        writer.add(step, _preview(step, format=writer.format))
    writer.add(11, _preview(11))  # raw, encoded here
    writer.add(12, _preview(12, format="jpeg"))  # kept as it is
    writer.close()
    names = sorted(p.name for p in (tmp_path / "previews").iterdir())
    assert names == [
        "step_00001.png", "step_00002.png", "step_00010.png", "step_00011.png", "step_00012.jpg"
    ]
    assert writer.written == 5
    with Image.open(tmp_path / "previews" / "step_00011.png") as image:
        assert image.size == (32, 32)


def test_writer_uses_an_existing_folder_whatever_its_name(tmp_path):
    (tmp_path / "run.v2").mkdir()
    writer = PreviewWriter(tmp_path / "run.v2")
    writer.add(1, _rgb())
    assert (tmp_path / "run.v2" / "step_0001.png").exists()


def test_writer_refuses_a_file_where_the_folder_goes(tmp_path):
    (tmp_path / "previews").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        PreviewWriter(tmp_path / "previews")


@pytest.mark.parametrize("name", ["out.png", "out.avi", "out.jpeg", "run.v2"])
def test_writer_rejects_other_suffixes_at_construction(tmp_path, name):
    with pytest.raises(ValueError) as info:
        PreviewWriter(tmp_path / name)
    message = str(info.value)
    assert "\n" not in message
    assert ".gif, .webp, .mp4 or a folder (no suffix)" in message
    assert name[name.rfind(".") :] in message
    assert list(tmp_path.iterdir()) == []


def _writer_frames(path, kind):
    if kind == "mp4":
        _, frames = _read_mp4(path)
        return frames
    with Image.open(path) as anim:
        frames = []
        for i in range(anim.n_frames):
            anim.seek(i)
            frames.append(np.asarray(anim.convert("RGB")))
        return frames


@pytest.mark.parametrize("kind", ["gif", "webp", pytest.param("mp4", marks=needs_av)])
def test_writer_animations_scale_frames_to_the_last(tmp_path, kind):
    path = tmp_path / "deep" / f"previews.{kind}"
    with PreviewWriter(path, fps=10) as writer:
        assert writer.format == "raw"
        writer.add(1, _preview(1, size=8))  # a small latent preview
        writer.add(2, _preview(3, size=8))
        writer.add(3, _preview(5, size=32, format="png"))  # the final, decoded image
        assert not path.exists()  # written on close
    assert writer.written == 3
    frames = _writer_frames(path, kind)
    assert all(f.shape == (32, 32, 3) for f in frames)
    # The last frame is held for a second: 10 repeats at 10 fps in an mp4.
    assert len(frames) == (12 if kind == "mp4" else 3)
    means = [f.mean() for f in frames]
    assert means[0] < means[1] < means[2]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    writer.close()  # a second close does nothing


def test_writer_holds_the_last_frame(tmp_path):
    with PreviewWriter(tmp_path / "p.gif", fps=10) as writer:
        for step in (1, 2, 3):
            writer.add(step, _preview(step))
    with Image.open(tmp_path / "p.gif") as gif:
        durations = []
        for i in range(gif.n_frames):
            gif.seek(i)
            durations.append(gif.info["duration"])
    assert durations == [100, 100, 1000]


def test_writer_without_frames_writes_nothing_and_refuses_adds_after_close(tmp_path):
    writer = PreviewWriter(tmp_path / "p.webp")
    writer.close()
    assert not (tmp_path / "p.webp").exists() and writer.written == 0
    with pytest.raises(ValueError, match="closed"):
        writer.add(1, _rgb())


def test_writer_checks_fps(tmp_path):
    with pytest.raises(ParamsError) as info:
        PreviewWriter(tmp_path / "p.gif", fps=-1)
    assert info.value.field == "fps"


def test_writer_takes_arrays_and_encoded_stills(tmp_path):
    with PreviewWriter(tmp_path / "p.webp") as writer:
        writer.add(1, _rgb(8, 8))
        writer.add(2, encode(_rgb(8, 8, seed=1), format="jpeg"))
    assert writer.written == 2


def test_encode_output_takes_params_positionally():
    # The server calls encode_output(frame, format, quality, params).
    out = encode_output(_image_frame(4, 4), "png", None, {"seed": 3})
    with Image.open(io.BytesIO(out.data)) as image:
        assert image.text["parameters"] == "Seed: 3, Size: 4x4"


@pytest.mark.asyncio
async def test_previewer_run_sync_encodes_the_output_in_a_preview_thread():
    import threading

    from omni_stream.preview import Previewer

    loop_thread = threading.get_ident()
    seen = []

    def encode_in_thread(frame, format):
        seen.append(threading.get_ident())
        return encode_output(frame, format)

    out = await Previewer().run_sync(encode_in_thread, _image_frame(8, 8), "jpeg")
    assert out.format == "jpeg" and (out.width, out.height) == (8, 8)
    assert seen and seen[0] != loop_thread


def test_check_output_path_before_the_kind_is_known(tmp_path):
    from omni_stream.preview import check_output_path

    assert check_output_path("a.PNG") == "png"
    assert check_output_path(tmp_path / "a.jpg") == "jpeg"
    assert check_output_path("a.webp") == "webp"  # a still or an animation: both fit
    assert check_output_path("a.mp4") == "mp4" and check_output_path("a.gif") == "gif"
    assert check_output_path("a.webp", video=True) == "webp"
    with pytest.raises(ValueError, match=r"unknown file suffix '\.bmp'.*\.png.*\.mp4"):
        check_output_path("a.bmp")
    with pytest.raises(ValueError, match=r"cannot save an image as '\.gif'"):
        check_output_path("a.gif", video=False)
    with pytest.raises(ValueError, match=r"'\(none\)'"):
        check_output_path("out")


def test_a_still_saves_and_encodes_as_a_one_frame_video(tmp_path):
    # A video model asked for num_frames=1 makes a still; its result still
    # goes out in the video format asked for.
    pytest.importorskip("av")
    frame = Frame("r", 2, 2, torch.zeros(3, 8, 6), decoded=True)
    path = frame.save(tmp_path / "one.mp4")
    (codec, _, _), frames = _read_mp4(path)
    assert codec == "h264" and len(frames) == 1
    out = encode_output(frame, "gif")
    assert (out.format, out.frames, out.width, out.height) == ("gif", 1, 6, 8)
