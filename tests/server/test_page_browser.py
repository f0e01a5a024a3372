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
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import websockets
from PIL import Image

import omni_stream as om
from omni_stream import client as omc
from omni_stream.models.diffusers.step_cache import METHODS, cache_param
from omni_stream.params import Param
from omni_stream.server import Server

from ..conftest import Slow, running

PAGE = Path(om.__file__).parent / "server" / "static" / "index.html"
CHROMIUM = shutil.which("chromium")
TOKEN = "page-test-token"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no `chromium` on PATH; install it with `bash scripts/install_browser.sh`",
)
# What these test is the page, in Chromium; the server's paths under each event loop are
# tested elsewhere under both: once, under asyncio's (it halves the suite's slowest file).
pytestmark = pytest.mark.one_loop


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

    async def set_field(self, name: str, value: str, group: str | None = None) -> None:
        """Sets a form field: the first ``data-param=name``, or the one of ``group``."""
        where = f"[data-group={json.dumps(group)}]" if group else ""
        await self.evaluate(
            f"(() => {{ const el = document.querySelector('{where}[data-param={json.dumps(name)}]');"
            f" el.value = {json.dumps(value)}; return true; }})()"
        )

    async def form(self) -> dict[str, Any]:
        """Every field of the form, ``group.name`` -> its value (checked for a checkbox)."""
        return await self.evaluate(
            "Object.fromEntries([...document.querySelectorAll('[data-param]')].map(e =>"
            " [e.dataset.group + '.' + e.dataset.param, e.type === 'checkbox' ? e.checked : e.value]))"
        )

    async def gallery(self) -> list[dict[str, Any]]:
        """The gallery as the page lists it (newest first), with each entry's DOM."""
        return await self.evaluate(
            "window.omniStream.gallery.map(e => { const li = document.querySelector("
            " `#gallery li[data-id=\"${e.id}\"]`); const a = li && li.querySelector('a.download');"
            " const media = li && li.querySelector('img, video');"
            " return {...e, domState: li && li.dataset.state, text: li && li.textContent,"
            " download: a && a.download, label: a && a.getAttribute('aria-label'),"
            " shown: !!media && (media.tagName === 'VIDEO' || (media.complete && media.naturalWidth > 0))};"
            " })"
        )

    async def download(self, request_id: str) -> tuple[str, bytes]:
        """The file name and the bytes behind the gallery's download link for ``request_id``."""
        name, data = await self.evaluate(
            "(async () => { const a = document.querySelector("
            f" {json.dumps(f'#gallery li[data-id={json.dumps(request_id)}] a.download')});"
            " const bytes = new Uint8Array(await (await fetch(a.href)).arrayBuffer());"
            " let text = ''; for (let i = 0; i < bytes.length; i += 0x8000)"
            " text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));"
            " return [a.download, btoa(text)]; })()"
        )
        return name, base64.b64decode(data)

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


class Recording(Slow):
    """Slow that records the params of every request it starts (what the server got)."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.seen: list[dict[str, Any]] = []

    def start(self, params: Mapping[str, Any], device: Any) -> Any:
        self.seen.append(dict(params))
        return super().start(params, device)


class NarrowSeed(Recording):
    """Its seed may only be 1000-1009: a random seed must come from the param's own range."""

    params = tuple(
        Param("seed", "int", 1000, "random seed", minimum=1000, maximum=1009) if p.name == "seed" else p
        for p in Slow.params
    )


async def _server_output(server: Server, request_id: str) -> httpx.Response:
    """``GET /v1/generations/{id}/output`` with the token, as any HTTP client would."""
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        return await http.get(
            f"/v1/generations/{request_id}/output", headers={"Authorization": f"Bearer {TOKEN}"}
        )


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
    assert isinstance(model, Slow)
    pause, model.delay = model.delay, 0.0
    try:
        async with omc.connect(server.url, token=TOKEN) as client:
            final = await client.generate(params, preview={"format": fmt}).result()
    finally:
        model.delay = pause
    return _pixels(final.image())


