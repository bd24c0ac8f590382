#!/usr/bin/env bash
# Twenty-first lease, call 1 (planned; no machine was lent on 2026-12-04, so it has not run), a
# machine new to the session (carry [".carry/tiktoken", "data/embedded"]):
# 1. bench/gemm_memsets.py: which cuBLAS settings keep the memset nodes out of the captured GEMMs
# at stage A and C shapes, and at what cost; its choice (a train.blas setting,
# perf/blas.py) goes to build/gemm_choice.txt (kept by the warm machine for call 3).
# Prediction: the default variant has
# one memset per non-split-K nvjet GEMM (lease 18's trace); a variant without workspace drops them
# but may pick slower kernels for the split-K dW GEMMs. 2. The small-gpu preset at one micro-step:
# compile + capture every key (scripts/gpu/micro1_compare.sh warmup), for call 2's runs.
source scripts/gpu/common.sh
timeout -k 10 200 python3 bench/gemm_memsets.py --out "$OUT/gemm_memsets.json" \
    --choice-env build/gemm_choice.txt > "$L/gemm_memsets.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gemm_memsets.log"
cat "$L/gemm_memsets.log"; cp build/gemm_choice.txt "$L/" 2>/dev/null
DEADLINE_S=$(left) bash scripts/gpu/micro1_compare.sh warmup
