#!/usr/bin/env bash
# Set up (once), prepare the embedded corpus (if absent), then run the
# CPU test suite. Extra arguments pass through to pytest. GPU tests: `./test.sh -m gpu` on a GPU host.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
t1s_setup
t1s_prepare_embedded
exec "$PY" -m pytest -q "$@"