async def _render(tab: Tab, timeout: float = 15) -> str:
    """Click Generate and wait for the result; its request id."""
    before = await tab.evaluate("window.omniStream.requestId")
    await tab.evaluate("document.getElementById('generate').click(), true")
    await tab.wait_for(
        f"window.omniStream.requestId !== {json.dumps(before)} && window.omniStream.done"
        " && window.omniStream.finalDrawn || window.omniStream.state === 'error'",
        timeout=timeout,
    )
    state = await tab.state()
    assert state["state"] == "done", state
    return state["requestId"]


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
    async with open_tab(chromium) as tab, running(Slow(0.08), token=TOKEN) as server:
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
    async with open_tab(chromium) as tab, running(Slow(0.06), token=TOKEN) as server:
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


class SlowVideo(Slow):
    """Its result is a 4-frame video: the page must play it, not draw it on the canvas."""

    produces_video = True

    def decode(self, state: Any, frame: Any) -> Any:
        return frame.unsqueeze(0).repeat(4, 1, 1, 1).clamp(-1, 1)


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_offers_the_result_and_plays_a_video_result(chromium: str) -> None:
    pytest.importorskip("av", reason="an MP4 result needs the video extra")
    async with open_tab(chromium) as tab, running(SlowVideo(0.05), token=TOKEN) as server:
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
        # The gallery shows a video result as a video, and offers the MP4 itself.
        (entry,) = await tab.gallery()
        assert entry["format"] == "mp4" and entry["download"] == f"{request_id}.mp4", entry
        assert await tab.evaluate(
            f"!!document.querySelector('#gallery li[data-id={json.dumps(request_id)}] video')"
        )


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_reports_refusals_failures_and_cancel(chromium: str) -> None:
    async with open_tab(chromium) as tab:
        async with running(Slow(0.05), token=TOKEN) as server:
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


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_gallery_lists_results_newest_first_and_survives_a_reload(chromium: str) -> None:
    # max_retained=2: the third result makes the server forget the first.
    async with open_tab(chromium) as tab, running(Slow(0.01), token=TOKEN, max_retained=2) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        assert await tab.evaluate("document.getElementById('gallery-section').hidden") is True
        ids: list[str] = []
        outputs: dict[str, bytes] = {}
        for seed, fmt, ext in ((11, "", "png"), (12, "jpeg", "jpg"), (13, "webp", "webp")):
            await _fill_form(tab, dict(PARAMS, steps=5, seed=seed), "jpeg")
            await tab.set_field("format", fmt, group="output")
            request_id = await _render(tab)
            # The download link holds exactly the server's output, under the server's name.
            response = await _server_output(server, request_id)
            assert response.status_code == 200, response.text
            name, data = await tab.download(request_id)
            assert name == f"{request_id}.{ext}"
            assert f'filename="{name}"' in response.headers["content-disposition"]
            assert data == response.content, f"{fmt or 'png'}: the download is not the result"
            ids.append(request_id)
            outputs[request_id] = response.content

        gallery = await tab.gallery()
        assert [e["id"] for e in gallery] == ids[::-1], "newest first"
        assert await tab.evaluate(
            "[...document.querySelectorAll('#gallery li')].map(li => li.dataset.id)"
        ) == ids[::-1]
        for entry, seed in zip(gallery, (13, 12, 11)):
            assert entry["domState"] == "ready" and entry["source"] == "stream" and entry["shown"], entry
            assert f"seed {seed}" in entry["text"] and "steps 5" in entry["text"], entry["text"]
            assert entry["label"] == f"Download {entry['download']}"
        # Only ids and params are kept, never image bytes.
        stored = await tab.evaluate("sessionStorage.getItem('omniStream.gallery:/')")
        assert len(stored) < 3000 and [e["id"] for e in json.loads(stored)] == ids[::-1]
        assert (await _server_output(server, ids[0])).status_code == 404

        # After a reload every entry is fetched again from the server; the forgotten one expired.
        await tab.call("Page.reload")
        await tab.wait_for("document.readyState === 'complete' && !!window.omniStream")
        await tab.wait_for(
            "window.omniStream.gallery.length === 3 && window.omniStream.gallery.every("
            "e => e.state === 'ready' || e.state === 'expired')"
            " && [...document.querySelectorAll('#gallery img')].every(i => i.complete)"
        )
        gallery = await tab.gallery()
        assert [e["id"] for e in gallery] == ids[::-1]
        newest, middle, oldest = gallery
        assert middle["source"] == "server" and middle["shown"] and middle["seed"] == "12", middle
        assert newest["domState"] == "ready" and newest["shown"], newest
        for entry in (newest, middle):
            assert await tab.download(entry["id"]) == (entry["download"], outputs[entry["id"]])
        assert oldest["domState"] == "expired" and oldest["download"] is None, oldest
        assert "expired" in oldest["text"] and "seed 11" in oldest["text"], oldest["text"]


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_a_seed_left_at_minus_one_is_drawn_by_the_server_and_the_gallery_names_it(chromium: str) -> None:
    async with open_tab(chromium) as tab, running(Recording(0.01), token=TOKEN) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        assert await tab.evaluate("document.querySelector('[data-param=seed]').value") == "-1"
        await _fill_form(tab, dict(PARAMS, steps=3, seed=-1), "jpeg")
        request_id = await _render(tab)
        drawn = server.model.seen[-1]["seed"]
        assert 0 <= drawn < 2**32
        (entry,) = await tab.gallery()
        assert entry["id"] == request_id and entry["seed"] == str(drawn)
        assert f"seed {drawn}" in entry["text"]


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_seed_button_picks_a_seed_in_range_that_the_server_receives(chromium: str) -> None:
    async with open_tab(chromium) as tab, running(NarrowSeed(0.01), token=TOKEN) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        button = await tab.evaluate(
            "(() => { const b = document.getElementById('seed-random');"
            " return b && [b.textContent, b.getAttribute('aria-label'), b.type, b.checkVisibility(),"
            " b.parentElement.contains(document.querySelector('[data-param=seed]'))]; })()"
        )
        assert button == ["Random", "Random seed", "button", True, True], "no seed button beside the field"
        await _fill_form(tab, dict(PARAMS, steps=3, seed=1000), "jpeg")
        seeds = []
        for _ in range(12):
            await tab.evaluate("document.getElementById('seed-random').click(), true")
            seeds.append(await tab.evaluate("document.querySelector('[data-param=seed]').value"))
        assert all(re.fullmatch(r"\d+", s) and 1000 <= int(s) <= 1009 for s in seeds), seeds
        assert len(set(seeds)) > 1, f"not random: {seeds}"
        request_id = await _render(tab)
        assert server.model.seen[-1]["seed"] == int(seeds[-1])
        (entry,) = await tab.gallery()
        assert entry["id"] == request_id and entry["seed"] == seeds[-1]
        assert f"seed {seeds[-1]}" in entry["text"]


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_reload_mid_render_shows_the_running_requests_form(chromium: str) -> None:
    # A seed past 2**53 must reach the server exactly (a JavaScript Number would round it).
    params = {"steps": 30, "shape": [3, 16, 12], "work": 0, "seed": 2**63 - 1}
    async with open_tab(chromium) as tab, running(Recording(0.05), token=TOKEN) as server:
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        defaults = await tab.form()
        await _fill_form(tab, params, "png")
        for name, value in (("every", "2"), ("max_size", "64")):
            await tab.set_field(name, value, group="preview")
        for name, value in (("format", "webp"), ("quality", "70")):
            await tab.set_field(name, value, group="output")
        sent = await tab.form()
        assert sent != defaults
        await tab.evaluate("document.getElementById('generate').click(), true")
        request_id = await tab.wait_for("window.omniStream.requestId")
        await tab.wait_for("window.omniStream.lastStep >= 2")

        await tab.call("Page.reload")
        await tab.wait_for("document.readyState === 'complete' && !!window.omniStream")
        await tab.wait_for("window.omniStream.state === 'running' && window.omniStream.connected")
        assert await tab.form() == sent, "the form does not show the resumed request"
        state = await tab.state()
        assert state["requestId"] == request_id and state["lastStep"] < params["steps"], state
        # Generate stays enabled: another request would queue beside this one.
        assert await tab.evaluate("document.getElementById('generate').disabled") is False
        assert await tab.evaluate("window.omniStream.jobs.map(j => j.id)") == [request_id]
        assert server.model.seen[-1]["seed"] == 2**63 - 1
        assert len(server.model.seen) == 1, "the reload started another request"

        await tab.wait_for("window.omniStream.done && window.omniStream.finalDrawn", timeout=15)
        (entry,) = await tab.gallery()
        assert entry["id"] == request_id and entry["download"] == f"{request_id}.webp", entry
        assert entry["seed"] == str(2**63 - 1) and f"seed {2**63 - 1}" in entry["text"]


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_page_works_without_session_storage(chromium: str) -> None:
    async with open_tab(chromium) as tab, running(Slow(0.01), token=TOKEN) as server:
        await tab.call("Page.addScriptToEvaluateOnNewDocument", {"source": (
            "Object.defineProperty(window, 'sessionStorage', {get() {"
            " throw new DOMException('storage is off', 'SecurityError'); }});"
        )})
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        assert await tab.evaluate("window.omniStream.storage") is False
        await _fill_form(tab, dict(PARAMS, steps=3), "jpeg")
        request_id = await _render(tab)
        (entry,) = await tab.gallery()
        assert entry["id"] == request_id and entry["shown"] and entry["download"] == f"{request_id}.png"
        assert "session storage is off" in await tab.evaluate(
            "document.getElementById('gallery-note').textContent"
        )


