"""Image bombs through every door that takes an input image (issue #39, attack 2), and their model.

``python -m benchmarks.tenant_inputs [--seconds S] [--json PATH]``

One 0.47 MiB PNG declaring 13000x13000 (:func:`png_bomb`) took +1.29 GB of
RSS and 10-19 s of CPU on ``/v1/images/edits`` before its 400, +3.9 GB for
three at once: the door decoded the whole upload (any of Pillow's formats)
before the core read its header. This runs, against a fresh ``omni-stream
serve --model benchmarks.tenant_inputs:EditImage`` (``benchmarks/doors.py``'s
harness: an honest websocket client in a process of its own, ``/health``
probed, the server's RSS sampled), three attackers at once for ``--seconds``,
each sending bombs one after another: an edit's ``image``, an edit's
``mask``, and ``/v1/videos``' ``input_reference``. What it reports: the
peak RSS over the idle server (the bound: ``max_memory_bytes`` + 10%), the
honest client's step p99 against its quiet p99 (the bound: 3x), and what
the bombs were answered (each must be a 400 naming its field).

:class:`EditImage` is the model those doors need: Synthetic (its steps cost
what ``work`` says) with a ``prompt``, the input images ``image`` and
``mask_image``, and ``width`` / ``height``, so one model answers
``/v1/images/edits``, ``/v1/videos`` (with ``input_reference``; a bomb is
refused before the model is asked anything), ``/v1/generations`` and the
websocket; its frames take the input image's size. :class:`ImageToVideo` is
the same making videos (``num_frames``, frames ``[T, 3, H, W]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from omni_stream.errors import ParamsError
from omni_stream.model import StepModel
from omni_stream.models import Synthetic
from omni_stream.models.inputs import load_image
from omni_stream.models.synthetic import MAX_ELEMENTS
from omni_stream.params import Param

__all__ = ["EditImage", "ImageToVideo", "multipart", "png_bomb", "webp_bomb"]

MIB = 1 << 20


class EditImage(Synthetic):
    """Synthetic with input images (see the module docstring): its frames are pictures."""

    name = "edit_image"
    params = (
        *(p for p in Synthetic.params if p.name != "shape"),
        Param("prompt", "str", "", "text (not used: the frames are Synthetic's)"),
        Param("image", "str", None, "input image (a data: URL); the frames take its size"),
        Param("mask_image", "str", None, "mask image (a data: URL)"),
        Param("width", "int", 16, "frame width without an input image", minimum=8, maximum=256),
        Param("height", "int", 16, "frame height without an input image", minimum=8, maximum=256),
    )

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params; raises ParamsError naming the field."""
        rest = dict(params or {})
        rest.pop("shape", None)  # made below: checked params are checked again (the engine's intake)
        images = {name: rest.pop(name, None) for name in ("image", "mask_image")}
        out = StepModel.validate(self, rest)  # Synthetic's own checks a shape, made below
        width, height = out["width"], out["height"]
        for name, value in images.items():
            out[name] = None if value is None else load_image(value, field=name, allow_paths=False)
        if out["image"] is not None:
            width, height = out["image"].size
        shape = [*self._frames(out), 3, height, width]
        if math.prod(shape) > MAX_ELEMENTS:
            raise ParamsError(f"{self.name}: {shape} holds more than {MAX_ELEMENTS} values", field="width")
        out["shape"] = shape
        return out

    def _frames(self, params: Mapping[str, Any]) -> list[int]:
        return []

    def can_snapshot(self, params: Mapping[str, Any]) -> bool:
        # A decoded image is not JSON: such a request is not checkpointed.
        return params.get("image") is None and params.get("mask_image") is None


