"""``omni-stream serve --ray`` from the command line (issue 34).

Every documented option of ``serve --ray`` (docs/scale-out.md, ``serve
--help``) yields replicas' init args that Ray can pickle, and that a replica
builds the right model from; a model loader that was a closure over the
parsed arguments (their logging handler's lock) failed every ``serve --ray``
at ``deploy()``. Those tests need no cluster: ``deploy`` runs for real up to
Ray, whose Serve pickles the init args as the application is built.

Then the documented command itself, in its own process as a user runs it:
it starts its own local Ray (the cluster of this module), deploys one
replica, serves one request over the websocket and stops on Ctrl-C, taking
its Ray processes with it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'omni-stream[ray]'")

import psutil  # noqa: E402  (a dependency of Ray's)
from ray import cloudpickle, serve  # noqa: E402
from ray.serve.schema import (  # noqa: E402
    ApplicationStatusOverview,
    DeploymentStatusOverview,
    ServeStatus,
)
from websockets.sync.client import connect  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream import cli  # noqa: E402
from omni_stream.config import PREVIEW_VAE_ENV  # noqa: E402
from omni_stream.integrations.ray_serve import DEPLOYMENT, build_app, replica  # noqa: E402
from omni_stream.integrations.ray_serve.translate import startup_failed  # noqa: E402
from omni_stream.models import Synthetic  # noqa: E402
from omni_stream.protocol import unpack_preview  # noqa: E402

from ..server.conftest import check_stream  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_deploy_module = importlib.import_module("omni_stream.integrations.ray_serve.deploy")


class Tunable(Synthetic):
    """A model taking the diffusers-only options (--preview-vae, --lora, --max-images); records them."""

    name = "tunable"

    def __init__(self) -> None:
        super().__init__()
        self.preview_vae: str | None = None
        self.loras: dict[str, str] = {}
        self.max_images: int | None = None

    def use_preview_vae(self, vae: str) -> None:
        self.preview_vae = vae

    def load_loras(self, loras: dict[str, str]) -> None:
        self.loras = dict(loras)

    def set_max_images(self, n: int) -> None:
        self.max_images = n


TUNABLE = f"{__name__}:Tunable"


class _Deployed:
    """What ``serve --ray`` deployed: deploy()'s arguments, the application Serve built, the replicas'
    init args after a trip through Ray's pickler, and what the server in front was given."""

    def __init__(self) -> None:
        self.apps: list[Any] = []
        self.addresses: list[str | None] = []
        self.engines: list[dict[str, Any]] = []
        self.served: list[dict[str, Any]] = []

    def init_args(self) -> tuple[Any, dict[str, Any], Any, int | None]:
        """The replicas' init args as a replica gets them: through cloudpickle, as Serve sends them."""
        (app,) = self.apps
        sources, engine_kwargs, settings, max_models = cloudpickle.loads(
            cloudpickle.dumps(app._bound_deployment.init_args)
        )
        return sources, engine_kwargs, settings, max_models

    def built(self) -> Any:
        """The model(s) a replica builds from its init args (one, or ``{name: model}``)."""
        sources, *_ = self.init_args()
        if isinstance(sources, dict):
            return replica._build_models(sources)
        return replica._build_model(sources)


@pytest.fixture
def deployed(monkeypatch: pytest.MonkeyPatch) -> _Deployed:
    """``serve --ray`` with deploy() run for real but for Ray itself (no cluster is started or joined)
    and a stand-in for the server in front."""
    out = _Deployed()

    class Unconnected:
        def __init__(self, name: str, **kwargs: Any) -> None:
            out.engines.append({"name": name, **kwargs})

        def connect(self) -> None:
            pass

    monkeypatch.setattr(_deploy_module, "connect_ray", out.addresses.append)
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: out.apps.append(app))
    monkeypatch.setattr(_deploy_module, "RemoteEngine", Unconnected)

    server = types.ModuleType("omni_stream.server")

    async def fake_server(**kwargs: Any) -> None:
        out.served.append(kwargs)

    server.serve = fake_server  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", server)
    return out


def serve_ray(capsys: pytest.CaptureFixture[str], *argv: str) -> None:
    code = cli.main(["serve", "--ray", "--device", "cpu", *argv])
    assert code == 0, capsys.readouterr().err


# -- what is sent to the replicas pickles, for each documented option --------------------------


def test_the_documented_spelling_pickles_and_builds_on_the_replica(capsys, deployed) -> None:  # type: ignore[no-untyped-def]
    serve_ray(capsys, "--replicas", "1", "--model", "mixture")
    _, engine_kwargs, _, max_models = deployed.init_args()
    assert engine_kwargs == {"device": "cpu"} and max_models is None
    assert deployed.built().name == "mixture"
    assert deployed.addresses == [None] and deployed.engines[0]["name"] == "omni_stream"
    assert deployed.served[0]["model"] is not None and "state_dir" not in deployed.served[0]


