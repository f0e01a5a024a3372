"""The preview page (omni_stream/server/static/index.html) in a real headless Chromium.

Chromium is Debian's ``chromium`` package (``bash scripts/install_browser.sh``),
driven over the DevTools protocol on a websocket: no selenium, no playwright,
nothing downloaded. The browser tests are marked ``browser`` and skip with
the reason when no ``chromium`` is on PATH; the static checks of the page
(CSP hashes, nothing fetched from elsewhere) run everywhere.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import websockets
from PIL import Image

import omni_stream as om
from omni_stream import client as omc
from omni_stream.server import Server

PAGE = Path(om.__file__).parent / "server" / "static" / "index.html"
CHROMIUM = shutil.which("chromium")
TOKEN = "page-test-token"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no `chromium` on PATH; install it with `bash scripts/install_browser.sh`",
)


# ---- the page as a file ------------------------------------------------------


def _inline(html: str, tag: str) -> str:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    assert len(blocks) == 1, f"expected one inline <{tag}> block, found {len(blocks)}"
    return blocks[0]


def _csp_hash(code: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(code.encode()).digest()).decode() + "'"


def test_csp_hashes_match_inline_code() -> None:
    html = PAGE.read_text(encoding="utf-8")
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert csp, "the page lost its CSP meta tag"
    policy = csp.group(1)
    script, style = _csp_hash(_inline(html, "script")), _csp_hash(_inline(html, "style"))
    assert f"script-src {script};" in policy and f"style-src {style};" in policy, (
        "the inline script or style changed; put these in the page's CSP meta tag: "
        f"script-src {script}; style-src {style};"
    )


def test_page_fetches_nothing_from_elsewhere() -> None:
    html = PAGE.read_text(encoding="utf-8")
    # Offline and CSP-friendly: no external scripts, styles, fonts or images.
    assert not re.search(r"""\b(src|href)\s*=""", html), "the page must not load files"
    assert not re.search(r"""["'(]\s*(https?:)?//""", html), "the page must not name other hosts"
    assert "connect-src 'self'" in html


