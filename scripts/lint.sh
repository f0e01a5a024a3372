#!/usr/bin/env bash
# Lint, import order and types: ruff and mypy --strict on omni_stream/, with
# the settings in pyproject.toml ([tool.ruff], [tool.mypy]). .ci/run runs it
# after installing the test extra, which pins both tools.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m ruff check omni_stream
python3 -m mypy --strict omni_stream
