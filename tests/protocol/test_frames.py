"""protocol/frames.py: the binary preview frame, one layout packed by the server and parsed by the client."""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import pytest
from PIL import Image

from omni_stream.errors import ProtocolError
from omni_stream.protocol.formats import FORMATS
from omni_stream.protocol.frames import (
    MAX_HEADER_BYTES,
    Preview,
    PreviewFrame,
    PreviewHeader,
    pack_preview,
    parse_preview_frame,
    unpack_preview,
)

RAW = PreviewHeader(
    id="r-1", step=2, total=5, final=False, format="raw", width=2, height=1,
    mime="application/octet-stream",
)


def _png(width: int = 6, height: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 30)).save(out, "PNG")
    return out.getvalue()


def _frame(header: dict[str, Any] | bytes, image: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + image


def test_the_wire_bytes_are_pinned() -> None:
    assert pack_preview(RAW, bytes(range(6))) == (
        b'\x00\x00\x00s{"id":"r-1","step":2,"total":5,"final":false,"format":"raw","width":2,'
        b'"height":1,"mime":"application/octet-stream"}\x00\x01\x02\x03\x04\x05'
    )


def test_the_layout_is_length_header_image() -> None:
    image = bytes(range(6))
    frame = pack_preview(RAW, image)
    (length,) = struct.unpack(">I", frame[:4])
    assert json.loads(frame[4 : 4 + length].decode("utf-8")) == RAW.to_dict()
    assert frame[4 + length :] == image


# ---- server packs -> client parses ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["png", "raw"])
def test_what_the_server_packs_the_client_parses_back_equal(fmt: str) -> None:
    image = _png() if fmt == "png" else bytes(range(6 * 8 * 3))
    header = PreviewHeader(
        id="r", step=5, total=5, final=True, format=fmt, width=6, height=8, mime=FORMATS[fmt]
    )
    frame = parse_preview_frame(pack_preview(header, image))
    assert frame == PreviewFrame("r", 5, 5, True, fmt, 6, 8, image)
    assert frame.header == header and frame.mime == FORMATS[fmt]
    assert frame.pack() == pack_preview(header, image)
    assert parse_preview_frame(memoryview(frame.pack())) == frame


def test_the_server_unpacks_its_own_frames_without_copying() -> None:
    frame = pack_preview(RAW, bytes(range(6)))
    header, view = unpack_preview(frame)
    assert header == RAW and isinstance(view, memoryview) and bytes(view) == bytes(range(6))
    assert view.obj is frame


def test_a_preview_is_its_frame_packed_once_and_its_image_a_view_into_it() -> None:
    image = bytes(range(6))
    preview = Preview.build(RAW, bytearray(image))
    assert preview.kind == "preview" and preview.header == RAW and not preview.final
    assert preview.wire == pack_preview(RAW, image) and isinstance(preview.wire, bytes)
    assert isinstance(preview.image, memoryview) and bytes(preview.image) == image
    assert preview.image.obj is preview.wire  # no copy: the doors read the image out of the wire
    assert unpack_preview(preview.wire) == (RAW, preview.image)
    assert parse_preview_frame(preview.wire) == PreviewFrame("r-1", 2, 5, False, "raw", 2, 1, image)
    assert preview.cells == ()
    empty = Preview.build(RAW, b"")
    assert bytes(empty.image) == b"" and empty.wire == pack_preview(RAW, b"")


def test_a_grid_preview_keeps_its_cells_off_the_wire() -> None:
    header = PreviewHeader("g", 1, 4, False, "jpeg", 8, 4, "image/jpeg")
    cells = [(0, 0, 4, 4), (4, 0, 8, 4)]
    grid = Preview.build(header, b"jpeg", cells=cells)  # type: ignore[arg-type]
    assert grid.cells == ((0, 0, 4, 4), (4, 0, 8, 4))
    assert grid.wire == pack_preview(header, b"jpeg")  # the client sees one image
    result = Preview.build(PreviewHeader("g", 4, 4, True, "png", 4, 4, "image/png"), b"png")
    assert result.final and result.cells == ()


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x00\x00",
        struct.pack(">I", 50) + b"{}",
        struct.pack(">I", 2) + b"{}",
        struct.pack(">I", 3) + b"nop",
        _frame(b"[1]"),
        _frame({**RAW.to_dict(), "extra": 1}),
        (MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"{" * (MAX_HEADER_BYTES + 1),
    ],
)
def test_unpack_rejects_broken_frames_with_value_error(frame: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_preview(frame)


# ---- the client's strictness ---------------------------------------------------------------


def _header(**changes: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        "id": "r-1", "step": 2, "total": 5, "final": False, "format": "png",
        "width": 6, "height": 8, "mime": "image/png",
    }
    header.update(changes)
    return {k: v for k, v in header.items() if v is not None}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\x00\x00\x01", "shorter than its 4-byte length"),
        ((MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"{}", "exceeds"),
        (b"\x00\x00\x00\x40{}", "runs past the frame"),
        (_frame(b"\xff\xfe{}", _png()), "not UTF-8 JSON"),
        (_frame(b"[1, 2]", _png()), "must be a JSON object"),
        (_frame(_header(id="."), _png()), "malformed id"),
        (_frame(_header(id=".."), _png()), "malformed id"),
        (_frame(_header(step=0), _png()), "step 0 of 5"),
        (_frame(_header(final=1), _png()), "'final' must be a bool"),
        (_frame(_header(format="tiff"), _png()), "not one of"),
        (_frame(_header(width=0), _png()), "not positive"),
        (_frame(_header(mime="image/jpeg"), _png()), "does not match format"),
        (_frame(_header(mime=None), _png()), "has no 'mime'"),
        (_frame(_header(format="raw", mime="application/octet-stream"), b"\x00" * 143), "needs 144"),
        (_frame(_header(format="jpeg", mime="image/jpeg"), _png()), "claims jpeg"),
        (_frame(_header(format="mp4", mime="video/mp4"), _png()), "claims mp4"),
    ],
)
def test_the_client_refuses_malformed_frames_naming_the_problem(frame: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_preview_frame(frame)


def test_header_from_dict_allows_fields_a_newer_server_adds() -> None:
    assert PreviewHeader.from_dict({**RAW.to_dict(), "added_later": "x"}) == RAW
    frame = parse_preview_frame(_frame(_header(added_later="x"), _png()))
    assert frame.step == 2 and not frame.final


def test_a_raw_frame_decodes_to_its_rgb_bytes() -> None:
    frame = PreviewFrame("r", 1, 1, True, "raw", 2, 1, bytes(range(6)))
    image = frame.image()
    assert image.size == (2, 1) and image.tobytes() == bytes(range(6))


def test_a_frame_saves_only_under_a_suffix_that_fits(tmp_path: Any) -> None:
    frame = PreviewFrame("r", 1, 1, True, "png", 6, 8, _png())
    assert frame.save(tmp_path / "a.png").read_bytes() == frame.data
    with pytest.raises(ValueError, match="cannot be saved as '.jpg'"):
        frame.save(tmp_path / "a.jpg")
    video = PreviewFrame("r", 1, 1, True, "mp4", 6, 8, b"\x00\x00\x00\x18ftypisom")
    with pytest.raises(ValueError, match="MP4"):
        video.image()



def test_a_result_of_several_images_carries_its_index_and_count() -> None:
    header = PreviewHeader("r-1", 5, 5, True, "png", 6, 8, "image/png", index=2, images=3)
    assert header.to_dict()["index"] == 2 and header.to_dict()["images"] == 3
    frame = parse_preview_frame(pack_preview(header, _png()))
    assert (frame.index, frame.images, frame.header) == (2, 3, header)
    # A single result's header carries neither (the wire as before).
    single = PreviewHeader("r-1", 5, 5, True, "png", 6, 8, "image/png")
    assert "index" not in single.to_dict() and "images" not in single.to_dict()
    assert unpack_preview(pack_preview(header, b"x"))[0] == header


@pytest.mark.parametrize(
    "extra",
    [{"index": 3, "images": 3}, {"index": -1, "images": 2}, {"index": 0, "images": 0}, {"index": 0},
     {"images": 2}, {"index": "0", "images": 2}],
)
def test_a_bad_image_index_is_refused(extra: dict[str, Any]) -> None:
    head = {"id": "r-1", "step": 5, "total": 5, "final": True, "format": "png", "width": 6, "height": 8,
            "mime": "image/png", **extra}
    with pytest.raises(ProtocolError):
        parse_preview_frame(_frame(head, _png()))


def test_an_index_on_a_preview_that_is_not_a_result_is_refused() -> None:
    head = {"id": "r-1", "step": 2, "total": 5, "final": False, "format": "png", "width": 6, "height": 8,
            "mime": "image/png", "index": 0, "images": 2}
    with pytest.raises(ProtocolError, match="not a result"):
        parse_preview_frame(_frame(head, _png()))
