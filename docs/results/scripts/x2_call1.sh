#!/usr/bin/env bash
# Device call 1 (nvidia-h200-x2, 2026-11-30): evidence for issues 4, 5 and 7.
#   GPU 0: small-gpu preset, graphs on, cold compile cache (writes the portable compile cache)
#   both:  NCCL tests (sharded n-gram table, AnvilAndAdam), 2-GPU optimizer and row-prefetch benches
#   GPU 1: trainer GPU tests (graphs on/off equivalence, resume)
# Run from the repo root with $OUT set (the device tool's output dir); results land in $OUT.
source scripts/gpu/common.sh  # run from the repo root
( CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16 timeout 575 python3 -m track_1_short.train \
    --preset small-gpu --graphs on --run-id small-gpu-on-cold --runs-dir "$OUT/runs" \
    --compile-cache "$OUT/compile_cache.bin" --no-save-final > "$L/small_gpu_on_cold.log" 2>&1;
  echo "exit $? after $(elapsed) s" >> "$L/small_gpu_on_cold.log" ) &
A=$!
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ngram_sharded_gpu.py \
    tests/test_anvil_distributed_gpu.py > "$L/nccl_tests.log" 2>&1; echo "exit $?" >> "$L/nccl_tests.log"
timeout 90 torchrun --standalone --nproc_per_node 2 bench/optimizer.py --out "$L/optimizer_h200_2gpu.json" \
    > "$L/optimizer_2gpu.log" 2>&1; echo "exit $?" >> "$L/optimizer_2gpu.log"
timeout 90 torchrun --standalone --nproc_per_node 2 bench/row_prefetch.py --out "$L/row_prefetch_h200_2gpu.json" \
    > "$L/row_prefetch_2gpu.log" 2>&1; echo "exit $?" >> "$L/row_prefetch_2gpu.log"
CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16 timeout $(( 575 - $(elapsed) )) \
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_train_gpu.py > "$L/train_gpu_tests.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/train_gpu_tests.log"
wait $A
pack_outputs
