#!/usr/bin/env bash
# Thirty-fourth session, call 1, a fresh machine; carry [".carry/fa4a", ".carry/tiktoken",
# ".carry/baseline"]. An H200 probe first: on an H200 it prints "ok" and stops (the chain's call 2,
# docs/results/scripts/s28_call2.sh, follows within 30 s). On any other card, at the code whose q/k
# norm + RoPE kernels read only the tables' rotating half (columns 2i, i < D/4):
# 1. tests/test_qk_norm_rope_gpu.py (stage C shapes, unpaired and paired: values and gradient vs
#    the torch path, captured = eager, no host sync), its log now without torch's DEBUG records;
# 2. bench/qk_norm_rope.py at stages A and C, the tilings sweep, against
#    .carry/baseline/qk_norm_rope_c8cbc6c.py (`git show c8cbc6c:track_1_short/kernels/qk_norm_rope.py`,
#    the whole table row read).
# Prediction: tests pass; at A unpaired the baseline's forward ~46.5 us and backward ~62 us
# (session 33's numbers), the new default ~42 and ~58 us (the table's HBM bytes halved, 7-12% of
# the floor); every variant's outputs equal the first's (diff 0: the stationary pairs took cos 1,
# sin 0 from the table before, exactly the values substituted now).
nvidia-smi -L
if nvidia-smi -L | grep -q H200; then echo ok; exit 0; fi
echo "not an H200: the q/k norm + RoPE kernels instead"
source scripts/gpu/common.sh
run_gpu_tests "$L/gpu_tests.log" 200 tests/test_qk_norm_rope_gpu.py -s
timeout -k 10 $(( $(left) - 20 )) python3 bench/qk_norm_rope.py \
    --baseline-kernel .carry/baseline/qk_norm_rope_c8cbc6c.py --out "$OUT/qk_norm_rope.json" \
    > "$L/qk_norm_rope.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/qk_norm_rope.log"
cat "$L/qk_norm_rope.log"
pack_outputs
