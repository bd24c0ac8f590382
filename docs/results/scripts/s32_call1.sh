#!/usr/bin/env bash
# Thirty-second session, call 1, a fresh machine; carry [".carry/fa4a", ".carry/tiktoken"] (fa4a
# stays for call 2). At the code with the lazy n-gram event as two kernels (list the touched rows,
# then a persistent Adam over them) and the tied embed/lm_head fold and copy compiled:
# 1. the GPU tests of what changed: tests/test_ngram_adam_gpu.py (event kernel vs reference at
#    stage C's held rows, no host sync), tests/test_anvil_gpu.py (compiled vs eager optimizer over
#    the tie and the untie, no sync), tests/test_optimizer_graphs_gpu.py (captured optimizer vs
#    eager, no sync, the self-check);
# 2. bench/optimizer.py, tied (stage A-B shapes), compile off and on: unit_ms.tied_fold and
#    tied_copy eager (the code before this change: the same torch ops) vs compiled.
# Prediction (docs/results/ngram_event_tied_2026-12-07/README.md): tests pass; tied_fold eager
# ~0.4 ms -> compiled ~0.2 ms, tied_copy eager ~0.3 ms -> compiled <= 0.1 ms.
source scripts/gpu/common.sh
run_gpu_tests "$L/gpu_tests.log" 300 tests/test_ngram_adam_gpu.py tests/test_anvil_gpu.py \
    tests/test_optimizer_graphs_gpu.py -s
timeout -k 10 $(( $(left) - 20 )) python3 bench/optimizer.py --steps 10 --out "$OUT/optimizer_tied.json" \
    > "$L/optimizer_tied.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/optimizer_tied.log"
tail -n 30 "$L/optimizer_tied.log"
pack_outputs
