"""PreviewSpec, should_preview and the Previewer's threads."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from omni_stream.errors import ParamsError
from omni_stream.frame import Frame
from omni_stream.preview import (
    EncodedImage,
    PreviewSpec,
    Previewer,
    decode_sd15,
    render_sync,
    should_preview,
)


def _frame(data: torch.Tensor, step: int = 1, total: int = 4) -> Frame:
    return Frame(request_id="r1", step=step, total=total, data=data)


# -- should_preview -----------------------------------------------------------


def test_should_preview_every_nth_and_always_the_final():
    assert [s for s in range(1, 11) if should_preview(s, 10, 1)] == list(range(1, 11))
    assert [s for s in range(1, 11) if should_preview(s, 10, 3)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if should_preview(s, 10, 5)] == [5, 10]
    assert [s for s in range(1, 4) if should_preview(s, 3, 100)] == [3]
    assert should_preview(1, 1, 7)


@pytest.mark.parametrize("every", [0, -1])
def test_should_preview_rejects_every_below_one(every):
    with pytest.raises(ParamsError) as info:
        should_preview(1, 10, every)
    assert info.value.field == "every"


# -- PreviewSpec ---------------------------------------------------------------


def test_spec_defaults_and_wire_form():
    assert PreviewSpec() == PreviewSpec(
        every=1, format="jpeg", max_size=512, quality=None, decoder="auto", video="strip"
    )
    spec = PreviewSpec.from_dict({"every": 1, "format": "jpeg", "max_size": 512})
    assert spec == PreviewSpec()
    spec = PreviewSpec.from_dict({"every": 4, "format": "webp", "max_size": None, "quality": 50})
    assert (spec.every, spec.format, spec.max_size, spec.quality) == (4, "webp", None, 50)
    assert PreviewSpec.from_dict({}) == PreviewSpec()


def test_spec_decoder_default_comes_from_the_caller_and_the_wire_may_name_a_builtin():
    assert PreviewSpec.from_dict({}, decoder="sd15").decode is decode_sd15
    assert PreviewSpec.from_dict({"decoder": "sd15"}).decode is decode_sd15


@pytest.mark.parametrize(
    "wire, field",
    [
        ({"every": 0}, "every"),
        ({"every": 1.5}, "every"),
        ({"every": "2"}, "every"),
        ({"every": True}, "every"),
        ({"format": "bmp"}, "format"),
        ({"max_size": 0}, "max_size"),
        ({"max_size": "big"}, "max_size"),
        ({"quality": 500}, "quality"),
        ({"format": "png", "quality": 80}, "quality"),
        ({"decoder": "vae"}, "decoder"),
        ({"decoder": ["rgb"]}, "decoder"),
        ({"decoder": "os:system"}, "decoder"),
        ({"size": 512}, "size"),
        ({"every": 1, "zoom": 2}, "zoom"),
    ],
)
def test_spec_from_dict_names_the_bad_field(wire, field):
    with pytest.raises(ParamsError) as info:
        PreviewSpec.from_dict(wire)
    assert info.value.field == field
    assert field in str(info.value)


def test_spec_from_dict_lists_known_keys_for_unknown_ones():
    with pytest.raises(ParamsError, match="every, format, max_size, quality, decoder"):
        PreviewSpec.from_dict({"fps": 3})


@pytest.mark.parametrize("data", [None, [("every", 1)], "every=1"])
def test_spec_from_dict_wants_an_object(data):
    with pytest.raises(ParamsError) as info:
        PreviewSpec.from_dict(data)
    assert info.value.field == "preview"


def test_spec_constructor_validates_too():
    with pytest.raises(ParamsError) as info:
        PreviewSpec(every=0)
    assert info.value.field == "every"
    with pytest.raises(ParamsError) as info:
        PreviewSpec(decoder="nope")
    assert info.value.field == "decoder"


def test_spec_is_frozen_and_hashable():
    spec = PreviewSpec()
    with pytest.raises(AttributeError):
        spec.every = 3  # type: ignore[misc]
    assert hash(spec) == hash(PreviewSpec())


# -- rendering -----------------------------------------------------------------


def test_render_sync_decodes_shrinks_and_encodes():
    frame = _frame(torch.rand(3, 64, 128) * 2 - 1)
    out = render_sync(frame, PreviewSpec(format="png", max_size=32))
    assert (out.width, out.height, out.format) == (32, 16, "png")
    assert Image.open(io.BytesIO(out.data)).size == (32, 16)
    # A bare tensor works too.
    assert render_sync(frame.data, PreviewSpec(format="png", max_size=32)) == out


def test_render_sync_latent_with_a_named_decoder():
    latent = torch.randn(4, 16, 16)
    out = render_sync(_frame(latent), PreviewSpec(format="raw", decoder="sd15"))
    assert (out.width, out.height) == (16, 16)
    assert out.data == decode_sd15(latent).tobytes()


def test_render_sync_frame_that_does_not_fit_the_decoder():
    with pytest.raises(ParamsError) as info:
        render_sync(_frame(torch.zeros(4, 8, 8)), PreviewSpec(decoder="rgb"))
    assert info.value.field == "frame"


@pytest.mark.asyncio
async def test_previewer_renders_off_the_event_loop_thread():
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def hook(t: torch.Tensor) -> np.ndarray:
        seen.append(threading.get_ident())
        return np.zeros((8, 8, 3), dtype=np.uint8)

    out = await Previewer().render(_frame(torch.zeros(1)), PreviewSpec(decoder=hook, format="raw"))
    assert isinstance(out, EncodedImage) and (out.width, out.height) == (8, 8)
    assert seen and seen[0] != loop_thread
    assert seen[0] != threading.main_thread().ident


@pytest.mark.asyncio
async def test_previewer_loop_keeps_running_while_a_preview_renders():
    started, release = threading.Event(), threading.Event()

    def slow(t: torch.Tensor) -> np.ndarray:
        started.set()
        release.wait(10)
        return np.zeros((2, 2, 3), dtype=np.uint8)

    task = asyncio.ensure_future(Previewer().render(torch.zeros(1), PreviewSpec(decoder=slow)))
    for _ in range(1000):
        if started.is_set():
            break
        await asyncio.sleep(0.005)  # the loop is free: this keeps running
    assert started.is_set()
    release.set()
    out = await asyncio.wait_for(task, 10)
    assert out.format == "jpeg"


def _concurrency_probe(threads: int) -> tuple[Previewer, list[int], object]:
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    peaks: list[int] = []
    barrier = threading.Barrier(threads, timeout=5) if threads > 1 else None

    def hook(t: torch.Tensor) -> np.ndarray:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        if barrier is not None:
            barrier.wait()  # proves `threads` renders can be in here at once
        with lock:
            state["now"] -= 1
            peaks.append(state["peak"])
        return np.zeros((2, 2, 3), dtype=np.uint8)

    return Previewer(threads=threads), peaks, hook


@pytest.mark.asyncio
@pytest.mark.parametrize("threads", [1, 2])
async def test_previewer_bounds_concurrent_renders_by_its_limiter(threads):
    previewer, peaks, hook = _concurrency_probe(threads)
    spec = PreviewSpec(decoder=hook, format="raw")
    await asyncio.wait_for(
        asyncio.gather(*(previewer.render(torch.zeros(1), spec) for _ in range(6))), 20
    )
    assert len(peaks) == 6
    assert max(peaks) == threads
    assert previewer.threads == threads


@pytest.mark.asyncio
async def test_previewer_raises_decode_errors_to_the_caller():
    with pytest.raises(ParamsError) as info:
        await Previewer().render(_frame(torch.zeros(5, 8, 8)), PreviewSpec(decoder="rgb"))
    assert info.value.field == "frame"


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_previewer_rejects_bad_thread_counts(threads):
    with pytest.raises(ParamsError) as info:
        Previewer(threads=threads)
    assert info.value.field == "threads"


@pytest.mark.asyncio
async def test_reserve_holds_a_preview_thread_for_its_renders():
    import anyio

    from omni_stream.preview import Previewer, PreviewSpec

    previewer = Previewer(threads=1)
    spec = PreviewSpec(format="jpeg", max_size=32)
    frame = torch.zeros(3, 16, 16)
    order: list[str] = []

    async def other() -> None:
        await previewer.render(frame, spec)
        order.append("other")

    async with anyio.create_task_group() as tg:
        async with previewer.reserve() as render:
            tg.start_soon(other)
            await anyio.sleep(0.05)  # "other" must wait: the only thread is reserved
            first = await render(frame, spec)
            second = await render(frame, spec)
            order.append("reserved")
    assert order == ["reserved", "other"]
    assert first.format == second.format == "jpeg" and (first.width, first.height) == (16, 16)


def test_spec_from_dict_takes_taesd_and_checks_it_against_the_model():
    import omni_stream as om

    assert PreviewSpec.from_dict({"decoder": "taesd"}).decoder == "taesd"
    with pytest.raises(ParamsError) as info:
        PreviewSpec.from_dict({"decoder": "taesd"}, model=om.models.Mixture())
    assert info.value.field == "decoder" and "--preview-vae" in info.value.message
    assert PreviewSpec.from_dict({}, model=om.models.Mixture()).decoder == "auto"


def test_a_frame_of_several_images_previews_as_a_grid_that_says_where_each_image_is():
    # Three decoded 3x8x12 images: a 2x2 grid of 24x16; the cells let a door crop each one.
    data = torch.stack([torch.full((3, 8, 12), v) for v in (-1.0, 0.0, 1.0)])
    frame = Frame(request_id="r1", step=1, total=4, data=data, decoded=True, image_count=3)
    out = render_sync(frame, PreviewSpec(format="raw"))
    assert (out.width, out.height) == (24, 16)
    assert out.cells == ((0, 0, 12, 8), (12, 0, 24, 8), (0, 8, 12, 16))
    rgb = np.frombuffer(out.data, np.uint8).reshape(16, 24, 3)
    firsts = [int(rgb[top, left, 0]) for left, top, _, _ in out.cells]
    assert firsts[0] < firsts[1] < firsts[2]  # each cell holds its own image, in order
    shrunk = render_sync(frame, PreviewSpec(format="png", max_size=12))
    assert (shrunk.width, shrunk.height) == (12, 8)
    assert shrunk.cells == ((0, 0, 6, 4), (6, 0, 12, 4), (0, 4, 6, 8))
    single = render_sync(frame.split()[0], PreviewSpec(format="raw"))
    assert single.cells == ()
