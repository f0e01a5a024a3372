#!/usr/bin/env bash
# One command for a CUDA machine: the GPU-only tests, then the GPU benchmark.
# Needs only torch, anyio and pytest (no pytest-asyncio, no websockets, no
# install of this project): it runs from the repository root. Under 8 minutes
# (the timeouts below add up to 460 s). Results go to ${OUT:-./gpu-results}.
#
# The diffusers rows of the benchmark (SD- and Flux-sized random-weight
# pipelines, TAESD previews on vs off) need diffusers, which the GPU image
# lacks and which it cannot download (no network there). Carry it as wheels
# in .whl (ignored by git): on a machine with network, in the repository root,
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 simplejpeg==1.9.0
#
# (pure-python wheels such as diffusers' py3-none-any match any --platform).
# Only what the image lacks: its torch 2.11 environment already has every
# requirement of diffusers 0.42.1 that Python 3.12 uses (huggingface-hub >=
# 1.32, safetensors >= 0.8, filelock, numpy, regex, requests, Pillow;
# importlib_metadata is imported on Python < 3.8 only), hence --no-deps here
# and there. simplejpeg is this project's JPEG encoder (without it previews
# fall back to Pillow, which holds the GIL while it encodes). Keep one version
# of each wheel. Then run this script with .whl carried beside the checkout.
# Without .whl (or without diffusers in it) the diffusers rows are skipped,
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
    echo "pip could not install .whl/*.whl; the rows that need them will be skipped" | tee "$out/wheels.txt"
  fi
else
  echo "no .whl folder: the diffusers rows will be skipped (see the top of this script)" | tee "$out/wheels.txt"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$out/gpu.txt"
status=0
timeout 170 python3 -m pytest -p no:cacheprovider -m gpu tests/device/test_cuda.py tests/models/test_mixture.py -v -rs 2>&1 | tee "$out/gpu-tests.log" || status=1
timeout 90 python3 benchmarks/gpu_bench.py --only core --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log" || status=1
# Flux at Flux.1's depth by default; FLUX_LAYERS=4,8 (double,single) for a shallower one.
timeout 200 python3 benchmarks/gpu_bench.py --only diffusers --flux-layers "${FLUX_LAYERS:-19,38}" \
  --json "$out/gpu-bench-diffusers.json" 2>&1 | tee "$out/gpu-bench-diffusers.log" || status=1
exit $status
