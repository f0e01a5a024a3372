"""Decoders: one step's frame (a CPU tensor) to an RGB ``uint8`` array ``[H, W, 3]``.

Built-in decoders, by name:

``rgb``
    An image already: ``[3, H, W]`` (channels first, the models' convention)
    or ``[H, W, 3]``, floats in ``[-1, 1]`` or ``uint8`` in ``[0, 255]``.
    Channels first wins when both fit (``[3, H, 3]``).
``sd15``, ``sdxl``
    4-channel latents ``[4, h, w]``.
``sd3``
    16-channel latents ``[16, h, w]``.
``flux``
    16-channel latents ``[16, h, w]``, or diffusers' packed form ``[seq, 64]``
    (see :func:`unpack_flux`).
``taesd``
    The model's tiny autoencoder (``use_preview_vae``, ``--preview-vae``,
    ``OMNI_STREAM_PREVIEW_VAE``): it runs on the model's device and its
    frames arrive decoded, so here it only refuses a latent it never saw
    (see :func:`check_decoder`, which refuses it up front for a model
    without one).
``auto``
    Picks one of the above from the shape, and previews any other channel
    count too (see :func:`decode_auto`); what :func:`default_decoder` returns
    for a model that names no decoder.

Every decoder also takes a leading batch dimension of 1. Videos (``[C, T,
h, w]`` latents, ``[T, 3, H, W]`` pixels) go through :func:`decode_frame`,
which applies a decoder to each of the T frames. The latent decoders
are the linear latent-to-RGB approximations ComfyUI uses: each output pixel
is ``latent[:, y, x] @ factors + bias``, mapped from ``[-1, 1]`` to
``[0, 255]`` and clamped (NaN becomes 0), one pixel per latent pixel (so an
SD 1.5 512 px image previews at 64 px).

Why numpy, elementwise: decoders run in a preview thread while the engine's
producer thread computes the next step. A torch op here would start a second
OpenMP team that fights the producer's for the same cores (3-4x slower steps
on a 2-core box), and ``np.matmul`` may start a BLAS team. Numpy ufuncs are
single-threaded and release the GIL, so the math is written as explicit
per-channel multiply-adds, and tensors are read through ``Tensor.numpy()``
views (bfloat16 by reinterpreting its bits), never through torch compute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import torch

from ..config import PREVIEW_VAE_ENV
from ..errors import ParamsError
from ..frame import Frame

__all__ = [
    "Decoder",
    "DECODERS",
    "check_decoder",
    "LATENT_FACTORS",
    "decoder_for",
    "default_decoder",
    "decode_frame",
    "is_video",
    "decode_auto",
    "decode_rgb",
    "decode_sd15",
    "decode_sdxl",
    "decode_sd3",
    "decode_flux",
    "decode_taesd",
    "unpack_flux",
    "tensor_to_numpy",
]

#: A decoder: a frame tensor in, a C-contiguous ``uint8`` array ``[H, W, 3]`` out
#: (a user's callable may also return ``[T, H, W, 3]`` for a video).
Decoder: TypeAlias = Callable[[torch.Tensor], np.ndarray]

_Factors: TypeAlias = tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]

#: Latent-to-RGB factors (rows: latent channels; columns: R, G, B) and bias,
#: the public values ComfyUI uses (docs/previews.md cites them).
LATENT_FACTORS: dict[str, _Factors] = {
    "sd15": (
        (
            (0.3512, 0.2297, 0.3227),
            (0.3250, 0.4974, 0.2350),
            (-0.2829, 0.1762, 0.2721),
            (-0.2120, -0.2616, -0.7177),
        ),
        (0.0, 0.0, 0.0),
    ),
    "sdxl": (
        (
            (0.3651, 0.4232, 0.4341),
            (-0.2533, -0.0042, 0.1068),
            (0.1076, 0.1111, -0.0362),
            (-0.3165, -0.2492, -0.2188),
        ),
        (0.1084, -0.0175, -0.0011),
    ),
    "sd3": (
        (
            (-0.0922, -0.0175, 0.0749),
            (0.0311, 0.0633, 0.0954),
            (0.1994, 0.0927, 0.0458),
            (0.0856, 0.0339, 0.0902),
            (0.0587, 0.0272, -0.0496),
            (-0.0006, 0.1104, 0.0309),
            (0.0978, 0.0306, 0.0427),
            (-0.0042, 0.1038, 0.1358),
            (-0.0194, 0.0020, 0.0669),
            (-0.0488, 0.0130, -0.0268),
            (0.0922, 0.0988, 0.0951),
            (-0.0278, 0.0524, -0.0542),
            (0.0332, 0.0456, 0.0895),
            (-0.0069, -0.0030, -0.0810),
            (-0.0596, -0.0465, -0.0293),
            (-0.1448, -0.1463, -0.1189),
        ),
        (0.2394, 0.2135, 0.1925),
    ),
    "flux": (
        (
            (-0.0346, 0.0244, 0.0681),
            (0.0034, 0.0210, 0.0687),
            (0.0275, -0.0668, -0.0433),
            (-0.0174, 0.0160, 0.0617),
            (0.0859, 0.0721, 0.0329),
            (0.0004, 0.0383, 0.0115),
            (0.0405, 0.0861, 0.0915),
            (-0.0236, -0.0185, -0.0259),
            (-0.0245, 0.0250, 0.1180),
            (0.1008, 0.0755, -0.0421),
            (-0.0515, 0.0201, 0.0011),
            (0.0428, -0.0012, -0.0036),
            (0.0817, 0.0765, 0.0749),
            (-0.1264, -0.0522, -0.1103),
            (-0.0280, -0.0881, -0.0499),
            (-0.1262, -0.0982, -0.0778),
        ),
        (-0.0329, -0.0718, -0.0851),
    ),
}


def _shape(t: Any) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Return ``t`` as a numpy array without running a torch compute op.

    float32/float64/uint8 come back as zero-copy views; float16 and bfloat16
    are widened to float32 in numpy. Raises ParamsError (field ``frame``) for
    a non-tensor, a tensor not on the CPU, or a dtype no decoder reads.
    """
    if not isinstance(t, torch.Tensor):
        raise ParamsError(f"frame must be a torch.Tensor, got {type(t).__name__}", field="frame")
    if t.device.type != "cpu":
        raise ParamsError(f"frame must be a CPU tensor to preview, got one on {t.device}", field="frame")
    # detach() and view(dtype) only make new tensor headers: no kernels run.
    t = t.detach()
    dtype = t.dtype
    if dtype in (torch.float32, torch.float64, torch.uint8):
        return t.numpy()
    if dtype == torch.float16:
        return t.numpy().astype(np.float32)
    if dtype == torch.bfloat16:
        # bfloat16 is the top half of a float32: put its 16 bits there.
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    raise ParamsError(
        f"frame dtype {dtype} cannot be previewed; use float32, float16, bfloat16 or uint8",
        field="frame",
    )


