"""A server over an engine that renders where it makes frames (as a Ray replica does).

``Rendering`` wraps a CPU Engine the way ``RemoteEngine`` and its replica
do, without Ray: it satisfies ``RendersFrames``, and when the server asks
with a ``RenderRequest`` it renders each frame with ``render_frame`` before
handing it over, counting the pixels that would have crossed. The server
must publish those bytes as they are (never render itself), answer with
the same result a local engine gives, and end the request with
``preview_failed`` when rendering fails there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import pytest

from omni_stream import Engine, Frame
from omni_stream.engine.like import FrameStreamLike, RendersFrames
from omni_stream.errors import RenderFailedError
from omni_stream.preview import EncodedImage, Previewer, PreviewSpec, RenderRequest, render_frame
from omni_stream.protocol import unpack_preview
from omni_stream.core.limits import ServerLimits
from omni_stream.server.service import Service

from .conftest import Slow
from .test_service import SHORT, Client, check_stream, decode

ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])


class CountingPreviewer(Previewer):
    """The server's previewer: counts what it renders (it must render nothing here)."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.calls = 0

    async def run_sync(self, fn: Any, *args: Any) -> Any:
        self.calls += 1
        return await super().run_sync(fn, *args)

    async def render(self, frame: Any, spec: PreviewSpec) -> EncodedImage:
        self.calls += 1
        return await super().render(frame, spec)

    async def _render_reserved(self, frame: Any, spec: PreviewSpec, **options: Any) -> EncodedImage:
        self.calls += 1
        return await super()._render_reserved(frame, spec, **options)


class RenderedStream:
    def __init__(self, owner: Rendering, inner: FrameStreamLike, render: RenderRequest) -> None:
        self._owner = owner
        self._inner = inner
        self._render = render
        self._spec = render.spec()

    request_id = property(lambda self: self._inner.request_id)
    total = property(lambda self: self._inner.total)
    params = property(lambda self: self._inner.params)

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        frame = await self._inner.__anext__()
        if self._owner.fail_at == frame.step:
            raise RenderFailedError("could not render: boom", request_id=frame.request_id, step=frame.step)
        out = await render_frame(
            frame, self._render, spec=self._spec, previewer=self._owner.previewer,
            params={"model": self._owner.engine.model.name, **self._inner.params},
        )
        self._owner.sent_tensor_bytes += out.data.numel() * out.data.element_size()
        if out.encoded is not None:
            self._owner.images.append(bytes(out.encoded.data))
        return out

    def poll(self) -> Frame | None:
        return None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> RenderedStream:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._inner.__aexit__(*exc)


class Rendering:
    """An Engine that renders its frames when asked (a RendersFrames), like a Ray replica."""

    renders_frames = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.previewer = Previewer()
        self.images: list[bytes] = []
        self.sent_tensor_bytes = 0
        self.asked = 0
        self.fail_at: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def stream(self, params: Mapping[str, Any] | None = None, *, render: RenderRequest | None = None,
               **kw: Any) -> FrameStreamLike:
        inner = self.engine.stream(params, **kw)
        if render is None:
            return inner
        self.asked += 1
        return RenderedStream(self, inner, render)

    async def __aenter__(self) -> Rendering:
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.engine.__aexit__(*exc)


class RawClient(Client):
    """A Client that also keeps each binary preview's bytes, in order."""

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        self.raw: list[bytes] = []

    def _take(self) -> list[dict[str, Any]]:
        out = []
        while (item := self.outbox.get_nowait()) is not None:
            out.append(self._decode(item.message.wire))
        return out

    async def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        if self._backlog:
            return self._backlog.pop(0)
        with anyio.fail_after(timeout):
            item = await self.outbox.get()
        return self._decode(item.message.wire)

    def _decode(self, data: str | bytes) -> dict[str, Any]:
        if isinstance(data, bytes):
            self.raw.append(bytes(data))
        return decode(data)


async def run(engine: Any, previewer: Previewer, preview: dict[str, Any],
              params: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[bytes]]:
    """One request ``r`` through a Service over ``engine``: its messages and its previews' bytes."""
    service = Service(engine, limits=ServerLimits.from_env({}), previewer=previewer, owns_engine=True)
    async with service:
        client = RawClient(service)
        accepted = client.generate("r", params or SHORT, preview=preview)
        msgs = [accepted, *await client.until_end("r")]
    return msgs, client.raw


@ASYNCIO
async def test_the_server_publishes_what_the_engine_rendered_and_renders_nothing() -> None:
    engine = Rendering(Engine(_slow(), device="cpu", torch_threads=1))
    assert isinstance(engine, RendersFrames)
    previewer = CountingPreviewer()
    msgs, raw = await run(engine, previewer, {"every": 3, "format": "jpeg", "max_size": 8})
    check_stream(msgs, "r", SHORT["steps"])
    assert engine.asked == 1 and previewer.calls == 0
    assert engine.sent_tensor_bytes == 0, "pixels crossed"
    previews = [m for m in msgs if m["type"] == "preview"]
    assert [m["step"] for m in previews if not m["final"]] == list(range(3, SHORT["steps"], 3))
    assert previews[-1]["final"] and previews[-1]["format"] == "png"
    # Exactly the bytes the engine rendered, in order.
    assert [bytes(unpack_preview(r)[1]) for r in raw] == engine.images


@ASYNCIO
async def test_the_result_is_the_one_a_local_engine_gives() -> None:
    params = {**SHORT, "seed": 11}
    preview = {"every": 5, "format": "raw"}
    _, local = await run(Engine(_slow(), device="cpu", torch_threads=1), Previewer(), preview, params=params)
    _, remote = await run(Rendering(Engine(_slow(), device="cpu", torch_threads=1)), Previewer(), preview,
                          params=params)

    def result(raw: list[bytes]) -> bytes:
        header, image = unpack_preview(raw[-1])
        assert header.final and header.format == "png"
        return bytes(image)

    assert result(local) == result(remote)


@ASYNCIO
async def test_a_render_failure_there_ends_the_request_with_preview_failed() -> None:
    engine = Rendering(Engine(_slow(), device="cpu", torch_threads=1))
    engine.fail_at = 4
    msgs, _ = await run(engine, Previewer(), {"every": 1, "format": "jpeg"})
    assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "preview_failed"
    assert "boom" in msgs[-1]["message"] and msgs[-1]["id"] == "r"


@ASYNCIO
async def test_an_engine_that_says_no_gets_raw_frames() -> None:
    engine = Rendering(Engine(_slow(), device="cpu", torch_threads=1))
    engine.renders_frames = False  # type: ignore[misc]
    previewer = CountingPreviewer()
    msgs, _ = await run(engine, previewer, {"every": 1, "format": "raw"})
    check_stream(msgs, "r", SHORT["steps"])
    assert engine.asked == 0 and previewer.calls > 0


def _slow() -> Slow:
    return Slow(0.002)