async def _enter_token(tab: Tab, value: str) -> None:
    await tab.evaluate(
        f"(() => {{ document.getElementById('token').value = {json.dumps(value)};"
        " document.querySelector('#token-form button').click(); return true; })()"
    )


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_a_token_server_page_asks_for_the_token_and_streams_once_given_it(chromium: str) -> None:
    async with open_tab(chromium) as tab, running(Slow(0.02), token=TOKEN) as server:
        await tab.open(f"{server.http_url}/")  # no ?token=
        await tab.wait_for("window.omniStream.state === 'error'")
        state = await tab.state()
        assert state["error"]["code"] == "unauthorized" and "token" in state["status"], state
        shown = await tab.evaluate(
            "[document.getElementById('token-form').hidden, document.getElementById('token').type,"
            " document.getElementById('model').textContent]"
        )
        assert shown[:2] == [False, "password"] and "loading" not in shown[2], shown

        # A wrong one: refused again, and asked again.
        await _enter_token(tab, "not-the-token")
        await tab.wait_for(
            "window.omniStream.state === 'error' && !document.getElementById('token-form').hidden"
        )
        assert (await tab.state())["error"]["code"] == "unauthorized"

        await _enter_token(tab, TOKEN)
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        assert await tab.evaluate("document.getElementById('token-form').hidden") is True
        await _fill_form(tab, dict(PARAMS, steps=4), "png")
        canvases = await _generate_and_watch(tab)
        assert (await tab.state())["state"] == "done" and len(canvases) >= 2
        # Kept for this tab only: sessionStorage, never localStorage or a cookie.
        kept = await tab.evaluate(
            "[Object.keys(sessionStorage).filter(k => sessionStorage.getItem(k).includes("
            f"{json.dumps(TOKEN)})), localStorage.length, document.cookie]"
        )
        assert kept == [["omniStream.token:/"], 0, ""], kept

        # A reload in the same tab needs no token typed again.
        await tab.call("Page.reload")
        await tab.wait_for("document.readyState === 'complete' && !!window.omniStream")
        await tab.wait_for("window.omniStream.connected && window.omniStream.state === 'done'")


