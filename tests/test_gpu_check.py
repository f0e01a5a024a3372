"""scripts/gpu_check.sh's driver runs on the simulated GPU, so what it runs on a lent GPU cannot rot.

The GPU machine is lent rarely; the script that uses it once failed before
it started (a test it ran had broken unseen). Here each part runs as the
script runs it, on ``sim`` with small sizes: the serve part's real
``omni-stream serve`` and its websocket and HTTP clients, the chaos run, and
the step-shape benchmark. (Its ``tests`` part runs the ``-m gpu`` tests,
whose sim halves the suite runs anyway.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_part_on_the_simulated_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "sim", "--quick",
         "--parts", "serve", "chaos", "bench", "cache", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert proc.returncode == 0 and report["ok"], (proc.stdout[-3000:], proc.stderr[-3000:])
    serve = report["serve"]
    assert serve["ws_cancel"]["end"] == "cancelled" and serve["ws_cancel"]["reason"] == "client"
    assert serve["health"]["buffers_in_use"] == 0 and serve["health"]["cancelled"] >= 3
    assert report["chaos"]["corrupt"] == 0 and report["chaos"]["frames_checked"] > 0
    rows = report["bench"]["figures"]["rows"]
    assert {r["figure"] for r in rows} == {"compute_1ms", "compute_25ms", "launch_8ms", "video_6ms",
                                           "copy_9MiB", "copy_64MiB"}
    assert all(r["corrupt"] == 0 for r in rows)
    cache = report["cache"]["figures"]["figures"]  # the step-caching rows' dry run, each setting
    assert {"diffusers_flux_cache_taylorseer", "diffusers_flux_cache_fbcache_0.2"} <= {r["figure"] for r in cache}
