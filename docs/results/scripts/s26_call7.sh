#!/usr/bin/env bash
# Twenty-sixth session, call 7, a machine new to the session (carry []): bench/gemm_memsets.py
# under train.blas default and no_workspace, with its gates section: the five value-embedding gates'
# compiled forward + backward, captured, as F.linear, as autograd's product-and-sum, and as
# model/gpt.narrow_linear (the weight gradient a chunked float32 bmm), at T = 16384 and 49152.
# Prediction: with no_workspace, linear ~1.0 ms (A) / ~2.2 ms (C) per replay (call 2-3's
# one-block kernels), product_sum ~1.2 / ~3.6 ms (call 5's reduction), narrow_linear under 0.15 ms
# at both; with the default setting linear ~0.1 ms (split-K) and narrow_linear no slower.
source scripts/gpu/common.sh
timeout -k 10 $(( $(left) - 20 )) python3 bench/gemm_memsets.py --out "$OUT/gemm_memsets_gates.json" \
    --variants default,no_workspace > "$L/gemm_memsets_gates.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gemm_memsets_gates.log"
tail -n 40 "$L/gemm_memsets_gates.log"
pack_outputs