class ImageToVideo(EditImage):
    """:class:`EditImage` making videos: ``num_frames`` frames ``[T, 3, H, W]`` at ``fps``."""

    name = "image_to_video"
    produces_video = True
    #: Frames a second of its videos (``/v1/videos``' ``seconds`` -> ``num_frames``).
    fps = 8
    params = (
        *EditImage.params,
        Param("num_frames", "int", 5, "frames of the video", minimum=1, maximum=64),
    )

    def _frames(self, params: Mapping[str, Any]) -> list[int]:
        # One frame is not a video (a [1, 3, H, W] frame is a picture): what a video model
        # asked for one frame does (Wan's ended step_failed), this one does too.
        return [int(params["num_frames"])]


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int, *, bits: int = 8) -> bytes:
    """A valid PNG of ``side`` x ``side`` black pixels, deflated to a few hundred KiB: RGB at 8 bits
    (13000: 0.47 MiB that decodes to 507 MB), or grayscale at ``bits`` 1 (made in a few ms)."""
    color, row_bytes = (2, 3 * side) if bits == 8 else (0, (side + 7) // 8)
    deflate = zlib.compressobj(9)
    row = bytes(1 + row_bytes)
    idat = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    header = struct.pack(">IIBBBBB", side, side, bits, color, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def webp_bomb(side: int) -> bytes:
    """An extended WebP's header declaring a ``side`` x ``side`` canvas (no picture after it)."""
    vp8x = bytes([0, 0, 0, 0]) + (side - 1).to_bytes(3, "little") + (side - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def multipart(fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of ``fields`` and ``files`` (name -> (filename, bytes)); the
    body and its content type."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                     + value.encode() + b"\r\n")
    for name, (filename, data) in files.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
        )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


# -- the attack, in benchmarks/doors.py's harness ------------------------------------------

#: (route, file field, the other fields) of each attacker.
_DOORS = (
    ("/v1/images/edits", "image", {"prompt": "x", "steps": "2"}),
    ("/v1/images/edits", "mask", {"prompt": "x", "steps": "2"}),
    ("/v1/videos", "input_reference", {"prompt": "x", "steps": "2"}),
)


async def _bombs(target: Any) -> Any:
    """Three attackers, one a door, each sending bombs one after another for ``target.seconds``."""
    from .door_attacks import Outcome
    from .http_wire import fetch

    bomb = png_bomb(13000)
    small = png_bomb(16)
    outcome = Outcome()
    answered: dict[str, list[float]] = {field: [] for _, field, _ in _DOORS}
    deadline = time.monotonic() + target.seconds

    async def attacker(route: str, field: str, fields: dict[str, str]) -> None:
        files = {field: ("bomb.png", bomb)}
        if field == "mask":
            files["image"] = ("in.png", small)
        body, ctype = multipart(fields, files)
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            answer = await fetch(target.port, "POST", route, body=body, headers=[("Content-Type", ctype)],
                                 timeout=120)
            answered[field].append(time.monotonic() - t0)
            outcome.count(answer, f"{field} ")
            error = _error_of(answer.body)
            if answer.status != 400 or error.get("param") != field:
                outcome.problems.append(f"{field}: a bomb was answered {answer.status} {answer.body[:200]!r}")

    await asyncio.gather(*(attacker(*door) for door in _DOORS))
    outcome.figures = {
        "bomb_mib": round(len(bomb) / MIB, 2),
        "answer_max_s": {k: round(max(v, default=math.nan), 3) for k, v in answered.items()},
        "bombs": {k: len(v) for k, v in answered.items()},
    }
    return outcome


def _error_of(body: bytes) -> dict[str, Any]:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def main(argv: Sequence[str] | None = None) -> int:
    from . import door_attacks, doors

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tenant_inputs", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the bombs go on (10)")
    ap.add_argument("--quiet-requests", type=int, default=10, help="honest requests before the attack (10)")
    ap.add_argument("--json", metavar="PATH", help="write the result here")
    args = ap.parse_args(argv)
    spec = doors.AttackSpec("39.2", "image_bombs", "three 13000x13000 PNG bombs at once: +3.9 GB RSS, "
                            "10-19 s CPU each", model="benchmarks.tenant_inputs:EditImage")
    door_attacks.RUNS[spec.id] = _bombs
    doors._raise_nofile()
    result = asyncio.run(doors.run_attack(spec, seconds=args.seconds, quiet_requests=args.quiet_requests))
    print(doors.format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
