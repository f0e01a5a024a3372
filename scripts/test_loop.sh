#!/usr/bin/env bash
# The README's test command, run N times in a row (default 10) on a fresh
# clone of this checkout's HEAD: prints each run's closing line, the tests
# that failed, and the counts. Exit 0 only when every run passed.
#
#   bash scripts/test_loop.sh [RUNS]
#
# Needs the project's dependencies installed (the README's first command);
# the clone's own code is what runs (PYTHONPATH points at it, so a
# subprocess that imports omni_stream gets the clone's too).
set -uo pipefail

runs=${1:-10}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d -t omni-stream-loop.XXXXXX)
git clone --quiet "$repo" "$work/clone"
cd "$work/clone" || exit 2
export PYTHONPATH="$work/clone${PYTHONPATH:+:$PYTHONPATH}"
echo "test_loop: $runs runs of 'python3 -m pytest -q -rs' on a clone of $(git rev-parse --short HEAD) in $work/clone"

passed=0
failed=0
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    python3 -m pytest -q -rs >"$work/run$i.log" 2>&1
    rc=$?
    echo "run $i/$runs: exit $rc in $(( $(date +%s) - start )) s: $(tail -n 1 "$work/run$i.log")"
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        grep -E '^(FAILED|ERROR) ' "$work/run$i.log" | sed 's/^/    /'
    fi
done
echo "test_loop: $passed of $runs runs passed, $failed failed (logs in $work)"
[ "$failed" -eq 0 ]
