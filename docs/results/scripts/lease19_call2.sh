#!/usr/bin/env bash
# Nineteenth lease, call 2, right after call 1 on the same warm machine (carry [".carry/fa4a"]):
# the q/k kernel's GPU tests (C shapes, capture and replay, no sync, captured replays timed).
# Code at 531e416. 36 s wall.
source scripts/gpu/common.sh; run_gpu_tests "$L/gpu_tests.log" 150 tests/test_qk_norm_rope_gpu.py -s
tail -n 30 "$L/gpu_tests.log"; cp "$L/gpu_tests.log" "$OUT/"