def _float_array(a: np.ndarray, decoder: str) -> np.ndarray:
    if a.dtype == np.uint8:
        raise ParamsError(f"the {decoder} decoder needs a floating-point latent, got uint8", field="frame")
    return a


def _to_uint8(planes: np.ndarray) -> np.ndarray:
    """``[3, H, W]`` floats already scaled to pixel units plus 0.5 -> ``[H, W, 3]`` uint8."""
    # fmax/fmin (not clip) so NaN becomes 0 rather than an undefined cast.
    np.fmax(planes, 0.0, out=planes)
    np.fmin(planes, 255.0, out=planes)
    # The +0.5 folded in earlier makes this truncating cast round half up.
    # One strided write per channel measured ~1.5x faster than a transposed astype.
    rgb = np.empty((planes.shape[1], planes.shape[2], 3), dtype=np.uint8)
    for k in range(3):
        rgb[..., k] = planes[k]
    return rgb


def _rgb_array(a: np.ndarray) -> np.ndarray:
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim == 3 and a.shape[0] == 3:
        chw = True
    elif a.ndim == 3 and a.shape[2] == 3:
        chw = False
    else:
        raise ParamsError(
            f"the rgb decoder expects an image shaped [3, H, W] or [H, W, 3] "
            f"(optionally with a leading batch of 1), got {_shape(a)}",
            field="frame",
        )
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a.transpose(1, 2, 0) if chw else a)
    planes = a if chw else a.transpose(2, 0, 1)
    # One fused pass into a fresh array: x * 127.5 + (127.5 + 0.5 for rounding).
    out = np.multiply(planes, np.float32(127.5), dtype=np.float32)
    out += np.float32(128.0)
    return _to_uint8(out)


