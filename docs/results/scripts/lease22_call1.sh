#!/usr/bin/env bash
# Twenty-second lease (2026-12-05), call 1 of 2, carry [".carry/fa4a"] (for call 2,
# docs/results/scripts/polar_call.sh with .carry/fa4b, within the warm machine's idle window).
# The session's machine came only after three refused starts, with ~35 minutes of the session
# left: too late for the three calls of lease21_call{1,2,3}.sh (~1,750 s), so this call runs
# lease21_call1.sh's first half alone: bench/gemm_memsets.py, which cuBLAS settings keep the
# memset nodes out of the captured GEMMs at stage A and C shapes, and at what cost.
# Prediction (as lease21_call1.sh): the default variant has one memset per non-split-K nvjet GEMM;
# a variant without workspace drops them but may pick slower kernels for the split-K dW GEMMs.
source scripts/gpu/common.sh
timeout -k 10 240 python3 bench/gemm_memsets.py --out "$OUT/gemm_memsets.json" \
    --choice-env build/gemm_choice.txt > "$L/gemm_memsets.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gemm_memsets.log"
cat "$L/gemm_memsets.log"; cp build/gemm_choice.txt "$L/" 2>/dev/null
pack_outputs