# ---- the page as a front end (issue #38): picker, queue, upload, layout --------------


class Inpaint(Recording):
    """Recording with an input image and a mask, as an inpaint pipeline's params: file fields."""

    name = "inpaint"
    params = (
        *Slow.params,
        Param("image", "str", None, "input image (img2img, inpaint)"),
        Param("mask_image", "str", None, "inpaint mask, white where to paint"),
        cache_param(METHODS),  # an object param, as the native diffusers loops declare
    )

    def validate(self, params: Any) -> dict[str, Any]:
        from omni_stream.models.inputs import load_image

        params = dict(params or {})
        images = {name: params.pop(name, None) for name in ("image", "mask_image")}
        out = super().validate(params)
        return {**out, **{k: load_image(v) if isinstance(v, str) else v for k, v in images.items()}}


async def _at_1280x800(tab: Tab) -> None:
    await tab.call("Emulation.setDeviceMetricsOverride",
                   {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})


async def _screenshot(tab: Tab, path: Path) -> None:
    """The page as a person sees it, saved for one to look at."""
    shot = await tab.call("Page.captureScreenshot", {"format": "png"})
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {path}")


async def _pick_model(tab: Tab, name: str) -> None:
    await tab.evaluate(
        f"(() => {{ const p = document.getElementById('model-picker'); p.value = {json.dumps(name)};"
        " p.dispatchEvent(new Event('change')); return true; })()"
    )


