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

Every decoder also takes a leading batch dimension of 1. The latent decoders
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

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import torch

from ..errors import ParamsError

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
]

#: A decoder: a frame tensor in, a C-contiguous ``uint8`` array ``[H, W, 3]`` out.
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
        raise ParamsError(
            f"frame must be a CPU tensor to preview, got one on {t.device}", field="frame"
        )
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


def _floats(t: torch.Tensor, decoder: str) -> np.ndarray:
    a = tensor_to_numpy(t)
    if a.dtype == np.uint8:
        raise ParamsError(
            f"the {decoder} decoder needs a floating-point latent, got uint8", field="frame"
        )
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


def decode_rgb(t: torch.Tensor) -> np.ndarray:
    """An RGB image frame to ``uint8 [H, W, 3]``.

    Takes ``[3, H, W]`` or ``[H, W, 3]`` (either with a leading batch of 1);
    floats map ``[-1, 1]`` to ``[0, 255]`` (clamped, NaN -> 0), ``uint8`` is
    taken as pixels. Raises ParamsError (field ``frame``) for any other shape.
    """
    a = tensor_to_numpy(t)
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


def _latent(t: torch.Tensor, family: str) -> np.ndarray:
    channels = len(LATENT_FACTORS[family][0])
    x = _floats(t, family)
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
    return _latent(t, "sd15")


def decode_sdxl(t: torch.Tensor) -> np.ndarray:
    """SDXL latent ``[4, h, w]`` -> uint8 ``[h, w, 3]``; raises ParamsError on shape."""
    return _latent(t, "sdxl")


def decode_sd3(t: torch.Tensor) -> np.ndarray:
    """SD3 latent ``[16, h, w]`` -> uint8 ``[h, w, 3]``; raises ParamsError on shape."""
    return _latent(t, "sd3")


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
    return (
        packed.reshape(h2, w2, channels, 2, 2)
        .transpose(2, 0, 3, 1, 4)
        .reshape(channels, 2 * h2, 2 * w2)
    )


def decode_flux(t: torch.Tensor, *, latent_size: tuple[int, int] | None = None) -> np.ndarray:
    """Flux.1 latent -> uint8 ``[h, w, 3]``.

    Takes the unpacked ``[16, h, w]`` or diffusers' packed ``[seq, 64]``
    (see :func:`unpack_flux`; ``latent_size`` gives ``(h, w)`` of non-square
    packed latents), each with an optional leading batch of 1. Raises
    ParamsError (field ``frame``) when the shape fits neither.
    """
    x = _floats(t, "flux")
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


#: Built-in decoders by name (``decoder_for`` also takes any callable).
DECODERS: dict[str, Decoder] = {
    "rgb": decode_rgb,
    "sd15": decode_sd15,
    "sdxl": decode_sdxl,
    "sd3": decode_sd3,
    "flux": decode_flux,
}


def _checked(fn: Callable[[torch.Tensor], Any]) -> Decoder:
    name = getattr(fn, "__name__", type(fn).__name__)

    def decode(t: torch.Tensor) -> np.ndarray:
        out = fn(t)
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim != 3
            or out.shape[2] != 3
        ):
            got = (
                f"{out.dtype} array shaped {_shape(out)}"
                if isinstance(out, np.ndarray)
                else type(out).__name__
            )
            raise ParamsError(
                f"decoder {name} must return a uint8 numpy array shaped [H, W, 3], got {got}",
                field="decoder",
            )
        return np.ascontiguousarray(out)

    decode.__name__ = name
    decode.__wrapped__ = fn  # type: ignore[attr-defined]
    return decode


def decoder_for(spec: str | Callable[[torch.Tensor], Any]) -> Decoder:
    """Return the decoder named ``spec``, or wrap a user's callable.

    A callable (a VAE, a tiny autoencoder) takes the frame tensor and must
    return a ``uint8`` numpy array ``[H, W, 3]``; the wrapper raises
    ParamsError (field ``decoder``) when it returns anything else. Raises
    ParamsError (field ``decoder``) for an unknown name, listing the known ones.
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
        return _checked(spec)
    raise ParamsError(
        f"decoder must be a name ({', '.join(DECODERS)}) or a callable, "
        f"got {type(spec).__name__}",
        field="decoder",
    )

