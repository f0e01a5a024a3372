"""The command line, in-process through main([...]) and once as `python -m omni_stream`."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import omni_stream as om
from omni_stream import cli
from omni_stream.models.synthetic import Synthetic
from omni_stream.preview import decode_rgb

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("omni-stream"), err
    assert "error:" in lines[0]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# -- basics ----------------------------------------------------------------------


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.strip() == f"omni-stream {om.__version__}"


def test_no_command_prints_help_and_exits_2(capsys):
    code, _, err = run(capsys)
    assert code == 2
    assert "generate" in err and "serve" in err and "models" in err and "bench" in err


def _cli_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "omni_stream", "generate", "--steps", "nope"],
        capture_output=True, text=True, cwd=REPO, env=_cli_env(), timeout=120,
    )
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "--steps", "nope")


def test_the_command_ends_its_process_without_running_native_finalizers():
    # A normal interpreter exit runs C++ static destructors while a thread
    # that ran torch code may still be tearing down: under CPU load 4 of 25
    # Ctrl-Cs aborted ("terminate called without an active exception", 134).
    # entry() ends the process deliberately once its output is flushed; an
    # atexit hook standing for those destructors must not run.
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "from omni_stream.cli import entry\n"
        "print('before', flush=True)\n"
        "entry(['generate', '--steps', 'nope'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=_cli_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.split() == ["before"]
    assert_one_line_error(proc.stderr, "--steps", "nope")


def test_ctrl_c_during_generate_exits_130_with_one_line(tmp_path):
    import signal
    import time

    frames = tmp_path / "frames"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream", "generate", "stripes", "--steps", "10000", "--size", "64",
         "-o", str(tmp_path / "x.png"), "--previews", str(frames)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_cli_env(),
    )
    try:
        # Interrupted mid-render: once the first preview is on disk.
        deadline = time.monotonic() + 120
        while not (frames.is_dir() and any(frames.iterdir())):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no preview within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and "terminate" not in err
    assert not (tmp_path / "x.png").exists()


# -- generate: bad arguments exit 2 with one line ----------------------------------------


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["generate", "--steps", "x"], ["--steps", "'x'"]),
        (["generate", "--steps", "0"], ["--steps"]),
        (["generate", "--bogus"], ["--bogus"]),
        (["generate", "--model", "synthetic", "--size", "64"],
         ["'size'", "--size", "steps, shape"]),
        (["generate", "--model", "synthetic", "--sampler", "euler"], ["'sampler'"]),
        (["generate", "a prompt", "--model", "synthetic"], ["'prompt'", "PROMPT"]),
        (["generate", "--model", "synthetic", "-p", "zoom=2"], ["'zoom'"]),
        (["generate", "--model", "synthetic", "-p", "steps=0"], ["steps", ">= 1"]),
        (["generate", "--model", "synthetic", "-p", "shape=[0]"], ["shape"]),
        (["generate", "--model", "nope"], ["'nope'", "mixture", "synthetic"]),
        (["generate", "--model", "no_such_module_xyz:thing"], ["no_such_module_xyz"]),
        (["generate", "--model", "json:JSONDecodeError"], ["failed to load"]),
        (["generate", "--model", "synthetic", "--device", "tpu"], ["'tpu'"]),
        (["generate", "--model", "synthetic", "--decoder", "vae"], ["'vae'", "sd15"]),
        (["generate", "--model", "synthetic", "-o", "out.xyz"], ["out.xyz", "suffix", ".png"]),
        (["generate", "--model", "synthetic", "--previews", "p.avi"], ["--previews", ".avi", ".gif"]),
        (["generate", "--model", "synthetic", "--preview-vae", "x"], ["--preview-vae", "diffusers"]),
        (["generate", "--model", "synthetic", "--every", "2"], ["--every needs --previews"]),
        (["generate", "--model", "synthetic", "-p", "noequals"], ["KEY=VALUE"]),
    ],
)
def test_generate_bad_arguments_exit_2_with_one_line(capsys, tmp_path, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert_one_line_error(err, *needles)
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--steps", "20", "-p", "steps=10"], ["-p steps=10", "--steps", "'steps'", "20"]),
        (["blue square", "-p", "prompt=red circle"], ['-p prompt="red circle"', 'PROMPT', '"blue square"']),
        (["-p", "seed=1", "-p", "seed=2"], ["-p seed=2", "-p seed=1"]),
        (["--seed", "3", "-p", "seed=4"], ["--seed", "-p seed=4"]),
    ],
)
def test_generate_refuses_two_flags_that_set_one_param_differently(capsys, tmp_path, argv, needles):
    # Silently keeping one of the two (as it did: -p won) runs what the user did not ask for.
    code, _, err = run(capsys, "generate", *argv, "-o", str(tmp_path / "x.png"))
    assert code == 2, err
    assert_one_line_error(err, *needles)
    assert not (tmp_path / "x.png").exists()


def test_generate_takes_a_flag_and_a_param_that_agree(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "red circle", "--steps", "2", "-p", "steps=2", "--size", "32",
                       "-o", str(tmp_path / "x.png"))
    assert code == 0, err
    assert json.loads(Image.open(tmp_path / "x.png").text["omni_stream"])["steps"] == 2


def test_generate_with_a_decoder_that_does_not_fit_exits_2(capsys, tmp_path):
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "2", "--decoder", "flux",
        "-o", str(tmp_path / "x.png"),
    )
    assert code == 2
    assert_one_line_error(err, "'flux'", "--decoder")


def test_generate_model_failure_exits_1_with_one_error_line(capsys, tmp_path):
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "4", "-p", "fail_at=2",
        "-o", str(tmp_path / "x.png"),
    )
    assert code == 1
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1]
    assert "SyntheticFault" in errors[0] and "step 2" in errors[0]
    # The model's message appears once, not repeated from its __cause__.
    assert errors[0].count("synthetic failure injected") == 1
    assert not (tmp_path / "x.png").exists()


def test_generate_unwritable_output_exits_1(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "2", "-o", str(blocker / "x.png")
    )
    assert code == 1
    assert_one_line_error(err)


# -- generate: results ---------------------------------------------------------------


def test_generate_synthetic_writes_png_and_gif(capsys, tmp_path):
    out, gif = tmp_path / "out.png", tmp_path / "steps.gif"
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "5", "--seed", "3",
        "-o", str(out), "--previews", str(gif),
    )
    assert code == 0, err
    assert Image.open(out).size == (64, 64)  # [4, 64, 64] latent -> sd15 -> 64 px
    with Image.open(gif) as im:
        assert im.n_frames == 5
    assert "5/5 steps" in err and str(out) in err


def test_generate_synthetic_final_image_is_the_decoded_final_frame(capsys, tmp_path):
    out = tmp_path / "out.png"
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "3", "--seed", "5",
        "-p", "shape=[3,24,40]", "-o", str(out),
    )
    assert code == 0, err
    want = decode_rgb(
        Synthetic().expected_frames({"steps": 3, "seed": 5, "shape": [3, 24, 40]})[-1]
    )
    np.testing.assert_array_equal(np.asarray(Image.open(out).convert("RGB")), want)


def test_generate_without_a_seed_says_the_drawn_one_and_the_png_records_it(capsys, tmp_path):
    import re

    code, _, err = run(capsys, "generate", "--model", "synthetic", "--steps", "2",
                       "-p", "shape=[3,24,40]", "-o", str(tmp_path / "a.png"))
    assert code == 0, err
    found = re.search(r", seed (\d+)", err)
    assert found, err
    seed = int(found.group(1))
    assert f"Seed: {seed}" in Image.open(tmp_path / "a.png").info["parameters"]
    # That seed gives the same picture again.
    code, _, err = run(capsys, "generate", "--model", "synthetic", "--steps", "2", "--seed", str(seed),
                       "-p", "shape=[3,24,40]", "-o", str(tmp_path / "b.png"))
    assert code == 0, err
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "a.png")), np.asarray(Image.open(tmp_path / "b.png")))


def test_generate_previews_folder_every_n(capsys, tmp_path):
    folder = tmp_path / "previews"
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--steps", "7", "--every", "3",
        "--previews", str(folder), "-o", str(tmp_path / "out.png"),
    )
    assert code == 0, err
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step_0003.png", "step_0006.png", "step_0007.png"]
    assert Image.open(folder / names[0]).format == "PNG"


def test_generate_previews_path_that_is_a_file_exits_2(capsys, tmp_path):
    (tmp_path / "taken").write_text("")
    code, _, err = run(
        capsys, "generate", "--model", "synthetic", "--previews", str(tmp_path / "taken"),
        "-o", str(tmp_path / "out.png"),
    )
    assert code == 2
    assert_one_line_error(err, "not a folder")


def test_generate_default_model_writes_png_and_gif(capsys, tmp_path):
    out, gif = tmp_path / "fox.png", tmp_path / "fox.gif"
    code, _, err = run(
        capsys, "generate", "red circle", "--steps", "4", "--size", "48", "--seed", "1",
        "--sampler", "ddim", "-o", str(out), "--previews", str(gif),
    )
    assert code == 0, err
    assert Image.open(out).size == (48, 48)
    with Image.open(gif) as im:
        assert im.n_frames == 4
        assert im.size == (48, 48)


def test_generate_default_model_rejects_its_own_bad_params(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "x", "--size", "8", "-o", str(tmp_path / "o.png"))
    assert code == 2
    assert_one_line_error(err, "size")


# -- default_decoder ---------------------------------------------------------------


def test_default_decoder_is_the_models_else_auto():
    from omni_stream.preview import default_decoder

    assert default_decoder(Synthetic()) == "auto"

    class Declares(Synthetic):
        preview_decoder = "flux"

    assert default_decoder(Declares()) == "flux"


# -- the progress bar ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_bar_draws_step_rate_and_eta():
    out, clock = io.StringIO(), FakeClock()
    bar = cli.ProgressBar(out, live=True, width=10, clock=clock)
    clock.now += 5.0  # model loading: not counted in the rate
    bar.update(1, 10)
    assert out.getvalue() == "\r 1/10 [#.........] -- steps/s ETA --:--"
    clock.now += 2.0
    bar.update(5, 10)
    assert out.getvalue().endswith("\r 5/10 [#####.....] 2.0 steps/s ETA 0:03")
    bar.finish("-> out.png")
    assert out.getvalue().endswith("\r\x1b[2K5/10 steps in 7.0s (2.0 steps/s) -> out.png\n")


def test_progress_bar_throttles_but_always_draws_the_last_step():
    out, clock = io.StringIO(), FakeClock()
    bar = cli.ProgressBar(out, live=True, interval=1.0, clock=clock)
    for step in range(1, 11):
        clock.now += 0.01
        bar.update(step, 10)
    draws = out.getvalue().split("\r")[1:]
    assert len(draws) == 2
    assert draws[0].startswith(" 1/10") and draws[1].startswith("10/10")


def test_progress_bar_not_live_writes_only_the_summary():
    out, clock = io.StringIO(), FakeClock()
    bar = cli.ProgressBar(out, live=False, clock=clock)
    for step in range(1, 4):
        clock.now += 1
        bar.update(step, 3)
    bar.abort()
    assert out.getvalue() == ""
    bar.finish()
    assert out.getvalue() == "3/3 steps in 3.0s (1.0 steps/s)\n"


def test_progress_bar_abort_ends_a_drawn_line():
    out = io.StringIO()
    bar = cli.ProgressBar(out, live=True, clock=FakeClock())
    bar.update(1, 3)
    bar.abort()
    assert out.getvalue().endswith("\n")


# -- models ------------------------------------------------------------------------


def test_models_lists_builtins_with_their_params(capsys):
    code, out, err = run(capsys, "models")
    assert code == 0, err
    assert "mixture (default):" in out
    assert "synthetic:" in out
    assert "  steps      int    default=20 range=1..100000" in out
    for name in ("prompt", "size", "sampler"):
        assert f"  {name} " in out


def test_models_one_name_json(capsys):
    code, out, _ = run(capsys, "models", "synthetic", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["synthetic"]
    params = {p["name"]: p for p in rows[0]["params"]}
    assert params["steps"] == {
        "name": "steps", "kind": "int", "default": 20, "help": "frames to produce",
        "minimum": 1, "maximum": 100_000,
    }
    assert rows[0]["preview_decoder"] == "auto"


def test_models_instantiates_only_the_named_model(capsys, monkeypatch):
    made = []
    from omni_stream.models import registry

    for name, factory in list(registry.BUILTIN_MODELS.items()):
        monkeypatch.setitem(
            registry.BUILTIN_MODELS, name, lambda f=factory, n=name: made.append(n) or f()
        )
    code, _, _ = run(capsys, "models", "synthetic")
    assert code == 0 and made == ["synthetic"]


def test_models_reports_a_model_that_cannot_load_and_lists_the_rest(capsys, monkeypatch):
    from omni_stream.models import registry

    def broken():
        raise ImportError("needs the 'diffusers' extra")

    monkeypatch.setitem(registry.BUILTIN_MODELS, "broken", broken)
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert "broken: unavailable: needs the 'diffusers' extra" in out
    assert "synthetic:" in out


def test_models_unknown_name_exits_2(capsys):
    code, _, err = run(capsys, "models", "nope")
    assert code == 2
    assert_one_line_error(err, "'nope'")


# -- serve -------------------------------------------------------------------------


@pytest.fixture
def fake_server(monkeypatch):
    calls: list[dict] = []
    module = types.ModuleType("omni_stream.server")

    async def serve(**kwargs):
        kwargs["loop"] = type(asyncio.get_running_loop()).__module__
        calls.append(kwargs)

    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", module)
    return module, calls


def test_serve_passes_its_options(capsys, fake_server, monkeypatch):
    _, calls = fake_server
    monkeypatch.delenv(cli.TOKEN_ENV, raising=False)
    code, _, err = run(
        capsys, "serve", "--model", "synthetic", "--host", "0.0.0.0", "--port", "9001",
        "--token", "s3cret", "--allow-origin", "https://a.example",
        "--allow-origin", "https://b.example", "--device", "cpu",
    )
    assert code == 0, err
    (call,) = calls
    assert isinstance(call["model"], Synthetic)
    assert (call["host"], call["port"], call["token"], call["device"]) == (
        "0.0.0.0", 9001, "s3cret", "cpu",
    )
    assert call["allow_origins"] == ["https://a.example", "https://b.example"]
    pytest.importorskip("uvloop")
    assert call["loop"].startswith("uvloop")


def test_serve_passes_several_tenants_and_the_door_options(capsys, fake_server, monkeypatch, tmp_path):
    _, calls = fake_server
    monkeypatch.delenv(cli.TOKEN_ENV, raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text("ops=o priority=3\n")
    code, _, err = run(
        capsys, "serve", "--model", "synthetic", "--token", "ann=a", "--token", "bob=b",
        "--tokens-file", str(tokens), "--allowed-host", "omni.example", "--allowed-host", "*.farm.example",
        "--trusted-proxy", "10.0.0.0/8",
    )
    assert code == 0, err
    (call,) = calls
    assert call["token"] == ["ann=a", "bob=b"] and call["tokens_file"] == str(tokens)
    assert call["allowed_hosts"] == ["omni.example", "*.farm.example"]
    assert call["trusted_proxies"] == ["10.0.0.0/8"]


def test_serve_defaults_and_token_from_the_environment(capsys, fake_server, monkeypatch):
    _, calls = fake_server
    monkeypatch.setenv(cli.TOKEN_ENV, "from-env")
    code, _, err = run(capsys, "serve", "--model", "synthetic")
    assert code == 0, err
    (call,) = calls
    assert (call["host"], call["port"], call["token"], call["allow_origins"], call["device"]) == (
        "127.0.0.1", 8765, "from-env", [], "auto",
    )


def test_serve_accepts_a_blocking_serve_and_ctrl_c_is_a_clean_stop(capsys, monkeypatch):
    module = types.ModuleType("omni_stream.server")

    def serve(**kwargs):
        raise KeyboardInterrupt

    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", module)
    code, _, err = run(capsys, "serve", "--model", "synthetic")
    assert code == 0
    assert "stopped" in err and "Traceback" not in err


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_serve_bad_port_exits_2(capsys, port):
    code, _, err = run(capsys, "serve", "--port", port)
    assert code == 2
    assert_one_line_error(err, "--port")


def test_serve_unknown_model_exits_2(capsys, fake_server):
    code, _, err = run(capsys, "serve", "--model", "nope")
    assert code == 2
    assert_one_line_error(err, "'nope'")
    assert fake_server[1] == []


# -- bench -------------------------------------------------------------------------


def test_bench_outside_a_checkout_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "bench", "--quick")
    assert code == 2
    assert_one_line_error(err, "benchmarks/", "checkout")


def test_bench_runs_python_dash_m_benchmarks_with_the_rest_of_the_arguments(
    capsys, tmp_path, monkeypatch
):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "__main__.py").write_text(
        "import json, sys\n"
        "open('args.json', 'w').write(json.dumps(sys.argv[1:]))\n"
        "sys.exit(3)\n"
    )
    monkeypatch.chdir(tmp_path)
    code, _, _ = run(capsys, "bench", "--quick", "-k", "copy", "--help")
    assert code == 3  # the suite's own exit status
    assert json.loads((tmp_path / "args.json").read_text()) == ["--quick", "-k", "copy", "--help"]


def test_serve_several_named_models_makes_a_router_and_bad_specs_are_usage_errors(capsys, fake_server):
    from omni_stream.engine.router import ModelRouter

    _, calls = fake_server
    code, _, err = run(capsys, "serve", "--model", "a=synthetic", "--model", "b=synthetic", "--max-loaded", "1")
    assert code == 0, err
    (call,) = calls
    router = call["model"]
    assert isinstance(router, ModelRouter) and list(router.models) == ["a", "b"] and router.max_loaded == 1
    for argv, words in [
        (("--model", "a=synthetic", "--model", "synthetic"), "give each a name"),
        (("--model", "a=synthetic", "--model", "a=synthetic"), "given twice"),
        (("--model", "synthetic", "--max-loaded", "2"), "--max-loaded"),
        (("--model", "a=", "--model", "b=synthetic"), "no SPEC"),
        (("--model", "a=synthetic", "--model", "b=synthetic", "--ray", "--device", "cpu,cpu"), "one --device"),
    ]:
        code, _, err = run(capsys, "serve", *argv)
        assert code == 2, argv
        assert_one_line_error(err, words)
    assert len(calls) == 1


def test_models_lists_named_specs_under_their_serve_names(capsys):
    code, out, err = run(capsys, "models", "fast=synthetic", "mixture", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["name"], r["spec"], r["default"]) for r in rows] == [
        ("fast", "synthetic", True), ("mixture", "mixture", False)
    ]


def test_serve_passes_the_scheduling_policy_to_the_engine_it_makes(capsys, fake_server):
    _, calls = fake_server
    code, _, err = run(capsys, "serve", "--model", "synthetic", "--scheduling", "fcfs", "--quantum", "3")
    assert code == 0, err
    assert (calls[0]["scheduling"], calls[0]["quantum"]) == ("fcfs", 3)
    code, _, err = run(capsys, "serve", "--model", "a=synthetic", "--model", "b=synthetic",
                       "--scheduling", "round-robin")
    assert code == 0, err
    assert "scheduling" not in calls[1]  # the router's engines took it
    code, _, err = run(capsys, "serve", "--scheduling", "lottery")
    assert code == 2 and "lottery" in err


@pytest.fixture
def fake_ray(monkeypatch):
    """A stand-in for omni_stream.integrations.ray_serve: deploy() records its arguments (no Ray)."""
    deployed: list[tuple[object, dict]] = []
    module = types.ModuleType("omni_stream.integrations.ray_serve")

    def deploy(model, **kwargs):
        deployed.append((model, kwargs))
        return "remote engine"

    module.deploy = deploy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.integrations.ray_serve", module)
    return deployed


@pytest.mark.parametrize("models", [("synthetic",), ("a=synthetic", "b=synthetic")], ids=["one", "named"])
def test_serve_ray_passes_the_hand_over_options_to_deploy(capsys, fake_server, fake_ray, models):
    _, calls = fake_server
    argv = [arg for spec in models for arg in ("--model", spec)]
    code, _, err = run(capsys, "serve", *argv, "--ray", "--device", "cpu", "--checkpoint-every", "4",
                       "--max-handovers", "0", "--checkpoint-max-bytes", "1048576")
    assert code == 0, err
    ((_, kwargs),) = fake_ray
    assert (kwargs["checkpoint_every"], kwargs["max_handovers"], kwargs["checkpoint_max_bytes"]) == (4, 0, 1 << 20)
    assert calls[0]["model"] == "remote engine"
    # Not given: deploy's own defaults apply (none is passed).
    code, _, err = run(capsys, "serve", *argv, "--ray", "--device", "cpu")
    assert code == 0, err
    assert not {"checkpoint_every", "max_handovers", "checkpoint_max_bytes"} & set(fake_ray[1][1])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--ray", "--max-handovers", "-1"), ("--max-handovers", "'-1'")),
        (("--ray", "--max-handovers", "two"), ("--max-handovers", "'two'")),
        (("--ray", "--checkpoint-max-bytes", "1.5"), ("--checkpoint-max-bytes", "'1.5'")),
        (("--ray", "--checkpoint-every", "0"), ("--checkpoint-every", "'0'")),
        (("--max-handovers", "1"), ("--max-handovers", "--ray")),
        (("--checkpoint-max-bytes", "100"), ("--checkpoint-max-bytes", "--ray")),
    ],
)
def test_serve_bad_hand_over_options_are_usage_errors_naming_the_option(capsys, fake_server, fake_ray,
                                                                        argv, words):
    code, _, err = run(capsys, "serve", "--model", "synthetic", "--device", "cpu", *argv)
    assert code == 2
    assert_one_line_error(err, *words)
    assert fake_ray == [] and fake_server[1] == []
