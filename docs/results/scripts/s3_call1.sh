#!/usr/bin/env bash
# Device call 1 of session 3 (nvidia-h200-x2): `bash docs/results/scripts/s3_call1.sh` from the repo root, $OUT set.
#   GPU 0 (CPU cores of the first 5/8): `./run.sh --preset small-gpu --graphs on`, cold compile cache,
#          one process from start to summary (the preset's <= 10 minute bar, compile included)
#   GPU 1 (remaining cores): NCCL tests (both GPUs, briefly), then the 1-GPU GPU tests: fp8, attention,
#          step graphs (incl. the varlen self-check verdict), trainer (graphs on/off equivalence, resume)
# The two sides run on disjoint CPU cores (taskset) so compile work on one side does not take the
# other's cores. Results land in $OUT (logs and runs packed into results.tgz).
source scripts/gpu/common.sh  # run from the repo root
n=$(nproc); split=$(( n * 5 / 8 ))
echo "cores: $n; GPU0 side 0-$((split - 1)), GPU1 side $split-$((n - 1))" >> "$L/gpus.txt"
( CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=$split T1S_SYSTEM_PYTHON=1 timeout 585 \
    taskset -c "0-$((split - 1))" ./run.sh --preset small-gpu --graphs on --run-id small-gpu-on-cold \
    --runs-dir "$OUT/runs" --no-save-final > "$L/small_gpu_on_cold.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/small_gpu_on_cold.log" ) &
A=$!
export TORCHINDUCTOR_COMPILE_THREADS=$(( n - split ))
side1=(taskset -c "$split-$((n - 1))")
timeout 120 "${side1[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_ngram_sharded_gpu.py \
    tests/test_anvil_distributed_gpu.py > "$L/gpu_tests_nccl.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_nccl.log"
CUDA_VISIBLE_DEVICES=1 timeout $(( 580 - $(elapsed) )) "${side1[@]}" python3 -m pytest -m gpu -q \
    -p no:cacheprovider -rA tests/test_fp8_gpu.py tests/test_step_graphs_gpu.py tests/test_attention_gpu.py \
    tests/test_train_gpu.py > "$L/gpu_tests_1gpu.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_1gpu.log"
wait $A
pack_outputs