def decode_rgb(t: torch.Tensor) -> np.ndarray:
    """An RGB image frame to ``uint8 [H, W, 3]``.

    Takes ``[3, H, W]`` or ``[H, W, 3]`` (either with a leading batch of 1);
    floats map ``[-1, 1]`` to ``[0, 255]`` (clamped, NaN -> 0), ``uint8`` is
    taken as pixels. Raises ParamsError (field ``frame``) for any other shape.
    """
    return _rgb_array(tensor_to_numpy(t))


def _linear(x: np.ndarray, family: str) -> np.ndarray:
    """``x`` ``[C, h, w]`` floats -> uint8 ``[h, w, 3]`` with the family's factors."""
    factors, bias = LATENT_FACTORS[family]
    channels, h, w = x.shape
    planes = np.empty((3, h, w), dtype=np.float32)
    tmp = np.empty((h, w), dtype=np.float32)
    for k in range(3):
        # Fold the [-1, 1] -> [0, 255] map into the factors: every per-pixel
        # op saved here is saved on each preview of each step.
        acc = planes[k]
        np.multiply(x[0], np.float32(factors[0][k] * 127.5), out=acc, dtype=np.float32)
        for c in range(1, channels):
            np.multiply(x[c], np.float32(factors[c][k] * 127.5), out=tmp, dtype=np.float32)
            acc += tmp
        acc += np.float32(bias[k] * 127.5 + 128.0)
    return _to_uint8(planes)


def _latent_array(x: np.ndarray, family: str) -> np.ndarray:
    channels = len(LATENT_FACTORS[family][0])
    x = _float_array(x, family)
    if x.ndim == 4 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 3 or x.shape[0] != channels:
        raise ParamsError(
            f"the {family} decoder expects a latent shaped [{channels}, h, w] "
            f"(optionally with a leading batch of 1), got {_shape(x)}",
            field="frame",
        )
    return _linear(x, family)


def decode_sd15(t: torch.Tensor) -> np.ndarray:
    """SD 1.x latent ``[4, h, w]`` -> uint8 ``[h, w, 3]``; raises ParamsError on shape."""
    return _latent_array(tensor_to_numpy(t), "sd15")


def decode_sdxl(t: torch.Tensor) -> np.ndarray:
    """SDXL latent ``[4, h, w]`` -> uint8 ``[h, w, 3]``; raises ParamsError on shape."""
    return _latent_array(tensor_to_numpy(t), "sdxl")


def decode_sd3(t: torch.Tensor) -> np.ndarray:
    """SD3 latent ``[16, h, w]`` -> uint8 ``[h, w, 3]``; raises ParamsError on shape."""
    return _latent_array(tensor_to_numpy(t), "sd3")


