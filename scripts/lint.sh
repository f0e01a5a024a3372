#!/usr/bin/env bash
# Lint, format, import order and types: ruff and mypy --strict on omni_stream/, with
# the settings in pyproject.toml ([tool.ruff], [tool.mypy]). .ci/run runs it
# after installing the test extra, which pins both tools.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m ruff check omni_stream
# One formatting policy ([tool.ruff.format]): `python3 -m ruff format omni_stream` applies it.
python3 -m ruff format --check omni_stream
# In the tests and benchmarks, only what hides code: a second definition of
# a name silently replaces the first (a test defined twice runs once).
python3 -m ruff check --select F811 tests benchmarks examples
python3 -m mypy --strict omni_stream
