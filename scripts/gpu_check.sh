#!/usr/bin/env bash
# One command for a CUDA machine: what users run, on the GPU, with one JSON of figures.
#
#   bash scripts/gpu_check.sh            # results in ${OUT:-./gpu-results}/gpu-check.json
#
# Runs benchmarks/gpu_check.py --device cuda, whose parts are (each bounded, each recorded
# whatever the others do): the GPU tests (-m gpu, both halves: CUDA and the simulator); the
# engine chaos on device="cuda" (cancels, timeouts, injected failures, every frame checked bit
# for bit); `omni-stream serve` on CUDA with websocket and HTTP clients streaming, cancelling
# and disconnecting; and benchmarks/gpu_bench.py (the step shapes: engine against a bare loop
# and the hand-written peer, 9.2 and 64 MiB frames against bare pinned copies; then SD 1.5- and
# Flux-sized random-weight pipelines, TAESD previews on and off), then its step-caching rows
# (Flux.1-sized at 1024 px, each cache setting against none). Under 8 minutes on an H200
# (the parts' bounds: 200 + 60 + ~60 + 330 + 150 s at most; the cache part runs last). CI runs the same driver on the
# simulated GPU (tests/test_gpu_check.py), so this script does not rot between GPUs.
#
# The lent machine's image has torch 2.11, anyio, uvloop, Pillow, pytest, numpy, h11, click,
# prometheus-client and the diffusers requirements, and no network. What it lacks travels as
# wheels in .whl (ignored by git), made on a machine with network, in the repository root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl diffusers==0.42.1 websockets==17.4 starlette==1.10.0 uvicorn==0.55.0 \
#     simplejpeg==1.9.0 python-multipart==0.0.34
#
# (7 MiB; pure-python wheels match any platform; keep one version of each.) Then run this
# script with .whl carried beside the checkout. Without websockets/starlette/uvicorn the serve
# part fails saying which import is missing; without diffusers the pipeline rows are skipped,
# and the benchmark says why.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-./gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    echo "installed from .whl: $(cd .whl && ls *.whl | tr '\n' ' ')" | tee "$out/wheels.txt"
  else
    echo "pip could not install .whl/*.whl; the parts that need them will fail or skip" | tee "$out/wheels.txt"
  fi
else
  echo "no .whl folder: serve needs websockets/starlette/uvicorn (see the top of this script)" | tee "$out/wheels.txt"
fi
python3 - <<'EOF' 2>&1 | tee -a "$out/wheels.txt"
import importlib
for name in ("websockets", "starlette", "uvicorn", "simplejpeg", "multipart", "diffusers", "uvloop", "anyio"):
    try:
        importlib.import_module(name)
        print(f"  {name}: ok")
    except Exception as exc:
        print(f"  {name}: MISSING ({exc})")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$out/gpu.txt"
# Flux at Flux.1's depth by default; FLUX_LAYERS=4,8 (double,single) for a shallower one.
timeout 470 python3 -m benchmarks.gpu_check --device cuda --out "$out" 2>&1 | tee "$out/gpu-check.log"