async def _param_names(tab: Tab) -> list[str]:
    return await tab.evaluate(
        "[...document.querySelectorAll('#params [data-param]')].map(e => e.dataset.param)"
    )


async def _click_in_queue(tab: Tab, request_id: str, action: str) -> None:
    await tab.evaluate(
        f"document.querySelector('#jobs li[data-id={json.dumps(request_id)}] button.{action}').click(), true"
    )


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_model_picker_rebuilds_the_form_and_sends_the_chosen_model(
    chromium: str, tmp_path: Path
) -> None:
    slow, inpaint = Recording(0.01), Inpaint(0.01)
    async with open_tab(chromium) as tab, running({"slow": slow, "edit": inpaint}, token=TOKEN) as server:
        await _at_1280x800(tab)
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        shown = await tab.evaluate(
            "[[...document.getElementById('model-picker').options].map(o => o.value),"
            " document.getElementById('model-field').hidden, document.getElementById('model').textContent]"
        )
        assert shown[:2] == [["slow", "edit"], False] and shown[2].startswith("slow"), shown
        assert await _param_names(tab) == [p.name for p in Slow.params]

        await _pick_model(tab, "edit")
        # (An object param shows one input per field: cache.method, cache.threshold.)
        assert await _param_names(tab) == [
            n for p in Inpaint.params for n in ([f"{p.name}.{f.name}" for f in p.fields] or [p.name])
        ]
        assert (await tab.evaluate("document.getElementById('model').textContent")).startswith("edit")
        assert await tab.evaluate(
            "[...document.querySelectorAll('#params input[type=file]')].map(e => e.dataset.param)"
        ) == ["image", "mask_image"]
        await _fill_form(tab, dict(PARAMS, steps=3, seed=21), "jpeg")
        await _screenshot(tab, tmp_path / "picker-edit.png")
        edited = await _render(tab)
        assert len(inpaint.seen) == 1 and inpaint.seen[0]["steps"] == 3 and slow.seen == []
        assert inpaint.seen[0]["image"] is None  # no file chosen: the param is absent
        (entry,) = await tab.gallery()
        assert entry["id"] == edited and "edit" in entry["text"], entry

        # Back to the first model: its own params again, and requests go to it.
        await _pick_model(tab, "slow")
        assert await _param_names(tab) == [p.name for p in Slow.params]
        await _fill_form(tab, dict(PARAMS, steps=4, seed=22), "jpeg")
        await _render(tab)
        assert [s["steps"] for s in slow.seen] == [4] and len(inpaint.seen) == 1
        # "Use settings" of the first result brings its model back with its params.
        await tab.evaluate(
            f"document.querySelector('#gallery li[data-id={json.dumps(edited)}] button.reuse').click(), true"
        )
        assert await tab.evaluate("document.getElementById('model-picker').value") == "edit"
        assert (await tab.form())["params.seed"] == "21"


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_queue_panel_lists_this_tabs_jobs_with_positions_and_steers_them(
    chromium: str, tmp_path: Path
) -> None:
    # One place in the engine: the second and third requests wait, with their positions.
    async with open_tab(chromium) as tab, running(Slow(0.03), token=TOKEN, max_active=1) as server:
        await _at_1280x800(tab)
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        assert await tab.evaluate("document.getElementById('queue').hidden") is True
        await _fill_form(tab, dict(PARAMS, steps=300), "jpeg")
        ids = []
        for _ in range(3):
            before = await tab.evaluate("window.omniStream.requestId")
            assert await tab.evaluate("document.getElementById('generate').disabled") is False
            await tab.evaluate("document.getElementById('generate').click(), true")
            ids.append(await tab.wait_for(f"window.omniStream.requestId !== {json.dumps(before)}"
                                          " && window.omniStream.requestId"))
        first, second, third = ids
        jobs = await tab.wait_for(
            "(() => { const j = window.omniStream.jobs; return j.length === 3 && j[0].status === 'running'"
            " && j[0].step >= 1 && j[1].status === 'queued' && j[2].status === 'queued' && j; })()"
        )
        assert [j["id"] for j in jobs] == ids
        assert 0 <= jobs[1]["position"] < jobs[2]["position"], jobs
        rows = await tab.evaluate(
            "[...document.querySelectorAll('#jobs li')].map(li => [li.dataset.id, li.dataset.status,"
            " li.querySelector('.job-status').textContent, li.querySelector('.steps').textContent,"
            " li.querySelector('button.pause').disabled, li.classList.contains('shown')])"
        )
        assert [r[0] for r in rows] == ids and [r[1] for r in rows] == ["running", "queued", "queued"], rows
        assert "queued" in rows[1][2] and re.match(r"step \d+ / 300", rows[0][3]), rows
        assert [r[4] for r in rows] == [False, True, True], "only a running request can be paused"
        assert [r[5] for r in rows] == [False, False, True], "the canvas shows the newest request"
        await _screenshot(tab, tmp_path / "queue.png")

        # A reload attaches to every one of them again: the queue comes back as it was.
        await tab.call("Page.reload")
        await tab.wait_for("document.readyState === 'complete' && !!window.omniStream")
        jobs = await tab.wait_for(
            "(() => { const j = window.omniStream.jobs; return j.length === 3 && j[0].status === 'running'"
            " && j[1].status === 'queued' && j[2].status === 'queued' && j; })()"
        )
        assert [j["id"] for j in jobs] == ids and jobs[1]["position"] < jobs[2]["position"], jobs

        # Cancel the waiting ones from their rows: they leave the queue; the running one goes on.
        # The last one's position moves up (read again from the server while it waits).
        await _click_in_queue(tab, second, "cancel")
        await tab.wait_for(f"!window.omniStream.jobs.some(j => j.id === {json.dumps(second)})")
        await tab.wait_for(f"window.omniStream.jobs[1].position < {jobs[2]['position']}", timeout=5)
        await _click_in_queue(tab, third, "cancel")
        await tab.wait_for("window.omniStream.jobs.length === 1 && window.omniStream.state === 'cancelled'")
        assert [r.id for r in server.service.registry if r.id in (second, third) and not r.ended] == []

        # Pause and resume the running one; it goes on from where it stopped.
        await _click_in_queue(tab, first, "pause")
        paused = await tab.wait_for(
            "window.omniStream.jobs[0].status === 'paused' && window.omniStream.jobs[0].step"
        )
        assert await tab.evaluate("document.querySelector('#jobs li button.resume').disabled") is False
        await _click_in_queue(tab, first, "resume")
        await tab.wait_for(
            f"window.omniStream.jobs[0].status === 'running' && window.omniStream.jobs[0].step > {paused}"
        )
        await _click_in_queue(tab, first, "cancel")
        await tab.wait_for("window.omniStream.jobs.length === 0 && document.getElementById('queue').hidden")


