#!/usr/bin/env bash
# Fourteenth lease, call 1 (one H200, cold; carry [".carry/fa4a", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): the fa4 tarball's first half rides
# along for call 2. 1. the fp8 head's GPU tests (every loss schedule at A and C, the recompute
# backward against the one-pass path, with their kernels' times); 2. the record's timing at its
# stages 0 and 2 on synthetic shards, which fills its compile caches in .carry/anchor_work for
# call 2's vs_record.sh; 3. one rank's step of 8 GPUs (--micro-steps 1) at A, graphs on vs off,
# with the n-gram rows inside the step (the default: scripts/gpu/host_bound.sh); 4. at A once more
# with graphs on and the rows around the step (train.ngram_rows_in_step=false), if time is left.
# Run from the repo root with $OUT set: bash docs/results/scripts/lease14_call1.sh
source scripts/gpu/common.sh
run_gpu_tests "$L/softcap_ce_fp8_gpu_tests.log" 130 -s tests/test_softcap_ce_fp8_gpu.py
run_anchor timing 250 TIMING_STAGES=0,2
cp "$OUT/anchor/timing.json" "$OUT/record_warm_timing.json" 2>/dev/null
# host_bound.sh packs its logs into results.tgz; keep ~70 s for the rows-around run after it
DEADLINE_S=$(( 585 - 70 )) STAGES="A" DATA=data/embedded \
    bash scripts/gpu/host_bound.sh > "$OUT/host_bound_console.log" 2>&1
if (( $(left) > 55 )); then
  timeout -k 10 $(( $(left) - 10 )) python3 bench/step.py --stage A --steps 20 --graphs on --micro-steps 1 \
      --data-dir data/embedded --set train.ngram_rows_in_step=false --out "$OUT/rows_around_A.json" \
      > "$OUT/rows_around_A.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$OUT/rows_around_A.log"
fi
cd "$OUT" && tar czf call1_logs.tgz anchor host_bound_console.log rows_around_A.log logs 2>/dev/null
ls -la "$OUT"
