#!/usr/bin/env bash
# One command for a CUDA machine: the GPU-only tests, then the GPU benchmark.
# Needs only torch, anyio and pytest (no pytest-asyncio, no websockets, no
# install of this project): it runs from the repository root. Under 8 minutes.
# Results go to ${OUT:-./gpu-results}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-./gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$out/gpu.txt"
status=0
timeout 240 python3 -m pytest -p no:cacheprovider -m gpu tests/device/test_cuda.py tests/models/test_mixture.py -v -rs 2>&1 | tee "$out/gpu-tests.log" || status=1
timeout 200 python3 benchmarks/gpu_bench.py --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log" || status=1
exit $status
