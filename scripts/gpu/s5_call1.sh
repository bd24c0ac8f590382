#!/usr/bin/env bash
# Planned device call 1 of the next lease (nvidia-h200-x2, cold machine): `bash scripts/gpu/s5_call1.sh`.
#   GPU 0 (first half of the CPU cores): fp8 with every operand layout made in traced code (not yet
#          GPU-run): bench/model.py --fp8 then --no-fp8 at keys A and C, top kernels profiled (is
#          aten's strided fp8 copy gone, and is fp8 now faster than bf16?)
#   GPU 1 (second half): the fp8, step-graph and attention GPU tests on the current code
# Then, each within the warm window of the previous call (the speedrun preset on 2 GPUs, 4
# micro-steps per rank; the failed third-lease attempt needed 347 s of warmup to reach stage C's
# last visit, so the whole warmup takes ~7 minutes without a cache for these graphs):
#   bash scripts/gpu/run_preset.sh speedrun 2 warmup
#   bash scripts/gpu/run_preset.sh speedrun 2 on
#   bash scripts/gpu/run_preset.sh speedrun 2 off
source "$(dirname "$0")/common.sh"
n=$(nproc); h=$(( n / 2 ))
export TORCHINDUCTOR_COMPILE_THREADS=$h
( for fp8 in fp8 no-fp8; do
    left=$(( 560 - $(elapsed) )); (( left > 30 )) || break  # (timeout 0 would mean no limit)
    CUDA_VISIBLE_DEVICES=0 timeout $left taskset -c "0-$((h - 1))" python3 bench/model.py \
        --keys A,C --$fp8 --profile-top 20 --out "$L/model_${fp8}_layouts.json" > "$L/model_${fp8}.log" 2>&1
    echo "exit $? after $(elapsed) s" >> "$L/model_${fp8}.log"
  done ) &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 560 taskset -c "$h-$((n - 1))" python3 -m pytest -m gpu -v -p no:cacheprovider -rA \
    tests/test_fp8_gpu.py tests/test_step_graphs_gpu.py tests/test_attention_gpu.py > "$L/gpu_tests.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests.log"
wait $A
cp "$L"/*.json "$OUT/" 2>/dev/null
pack_outputs
