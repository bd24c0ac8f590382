#!/usr/bin/env bash
# Thirty-third session, call 1, a fresh machine; carry [".carry/fa4a", ".carry/tiktoken",
# ".carry/baseline"]. An H200 probe first: on an H200 it prints "ok" and stops (the chain's call 2,
# docs/results/scripts/s28_call2.sh, follows within 30 s). On any other card, at the code with the
# position-blocked q/k norm + RoPE kernels (one program per BLOCK_POS positions, the table row
# read once per position instead of once per head row):
# 1. tests/test_qk_norm_rope_gpu.py (stage C shapes, unpaired and paired: values and gradient vs
#    the torch path, captured = eager, no host sync; prints the replayed pair's time);
# 2. bench/qk_norm_rope.py at stages A and C, the tilings sweep, against
#    .carry/baseline/qk_norm_rope_7784b2d.py (`git show 7784b2d:track_1_short/kernels/qk_norm_rope.py`,
#    one program per 16 head rows).
# Prediction: tests pass; at A unpaired the baseline's forward ~51 us and backward ~68 us (the
# s32 traces: 0.516 and 0.684 ms per 10 calls), the new default ~42 and ~58 us; every tiling's
# outputs equal the first's (diff 0).
nvidia-smi -L
if nvidia-smi -L | grep -q H200; then echo ok; exit 0; fi
echo "not an H200: the q/k norm + RoPE kernels instead"
source scripts/gpu/common.sh
run_gpu_tests "$L/gpu_tests.log" 200 tests/test_qk_norm_rope_gpu.py -s
timeout -k 10 $(( $(left) - 20 )) python3 bench/qk_norm_rope.py \
    --baseline-kernel .carry/baseline/qk_norm_rope_7784b2d.py --out "$OUT/qk_norm_rope.json" \
    > "$L/qk_norm_rope.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/qk_norm_rope.log"
cat "$L/qk_norm_rope.log"
pack_outputs
