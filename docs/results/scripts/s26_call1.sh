#!/usr/bin/env bash
# Twenty-sixth session, call 1, a machine new to the session (carry [".carry/fa4a"]: the first half
# of flash-attn-4 / quack's wheels, for call 2; this call needs no data): bench/gemm_memsets.py,
# which cuBLAS setting (train.blas, perf/blas_config.py) keeps the memset nodes out of the captured
# GEMMs at stage A and C shapes and at what replay cost. Its choice goes to build/gemm_choice.txt
# (kept by the warm machine for calls 2-3).
# Prediction: "default" carries one memset per non-split-K nvjet GEMM (lease 18's A trace: 120
# per step); a no-workspace variant drops them, maybe with slower kernels for the split-K dW
# GEMMs; the choice is a no-workspace variant if its replay median is no slower at both T.
source scripts/gpu/common.sh
timeout -k 10 $(( $(left) - 20 )) python3 bench/gemm_memsets.py --out "$OUT/gemm_memsets.json" \
    --choice-env build/gemm_choice.txt > "$L/gemm_memsets.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gemm_memsets.log"
tail -n 40 "$L/gemm_memsets.log"; cp build/gemm_choice.txt "$L/" 2>/dev/null
echo "choice: $(cat build/gemm_choice.txt 2>/dev/null)"
pack_outputs
