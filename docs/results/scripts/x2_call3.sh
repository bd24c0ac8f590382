#!/usr/bin/env bash
# Device call 3 (nvidia-h200-x2, 2026-11-30).
#   GPU 0: small-gpu preset, graphs on, cold compile cache (writes the portable compile cache)
#   both:  NCCL AnvilAndAdam equivalence (after the contiguity fix)
#   GPU 1: step-graph GPU tests (gradient self-check, varlen fault injection), fp8 and attention GPU tests
# Run from the repo root with $OUT set; results land in $OUT.
source scripts/gpu/common.sh  # run from the repo root
( CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=24 timeout 570 python3 -m track_1_short.train \
    --preset small-gpu --graphs on --run-id small-gpu-graphs-on --runs-dir "$OUT/runs" \
    --compile-cache "$OUT/compile_cache.bin" --no-save-final > "$L/small_gpu_graphs_on.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/small_gpu_graphs_on.log" ) &
A=$!
export TORCHINDUCTOR_COMPILE_THREADS=8
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_anvil_distributed_gpu.py \
    > "$L/gpu_tests_nccl_anvil.log" 2>&1; echo "exit $?" >> "$L/gpu_tests_nccl_anvil.log"
CUDA_VISIBLE_DEVICES=1 timeout $(( 560 - $(elapsed) )) python3 -m pytest -m gpu -q -p no:cacheprovider \
    -rA tests/test_fp8_gpu.py tests/test_attention_gpu.py tests/test_step_graphs_gpu.py \
    > "$L/gpu_tests_1gpu.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_1gpu.log"
wait $A
pack_outputs
