#!/usr/bin/env bash
# Device call 4 of session 3 (nvidia-h200-x2): fp8 vs bf16 side by side, and the fp8 GPU tests.
#   GPU 0 (first half of the CPU cores): bench/model.py --fp8 at keys A and C
#   GPU 1 (second half): bench/model.py --no-fp8 at keys A and C, then tests/test_fp8_gpu.py
# Both benches start together on a cold compile cache. `bash docs/results/scripts/s3_call4.sh`, $OUT set.
source scripts/gpu/common.sh  # run from the repo root
n=$(nproc); h=$(( n / 2 ))
export TORCHINDUCTOR_COMPILE_THREADS=$h
( CUDA_VISIBLE_DEVICES=0 timeout 360 taskset -c "0-$((h - 1))" python3 bench/model.py --keys A,C --fp8 \
    --out "$L/model_h200_fp8_AC.json" > "$L/model_fp8.log" 2>&1; echo "exit $? after $(elapsed) s" >> "$L/model_fp8.log" ) &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 300 taskset -c "$h-$((n - 1))" python3 bench/model.py --keys A,C --no-fp8 \
    --out "$L/model_h200_bf16_AC.json" > "$L/model_bf16.log" 2>&1; echo "exit $? after $(elapsed) s" >> "$L/model_bf16.log"
CUDA_VISIBLE_DEVICES=1 timeout $(( 370 - $(elapsed) )) taskset -c "$h-$((n - 1))" python3 -m pytest -m gpu -q \
    -p no:cacheprovider -rA tests/test_fp8_gpu.py > "$L/gpu_tests_fp8.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_fp8.log"
wait $A
cp "$L"/*.json "$OUT/" 2>/dev/null
pack_outputs
