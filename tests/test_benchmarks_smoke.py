"""The benchmark harness runs: figures come out finite, the table and JSON render.

No timing assertions: speed is what ``python -m benchmarks`` reports, not
what a test on a shared machine can check.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys

import pytest

from benchmarks import FIGURES
from benchmarks.harness import Context, Figure, Target, interleave, percentile
from benchmarks.report import format_markdown, format_table
from benchmarks.runner import main, run_suite


def _check(figures: list[Figure], prefix: str) -> None:
    assert figures, f"{prefix} produced no figures"
    for f in figures:
        assert f.name.startswith(prefix + ".")
        assert math.isfinite(f.value) and f.value > 0, f
        for raw in (*f.baseline.values(), *f.engine.values()):
            assert math.isfinite(raw), f
        assert f.limits


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_quick_overlap_and_memory_produce_finite_figures(loop):
    figures, errors = run_suite(
        ["overlap", "memory"], quick=True, loop=loop, reps=1, isolate=False, verbose=False
    )
    assert errors == {}
    _check([f for f in figures if f.name.startswith("overlap.")], "overlap")
    _check([f for f in figures if f.name.startswith("memory.")], "memory")
    text = format_table(figures)
    assert "overlap.sim" in text and "memory.never_read_held_vs_bound" in text
    md = format_markdown(figures, {"machine": {"nproc": 2}, "elapsed_s": 1.0})
    assert md.count("\n| ") == len(figures) + 1  # header row + one row per figure


def test_quick_diffusers_stream_produces_finite_figures():
    pytest.importorskip("diffusers")
    figures, errors = run_suite(
        ["diffusers_stream"], quick=True, loop="asyncio", reps=1, isolate=False, verbose=False
    )
    assert errors == {}
    _check(figures, "diffusers_stream")
    names = {f.name for f in figures}
    assert {
        "diffusers_stream.native_previews_vs_pipe",
        "diffusers_stream.taesd_previews_vs_none",
        "diffusers_stream.taesd_decode_ms",
        "diffusers_stream.vae_decode_ms",
    } <= names
    try:
        import omni_stream.models.diffusers.callback  # noqa: F401
    except ImportError:
        pass
    else:
        assert "diffusers_stream.callback_vs_pipe" in names
    # The engine's final frame is pipe()'s image (native mode: the same operations).
    diffs = figures[0].details["max_abs_diff_vs_pipe"]
    assert diffs["native_previews"] < 1e-4, diffs


def test_quick_diffusers_models_produces_finite_figures():
    pytest.importorskip("diffusers")
    figures, errors = run_suite(
        ["diffusers_models"], quick=True, loop="asyncio", reps=1, isolate=False, verbose=False
    )
    assert errors == {}
    _check(figures, "diffusers_models")
    assert {f.name for f in figures} == {"diffusers_models.switch", "diffusers_models.num_images_4"}
    switch = next(f for f in figures if f.name == "diffusers_models.switch")
    assert switch.engine["load_s"] > 0 and switch.engine["unload_s"] > 0


def test_gpu_bench_diffusers_rows_run_on_the_cpu_at_toy_sizes(tmp_path, capsys):
    # The GPU figures only run on a CUDA machine; --dry-run checks their code here.
    pytest.importorskip("diffusers")
    from benchmarks import gpu_bench

    out = tmp_path / "gpu.json"
    assert gpu_bench.main(["--dry-run", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["figures"]
    assert [r["figure"] for r in rows] == [
        "diffusers_sd15_taesd_on_vs_off",
        "diffusers_sd15_stream_vs_pipe",
        "diffusers_sd15_batched4_vs_unbatched",
        "diffusers_sd15_model_switch",
        "diffusers_sd15_pause_to_host_ms",
        "diffusers_flux_taesd_on_vs_off",
        "diffusers_flux_stream_vs_pipe",
        "diffusers_flux_pause_to_host_ms",
        "diffusers_flux_cache_none",
        "diffusers_flux_cache_fbcache_0.2",
        "diffusers_flux_cache_fbcache_0.35",
        "diffusers_flux_cache_taylorseer",
        "diffusers_flux_cache_mixed4_together_vs_apart",
    ]
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in rows if not r.get("skipped"))
    cache = {r["figure"].removeprefix("diffusers_flux_cache_"): r for r in rows if "_cache_" in r["figure"]}
    # A method the model does not offer yet is a row saying so; the others ran, 6 steps each.
    assert {name for name, r in cache.items() if r.get("skipped")} <= {"taylorseer"}
    assert cache["none"]["reused"] == 0 and cache["fbcache_0.2"]["steps"] == 6
    assert cache["fbcache_0.2"]["psnr_note"] == "random weights: not a quality figure"
    assert cache["mixed4_together_vs_apart"]["max_batch"] > 1
    out = capsys.readouterr().out
    assert "diffusers_flux_taesd_on_vs_off" in out and "random weights: not a quality figure" in out


def test_gpu_bench_cache_rows_skip_a_method_the_model_does_not_offer(tmp_path, monkeypatch, capsys):
    pytest.importorskip("diffusers")
    from benchmarks import gpu_bench

    monkeypatch.setattr(gpu_bench, "cache_methods", lambda model: ("none", "fbcache"))
    out = tmp_path / "gpu.json"
    assert gpu_bench.main(["--dry-run", "--only", "cache", "--cache-steps", "2", "--json", str(out)]) == 0
    rows = {r["figure"]: r for r in json.loads(out.read_text())["figures"]}
    assert rows["diffusers_flux_cache_taylorseer"]["value"] is None
    assert "not taylorseer" in rows["diffusers_flux_cache_taylorseer"]["skipped"]
    # Its place in the mixed batch goes to an uncached request.
    assert [c["method"] for c in rows["diffusers_flux_cache_mixed4_together_vs_apart"]["caches"]] == [
        "none", "fbcache", "fbcache", "none"]
    assert "taylorseer: skipped" in capsys.readouterr().out


def test_a_failing_figure_is_reported_and_the_others_still_run(monkeypatch):
    from benchmarks import memory

    async def broken(ctx: Context) -> list[Figure]:
        raise RuntimeError("boom")

    monkeypatch.setattr(memory, "run", broken)
    figures, errors = run_suite(
        ["memory", "overlap"], quick=True, loop="asyncio", reps=1, isolate=False, verbose=False
    )
    assert errors == {"memory": "RuntimeError: boom"}
    assert [f.name for f in figures] == ["overlap.sim"]


def test_json_round_trip_and_from_json_rendering(tmp_path, capsys):
    fig = Figure(
        name="x.ratio", value=1.5, target=Target(">=", 1.4), baseline={"a": 2.0},
        engine={"b": 1.0}, limits="nothing", details={"k": [1, 2]},
    )
    data = {"meta": {"machine": {"nproc": 2}, "elapsed_s": 3.0}, "figures": [fig.to_dict()]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    assert Figure.from_dict(json.loads(path.read_text())["figures"][0]).to_dict() == fig.to_dict()
    assert main(["--from", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "x.ratio" in out and "| x.ratio | 1.50 x | >= 1.4 | pass |" in out


def test_targets_and_percentiles():
    assert Target("<=", 1.05).met(1.05) and not Target("<=", 1.05).met(1.06)
    assert Target(">=", 4).met(4.0) and not Target(">=", 4).met(math.nan)
    with pytest.raises(ValueError):
        Target("<", 1.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))


def test_interleave_alternates_the_order_of_variants():
    order: list[str] = []

    def variant(name: str):
        async def run() -> float:
            order.append(name)
            return 1.0

        return run

    samples = asyncio.run(interleave({"a": variant("a"), "b": variant("b")}, 3))
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert samples == {"a": [1.0] * 3, "b": [1.0] * 3}


def test_every_figure_module_has_a_run():
    import importlib

    for name, module in FIGURES.items():
        assert callable(importlib.import_module(module).run), name


@pytest.mark.parametrize(
    ("transport", "extra"), [("sse", None), ("sse_post", None), ("sse", "stuck")]
)
def test_fanout_sse_readers_get_previews_to_the_end(transport, extra):
    # The fanout figure's event-stream rows (fanout.sse.*), at toy size: the
    # whole figure takes ~20 s in quick mode, most of it the naive peer's
    # stalled-client deadline.
    from benchmarks import fanout

    s = asyncio.run(fanout._sample("ours", extra, 3, 2, 10.0, transport))
    assert s["finished"] == s["clients"] == 3, s
    assert s["outcomes"] == (["done", "stuck"] if extra else ["done"]), s
    assert s["frames"] >= 3 and math.isfinite(s["p99_ms"]) and s["fps"] > 0, s


@pytest.mark.parametrize("attack", ["8", "2"])
def test_doors_attack_runs_against_a_real_server_and_reports(attack):
    # benchmarks/doors.py (issue #19's attacks) at toy length: an `omni-stream serve` process, the
    # honest client and the /health probe each a process of their own. The figures are not
    # checked here (a shared machine), only that every measure came back and renders.
    from benchmarks import doors

    r = asyncio.run(doors.run_attack(doors.ATTACKS[attack], seconds=1.0, quiet_requests=2))
    assert r["exit_status"] == 0 and r["settled"]
    assert r["outcome"]["answers"], r["outcome"]
    expected = {"8": ("403 forbidden_origin", "421 forbidden_host"), "2": ("413 limit_exceeded",)}[attack]
    for code in expected:
        assert any(code in k for k in r["outcome"]["answers"]), r["outcome"]["answers"]
    assert r["health"]["probes"] > 0 and math.isfinite(r["health"]["max_s"])
    assert r["honest"]["quiet_steps"] > 0 and math.isfinite(r["peak_mib"]) and r["idle_mib"] > 0
    assert isinstance(r["violations"], list)
    text = doors.format_result(r)
    assert text.startswith(f"({attack}) ") and "honest: quiet" in text and "/health: max" in text


def test_doors_lists_its_attacks_and_refuses_unknown_ones(capsys):
    from benchmarks import doors

    assert doors.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f" {a.name} " in out for a in doors.ATTACKS.values())
    with pytest.raises(SystemExit, match="unknown attack"):
        doors.main(["--attacks", "nosuch"])


def test_handover_instructions_runs_its_scripts_and_says_when_valgrind_is_missing(monkeypatch, capsys):
    """The scripts callgrind runs are the ones that stream (run here without valgrind, a few
    frames); without valgrind the command says so and exits 2."""
    import os
    import subprocess
    import sys

    from benchmarks import handover_instructions as hi

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for script in (hi.ENGINE, hi.PEER):
        done = subprocess.run([sys.executable, "-c", script, root, "5", "0.001"], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setattr(hi.shutil, "which", lambda name: None)
    assert hi.main([]) == 2
    assert "valgrind is not installed" in capsys.readouterr().err


def test_client_backends_reads_through_a_real_serve_on_every_backend(capsys):
    pytest.importorskip("trio")
    from benchmarks import client_backends

    out = client_backends.measure(rounds=1, requests=1, steps=4, size=8)
    assert set(out) == {"asyncio", "uvloop", "trio"}
    for row in out.values():
        # accepted, progress and previews, the result, done: at least the final and done.
        assert row["messages"] >= 3 and row["cpu_us_per_message"] > 0


def test_wakeup_cycles_on_every_backend_and_against_another_tree(capsys):
    # The benchmark's cycle runs N waits to their end on each backend; --against loads a second
    # copy of the package (this one, here) under another name and runs its Wakeup beside.
    import anyio

    from benchmarks import handover, wakeup
    from omni_stream._wakeup import Wakeup

    for backend, options in handover.BACKENDS.values():
        for timeout in (None, 60.0):
            assert anyio.run(wakeup.cycle_us, Wakeup, timeout, 50, backend=backend,
                             backend_options=options) > 0
    root = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    try:
        other = handover.load_other(root)
        assert other.__name__ == "omni_stream_other" and other._wakeup.Wakeup is not Wakeup
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "omni_stream_other"]:
            del sys.modules[name]


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_handover_calls_counts_each_variants_loop_on_every_backend(backend, capsys):
    # Each variant's profile is of the loop thread while frames arrive: the engine's
    # reader and the peer's queue (or channel) are in it once a frame, the other's not.
    if backend == "trio":
        pytest.importorskip("trio")
    from benchmarks import handover_calls

    engine = handover_calls.count("engine", backend, 20, 0.001)
    peer = handover_calls.count("peer", backend, 20, 0.001)
    engine_calls = {where: n for n, where in engine.per_function}
    peer_calls = {where: n for n, where in peer.per_function}
    assert any("stream.py" in w and "__anext__" in w for w in engine_calls)
    assert not any("stream.py" in w for w in peer_calls)
    getter = " receive" if backend == "trio" else " get"
    assert any(w.endswith(getter) for w in peer_calls) and not any(w.endswith(getter) for w in engine_calls)
    assert engine.calls > 1 and peer.calls > 1
    handover_calls.main(["--backend", backend, "--frames", "10", "--pace", "1", "--top", "3"])
    out = capsys.readouterr().out
    assert f"{backend} engine:" in out and f"{backend} peer:" in out
