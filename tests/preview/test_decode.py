"""Decoders: exact pixels per family, shapes, dtypes, Flux packing, the registry."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_stream.errors import ParamsError
from omni_stream.preview import decode as D

# The factors as published (landscape.md / ComfyUI), typed in again here so a
# typo in the module's copy cannot pass by comparing the table with itself.
REFERENCE = {
    "sd15": (
        [[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350],
         [-0.2829, 0.1762, 0.2721], [-0.2120, -0.2616, -0.7177]],
        [0.0, 0.0, 0.0],
    ),
    "sdxl": (
        [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068],
         [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]],
        [0.1084, -0.0175, -0.0011],
    ),
    "sd3": (
        [[-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458],
         [0.0856, 0.0339, 0.0902], [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309],
         [0.0978, 0.0306, 0.0427], [-0.0042, 0.1038, 0.1358], [-0.0194, 0.0020, 0.0669],
         [-0.0488, 0.0130, -0.0268], [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542],
         [0.0332, 0.0456, 0.0895], [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293],
         [-0.1448, -0.1463, -0.1189]],
        [0.2394, 0.2135, 0.1925],
    ),
    "flux": (
        [[-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
         [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115],
         [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180],
         [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
         [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499],
         [-0.1262, -0.0982, -0.0778]],
        [-0.0329, -0.0718, -0.0851],
    ),
}
CHANNELS = {"sd15": 4, "sdxl": 4, "sd3": 16, "flux": 16}


def _latent_with(family: str, values: dict[int, float]) -> torch.Tensor:
    """A [C, 2, 3] latent, zero except at pixel (1, 2)."""
    t = torch.zeros(CHANNELS[family], 2, 3)
    for c, v in values.items():
        t[c, 1, 2] = v
    return t


# Expected pixels worked out by hand: (latent @ factors + bias + 1) * 127.5,
# clamped, rounded half up. E.g. sd15 channel 0 = 1: R = 1.3512 * 127.5 = 172.28.
@pytest.mark.parametrize(
    "family, values, expected",
    [
        ("sd15", {}, [128, 128, 128]),
        ("sd15", {0: 1.0}, [172, 157, 169]),
        ("sd15", {3: 1.0}, [100, 94, 36]),
        ("sd15", {0: 10.0}, [255, 255, 255]),
        ("sd15", {0: -10.0}, [0, 0, 0]),
        ("sdxl", {}, [141, 125, 127]),
        ("sdxl", {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, [129, 161, 164]),
        ("sd3", {}, [158, 155, 152]),
        ("sd3", {15: 2.0}, [121, 117, 122]),
        ("flux", {}, [123, 118, 117]),
        ("flux", {0: 10.0}, [79, 149, 203]),
    ],
)
def test_latent_pixels_match_hand_computed_values(family, values, expected):
    rgb = D.decoder_for(family)(_latent_with(family, values))
    assert rgb.dtype == np.uint8 and rgb.shape == (2, 3, 3)
    assert rgb[1, 2].tolist() == expected
    assert rgb.flags.c_contiguous


def _reference_decode(family: str, latent: np.ndarray) -> np.ndarray:
    factors, bias = REFERENCE[family]
    c, h, w = latent.shape
    out = np.zeros((h, w, 3), dtype=np.uint8)
    for y in range(h):
        for x in range(w):
            for k in range(3):
                v = bias[k] + sum(float(latent[ch, y, x]) * factors[ch][k] for ch in range(c))
                out[y, x, k] = min(255, max(0, int((v + 1) * 127.5 + 0.5)))
    return out


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_latent_decoders_match_a_per_pixel_reference(family):
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(CHANNELS[family], 5, 7, generator=gen) * 2
    got = D.decoder_for(family)(latent).astype(int)
    want = _reference_decode(family, latent.numpy()).astype(int)
    # float32 sums vs Python floats may land either side of a .5 boundary.
    assert np.abs(got - want).max() <= 1
    assert (got == want).mean() > 0.95


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_latent_decoders_take_a_batch_of_one(family):
    latent = torch.randn(CHANNELS[family], 4, 6)
    decode = D.decoder_for(family)
    np.testing.assert_array_equal(decode(latent[None]), decode(latent))


@pytest.mark.parametrize(
    "family, shape",
    [
        ("sd15", (3, 8, 8)),
        ("sd15", (16, 8, 8)),
        ("sd15", (2, 4, 8, 8)),
        ("sd15", (4, 8)),
        ("sdxl", (8, 8, 4)),
        ("sd3", (4, 8, 8)),
        ("flux", (4, 8, 8)),
        ("flux", (10, 64)),  # 10 packed tokens are not a square grid
        ("flux", (2, 16, 64)),  # batch of 2
        ("flux", (16, 32)),  # packed rows must have 64 channels
        ("rgb", (4, 8, 8)),
        ("rgb", (8, 8)),
        ("rgb", (2, 3, 8, 8)),
        ("rgb", (8, 8, 4)),
    ],
)
def test_shapes_that_fit_nothing_raise_params_error_naming_frame(family, shape):
    with pytest.raises(ParamsError) as info:
        D.decoder_for(family)(torch.zeros(shape))
    assert info.value.field == "frame"
    assert family in str(info.value) or "token" in str(info.value)
    if "token" not in str(info.value):
        assert "[" + ", ".join(map(str, shape)) + "]" in str(info.value)


def test_rgb_maps_minus_one_one_to_bytes_and_clamps_nan_and_inf():
    t = torch.tensor(
        [[[-1.0, 0.0, 1.0, 0.5]], [[2.0, -2.0, float("nan"), float("inf")]],
         [[float("-inf"), 0.999, -0.999, 0.25]]]
    )
    with warnings.catch_warnings():
        # Casting NaN to uint8 warns (every step) and is platform-defined.
        warnings.simplefilter("error")
        rgb = D.decode_rgb(t)
    assert rgb.shape == (1, 4, 3)
    # 0 -> 127.5 -> 128 (half up); 0.5 -> 191.25 -> 191; 0.25 -> 159.375 -> 159
    assert rgb[0, :, 0].tolist() == [0, 128, 255, 191]
    assert rgb[0, :, 1].tolist() == [255, 0, 0, 255]
    assert rgb[0, :, 2].tolist() == [0, 255, 0, 159]


def test_rgb_channels_last_batch_and_uint8():
    chw = torch.rand(3, 5, 7) * 2 - 1
    want = D.decode_rgb(chw)
    np.testing.assert_array_equal(D.decode_rgb(chw.permute(1, 2, 0).contiguous()), want)
    np.testing.assert_array_equal(D.decode_rgb(chw[None]), want)
    # A non-contiguous view reads the same values.
    np.testing.assert_array_equal(D.decode_rgb(chw.permute(1, 2, 0)), want)
    pixels = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)
    np.testing.assert_array_equal(D.decode_rgb(pixels), pixels.permute(1, 2, 0).numpy())
    hwc = pixels.permute(1, 2, 0)
    np.testing.assert_array_equal(D.decode_rgb(hwc), hwc.numpy())


def test_rgb_channels_first_wins_when_both_fit():
    t = torch.zeros(3, 4, 3)
    t[0] = 1.0  # the red plane, if channels come first
    rgb = D.decode_rgb(t)
    assert rgb.shape == (4, 3, 3)
    assert (rgb[..., 0] == 255).all() and (rgb[..., 1] == 128).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("family", ["rgb", "sd15", "flux"])
def test_narrow_and_wide_floats_decode_like_float32(family, dtype):
    shape = {"rgb": (3, 6, 5), "sd15": (4, 6, 5), "flux": (16, 6, 4)}[family]
    gen = torch.Generator().manual_seed(1)
    # Values exactly representable in every dtype, negatives included (the
    # bfloat16 path reinterprets sign bits).
    t = (torch.randint(-64, 64, shape, generator=gen).float() / 64).to(dtype)
    np.testing.assert_array_equal(D.decoder_for(family)(t), D.decoder_for(family)(t.float()))


def test_bfloat16_bits_are_widened_exactly():
    values = torch.tensor([0.0, -0.0, 1.0, -1.5, 3.140625, -1e-3, 1e30, float("inf")])
    got = D.tensor_to_numpy(values.bfloat16())
    np.testing.assert_array_equal(got, values.bfloat16().float().numpy())


def test_decoders_run_no_torch_compute():
    # A torch kernel here would start a second OpenMP team that fights the
    # producer thread's; only tensor-header views are allowed.
    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    cases = [
        ("rgb", torch.randn(3, 8, 8, requires_grad=True)),
        ("sd15", torch.randn(1, 4, 8, 8).half()),
        ("sdxl", torch.randn(4, 8, 8).bfloat16()),
        ("sd3", torch.randn(16, 8, 8)),
        ("flux", torch.randn(1, 16, 64).bfloat16()),
    ]
    for name, t in cases:
        with Record() as rec:
            D.decoder_for(name)(t)
        assert set(rec.ops) <= {"aten.detach.default", "aten.view.dtype"}, (name, rec.ops)


@pytest.mark.parametrize(
    "t, field_text",
    [
        (torch.zeros(3, 4, 4, dtype=torch.int32), "dtype"),
        (torch.zeros(3, 4, 4, dtype=torch.bool), "dtype"),
        (torch.zeros(3, 4, 4, device="meta"), "CPU"),
        (np.zeros((3, 4, 4), np.float32), "torch.Tensor"),
    ],
)
def test_unreadable_frames_raise_params_error(t, field_text):
    with pytest.raises(ParamsError) as info:
        D.decode_rgb(t)
    assert info.value.field == "frame"
    assert field_text in str(info.value)


def test_latent_decoders_reject_uint8():
    with pytest.raises(ParamsError, match="floating-point") as info:
        D.decode_sd15(torch.zeros(4, 4, 4, dtype=torch.uint8))
    assert info.value.field == "frame"


# -- Flux packing ------------------------------------------------------------


def diffusers_pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """FluxPipeline._pack_latents from diffusers, verbatim in substance."""
    batch_size, num_channels_latents, height, width = latents.shape
    latents = latents.view(batch_size, num_channels_latents, height // 2, 2, width // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(batch_size, (height // 2) * (width // 2), num_channels_latents * 4)


def diffusers_unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """FluxPipeline._unpack_latents, in latent pixels (diffusers takes image pixels)."""
    batch_size, _, channels = latents.shape
    latents = latents.view(batch_size, height // 2, width // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch_size, channels // 4, height, width)


def test_unpack_flux_inverts_diffusers_packing_and_matches_its_unpack():
    latent = torch.randn(1, 16, 6, 10)
    packed = diffusers_pack_latents(latent)
    assert packed.shape == (1, 15, 64)
    got = D.unpack_flux(packed[0].numpy(), latent_size=(6, 10))
    np.testing.assert_array_equal(got, latent[0].numpy())
    np.testing.assert_array_equal(got, diffusers_unpack_latents(packed, 6, 10)[0].numpy())


def test_unpack_flux_follows_the_written_rule():
    latent = torch.arange(16 * 4 * 4, dtype=torch.float32).view(1, 16, 4, 4)
    packed = diffusers_pack_latents(latent)[0]
    w2 = 2
    for c, y, x in [(0, 0, 0), (5, 1, 3), (15, 3, 2), (7, 2, 1)]:
        i, dy, j, dx = y // 2, y % 2, x // 2, x % 2
        assert packed[i * w2 + j, c * 4 + dy * 2 + dx] == latent[0, c, y, x]


@pytest.mark.parametrize("form", ["packed", "packed-batch", "unpacked", "unpacked-batch"])
def test_flux_decodes_packed_and_unpacked_alike(form):
    latent = torch.randn(1, 16, 8, 8)
    want = D.decode_flux(latent[0])
    t = {
        "packed": diffusers_pack_latents(latent)[0],
        "packed-batch": diffusers_pack_latents(latent),
        "unpacked": latent[0],
        "unpacked-batch": latent,
    }[form]
    got = D.decode_flux(t)
    assert got.shape == (8, 8, 3)
    np.testing.assert_array_equal(got, want)


def test_flux_non_square_packed_needs_latent_size():
    latent = torch.randn(1, 16, 4, 8)
    packed = diffusers_pack_latents(latent)
    with pytest.raises(ParamsError, match="not square") as info:
        D.decode_flux(packed)  # 8 tokens
    assert info.value.field == "frame"
    decode = D.decoder_for(functools.partial(D.decode_flux, latent_size=(4, 8)))
    np.testing.assert_array_equal(decode(packed), D.decode_flux(latent))
    with pytest.raises(ParamsError, match="does not fit"):
        D.decode_flux(packed, latent_size=(8, 8))
    with pytest.raises(ParamsError, match="does not fit"):
        D.decode_flux(packed, latent_size=(3, 8))


# -- the registry ------------------------------------------------------------


def test_decoder_for_names():
    assert set(D.DECODERS) == {"auto", "rgb", "sd15", "sdxl", "sd3", "flux", "taesd"}
    assert D.decoder_for("auto") is D.decode_auto
    assert D.decoder_for("sd15") is D.decode_sd15
    assert D.decoder_for("rgb") is D.decode_rgb


def test_decoder_for_unknown_name_lists_known_names():
    with pytest.raises(ParamsError) as info:
        D.decoder_for("sd2")
    assert info.value.field == "decoder"
    for name in D.DECODERS:
        assert name in str(info.value)


@pytest.mark.parametrize("bad", [None, 3, b"rgb"])
def test_decoder_for_rejects_non_callables(bad):
    with pytest.raises(ParamsError) as info:
        D.decoder_for(bad)
    assert info.value.field == "decoder"


def test_decoder_for_wraps_a_user_callable():
    seen = []

    def tiny_vae(t: torch.Tensor) -> np.ndarray:
        seen.append(tuple(t.shape))
        return np.full((2 * t.shape[1], 2 * t.shape[2], 3), 7, dtype=np.uint8)

    decode = D.decoder_for(tiny_vae)
    rgb = decode(torch.zeros(4, 3, 5))
    assert seen == [(4, 3, 5)]
    assert rgb.shape == (6, 10, 3) and (rgb == 7).all()


@pytest.mark.parametrize(
    "result",
    [
        np.zeros((4, 4, 3), dtype=np.float32),
        np.zeros((3, 4, 4), dtype=np.uint8),
        np.zeros((4, 4), dtype=np.uint8),
        [[0, 0, 0]],
        None,
    ],
)
def test_user_callable_with_a_bad_result_raises_params_error(result):
    decode = D.decoder_for(lambda t: result)
    with pytest.raises(ParamsError, match=r"uint8 numpy array shaped \[H, W, 3\]") as info:
        decode(torch.zeros(3, 4, 4))
    assert info.value.field == "decoder"


def test_user_callable_result_is_made_contiguous():
    decode = D.decoder_for(lambda t: np.zeros((3, 4, 5), dtype=np.uint8).transpose(1, 2, 0))
    rgb = decode(torch.zeros(1))
    assert rgb.shape == (4, 5, 3) and rgb.flags.c_contiguous


# -- taesd: the model's tiny autoencoder ------------------------------------------------


def test_taesd_is_a_decoder_name_that_draws_the_frames_the_tiny_vae_decoded():
    from omni_stream.frame import Frame

    assert D.decoder_for("taesd") is D.decode_taesd
    pixels = torch.rand(3, 8, 6, generator=torch.Generator().manual_seed(0)) * 2 - 1
    decoded = Frame(request_id="r", step=1, total=2, data=pixels, decoded=True)
    np.testing.assert_array_equal(D.decode_frame(decoded, "taesd"), D.decode_rgb(pixels))


def test_taesd_on_a_latent_it_never_saw_names_the_flag_and_the_variable():
    from omni_stream.frame import Frame

    latent = Frame(request_id="r", step=1, total=2, data=torch.randn(4, 8, 8))
    for call in (lambda: D.decode_frame(latent, "taesd"), lambda: D.decode_taesd(latent.data)):
        with pytest.raises(ParamsError) as info:
            call()
        assert info.value.field == "decoder"
        assert "--preview-vae" in info.value.message
        assert "OMNI_STREAM_PREVIEW_VAE" in info.value.message


def test_check_decoder_refuses_taesd_for_a_model_without_a_tiny_vae():
    import omni_stream as om

    class WithVae:
        name = "stub"
        preview_vae: object = None

    class OwnHook(om.models.Synthetic):
        def decode_preview(self, state, frame):  # a network of its own
            return None

    bare = WithVae()
    for model in (om.models.Mixture(), bare):
        with pytest.raises(ParamsError) as info:
            D.check_decoder("taesd", model)
        assert info.value.field == "decoder"
        assert "--preview-vae" in info.value.message and "OMNI_STREAM_PREVIEW_VAE" in info.value.message
        D.check_decoder("auto", model)  # other decoders are not its business
    bare.preview_vae = object()
    D.check_decoder("taesd", bare)
    D.check_decoder("taesd", OwnHook())
