"""The auto decoder: every supported rank and channel count previews."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from omni_stream.errors import ParamsError
from omni_stream.frame import Frame
from omni_stream.preview import (
    DECODERS,
    PreviewSpec,
    decode_auto,
    decode_flux,
    decode_frame,
    decode_rgb,
    decode_sd3,
    decode_sd15,
    default_decoder,
    render_sync,
)
from omni_stream.preview import decode as D


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _frame(data: torch.Tensor, *, decoded: bool = False) -> Frame:
    return Frame(request_id="r", step=1, total=1, data=data, decoded=decoded)


# -- the choice ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, named",
    [
        ((3, 6, 5), decode_rgb),
        ((6, 5, 3), decode_rgb),
        ((1, 3, 6, 5), decode_rgb),
        ((4, 6, 5), decode_sd15),
        ((1, 4, 6, 5), decode_sd15),
        ((16, 6, 5), decode_sd3),
        ((16, 6, 6), decode_sd3),
        ((64, 64), None),  # [64, 64] is a grey image, not 8x8 Flux tokens
        ((16, 64), decode_flux),  # 16 tokens: a packed 8x8 Flux latent
        ((1, 256, 64), decode_flux),
    ],
)
def test_auto_picks_the_family_decoder_by_shape(shape, named):
    t = torch.randn(*shape, generator=_gen())
    got = decode_auto(t)
    if named is None:
        assert got.shape == (64, 64, 3)
        assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all()
    else:
        np.testing.assert_array_equal(got, named(t))


def test_auto_channels_first_wins_like_rgb():
    t = torch.rand(3, 4, 3) * 2 - 1
    np.testing.assert_array_equal(decode_auto(t), decode_rgb(t))


def test_auto_uint8_pixels():
    rgb = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8, generator=_gen())
    np.testing.assert_array_equal(decode_auto(rgb), rgb.permute(1, 2, 0).numpy())
    # RGBA drops its alpha; a uint8 [H, W] is grey pixels, as they are.
    rgba = torch.randint(0, 256, (4, 4, 5), dtype=torch.uint8, generator=_gen(1))
    np.testing.assert_array_equal(decode_auto(rgba), rgba[:3].permute(1, 2, 0).numpy())
    grey = torch.randint(0, 256, (4, 5), dtype=torch.uint8, generator=_gen(2))
    np.testing.assert_array_equal(decode_auto(grey), np.repeat(grey.numpy()[..., None], 3, 2))
    # Other uint8 channel counts project, like floats.
    assert decode_auto(torch.zeros(7, 4, 5, dtype=torch.uint8)).shape == (4, 5, 3)


@pytest.mark.parametrize("shape", [(6, 5), (1, 6, 5), (1, 1, 6, 5), (6, 5, 1), (1, 1, 1, 6, 5)])
def test_one_channel_is_grey_with_the_rgb_value_map(shape):
    values = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
    t = values.repeat(5, 1).T.contiguous()  # [6, 5]: row i is values[i]
    got = decode_frame(t.reshape(shape))
    assert got.shape == (6, 5, 3)
    assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all()
    assert got[:, 0, 0].tolist() == [0, 64, 128, 191, 255, 255]


def test_grey_nan_is_black():
    t = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0]])
    assert decode_auto(t)[0, :, 0].tolist() == [0, 255, 0, 128]


# -- the projection for other channel counts -------------------------------------


@pytest.mark.parametrize("channels", [2, 5, 7, 8, 12, 32, 128])
def test_other_channel_counts_project_to_rgb(channels):
    t = torch.randn(channels, 16, 12, generator=_gen(channels))
    got = decode_auto(t)
    assert got.shape == (16, 12, 3) and got.dtype == np.uint8
    # Normalised to the frame: a Gaussian latent uses the whole range.
    assert got.min() < 40 and got.max() > 215


def test_projection_is_fixed_and_deterministic():
    t = torch.randn(5, 8, 8, generator=_gen())
    first = decode_auto(t)
    np.testing.assert_array_equal(first, decode_auto(t.clone()))
    # The weights come from a frozen numpy stream (RandomState), not from the frame.
    expected = np.random.RandomState(D._PROJECTION_SEED).standard_normal((5, 3))
    np.testing.assert_allclose(np.array(D._projection(5)), expected)
    # The first C rows are the same for every channel count: stable colours.
    np.testing.assert_allclose(np.array(D._projection(7))[:5], expected)


def test_projection_normalises_each_frame_to_its_own_statistics():
    t = torch.randn(5, 16, 16, generator=_gen())
    base = decode_auto(t).astype(int)
    # Mean +- 2 std is affine-invariant: scale and shift do not change the picture.
    scaled = decode_auto(t * 40 + 7).astype(int)
    assert np.abs(scaled - base).max() <= 1


def test_projection_is_nan_safe():
    t = torch.randn(5, 8, 8, generator=_gen())
    t[:, 0, 0] = float("nan")
    t[2, 1, 1] = float("inf")
    got = decode_auto(t)
    assert got[0, 0].tolist() == [0, 0, 0]
    # The other pixels still spread over the range (inf and NaN left out of the stats).
    assert got.max() > 200 and got[2:, 2:].min() < 60


@pytest.mark.parametrize("fill", [float("nan"), 0.0, 3.5, float("inf")])
def test_projection_of_degenerate_frames_does_not_raise(fill):
    got = decode_auto(torch.full((5, 4, 4), fill))
    assert got.shape == (4, 4, 3)
    if fill == fill and abs(fill) != float("inf"):  # a flat frame is mid-grey
        assert (got == 128).all()


# -- every supported rank ----------------------------------------------------------


@pytest.mark.parametrize(
    "shape, decoded, out",
    [
        ((6, 5), False, (6, 5, 3)),
        ((1, 6, 5), False, (6, 5, 3)),
        ((3, 6, 5), False, (6, 5, 3)),
        ((3, 6, 5), True, (6, 5, 3)),
        ((6, 5, 3), True, (6, 5, 3)),
        ((4, 6, 5), False, (6, 5, 3)),
        ((5, 6, 5), False, (6, 5, 3)),
        ((16, 6, 5), False, (6, 5, 3)),
        ((1, 4, 6, 5), False, (6, 5, 3)),  # a batch of one image
        ((1, 3, 6, 5), True, (6, 5, 3)),
        ((4, 2, 6, 5), False, (2, 6, 5, 3)),  # latent video [C, T, h, w]
        ((16, 3, 6, 5), False, (3, 6, 5, 3)),
        ((5, 3, 6, 5), False, (3, 6, 5, 3)),
        ((2, 3, 6, 5), True, (2, 6, 5, 3)),  # decoded video [T, 3, H, W]
        ((2, 6, 5, 3), True, (2, 6, 5, 3)),
        ((1, 4, 2, 6, 5), False, (2, 6, 5, 3)),
        ((1, 2, 3, 6, 5), True, (2, 6, 5, 3)),
        ((4096, 64), False, (128, 128, 3)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_supported_rank_previews(shape, decoded, out, dtype):
    t = torch.randn(*shape, generator=_gen()).to(dtype)
    got = decode_frame(_frame(t, decoded=decoded))
    assert got.shape == out and got.dtype == np.uint8
    # ... and renders through the default spec, which is auto.
    image = render_sync(_frame(t, decoded=decoded), PreviewSpec(format="png", max_size=None))
    width = out[-2] * (out[0] if len(out) == 4 else 1)
    assert (image.width, image.height) == (width, out[-3])
    assert Image.open(io.BytesIO(image.data)).size == (width, out[-3])


@pytest.mark.parametrize(
    "shape, text",
    [((), "got []"), ((7,), "got [7]"), ((2, 4, 2, 6, 5), "leading batch of 1"),
     ((1, 1, 1, 1, 1, 1), "got [1, 1, 1, 1, 1, 1]"), ((0, 5), "empty"), ((4, 0, 5), "empty")],
)
def test_unsupported_ranks_raise_params_error_naming_frame(shape, text):
    with pytest.raises(ParamsError, match=text.replace("[", r"\[")) as info:
        decode_frame(torch.zeros(shape))
    assert info.value.field == "frame"


def test_decoded_frames_are_pixels_whatever_the_decoder():
    rgb = torch.rand(3, 6, 5) * 2 - 1
    # A latent decoder (or a VAE callable) on the request's decoded output is
    # always wrong: decoded frames decode as pixels.
    for decoder in ("sd15", "flux", lambda t: 1 / 0):
        got = decode_frame(_frame(rgb, decoded=True), decoder)
        np.testing.assert_array_equal(got, decode_rgb(rgb))
    # Not decoded: the named decoder applies (and may not fit).
    with pytest.raises(ParamsError):
        decode_frame(_frame(rgb), "sd15")


def test_decode_frame_names_unknown_decoders():
    with pytest.raises(ParamsError) as info:
        decode_frame(torch.zeros(4, 4, 4), "vae")
    assert info.value.field == "decoder" and "auto" in str(info.value)


def test_decode_frame_none_means_auto():
    t = torch.randn(5, 4, 4, generator=_gen())
    np.testing.assert_array_equal(decode_frame(t, None), decode_auto(t))


# -- the model's default -------------------------------------------------------------


def test_default_decoder_is_the_models_name_or_auto():
    class Named:
        preview_decoder = "sdxl"

    class Unnamed:
        preview_decoder = None

    assert default_decoder(Named()) == "sdxl"
    assert default_decoder(Unnamed()) == "auto"
    assert default_decoder(object()) == "auto"
    assert default_decoder(type("Empty", (), {"preview_decoder": ""})()) == "auto"
    assert default_decoder(Named()) in DECODERS and "auto" in DECODERS


def test_spec_default_decoder_is_auto_also_on_the_wire():
    assert PreviewSpec().decoder == "auto" and PreviewSpec().decode is decode_auto
    assert PreviewSpec(decoder=None).decoder == "auto"
    assert PreviewSpec.from_dict({}).decoder == "auto"
    assert PreviewSpec.from_dict({}, decoder=None).decoder == "auto"
    assert PreviewSpec.from_dict({"decoder": "auto"}, decoder="sd15").decode is decode_auto


@pytest.mark.asyncio
async def test_a_five_and_a_one_channel_frame_preview_with_the_default_spec():
    from omni_stream.preview import Previewer

    previewer = Previewer()
    for data in (torch.randn(5, 32, 24, generator=_gen()), torch.randn(1, 32, 24)):
        image = await previewer.render(_frame(data), PreviewSpec())
        assert (image.format, image.width, image.height) == ("jpeg", 24, 32)
        assert Image.open(io.BytesIO(image.data)).size == (24, 32)


# -- the numpy-only rule ---------------------------------------------------------------


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "data, decoded",
    [
        (torch.randn(5, 8, 8, requires_grad=True), False),
        (torch.randn(1, 8, 8).half(), False),
        (torch.randn(8, 8).bfloat16(), False),
        (torch.randn(1, 64, 64), False),
        (torch.randn(4, 3, 8, 8), False),
        (torch.randn(7, 3, 8, 8).bfloat16(), False),
        (torch.randn(3, 3, 8, 8), True),
        (torch.randn(1, 16, 2, 8, 8), False),
    ],
)
def test_auto_and_videos_run_no_torch_compute(data, decoded):
    frame = _frame(data, decoded=decoded)
    with _Record() as rec:
        decode_frame(frame)
        decode_auto(data)
    assert set(rec.ops) <= {"aten.detach.default", "aten.view.dtype"}, rec.ops


def test_a_decoder_registered_by_name_runs_like_a_callable(monkeypatch):
    def mine(t: torch.Tensor) -> np.ndarray:
        return np.full((2, 3, 3), 5, np.uint8)

    monkeypatch.setitem(DECODERS, "mine", mine)
    got = render_sync(torch.zeros(7, 7), PreviewSpec(decoder="mine", format="raw"))
    assert (got.width, got.height) == (3, 2) and set(got.data) == {5}