def test_a_state_directory_is_the_front_doors_and_the_replicas_pickle(capsys, deployed, tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    serve_ray(capsys, "--model", "mixture", "--state-dir", state, "--checkpoint-every", "4",
              "--checkpoint-seconds", "0.5", "--state-max-bytes", "1000000")
    assert deployed.built().name == "mixture"
    served = deployed.served[0]
    assert (served["state_dir"], served["checkpoint_every"], served["checkpoint_seconds"],
            served["state_max_bytes"]) == (state, 4, 0.5, 1000000)
    # The same interval for the checkpoints the replicas send the front door.
    assert deployed.engines[0]["checkpoint_every"] == 4


@pytest.mark.parametrize("max_loaded", [None, "1"], ids=["all-loaded", "max-loaded-1"])
def test_several_named_models_pickle_and_each_builds(capsys, deployed, max_loaded) -> None:  # type: ignore[no-untyped-def]
    extra = ("--max-loaded", max_loaded) if max_loaded else ()
    serve_ray(capsys, "--model", "a=mixture", "--model", "b=synthetic", "--replicas", "2", *extra)
    _, _, _, max_models = deployed.init_args()
    assert max_models == (1 if max_loaded else None)
    models = deployed.built()
    assert {name: m.name for name, m in models.items()} == {"a": "mixture", "b": "synthetic"}
    assert deployed.apps[0]._bound_deployment.num_replicas == 2


def test_the_cluster_gpus_and_hand_over_options_reach_deploy(capsys, deployed) -> None:  # type: ignore[no-untyped-def]
    serve_ray(capsys, "--model", "synthetic", "--ray-address", "auto", "--replicas", "3", "--num-gpus", "0.5",
              "--checkpoint-every", "4", "--max-handovers", "0", "--checkpoint-max-bytes", "0")
    assert deployed.built().name == "synthetic"
    assert deployed.addresses == ["auto"]
    bound = deployed.apps[0]._bound_deployment
    assert (bound.num_replicas, bound.ray_actor_options["num_gpus"]) == (3, 0.5)
    (engine,) = deployed.engines
    assert (engine["address"], engine["checkpoint_every"], engine["max_handovers"],
            engine["checkpoint_max_bytes"]) == ("auto", 4, 0, 0)


def test_scheduling_goes_to_each_replicas_engine_and_no_batch_to_its_model(capsys, deployed) -> None:  # type: ignore[no-untyped-def]
    serve_ray(capsys, "--model", "synthetic", "--scheduling", "fcfs", "--quantum", "2", "--no-batch")
    _, engine_kwargs, _, _ = deployed.init_args()
    assert engine_kwargs == {"device": "cpu", "scheduling": "fcfs", "quantum": 2}
    assert deployed.built().max_batch_size == 1


def test_the_model_options_travel_with_the_spec(capsys, deployed) -> None:  # type: ignore[no-untyped-def]
    serve_ray(capsys, "--model", TUNABLE, "--preview-vae", "taesd",
              "--lora", "style=/loras/style.safetensors", "--max-images", "3")
    model = deployed.built()
    assert (model.preview_vae, model.loras, model.max_images) == (
        "taesd", {"style": "/loras/style.safetensors"}, 3
    )


def test_the_preview_vae_variable_is_read_where_the_command_runs(capsys, deployed, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(PREVIEW_VAE_ENV, "taesd-from-env")
    serve_ray(capsys, "--model", TUNABLE)
    # A replica of another machine has its own environment, without it.
    monkeypatch.delenv(PREVIEW_VAE_ENV)
    assert deployed.built().preview_vae == "taesd-from-env"


def test_a_model_that_cannot_travel_is_a_params_error_naming_it() -> None:
    import threading

    lock = threading.RLock()

    def closure() -> om.StepModel:
        with lock:
            return Synthetic()

    with pytest.raises(om.ParamsError, match="model cannot be sent to the replicas.*pickle") as err:
        build_app(closure)
    assert err.value.field == "model"
    with pytest.raises(om.ParamsError, match="engine_kwargs cannot be sent") as err:
        build_app("synthetic", engine_kwargs={"device": "cpu", "lock": lock})
    assert err.value.field == "engine_kwargs"


# -- a deployment whose replicas fail to start names why -----------------------------------------


#: The end of Serve's status message for a deployment whose replica's __init__ raised.
_FAILED_STATUS = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its "
    "constructor or initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:omni_stream:EngineReplica.initialize_and_get_metadata()\x1b[39m (pid=1)\n"
    "RuntimeError: Traceback (most recent call last):\n"
    '  File "/omni_stream/integrations/ray_serve/replica.py", line 205, in _build_model\n'
    "    model = source()\n"
    "            ^^^^^^^^\n"
    '  File "/omni_stream/cli/loader.py", line 111, in __call__\n'
    '    raise UsageError(f"--max-images: model {spec!r} makes one image a request; "\n'
    "omni_stream.cli.console.UsageError: --max-images: model 'mixture' makes one image a request; "
    "diffusers:... image models make several"
)


def test_replicas_that_fail_to_start_are_a_dead_engine_naming_what_they_raised(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ran = RuntimeError(
        "Deploying application omni_stream failed: Failed to update the deployments ['EngineReplica']."
    )

    def run(app: Any, **kwargs: Any) -> None:
        raise ran

    # Serve's own status records, as serve.status() returns them.
    status = ServeStatus(applications={"omni_stream": ApplicationStatusOverview(
        status="DEPLOY_FAILED", message="", last_deployed_time_s=0.0,
        deployments={DEPLOYMENT: DeploymentStatusOverview(
            status="DEPLOY_FAILED", status_trigger="REPLICA_STARTUP_FAILED", replica_states={},
            message=_FAILED_STATUS,
        )},
    )})
    monkeypatch.setattr(_deploy_module, "connect_ray", lambda address: None)
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve, "run", run)
    monkeypatch.setattr(serve, "status", lambda: status)
    with pytest.raises(om.EngineDeadError) as err:
        _deploy_module.deploy("mixture")
    assert str(err.value) == (
        "the Serve application 'omni_stream' failed to start: a replica raised UsageError: --max-images: "
        "model 'mixture' makes one image a request; diffusers:... image models make several"
    )
    assert err.value.__cause__ is ran
    # Without a status to read, Serve's own words.
    bare = startup_failed("omni_stream", ran, None)
    assert "Failed to update the deployments ['EngineReplica']" in str(bare)


# -- the documented command, as a user runs it -------------------------------------------------


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)  # its output ended: it exited


