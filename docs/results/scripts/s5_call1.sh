#!/usr/bin/env bash
# Device call 1 of the fourth lease (nvidia-h200-x2, cold machine): `bash docs/results/scripts/s5_call1.sh`.
#   - the speedrun preset's warmup on 2 GPUs (4 micro-steps per rank): compiles and captures every
#     key into build/inductor_cache (390 s cold in the fourth lease), so the timed runs after it
#     fit one call each;
#   - alongside, on GPU 1 at the lowest priority and 4 cores: the fp8 GPU tests on the current code
#     (every GEMM operand layout made in traced code; ~25 s).
# Then, each within the warm window of the previous call:
#   bash scripts/gpu/run_preset.sh speedrun 2 on
#   bash scripts/gpu/run_preset.sh speedrun 2 off
#   bash docs/results/scripts/s5_fp8_bench.sh LIMIT_S   (with what device time is left)
source scripts/gpu/common.sh  # run from the repo root
n=$(nproc)
( CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=2 timeout 300 nice -n 19 taskset -c "$((n - 4))-$((n - 1))" \
    python3 -m pytest -m gpu -v -p no:cacheprovider -rA tests/test_fp8_gpu.py > "$L/gpu_tests_fp8.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_fp8.log" ) &
tests=$!
run_trainer speedrun 2 warmup 575
wait $tests
pack_outputs
