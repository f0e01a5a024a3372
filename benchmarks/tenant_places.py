"""One tenant against another's share of the engine, the models and the results (issue #39).

Four of the issue's attacks, each against a real ``omni-stream serve`` (a
process of its own, as an operator runs it: :func:`serve`), with the
honest tenant's figures measured beside the attack and quiet:

- ``pause`` (attack 1): tenant A starts ``max_active`` long requests and
  pauses them all; B's 5-step requests: the time to their first step and
  to their end, beside quiet. Then the same with ``--max-loaded 1``: A's
  one paused request on model a, B's requests on model b.
- ``residency`` (attack 6): ``--model a --model b --max-loaded 1``, A's long
  request on b, B's 20-step requests on a: their time beside quiet; then
  one-step requests alternating a, b for ``--seconds`` (one client, then
  two clients at once): requests done, loads, and loads a minute.
- ``retention`` (attack 4): A floods 300 one-step ``response_format=url``
  images; B's result URLs (an image, a video) fetched after.
- ``scope`` (attack 9): B with A's video id on every route (status, pause,
  resume, events, output, preview, DELETE, the websocket's attach and
  cancel, ``/v1/videos/{id}``): what each answered, and A's job's end.

Run ``python -m benchmarks.tenant_places [pause|residency|retention|scope]``
(all four by default); it prints one JSON object a line. The models it
serves (``PromptImage``, ``PromptVideo``: Synthetic with a prompt, sides
and frames, so the OpenAI doors take them) are the tests' too
(tests/server/test_tenant_places.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_stream.model import StepModel
from omni_stream.models import Synthetic
from omni_stream.params import Param

from .serve_process import omni_stream_argv
from .stress_common import ROOT

__all__ = ["PromptImage", "PromptVideo", "Server", "main", "serve"]


class PromptImage(Synthetic):
    """Synthetic with a ``prompt`` (not used: the frames are Synthetic's) and ``width`` /
    ``height``: what the OpenAI images door asks of a model."""

    name = "prompt_image"
    params = (
        *(p for p in Synthetic.params if p.name != "shape"),
        Param("prompt", "str", "", "text (not used)"),
        Param("width", "int", 16, "frame width", minimum=8, maximum=256),
        Param("height", "int", 16, "frame height", minimum=8, maximum=256),
    )

    def validate(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Checked params; raises ParamsError naming the field."""
        rest = dict(params or {})
        rest.pop("shape", None)  # made here: checked params are checked again (the engine's intake)
        out = StepModel.validate(self, rest)
        out["shape"] = [*self._frames(out), 3, out["height"], out["width"]]
        return out

    def _frames(self, params: Mapping[str, Any]) -> list[int]:
        return []


class PromptVideo(PromptImage):
    """:class:`PromptImage` making videos of ``num_frames`` frames at ``fps``: the OpenAI videos door's."""

    name = "prompt_video"
    produces_video = True
    fps = 8
    params = (
        *PromptImage.params, Param("num_frames", "int", 3, "frames of the video", minimum=2, maximum=16)
    )

    def _frames(self, params: Mapping[str, Any]) -> list[int]:
        return [int(params["num_frames"])]


IMAGE = "benchmarks.tenant_places:PromptImage"
VIDEO = "benchmarks.tenant_places:PromptVideo"
#: Two tenants: ann (the attacker, A) and bob (the honest one, B).
TOKENS = ("--token", "ann=a-secret", "--token", "bob=b-secret")
ANN, BOB = "a-secret", "b-secret"


class Server:
    """A running ``omni-stream serve``: its URL, and its log lines so far."""

    def __init__(self, proc: subprocess.Popen[str], url: str, lines: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.lines = lines

    def call(
        self, method: str, path: str, body: Any = None, *, token: str | None = None, timeout: float = 120
    ) -> tuple[int, Any]:
        """One HTTP call: (status, the JSON body or the raw bytes)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                raw, status, ctype = reply.read(), reply.status, reply.headers.get("content-type", "")
        except urllib.error.HTTPError as err:
            raw, status, ctype = err.read(), err.code, err.headers.get("content-type", "")
        return status, json.loads(raw) if "json" in ctype else raw

    def loads(self) -> int:
        """Models loaded so far (the router's ``model X loaded`` log lines)."""
        return sum(1 for line in list(self.lines) if re.search(r"model \S+ loaded in", line))


@contextlib.contextmanager
def serve(*args: str, env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """``omni-stream serve --port 0 --device cpu ARGS`` (the ``OMNI_STREAM_*`` of this process
    removed, ``env`` added) until the block ends."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_")}
    environ.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})})
    proc = subprocess.Popen(
        omni_stream_argv("serve", "--port", "0", "--device", "cpu", *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, cwd=ROOT,
    )
    lines: list[str] = []
    found: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if match := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                found.put(match.group(1))

    threading.Thread(target=pump, daemon=True).start()
    try:
        try:
            url = found.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("omni-stream serve did not start: " + "".join(lines[-20:])) from None
        yield Server(proc, url, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: Sequence[float]) -> dict[str, float]:
    """n, p50 and p99 (nearest rank) of ``values``, in seconds."""
    return {
        "n": len(values), "p50_s": round(statistics.median(values), 4), "p99_s": round(_p(values, 0.99), 4)
    }


def timed(server: Server, body: Mapping[str, Any], *, token: str) -> tuple[float, float]:
    """(seconds to the first step, seconds to the end) of one request, over SSE."""
    started = time.monotonic()
    request = urllib.request.Request(
        server.url + "/v1/generations", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                 "Authorization": f"Bearer {token}"},
    )
    first = float("nan")
    with urllib.request.urlopen(request, timeout=300) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line == "event: progress" and first != first:
                first = time.monotonic() - started
            if line in ("event: done", "event: error", "event: cancelled"):
                break
    return first, time.monotonic() - started


def honest(server: Server, body: Mapping[str, Any], n: int) -> dict[str, Any]:
    """B's ``n`` requests one after another: its first step and its whole request, p50 and p99."""
    firsts, ends = zip(*(timed(server, body, token=BOB) for _ in range(n)), strict=True)
    return {"first_step": summary(firsts), "request": summary(ends)}


def _ratio(during: Mapping[str, Any], quiet: Mapping[str, Any]) -> dict[str, float]:
    return {k: round(during[k]["p99_s"] / quiet[k]["p99_s"], 2) for k in ("first_step", "request")}


LONG = {"steps": 10_000, "work": 20}


def bench_pause(n: int) -> dict[str, Any]:
    """Attack 1: B's 5-step requests while A pauses every place, beside quiet; then the same
    with ``--max-loaded 1``, A's one paused request on model a, B's on model b."""
    body = {"params": {"steps": 5, "work": 20}}
    out: dict[str, Any] = {"attack": "pause"}
    with serve("--model", "synthetic", *TOKENS) as server:
        out["quiet"] = honest(server, body, n)
        ids = [server.call("POST", "/v1/generations", {"params": LONG}, token=ANN)[1]["id"] for _ in range(4)]
        while any(server.call("GET", f"/v1/generations/{i}", token=ANN)[1]["step"] < 1 for i in ids):
            time.sleep(0.05)
        out["paused"] = [server.call("POST", f"/v1/generations/{i}/pause", token=ANN)[0] for i in ids]
        out["during"] = honest(server, body, n)
        out["p99_vs_quiet"] = _ratio(out["during"], out["quiet"])
    with serve("--model", "a=synthetic", "--model", "b=synthetic", "--max-loaded", "1", *TOKENS) as server:
        on_b = {**body, "model": "b"}
        server.call("POST", "/v1/generations?wait=true", on_b, token=BOB)  # b loaded
        out["max_loaded_1_quiet"] = honest(server, on_b, n)
        made = server.call("POST", "/v1/generations", {"params": LONG, "model": "a"}, token=ANN)[1]
        while server.call("GET", f"/v1/generations/{made['id']}", token=ANN)[1]["step"] < 1:
            time.sleep(0.05)
        time.sleep(3.0)  # a past its quantum (2 s): the run is under way, as the attack's was
        out["max_loaded_1_paused"] = server.call("POST", f"/v1/generations/{made['id']}/pause", token=ANN)[0]
        out["max_loaded_1_during"] = honest(server, on_b, n)
        out["max_loaded_1_p99_vs_quiet"] = _ratio(out["max_loaded_1_during"], out["max_loaded_1_quiet"])
    return out


def alternate(server: Server, *, clients: int, seconds: float) -> dict[str, Any]:
    """One-step requests alternating models a and b for ``seconds``, from ``clients`` clients at
    once (each alternating, starting on another model): requests done, loads, loads a minute."""
    before = server.loads()
    started = time.monotonic()
    deadline = started + seconds

    def client(k: int) -> int:
        done = i = 0
        while time.monotonic() < deadline:
            body = {"params": {"steps": 1, "work": 0}, "model": "ab"[(i + k) % 2]}
            i += 1
            with contextlib.suppress(OSError):
                done += server.call("POST", "/v1/generations?wait=true", body, token=(ANN, BOB)[k % 2],
                                    timeout=600)[0] == 200
        return done

    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(client, range(clients)))
    elapsed = time.monotonic() - started
    loads = server.loads() - before
    return {"clients": clients, "done": done, "elapsed_s": round(elapsed, 2), "loads": loads,
            "loads_per_min": round(loads * 60 / elapsed, 1)}


def bench_residency(n: int, seconds: float) -> dict[str, Any]:
    """Attack 6: B's 20-step requests on a beside A's long run on b, beside quiet; alternation."""
    out: dict[str, Any] = {"attack": "residency"}
    with serve("--model", "a=synthetic", "--model", "b=synthetic", "--max-loaded", "1", *TOKENS) as server:
        body = {"params": {"steps": 20, "work": 20}, "model": "a"}
        server.call("POST", "/v1/generations?wait=true", body, token=BOB)  # a loaded
        out["quiet"] = honest(server, body, n)
        made = server.call("POST", "/v1/generations", {"params": LONG, "model": "b"}, token=ANN)[1]
        while server.call("GET", f"/v1/generations/{made['id']}", token=ANN)[1]["step"] < 1:
            time.sleep(0.05)
        time.sleep(3.0)  # its model past its quantum (2 s): the run is under way, as the attack's was
        out["beside_long_run"] = honest(server, body, n)
        out["long_run_after"] = server.call("GET", f"/v1/generations/{made['id']}", token=ANN)[1]["status"]
        out["p99_vs_quiet"] = _ratio(out["beside_long_run"], out["quiet"])
        server.call("DELETE", f"/v1/generations/{made['id']}", token=ANN)
        out["alternating"] = alternate(server, clients=1, seconds=seconds)
        out["alternating_two_clients"] = alternate(server, clients=2, seconds=seconds)
    return out


def bench_retention(flood: int) -> dict[str, Any]:
    """Attack 4: B's image URL and video content after A's flood of one-step url images."""
    with serve("--model", f"img={IMAGE}", "--model", f"vid={VIDEO}", *TOKENS) as server:
        image = server.call("POST", "/v1/images/generations",
                            {"prompt": "x", "response_format": "url", "steps": 1}, token=BOB)[1]
        video = server.call("POST", "/v1/videos", {"prompt": "x", "model": "vid", "steps": 1}, token=BOB)[1]
        while server.call("GET", f"/v1/videos/{video['id']}", token=BOB)[1]["status"] != "completed":
            time.sleep(0.05)
        path = "/v1/" + image["data"][0]["url"].split("/v1/", 1)[1]
        started = time.monotonic()

        def one(_: int) -> int:
            body = {"prompt": "x", "response_format": "url", "steps": 1}
            return server.call("POST", "/v1/images/generations", body, token=ANN)[0]

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(flood)))
        return {
            "attack": "retention", "flood": flood, "flood_s": round(time.monotonic() - started, 2),
            "flood_ok": sum(s == 200 for s in statuses),
            "b_image_url": server.call("GET", path, token=BOB)[0],
            "b_video_content": server.call("GET", f"/v1/videos/{video['id']}/content", token=BOB)[0],
        }


def bench_scope() -> dict[str, Any]:
    """Attack 9: B with A's video id on every HTTP route; A's job's end."""
    with serve("--model", f"vid={VIDEO}", *TOKENS) as server:
        job = server.call("POST", "/v1/videos", {"prompt": "x", "steps": 200, "work": 20}, token=ANN)[1]
        rid = job["id"]
        answers = {}
        for method, path in [
            ("GET", "/v1/generations/{id}"), ("POST", "/v1/generations/{id}/pause"),
            ("POST", "/v1/generations/{id}/resume"), ("GET", "/v1/generations/{id}/output"),
            ("GET", "/v1/generations/{id}/preview"), ("GET", "/v1/videos/{id}"),
            ("DELETE", "/v1/generations/{id}"),
        ]:
            answers[f"{method} {path}"] = server.call(method, path.replace("{id}", rid), token=BOB)[0]
        while True:
            status = server.call("GET", f"/v1/videos/{rid}", token=ANN)[1]["status"]
            if status not in ("queued", "in_progress"):
                break
            time.sleep(0.1)
        return {"attack": "scope", "b_answers": answers, "a_job": status}


BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "pause": lambda a: bench_pause(a.n),
    "residency": lambda a: bench_residency(a.n, a.seconds),
    "retention": lambda a: bench_retention(a.flood),
    "scope": lambda a: bench_scope(),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tenant_places",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "attacks", nargs="*", metavar="ATTACK", help=f"any of {', '.join(BENCHES)} (default: all)"
    )
    parser.add_argument("-n", type=int, default=20, help="honest requests per measure (default 20)")
    parser.add_argument("--flood", type=int, default=300, help="attack 4's url images (default 300)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="attack 6's alternation, per measure (default 60)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.attacks if a not in BENCHES]
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    for name in args.attacks or list(BENCHES):
        print(json.dumps(BENCHES[name](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