def unpack_flux(packed: np.ndarray, latent_size: tuple[int, int] | None = None) -> np.ndarray:
    """Undo diffusers' Flux 2x2 packing: ``[seq, 64]`` -> ``[16, h, w]``.

    diffusers' ``FluxPipeline._pack_latents`` folds each 2x2 patch of a
    ``[16, h, w]`` latent into one token::

        packed[i * (w // 2) + j, c * 4 + dy * 2 + dx] == latent[c, 2 * i + dy, 2 * j + dx]

    so ``seq = (h // 2) * (w // 2)``. The packed form does not record the
    aspect ratio: without ``latent_size=(h, w)`` the latent is taken to be
    square. Raises ParamsError (field ``frame``) when the shape does not fit.
    """
    seq, width = packed.shape
    if latent_size is None:
        side = math.isqrt(seq)
        if side * side != seq:
            raise ParamsError(
                f"packed Flux latents with {seq} tokens are not square; "
                "use functools.partial(decode_flux, latent_size=(h, w))",
                field="frame",
            )
        h2 = w2 = side
    else:
        h, w = latent_size
        if h % 2 or w % 2 or (h // 2) * (w // 2) != seq:
            raise ParamsError(
                f"latent_size {latent_size!r} does not fit {seq} packed Flux tokens "
                "(need even h, w with (h/2)*(w/2) == tokens)",
                field="frame",
            )
        h2, w2 = h // 2, w // 2
    channels = width // 4
    # [i, j, c, dy, dx] -> [c, i, dy, j, dx] -> [c, 2i+dy, 2j+dx]: one copy.
    latent: np.ndarray = (
        packed.reshape(h2, w2, channels, 2, 2).transpose(2, 0, 3, 1, 4).reshape(channels, 2 * h2, 2 * w2)
    )
    return latent


def _flux_array(x: np.ndarray, latent_size: tuple[int, int] | None = None) -> np.ndarray:
    x = _float_array(x, "flux")
    if x.ndim in (3, 4) and x.shape[0] == 1:
        x = x[0]
    if x.ndim == 2 and x.shape[1] == 64:
        x = unpack_flux(x, latent_size)
    if x.ndim != 3 or x.shape[0] != 16:
        raise ParamsError(
            "the flux decoder expects a latent shaped [16, h, w] or packed [seq, 64] "
            f"(optionally with a leading batch of 1), got {_shape(x)}",
            field="frame",
        )
    return _linear(x, "flux")


def decode_flux(t: torch.Tensor, *, latent_size: tuple[int, int] | None = None) -> np.ndarray:
    """Flux.1 latent -> uint8 ``[h, w, 3]``.

    Takes the unpacked ``[16, h, w]`` or diffusers' packed ``[seq, 64]``
    (see :func:`unpack_flux`; ``latent_size`` gives ``(h, w)`` of non-square
    packed latents), each with an optional leading batch of 1. Raises
    ParamsError (field ``frame``) when the shape fits neither.
    """
    return _flux_array(tensor_to_numpy(t), latent_size)


# -- auto ----------------------------------------------------------------------

# The projection for channel counts no family has. RandomState, not
# default_rng: its stream is frozen across numpy versions, so a given channel
# count gets the same colours everywhere.
_PROJECTION_SEED = 20240607
# Normalise each projected colour to mean +- 2 std: a Gaussian latent then
# fills the range with ~5% clipped; min/max would let one outlier grey out
# the whole frame, and 3 std leaves most pixels in the middle third.
_SPREAD = 2.0


@functools.lru_cache(maxsize=64)
def _projection(channels: int) -> tuple[tuple[float, float, float], ...]:
    rng = np.random.RandomState(_PROJECTION_SEED)
    weights = rng.standard_normal((max(channels, 1), 3))
    return tuple((float(r), float(g), float(b)) for r, g, b in weights[:channels])


def _grey(a: np.ndarray) -> np.ndarray:
    """``[H, W]`` to ``[H, W, 3]`` grey: uint8 as pixels, floats ``[-1, 1] -> [0, 255]``."""
    if a.dtype != np.uint8:
        plane = np.multiply(a, np.float32(127.5), dtype=np.float32)
        plane += np.float32(128.0)
        np.fmax(plane, 0.0, out=plane)
        np.fmin(plane, 255.0, out=plane)
        a = plane.astype(np.uint8)
    rgb = np.empty((a.shape[0], a.shape[1], 3), dtype=np.uint8)
    for k in range(3):
        rgb[..., k] = a
    return rgb


def _project(x: np.ndarray) -> np.ndarray:
    """``[C, h, w]`` (any C) -> uint8 ``[h, w, 3]``: a fixed projection, normalised."""
    weights = _projection(x.shape[0])
    h, w = x.shape[1:]
    planes = np.empty((3, h, w), dtype=np.float32)
    tmp = np.empty((h, w), dtype=np.float32)
    # inf - inf is NaN here, by design (a NaN pixel previews black): no warning.
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(3):
            # Explicit multiply-adds, as in _linear: np.dot/matmul may start BLAS threads.
            acc = planes[k]
            np.multiply(x[0], np.float32(weights[0][k]), out=acc, dtype=np.float32)
            for c in range(1, x.shape[0]):
                np.multiply(x[c], np.float32(weights[c][k]), out=tmp, dtype=np.float32)
                acc += tmp
            _normalise(acc)
    return _to_uint8(planes)


def _normalise(plane: np.ndarray) -> None:
    """Map ``plane``'s own mean +- _SPREAD std to ``[0, 255]`` (+0.5), in place.

    Statistics over the finite values only: NaN stays NaN (and becomes 0 in
    _to_uint8), infinities clamp. A flat or all-NaN plane becomes mid-grey.
    """
    finite = np.isfinite(plane)
    values = plane if finite.all() else plane[finite]
    if values.size == 0:
        plane[finite] = 128.0  # nothing finite: leave the NaNs, they map to 0
        return
    # float64 statistics: float32 sums of a large plane lose the mean.
    mean = float(values.mean(dtype=np.float64))
    std = float(values.std(dtype=np.float64))
    if not std > 0.0 or not math.isfinite(std):
        plane[finite] = 128.0
        return
    scale = 255.0 / (2.0 * _SPREAD * std)
    offset = 0.5 - (mean - _SPREAD * std) * scale
    plane *= np.float32(scale)
    plane += np.float32(offset)


def _is_packed_flux(a: np.ndarray) -> bool:
    # [seq, 64] with a square token count. [64, 64] itself stays a grey
    # image: a square single-channel picture is likelier than an 8x8-token
    # (128 px) Flux image.
    seq = a.shape[0]
    return a.dtype != np.uint8 and a.shape[1] == 64 and seq != 64 and math.isqrt(seq) ** 2 == seq


def _auto_array(a: np.ndarray) -> np.ndarray:
    """One image (any supported layout, no time axis) -> uint8 ``[H, W, 3]``."""
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim == 2:
        return _flux_array(a) if _is_packed_flux(a) else _grey(a)
    if a.ndim != 3:
        raise ParamsError(
            f"the auto decoder expects an image shaped [H, W], [C, H, W] or [H, W, 3] "
            f"(optionally with a leading batch of 1), got {_shape(a)}",
            field="frame",
        )
    channels = a.shape[0]
    if channels == 3 or a.shape[2] == 3:
        return _rgb_array(a)
    if a.shape[2] == 1:
        return _grey(a[..., 0])
    if a.dtype == np.uint8:
        # Pixels with a channel count of their own: RGBA drops its alpha.
        if channels == 4:
            return _rgb_array(a[:3])
        return _project(a)
    if channels == 4:
        return _linear(a, "sd15")
    if channels == 16:
        return _linear(a, "sd3")
    return _project(a)


def decode_auto(t: torch.Tensor) -> np.ndarray:
    """Any supported frame -> uint8 ``[H, W, 3]``, the decoder chosen from its shape.

    3 channels (first or last) -> ``rgb``; 4 -> ``sd15``; 16 -> ``sd3``;
    packed ``[seq, 64]`` -> ``flux``; 1 channel or ``[H, W]`` -> grey;
    any other count -> a fixed projection normalised per frame. A video
    (see :func:`decode_frame`) comes back as one strip of its frames side by
    side. Raises ParamsError (field ``frame``) for an unsupported rank, an
    empty frame, a dtype no decoder reads or a non-CPU tensor.
    """
    frames, video = _decode(t, None, "auto")
    if video:
        return np.concatenate(frames, axis=1)
    return frames[0]


def _taesd_array(a: np.ndarray) -> np.ndarray:
    # Only frames the model decoded reach here undecoded-as-pixels: _decode
    # reads decoded frames as auto, so this frame is a latent the tiny
    # autoencoder never saw.
    raise ParamsError(
        f"the taesd decoder draws the frames a tiny autoencoder decoded on the model's device, "
        f"and this one is a latent shaped {_shape(a)}: configure one with --preview-vae PATH|ID "
        f"or {PREVIEW_VAE_ENV} (model.use_preview_vae() in Python); it decodes image latents, "
        "on the steps a reader previews (preview_every)",
        field="decoder",
    )


def decode_taesd(t: torch.Tensor) -> np.ndarray:
    """The ``taesd`` decoder on a bare tensor: always ParamsError (field ``decoder``).

    ``taesd`` names the model's tiny autoencoder, which runs on the model's
    device (``use_preview_vae``); the frames it decoded arrive with
    ``decoded=True`` and are drawn as pixels, so a latent that gets here was
    not decoded by one.
    """
    return _taesd_array(tensor_to_numpy(t))


def check_decoder(decoder: str | Callable[[torch.Tensor], Any] | None, model: Any) -> None:
    """Raise ParamsError (field ``decoder``) when ``decoder`` cannot preview ``model``'s frames.

    That is ``taesd`` for a model with no tiny autoencoder configured: a
    diffusers model without ``use_preview_vae`` (``--preview-vae``,
    ``OMNI_STREAM_PREVIEW_VAE``), or a model with no ``decode_preview`` hook
    of its own. Checked when a request is admitted, not at its first preview.
    """
    if decoder != "taesd":
        return
    from ..model import StepModel

    hook = getattr(type(model), "decode_preview", None)
    if hasattr(model, "preview_vae"):
        configured = model.preview_vae is not None
    else:
        configured = hook is not None and hook is not StepModel.decode_preview
    if not configured:
        name = getattr(model, "name", type(model).__name__)
        raise ParamsError(
            f"decoder 'taesd' needs a tiny autoencoder and model {name!r} has none: start it with "
            f"--preview-vae PATH|ID (e.g. madebyollin/taesd) or set {PREVIEW_VAE_ENV} "
            "(model.use_preview_vae() in Python), or pick another decoder",
            field="decoder",
        )


#: Built-in decoders by name (``decoder_for`` also takes any callable).
DECODERS: dict[str, Decoder] = {
    "auto": decode_auto,
    "rgb": decode_rgb,
    "sd15": decode_sd15,
    "sdxl": decode_sdxl,
    "sd3": decode_sd3,
    "flux": decode_flux,
    "taesd": decode_taesd,
}

# The same decoders on numpy arrays, for the frames of a video.
_ARRAY_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "auto": _auto_array,
    "rgb": _rgb_array,
    "sd15": functools.partial(_latent_array, family="sd15"),
    "sdxl": functools.partial(_latent_array, family="sdxl"),
    "sd3": functools.partial(_latent_array, family="sd3"),
    "flux": _flux_array,
    "taesd": _taesd_array,
}