def _wait_line(
    proc: subprocess.Popen[str], lines: queue.Queue[str | None], seen: list[str], pattern: str, timeout: float
) -> re.Match[str]:
    """The first line of ``proc``'s output matching ``pattern``; AssertionError, with its last lines,
    when none came within ``timeout`` or it exited without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    said = "".join(seen[-60:])
    raise AssertionError(f"no line matching {pattern!r} (exit status {proc.poll()}):\n{said}")


@contextlib.contextmanager
def _omni_stream(*argv: str) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str | None], list[str]]]:
    """``python -m omni_stream ARGV`` (the ``omni-stream`` command) in its own process, and every
    process it started killed on the way out if the test did not stop them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, as on a fresh machine
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    started: list[psutil.Process] = []
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    try:
        yield proc, lines, started
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            started += psutil.Process(proc.pid).children(recursive=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _generate(url: str, rid: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Request ``rid``'s messages over the websocket, to its end (previews decoded as the server
    tests' ``recv`` does)."""
    out: list[dict[str, Any]] = []
    with connect(url.replace("http", "ws", 1) + "/ws", open_timeout=30) as ws:
        ws.send(json.dumps({"type": "generate", "id": rid, "params": params}))
        while not out or out[-1]["type"] not in ("done", "error", "cancelled"):
            data = ws.recv(timeout=60)
            if isinstance(data, bytes):
                header, image = unpack_preview(data)
                out.append({"type": "preview", **header.to_dict(), "image": bytes(image)})
            else:
                out.append(json.loads(data))
    return out


def test_serve_ray_as_documented_starts_serves_a_request_and_stops_on_ctrl_c() -> None:
    # docs/scale-out.md's command on one replica of the embedded model (no GPU here), port 0.
    argv = ("serve", "--ray", "--replicas", "1", "--model", "mixture", "--device", "cpu", "--port", "0")
    with _omni_stream(*argv) as (proc, lines, started):
        seen: list[str] = []
        url = _wait_line(proc, lines, seen, r"listening on (http://127\.0\.0\.1:\d+)", timeout=150).group(1)
        with urllib.request.urlopen(url + "/health", timeout=30) as reply:
            health = json.loads(reply.read())
        assert (health["ok"], health["device"]) == (True, "ray:omni_stream"), health

        msgs = _generate(url, "r1", {"prompt": "red circle", "steps": 6, "size": 64, "seed": 7})
        check_stream(msgs, "r1", 6)
        result = [m for m in msgs if m["type"] == "preview" and m["final"]][0]
        assert result["image"].startswith(b"\x89PNG"), "the result is the replica's PNG"

        started += psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in started), "no local Ray started"
        proc.send_signal(signal.SIGINT)
        _wait_line(proc, lines, seen, "SIGINT: shutting down", timeout=30)
        assert proc.wait(timeout=60) == 0, "".join(seen[-40:])
        # Its local Ray went with it: nothing left running for the next test.
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, alive
