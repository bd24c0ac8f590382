#!/usr/bin/env bash
# Set up (once), prepare the embedded corpus (if absent), then run the
# CPU test suite (slow scenarios left out: `./test.sh -m slow` runs them) on T1S_TEST_WORKERS
# pytest-xdist workers (default 2, one intra-op thread each). Extra arguments pass through to
# pytest. GPU tests, one at a time on a GPU host: `T1S_TEST_WORKERS=0 ./test.sh -m gpu`.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
t1s_setup
t1s_prepare_embedded
workers=${T1S_TEST_WORKERS:-2}
if [[ "$workers" == "0" ]]; then
  exec "$PY" -m pytest -q "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# worksteal: an idle worker takes queued tests from the busy one (the suite has a few 60-110 s
# scenarios; measured 512 vs 539 s with the default "load" on 2 cores, 2026-12-01)
exec "$PY" -m pytest -q -n "$workers" --dist worksteal "$@"