# ---- Chromium and the DevTools protocol ---------------------------------------


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One headless Chromium for the module; yields its DevTools websocket URL."""
    if CHROMIUM is None:
        pytest.skip("no `chromium` on PATH; install it with `bash scripts/install_browser.sh`")
    tmp = tmp_path_factory.mktemp("chromium")
    log_path = tmp / "stderr.log"
    args = [
        CHROMIUM,
        "--headless=new",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={tmp / 'profile'}",
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--mute-audio",
        "about:blank",
    ]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    with open(log_path, "wb") as log:
        # Its own session, so teardown can end the browser's whole process group.
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        url = None
        while url is None:
            found = re.search(r"DevTools listening on (ws://\S+)", log_path.read_text(errors="replace"))
            if found:
                url = found.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"chromium did not start (exit {proc.poll()}):\n{tail}")
            else:
                time.sleep(0.05)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class CDPError(Exception):
    pass


class DevTools:
    """A DevTools-protocol connection to the browser; pages are flattened sessions on it."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._waiters: dict[int, anyio.Event] = {}
        self.events: list[dict[str, Any]] = []

    async def read(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if "id" in message:
                self._replies[message["id"]] = message
                self._waiters.pop(message["id"]).set()
            else:
                self.events.append(message)

    async def call(self, method: str, params: Mapping[str, Any] | None = None,
                   session: str | None = None) -> dict[str, Any]:
        call_id = next(self._ids)
        message: dict[str, Any] = {"id": call_id, "method": method, "params": dict(params or {})}
        if session is not None:
            message["sessionId"] = session
        done = self._waiters[call_id] = anyio.Event()
        await self._ws.send(json.dumps(message))
        with anyio.fail_after(20):
            await done.wait()
        reply = self._replies.pop(call_id)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply["result"]


@asynccontextmanager
async def devtools(url: str) -> AsyncIterator[DevTools]:
    async with websockets.connect(url, max_size=None) as ws, anyio.create_task_group() as tg:
        tools = DevTools(ws)
        tg.start_soon(tools.read)
        try:
            yield tools
        finally:
            tg.cancel_scope.cancel()


class Tab:
    """One page (a target attached as a flattened session)."""

    def __init__(self, tools: DevTools, target: str, session: str) -> None:
        self.tools = tools
        self.target = target
        self.session = session

    async def call(self, method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return await self.tools.call(method, params, session=self.session)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise CDPError(f"{expression[:80]!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10.0) -> Any:
        """Poll ``expression`` until truthy; fails with the page's state on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {expression!r}; page: {await self.state()}")
            await anyio.sleep(0.03)

    async def state(self) -> dict[str, Any]:
        return await self.evaluate(
            "({...window.omniStream, status: document.getElementById('status').textContent,"
            " connection: document.getElementById('connection').textContent,"
            " progressText: document.getElementById('progress-text').textContent})"
        )

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete' && !!window.omniStream")

    async def set_field(self, name: str, value: str) -> None:
        await self.evaluate(
            f"(() => {{ const el = document.querySelector('[data-param={json.dumps(name)}]');"
            f" el.value = {json.dumps(value)}; return true; }})()"
        )

    async def canvas_png(self) -> str:
        return await self.evaluate("document.getElementById('canvas').toDataURL('image/png')")

    def page_errors(self) -> list[str]:
        return [
            json.dumps(e["params"])[:500]
            for e in self.tools.events
            if e.get("sessionId") == self.session and e["method"] == "Runtime.exceptionThrown"
        ]


@asynccontextmanager
async def open_tab(chromium: str) -> AsyncIterator[Tab]:
    async with devtools(chromium) as tools:
        target = (await tools.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await tools.call(
            "Target.attachToTarget", {"targetId": target, "flatten": True}
        ))["sessionId"]
        tab = Tab(tools, target, session)
        await tab.call("Runtime.enable")
        await tab.call("Page.enable")
        try:
            yield tab
            assert not tab.page_errors(), f"the page threw: {tab.page_errors()}"
            assert await tab.evaluate("window.omniStream.cspViolations") == []
        finally:
            with anyio.move_on_after(5, shield=True):
                await tools.call("Target.closeTarget", {"targetId": target})


def _pixels(data_url_or_image: str | Image.Image) -> Image.Image:
    if isinstance(data_url_or_image, Image.Image):
        return data_url_or_image.convert("RGB")
    prefix = "data:image/png;base64,"
    assert data_url_or_image.startswith(prefix)
    return Image.open(io.BytesIO(base64.b64decode(data_url_or_image[len(prefix):]))).convert("RGB")


# ---- the server side -----------------------------------------------------------


class SlowSynthetic(om.models.Synthetic):
    """Synthetic with a fixed pause per step, so a browser sees the picture change."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def step(self, states: Sequence[Any]) -> list[Any]:
        time.sleep(self.step_s)
        return super().step(states)


@asynccontextmanager
async def serving(model: SlowSynthetic) -> AsyncIterator[Server]:
    """A token-protected server on a free port, with short shutdown bounds."""
    async with Server(
        model, host="127.0.0.1", port=0, token=TOKEN, device="cpu",
        shutdown_timeout_s=0.5, close_timeout_s=1.0,
    ) as server:
        yield server


PARAMS = {"steps": 12, "shape": [3, 24, 20], "work": 0, "seed": 3}


async def _fill_form(tab: Tab, params: Mapping[str, Any], fmt: str) -> None:
    for name, value in params.items():
        text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        await tab.set_field(name, text)
    await tab.set_field("format", fmt)
    await tab.set_field("every", "1")


async def _expected_final(server: Server, params: Mapping[str, Any], fmt: str) -> Image.Image:
    """The result as the Python client receives it (the pauses only slow it, never change it)."""
    model = server.model
    assert isinstance(model, SlowSynthetic)
    pause, model.step_s = model.step_s, 0.0
    try:
        async with omc.connect(server.url, token=TOKEN) as client:
            final = await client.generate(params, preview={"format": fmt}).result()
    finally:
        model.step_s = pause
    return _pixels(final.image())


async def _generate_and_watch(tab: Tab) -> set[str]:
    """Click Generate; collect the distinct canvases seen until the final one is drawn."""
    seen: set[str] = set()
    await tab.evaluate("document.getElementById('generate').click(), true")
    deadline = time.monotonic() + 15
    while not await tab.evaluate("window.omniStream.done && window.omniStream.finalDrawn"):
        if await tab.evaluate("window.omniStream.state === 'error'") or time.monotonic() > deadline:
            pytest.fail(f"generation did not finish; page: {await tab.state()}")
        seen.add(await tab.canvas_png())
        await anyio.sleep(0.02)
    seen.add(await tab.canvas_png())
    return seen


# ---- the browser tests -----------------------------------------------------------


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_draws_every_step_and_the_exact_final_image(chromium: str) -> None:
    async with open_tab(chromium) as tab, serving(SlowSynthetic(0.08)) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        # The form is built from GET /models.
        names = await tab.evaluate(
            "[...document.querySelectorAll('#params [data-param]')].map(e => e.dataset.param)"
        )
        assert names == [p.name for p in server.model.params]
        for fmt in ("png", "raw"):  # the ImageBitmap path and the ImageData path
            await _fill_form(tab, PARAMS, fmt)
            canvases = await _generate_and_watch(tab)
            state = await tab.state()
            assert state["state"] == "done" and state["lastDrawnStep"] == PARAMS["steps"]
            assert state["progressText"] == f"step {PARAMS['steps']} / {PARAMS['steps']}"
            # The picture sharpens live: several different canvases, not just the result.
            assert state["framesDrawn"] >= 3 and len(canvases) >= 3, (fmt, state, len(canvases))
            drawn = _pixels(await tab.canvas_png())
            expected = await _expected_final(server, PARAMS, fmt)
            assert drawn.size == expected.size == (20, 24)
            assert drawn.tobytes() == expected.tobytes(), f"{fmt}: the canvas is not the result"


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_resumes_after_a_drop_and_after_a_reload(chromium: str) -> None:
    params = dict(PARAMS, steps=30)
    async with open_tab(chromium) as tab, serving(SlowSynthetic(0.06)) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        await _fill_form(tab, params, "png")
        await tab.evaluate("document.getElementById('generate').click(), true")
        request_id = await tab.wait_for("window.omniStream.requestId")
        await tab.wait_for("window.omniStream.lastStep >= 3")

        await tab.evaluate("window.omniStream.dropConnection(), true")
        await tab.wait_for("window.omniStream.reconnects >= 1")
        step = await tab.wait_for(
            "window.omniStream.connected && window.omniStream.state === 'running'"
            " && window.omniStream.lastStep"
        )
        assert step < params["steps"], "the request ended before the drop could be resumed"

        await tab.call("Page.reload")
        await tab.wait_for("document.readyState === 'complete' && !!window.omniStream")
        await tab.wait_for("window.omniStream.done && window.omniStream.finalDrawn", timeout=15)
        state = await tab.state()
        assert state["requestId"] == request_id and state["state"] == "done"
        drawn = _pixels(await tab.canvas_png())
        assert drawn.tobytes() == (await _expected_final(server, params, "png")).tobytes()


class SlowVideo(SlowSynthetic):
    """Its result is a 4-frame video: the page must play it, not draw it on the canvas."""

    produces_video = True

    def decode(self, state: Any, frame: Any) -> Any:
        return frame.unsqueeze(0).repeat(4, 1, 1, 1).clamp(-1, 1)


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_offers_the_result_and_plays_a_video_result(chromium: str) -> None:
    pytest.importorskip("av", reason="an MP4 result needs the video extra")
    async with open_tab(chromium) as tab, serving(SlowVideo(0.05)) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        await _fill_form(tab, dict(PARAMS, steps=4), "jpeg")
        await tab.evaluate("document.getElementById('generate').click(), true")
        await tab.wait_for("window.omniStream.done && window.omniStream.finalDrawn", timeout=15)
        shown = await tab.evaluate(
            "[document.getElementById('video').hidden, document.getElementById('canvas').hidden,"
            " document.getElementById('result').hidden, document.getElementById('result').download,"
            " document.getElementById('video').getAttribute('src').startsWith('blob:')]"
        )
        request_id = await tab.evaluate("window.omniStream.requestId")
        assert shown == [False, True, False, f"{request_id}.mp4", True]


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_reports_refusals_failures_and_cancel(chromium: str) -> None:
    async with open_tab(chromium) as tab:
        async with serving(SlowSynthetic(0.05)) as server:
            # No token in the page URL: the handshake is refused, and the page says why.
            await tab.open(f"{server.http_url}/")
            await tab.wait_for("window.omniStream.state === 'error'")
            state = await tab.state()
            assert state["error"]["code"] == "unauthorized" and "token" in state["status"], state

            await tab.open(f"{server.http_url}/?token={TOKEN}")
            await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
            await _fill_form(tab, dict(PARAMS, steps=0), "jpeg")
            await tab.evaluate("document.getElementById('generate').click(), true")
            await tab.wait_for("window.omniStream.state === 'error'")
            state = await tab.state()
            assert state["error"]["code"] == "bad_params" and state["error"]["field"] == "steps"
            assert "steps" in state["status"]
            assert await tab.evaluate(
                "document.querySelector('[data-param=steps]').getAttribute('aria-invalid')"
            ) == "true"

            await _fill_form(tab, dict(PARAMS, steps=200), "jpeg")
            await tab.evaluate("document.getElementById('generate').click(), true")
            await tab.wait_for("window.omniStream.lastStep >= 2")
            await tab.evaluate("document.getElementById('cancel').click(), true")
            await tab.wait_for("window.omniStream.state === 'cancelled'")
            assert (await tab.state())["lastStep"] < 200
            assert await tab.evaluate("document.getElementById('generate').disabled") is False

        # The server is gone: the close reason shows, and a new request says it cannot connect.
        await tab.wait_for("!window.omniStream.connected")
        assert "shutting down" in (await tab.state())["connection"]
        await tab.evaluate("document.getElementById('generate').click(), true")
        # A reconnect attempt made during the server's grace period may have
        # shown "shutting_down" first; the click must end in "unreachable".
        await tab.wait_for(
            "window.omniStream.state === 'error' && window.omniStream.error"
            " && window.omniStream.error.code === 'unreachable'"
        )
        state = await tab.state()
        assert "cannot reach" in state["status"], state
