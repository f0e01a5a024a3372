"""Frame.image(), Frame.images() and Frame.save(): real files, read back."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import omni_stream.frame as frame_module
from omni_stream.errors import ParamsError
from omni_stream.frame import Frame
from omni_stream.preview import PreviewSpec, decode_rgb, decode_sd15, decode_sdxl, render_sync

try:
    import av
except ImportError:  # pragma: no cover - the video extra is optional
    av = None


def _frame(data: torch.Tensor, *, decoded: bool = False) -> Frame:
    return Frame(request_id="r", step=3, total=3, data=data, decoded=decoded)


def _image(h: int = 12, w: int = 10) -> Frame:
    data = torch.rand(3, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return _frame(data, decoded=True)


def _video(t: int = 3, h: int = 12, w: int = 10) -> Frame:
    levels = torch.arange(t, dtype=torch.float32).view(t, 1, 1, 1) / t * 1.5 - 0.75
    return _frame(levels.expand(t, 3, h, w).contiguous(), decoded=True)


def test_frame_module_imports_no_pillow_or_previews_at_import_time():
    # The engine imports frame.py; the image methods import what they need when called.
    tree = ast.parse(Path(frame_module.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top for a in n.names} | {
        n.module or "" for n in top if isinstance(n, ast.ImportFrom)
    }
    assert not any("PIL" in n or "preview" in n for n in names), names


# -- image / images ------------------------------------------------------------------


def test_image_of_a_decoded_frame():
    frame = _image()
    image = frame.image()
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (10, 12)
    np.testing.assert_array_equal(np.asarray(image), decode_rgb(frame.data))


def test_image_of_a_latent_uses_auto_or_the_given_decoder():
    latent = torch.randn(4, 8, 6)
    frame = _frame(latent)
    np.testing.assert_array_equal(np.asarray(frame.image()), decode_sd15(latent))
    np.testing.assert_array_equal(np.asarray(frame.image(decoder="sdxl")), decode_sdxl(latent))
    assert _frame(torch.randn(7, 8, 6)).image().size == (6, 8)


def test_image_of_a_video_frame_is_its_strip_as_the_previews_show_it():
    # An intermediate frame of a video model is a video too: image() must
    # give the picture the previews draw (PreviewSpec's default "strip").
    for frame in (_video(4), _frame(torch.randn(16, 3, 4, 6))):
        assert frame.is_video
        frames = frame.images()
        strip = frame.image()
        assert strip.size == (sum(f.width for f in frames), frames[0].height)
        np.testing.assert_array_equal(
            np.asarray(strip), np.concatenate([np.asarray(f) for f in frames], axis=1))
        preview = render_sync(frame, PreviewSpec(format="png", max_size=None))
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(preview.data))), np.asarray(strip))


def test_images_of_a_video_and_of_an_image():
    images = _video(4).images()
    assert len(images) == 4 and all(i.size == (10, 12) for i in images)
    means = [np.asarray(i).mean() for i in images]
    assert means == sorted(means) and means[0] < means[-1]
    latent_frames = _frame(torch.randn(16, 5, 4, 6)).images()
    assert len(latent_frames) == 5 and latent_frames[0].size == (6, 4)
    only = _image().images()
    assert len(only) == 1 and only[0].size == (10, 12)


def test_image_raises_params_error_when_the_decoder_does_not_fit():
    with pytest.raises(ParamsError) as info:
        _frame(torch.randn(4, 8, 8)).image(decoder="sd3")
    assert info.value.field == "frame"


# -- save: images ----------------------------------------------------------------------


def test_save_png_with_params(tmp_path):
    frame = _image()
    params = {"prompt": "cat", "steps": 3, "seed": 7, "model": "mixture"}
    path = frame.save(tmp_path / "out.png", params=params)
    assert path == tmp_path / "out.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (10, 12)
        np.testing.assert_array_equal(np.asarray(image), decode_rgb(frame.data))
        assert image.text["parameters"] == "cat\nSteps: 3, Seed: 7, Size: 10x12, Model: mixture"
        assert json.loads(image.text["omni_stream"]) == params


@pytest.mark.parametrize("name, kind", [("a.jpg", "JPEG"), ("a.jpeg", "JPEG"), ("a.webp", "WEBP")])
def test_save_lossy_images(tmp_path, name, kind):
    path = _image(20, 30).save(str(tmp_path / name), quality=90)
    with Image.open(path) as image:
        assert image.format == kind and image.size == (30, 20)
        assert not getattr(image, "is_animated", False)


def test_save_a_latent_frame_through_auto(tmp_path):
    path = _frame(torch.randn(16, 9, 11)).save(tmp_path / "latent.png")
    with Image.open(path) as image:
        assert image.size == (11, 9)


def test_save_rejects_unknown_and_mismatched_suffixes(tmp_path):
    known = r"'\.bmp'.*\.png, \.jpg, \.jpeg, \.webp.*\.mp4, \.webp, \.gif"
    with pytest.raises(ValueError, match=known):
        _image().save(tmp_path / "out.bmp")
    with pytest.raises(ValueError, match=r"cannot save a video as '\.png'"):
        _video().save(tmp_path / "out.png")
    assert list(tmp_path.iterdir()) == []


def test_save_checks_options(tmp_path):
    with pytest.raises(ParamsError) as info:
        _image().save(tmp_path / "out.png", quality=80)
    assert info.value.field == "quality"
    with pytest.raises(ParamsError) as info:
        _image().save(tmp_path / "out.png", fps=10)
    assert info.value.field == "fps"


# -- save: videos ------------------------------------------------------------------------


def test_save_gif(tmp_path):
    path = _video(3).save(tmp_path / "out.gif", fps=4)
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.n_frames == 3 and gif.size == (10, 12)
        assert gif.info["duration"] == 250


def test_save_animated_webp(tmp_path):
    path = _video(3).save(tmp_path / "out.webp")
    with Image.open(path) as webp:
        assert webp.format == "WEBP" and webp.is_animated and webp.n_frames == 3
        webp.load()
        assert webp.info["duration"] == round(1000 / 16)  # DEFAULT_FPS


@pytest.mark.skipif(av is None, reason="PyAV (the video extra) is not installed")
def test_save_mp4(tmp_path):
    frame = _video(4, 12, 9)  # odd width: padded to even for yuv420p
    path = frame.save(tmp_path / "out.mp4", fps=8)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.average_rate == 8
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 4 and frames[0].shape == (12, 10, 3)
    expected = [np.asarray(i) for i in frame.images()]
    for got, want in zip(frames, expected):
        assert np.abs(got[:, :9].astype(int) - want).mean() < 4


def test_save_mp4_without_pyav_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=r'pip install "omni-stream\[video\]"'):
        _video().save(tmp_path / "out.mp4")


def test_the_engines_fast_frame_is_the_dataclasses_own_field_for_field_and_as_frozen() -> None:
    import dataclasses

    import torch

    from omni_stream.frame import Frame, StepTimings, engine_frame

    data = torch.arange(6.0).view(1, 2, 3)
    fast = engine_frame("r", 3, 9, data, 0.25, 0.5, 0.125, 4, 0.0625, True, 2)
    slow = Frame("r", 3, 9, data, StepTimings(0.25, 0.5, 0.125, 4, 0.0625), True, None, 2)
    # A field added to either class and not set by engine_frame is missing (AttributeError) or
    # differs here: every field is compared, by name.
    for cls, a, b in ((Frame, fast, slow), (StepTimings, fast.timings, slow.timings)):
        for field in dataclasses.fields(cls):
            assert getattr(a, field.name) is getattr(b, field.name) or getattr(a, field.name) == getattr(
                b, field.name
            ), field.name
    assert fast == slow and hash(fast.timings) == hash(slow.timings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.step = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.timings.copy_s = 1.0  # type: ignore[misc]
