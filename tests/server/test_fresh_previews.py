"""A request that queued for a preview thread renders its newest step, not the one it held."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
from websockets.asyncio.client import connect

from omni_stream.models import Synthetic
from omni_stream.preview import Previewer

from .conftest import SMALL, check_stream, is_end, recv, running, send, wait_for


class _Gated(Previewer):
    """One preview thread; request "a"'s first preview blocks it until the gate opens."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.gate = threading.Event()
        self.rendered: list[tuple[str, int]] = []

    async def _render_reserved(self, frame, spec, **options):
        if frame.request_id == "a" and not self.gate.is_set():
            await anyio.to_thread.run_sync(self.gate.wait, 20)
        self.rendered.append((frame.request_id, frame.step))
        return await super()._render_reserved(frame, spec, **options)

    async def run_sync(self, fn, *args):
        # A fast request's first frame may be its result, encoded here: gate
        # it inside the preview thread, so it holds the thread as a preview would.
        frame = fn.args[0]
        self.rendered.append((frame.request_id, frame.step))
        if frame.request_id == "a" and not self.gate.is_set():
            def gated():
                self.gate.wait(20)
                return fn(*args)

            return await super().run_sync(gated)
        return await super().run_sync(fn, *args)


@pytest.mark.asyncio
async def test_a_request_that_waited_for_the_preview_thread_renders_its_newest_step():
    previewer = _Gated()
    async with running(Synthetic(), previewer=previewer) as server, connect(server.url) as ws:
        await send(ws, type="generate", id="a", params=dict(SMALL, steps=3))
        await wait_for(lambda: ("a", 1) in previewer.rendered or previewer._limiter.borrowed_tokens == 1,
                       what="a's first preview holding the thread")
        await send(ws, type="generate", id="b", params=dict(SMALL, steps=6))
        # Both requests compute to the end (policy "latest": the engine
        # never waits for previews) while "b" queues for the thread.
        await wait_for(lambda: server.engine.statistics().steps >= 9, what="all steps computed")
        previewer.gate.set()
        by_id: dict[str, list] = {"a": [], "b": []}
        while not all(any(is_end(m, rid) for m in ms) for rid, ms in by_id.items()):
            msg = await recv(ws)
            if msg.get("id") in by_id:
                by_id[msg["id"]].append(msg)
    msgs = by_id["b"]
    check_stream(msgs, "b", 6)
    b_previews = [m["step"] for m in msgs if m["type"] == "preview"]
    # Without the refresh, "b" would render step 1 (the frame it held while it
    # queued, by then six steps stale) before its final one.
    assert b_previews == [6]
    assert [r for r in previewer.rendered if r[0] == "b"] == [("b", 6)]


@pytest.mark.asyncio
async def test_preview_threads_is_a_server_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv("OMNI_STREAM_PREVIEW_THREADS", "3")
    async with running(Synthetic()) as server:
        assert server.limits.preview_threads == 3
        assert server.service.previewer.threads == 3


class _Counting(Previewer):
    def __init__(self) -> None:
        super().__init__(threads=1)
        self.renders = 0

    async def _render_reserved(self, frame, spec, **options):
        self.renders += 1
        return await super()._render_reserved(frame, spec, **options)


@pytest.mark.asyncio
@pytest.mark.parametrize("reads", [False, True])
async def test_a_request_nobody_reads_is_neither_rendered_nor_consumed_at_full_pace(reads: bool) -> None:
    from omni_stream import Engine
    from omni_stream.core.limits import ServerLimits
    from omni_stream.server.service import Service

    from .conftest import Slow
    from .test_service import Client, wait_for as wait_until

    steps = 200  # 5 ms each: about 1 s, 20 x UNREAD_AFTER_S
    previewer = _Counting()
    engine = Engine(Slow(0.005), device="cpu", torch_threads=1)
    service = Service(
        engine, limits=ServerLimits.from_env({}), previewer=previewer, owns_engine=True
    )
    async with service:
        client = Client(service)
        accepted = client.generate("r", {**SMALL, "steps": steps}, preview={"format": "raw"})
        assert accepted["type"] == "accepted"
        if reads:
            msgs = await client.until_end("r")
        else:  # never takes anything from its outbox
            await wait_until(lambda: not service.registry.running(), "the request to end")
            msgs = client.pending()
        dropped = engine.statistics().frames_dropped
    skipped = service.metrics.previews_skipped._value.get()
    previews = [m for m in msgs if m["type"] == "preview"]
    assert previews[-1]["final"] and msgs[-1]["type"] == "done"
    if reads:
        # A reader takes each message within milliseconds: every step is
        # taken and nearly every one rendered.
        assert dropped < steps / 4 and previewer.renders > steps / 2 and skipped < steps / 4
    else:
        # Once its first messages have waited UNREAD_AFTER_S unsent, no
        # preview is rendered for it and the server takes a step only every
        # UNREAD_AFTER_S (the engine coalesces the rest; the result comes).
        assert previewer.renders < steps / 5
        assert skipped >= 1 and dropped > steps / 2
        assert len(previews) == 1  # the unsent preview gave way to the result
