#!/usr/bin/env bash
# Eighteenth lease, call 2 (a fresh H200: the machine of call 1 went back before the next call
# could start, taking the record's compile caches and ours with it, and two starts failed after;
# carry [".carry/fa4a", ".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken",
# "data/embedded"]): the record's warm-up at its stage 2 (our C; its caches in .carry/anchor_work
# for call 3; the call ends by ~330 s: the session's device time left holds stage C only), and
# beside it the q/k kernel's GPU tests (the warm-up's timings are not used, only its caches). No
# fa4 or quack here: their wheels need this call's carry and the next one's.
# 205 s wall (the record finished its whole stage-2 timing; the GPU tests passed in 36 s).
source scripts/gpu/common.sh
run_gpu_tests "$L/gpu_tests.log" 150 tests/test_qk_norm_rope_gpu.py -s &
run_anchor timing $(( 330 - $(elapsed) )) TIMING_STAGES=2
wait
cp "$OUT/anchor/timing.json" "$OUT/record_warm_timing.json" 2>/dev/null
pack_outputs anchor