def _checked(fn: Callable[[torch.Tensor], Any]) -> Decoder:
    name = getattr(fn, "__name__", type(fn).__name__)

    def decode(t: torch.Tensor) -> np.ndarray:
        out = fn(t)
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim not in (3, 4)
            or out.shape[-1] != 3
            or 0 in out.shape
        ):
            got = (
                f"{out.dtype} array shaped {_shape(out)}"
                if isinstance(out, np.ndarray)
                else type(out).__name__
            )
            raise ParamsError(
                f"decoder {name} must return a uint8 numpy array shaped [H, W, 3] "
                f"(or [T, H, W, 3] for a video), got {got}",
                field="decoder",
            )
        return np.ascontiguousarray(out)

    decode.__name__ = name
    decode.__wrapped__ = fn  # type: ignore[attr-defined]
    decode._omni_checked = True  # type: ignore[attr-defined]
    return decode


def decoder_for(spec: str | Callable[[torch.Tensor], Any]) -> Decoder:
    """Return the decoder named ``spec``, or wrap a user's callable.

    A callable (a VAE, a tiny autoencoder) takes the frame tensor and must
    return a ``uint8`` numpy array ``[H, W, 3]`` (or ``[T, H, W, 3]`` for a
    video); the wrapper raises ParamsError (field ``decoder``) when it
    returns anything else. Raises ParamsError (field ``decoder``) for an
    unknown name, listing the known ones.
    """
    if isinstance(spec, str):
        try:
            return DECODERS[spec]
        except KeyError:
            raise ParamsError(
                f"unknown decoder {spec!r}; known: {', '.join(DECODERS)}, "
                "or pass a callable(tensor) -> uint8 [H, W, 3] array",
                field="decoder",
            ) from None
    if callable(spec):
        if getattr(spec, "_omni_checked", False):
            return spec
        return _checked(spec)
    raise ParamsError(
        f"decoder must be a name ({', '.join(DECODERS)}) or a callable, got {type(spec).__name__}",
        field="decoder",
    )


