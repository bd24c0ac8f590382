#!/usr/bin/env bash
# Fourteenth lease, call 2 (one H200, cold: call 1's machine went back; carry [".carry/fa4a",
# ".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): the fa4
# tarball's first half again, for call 3. 1. the recompute schedule's GPU tests after the fix of
# call 1's failure (the fix-up kernel read an expanded upstream gradient past its one element);
# 2. the record's timing at its stages 0 and 2 on synthetic shards (its compile caches for call
# 3's vs_record.sh). Kept short: call 3 needs the rest of the session's device time.
# Run from the repo root with $OUT set: bash docs/results/scripts/lease14_call2.sh
source scripts/gpu/common.sh
run_gpu_tests "$L/softcap_ce_fp8_recompute_gpu_tests.log" 100 -s tests/test_softcap_ce_fp8_gpu.py -k recompute
run_anchor timing 250 TIMING_STAGES=0,2
cp "$OUT/anchor/timing.json" "$OUT/record_warm_timing.json" 2>/dev/null
cd "$OUT" && tar czf call2_logs.tgz anchor logs && rm -rf anchor logs
ls -la "$OUT"