def _png_file(path: Path, size: tuple[int, int], color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, color)
    image.putpixel((0, 0), (1, 2, 3))
    image.save(path)
    return image


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_an_image_models_form_uploads_its_image_and_mask(chromium: str, tmp_path: Path) -> None:
    image = _png_file(tmp_path / "image.png", (20, 24), (200, 30, 40))
    mask = _png_file(tmp_path / "mask.png", (20, 24), (255, 255, 255))
    async with open_tab(chromium) as tab, running(Inpaint(0.01), token=TOKEN) as server:
        await _at_1280x800(tab)
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        # One model: no picker; its image params are file fields.
        assert await tab.evaluate("document.getElementById('model-field').hidden") is True
        fields = await tab.evaluate(
            "[...document.querySelectorAll('#params input[type=file]')].map(e => [e.dataset.param, e.accept])"
        )
        assert fields == [["image", "image/png,image/jpeg,image/webp"],
                          ["mask_image", "image/png,image/jpeg,image/webp"]]
        for name, path in (("image", tmp_path / "image.png"), ("mask_image", tmp_path / "mask.png")):
            found = await tab.call(
                "Runtime.evaluate", {"expression": f"document.getElementById('param-{name}')"}
            )
            await tab.call(
                "DOM.setFileInputFiles", {"files": [str(path)], "objectId": found["result"]["objectId"]}
            )
        await tab.wait_for(
            "[...document.querySelectorAll('.image-input img')].every(i => !i.hidden && i.complete)"
        )
        await _fill_form(tab, dict(PARAMS, steps=3), "jpeg")
        # An object param's fields, one input each, go back as one object.
        await tab.evaluate(
            "(e => { e.value = 'fbcache'; e.dispatchEvent(new Event('change')); })"
            "(document.getElementById('param-cache.method')), true"
        )
        await _screenshot(tab, tmp_path / "upload.png")
        await _render(tab)
        got = server.model.seen[-1]
        assert got["cache"] == {
            "method": "fbcache", "threshold": 0.05, "rel_l1": 0.4, "interval": 5, "warmup": 3, "order": 1,
            "results": True,
        }
        assert got["image"].convert("RGB").tobytes() == image.tobytes()
        assert got["mask_image"].convert("RGB").tobytes() == mask.tobytes()
        # The images went to the server, never into the tab's storage.
        stored = await tab.evaluate("Object.values(sessionStorage).join('')")
        assert "data:image" not in stored


@needs_chromium
@pytest.mark.browser
@pytest.mark.asyncio
async def test_generate_is_above_the_fold_at_1280x800(chromium: str, tmp_path: Path) -> None:
    models = {"slow": Slow(0.01), "edit": Inpaint(0.01)}
    async with open_tab(chromium) as tab, running(models, token=TOKEN) as server:
        await _at_1280x800(tab)
        await tab.open(f"{server.http_url}/?token={TOKEN}")
        await tab.wait_for("window.omniStream.state === 'ready' && window.omniStream.connected")
        for model in ("slow", "edit"):
            await _pick_model(tab, model)
            box = await tab.evaluate(
                "(() => { const b = document.getElementById('generate').getBoundingClientRect();"
                " const hit = document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2);"
                " return {top: b.top, bottom: b.bottom, height: innerHeight, width: innerWidth,"
                " scrolled: scrollY, hit: hit && hit.id}; })()"
            )
            assert (box["width"], box["height"], box["scrolled"]) == (1280, 800, 0), box
            assert box["top"] >= 0 and box["bottom"] <= 800 and box["hit"] == "generate", (model, box)
            await _screenshot(tab, tmp_path / f"fold-{model}.png")