def default_decoder(model: Any) -> str:
    """The preview decoder for ``model``: its ``preview_decoder`` name, else ``"auto"``.

    The one place that decides it: the CLI, the server and ``Frame.image()``
    all start from here. Raises nothing; an unknown name fails later, where
    the decoder is resolved (``decoder_for``, ``PreviewSpec``).
    """
    name = getattr(model, "preview_decoder", None)
    return name if isinstance(name, str) and name else "auto"


# -- frames and videos -----------------------------------------------------------


def is_video(data: torch.Tensor | np.ndarray) -> bool:
    """True when ``data``'s shape is a video: 4-D (or 5-D with a leading 1) and
    its first dimension is not 1.

    A 4-D frame whose first dimension is 1 is one image with a batch of 1 (a
    one-frame video is the same picture).
    """
    shape = tuple(data.shape)
    if len(shape) == 5 and shape[0] == 1:
        shape = shape[1:]
    return len(shape) == 4 and shape[0] != 1


def _time_axis(a: np.ndarray, decoded: bool | None, name: str) -> int:
    """Which axis of a 4-D video array is time: 0 for ``[T, 3, H, W]``, 1 for ``[C, T, h, w]``."""
    if decoded:
        return 0
    if name == "rgb":
        # Pixels by definition; a pixel-space video model's [T, 3, H, W].
        return 1 if a.shape[0] == 3 and a.shape[1] != 3 else 0
    if decoded is None and name == "auto" and a.shape[1] == 3:
        # A bare tensor: [T, 3, H, W] is the decoded-video convention.
        return 0
    return 1


def _video_frames(a: np.ndarray, decoded: bool | None, name: str, first_only: bool) -> list[np.ndarray]:
    axis = _time_axis(a, decoded, name)
    count = 1 if first_only else a.shape[axis]
    if axis == 1 and name == "auto" and not first_only and a.shape[0] not in (1, 3, 4, 16):
        # Project the whole video at once, so that one normalisation covers
        # all its frames: per-frame statistics would make them flicker.
        channels, frames, h, w = a.shape
        rgb = _project(a.reshape(channels, frames * h, w))
        return list(rgb.reshape(frames, h, w, 3))
    decode = _ARRAY_DECODERS[name]
    return [decode(a[i] if axis == 0 else a[:, i]) for i in range(count)]


def _decode(
    data: Any,
    decoded: bool | None,
    decoder: str | Callable[[torch.Tensor], Any] | None,
    *,
    first_only: bool = False,
) -> tuple[list[np.ndarray], bool]:
    """Decode a frame's tensor to its RGB images and whether it is a video."""
    if decoded or decoder is None:
        # Decoded output is pixels: a latent decoder (or a VAE) on it is always wrong.
        decoder = "auto"
    if isinstance(decoder, str) and decoder not in _ARRAY_DECODERS:
        # Raises for an unknown name, naming the known ones; a function put
        # into DECODERS by hand runs like a user's callable.
        decoder = decoder_for(decoder)
    if not isinstance(decoder, str):
        out = decoder_for(decoder)(data)
        if out.ndim == 4:
            return list(out[:1] if first_only else out), True
        return [out], False
    a = tensor_to_numpy(data)
    if 0 in a.shape:
        raise ParamsError(f"cannot preview an empty frame shaped {_shape(a)}", field="frame")
    if a.ndim == 5:
        if a.shape[0] != 1:
            raise ParamsError(
                f"a 5-D frame must have a leading batch of 1 ([1, C, T, h, w] or "
                f"[1, T, 3, H, W]), got {_shape(a)}",
                field="frame",
            )
        a = a[0]
    if a.ndim == 4 and a.shape[0] != 1:
        return _video_frames(a, decoded, decoder, first_only), True
    return [_ARRAY_DECODERS[decoder](a)], False


def decode_frame(
    frame: Any,
    decoder: str | Callable[[torch.Tensor], Any] | None = "auto",
) -> np.ndarray:
    """A ``Frame`` (or a bare tensor) to uint8 ``[H, W, 3]``; ``[T, H, W, 3]`` for a video.

    Which frames are videos: 4-D (or 5-D with a leading batch of 1) whose
    first dimension is not 1 (see :func:`is_video`). A ``Frame`` with
    ``decoded=True`` is ``[T, 3, H, W]`` pixels, one with ``decoded=False``
    a latent ``[C, T, h, w]``; for a bare tensor, ``auto`` reads ``[T, 3, H,
    W]`` when the second dimension is 3, ``rgb`` always reads pixels, and the
    latent decoders read ``[C, T, h, w]``. The named decoder runs on each
    video frame; a callable gets the whole tensor. Decoded frames always use
    ``auto`` (they are pixels, whatever ``decoder`` says); None means
    ``auto``. Raises ParamsError: field ``frame`` when the frame fits no
    reading, ``decoder`` for an unknown name or a callable's bad result.
    """
    if isinstance(frame, Frame):
        frames, video = _decode(frame.data, frame.decoded, decoder)
    else:
        frames, video = _decode(frame, None, decoder)
    if video:
        return np.stack(frames)
    return frames[0]
